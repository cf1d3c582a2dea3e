"""`serval quality`: the reference against itself is exactly 0 KL and 100% top-1; each model's PPL is the
one `serval perplexity` prints on the same file and flags; a coarser quantization is further from the
reference; the JSON matches the table; the PNG is a PNG; bad inputs are clear errors. On TinyStories-656K:
an F16 reference and Q8_0/Q4_0 candidates written from it by `serval quantize` (stories260K's FFN rows of
172 are not whole blocks), so each run takes well under a second."""
import json
import re
import struct

import pytest

from conftest import DATA, MODELS, run

Q8_FILE = MODELS / "TinyStories-656K-Q8_0.gguf"
TEXT = DATA / "tinystory.txt"
FLAGS = ["-c", 128, "--chunks", 4, "-t", 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    out = {"F16": d / "tiny-F16.gguf"}
    run("quantize", Q8_FILE, out["F16"], "F16", "--allow-requantize", timeout=120)
    for t in ["Q8_0", "Q4_0"]:
        out[t] = d / f"tiny-{t}.gguf"
        run("quantize", out["F16"], out[t], t, timeout=120)
    return out


def quality(tmp_path, *models, png=False):
    extra = ["--png", tmp_path / "q.png"] if png else []
    r = run("quality", *[a for m in models for a in ("-m", m)], "-f", TEXT, *FLAGS, "--json", tmp_path / "q.json", *extra)
    return r, json.loads((tmp_path / "q.json").read_text())


def perplexity(model):
    out = run("perplexity", "-m", model, "-f", TEXT, *FLAGS).stdout
    ppl, err = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out).groups()
    return ppl, err


def test_the_reference_against_itself_is_zero_kl_and_full_agreement(tmp_path, models):
    ref_path = models["F16"]
    _, doc = quality(tmp_path, ref_path, ref_path)
    ref, same = doc["models"]
    assert ref["reference"] and ref["kl_mean"] is None
    assert same["kl_mean"] == 0 and same["kl_p99"] == 0 and same["kl_max"] == 0
    assert same["top1_pct"] == 100 and same["ppl"] == ref["ppl"] and same["dppl_pct"] == 0
    assert doc["positions"] == 4 * (128 - 1 - 64)
    assert (f"{ref['ppl']:.4f}", f"{ref['ppl_err']:.5f}") == perplexity(ref_path)


def test_candidates_ppl_kl_and_agreement(tmp_path, models):
    r, doc = quality(tmp_path, models["F16"], models["Q8_0"], models["Q4_0"], png=True)
    _, q8, q4 = doc["models"]
    for m, path in [(q8, models["Q8_0"]), (q4, models["Q4_0"])]:
        assert (f"{m['ppl']:.4f}", f"{m['ppl_err']:.5f}") == perplexity(path)
        assert 0 < m["kl_median"] <= m["kl_p99"] <= m["kl_max"] and m["kl_mean"] > 0
        assert 0 <= m["top1_pct"] <= 100
    assert q8["kl_mean"] < q4["kl_mean"] and q8["top1_pct"] >= q4["top1_pct"]
    assert 16 < doc["models"][0]["bpw"] < 16.1  # F16 weights, a few F32 norms
    assert q4["bpw"] < q8["bpw"] < 16
    check_table_matches_json(r.stdout, doc)
    check_png(tmp_path / "q.png", 760, 720)


def check_table_matches_json(stdout, doc):
    rows = [line.split() for line in stdout.strip().splitlines()[1:]]
    assert len(rows) == len(doc["models"])
    for cells, m in zip(rows, doc["models"]):
        assert cells[0] == m["path"].split("/")[-1] and int(cells[1]) == m["file_bytes"]
        assert float(cells[3]) == pytest.approx(m["bpw"], abs=0.005)
        assert float(cells[4]) == pytest.approx(m["ppl"], abs=5e-5) and float(cells[6]) == pytest.approx(m["dppl_pct"], abs=5e-4)
        if not m["reference"]:
            for cell, key in zip(cells[7:10], ["kl_mean", "kl_median", "kl_p99"]):
                assert float(cell) == pytest.approx(m[key], abs=5e-7)
            assert float(cells[10]) == pytest.approx(m["top1_pct"], abs=5e-3)


def check_png(path, width, height):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (width, height)


def test_reference_only_prints_its_perplexity(tmp_path):
    r, doc = quality(tmp_path, Q8_FILE)
    assert len(doc["models"]) == 1 and len(r.stdout.strip().splitlines()) == 2
    assert f"{doc['models'][0]['ppl']:.4f}" == perplexity(Q8_FILE)[0]


def test_bad_inputs_are_clear_errors(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time")
    # stories260K has 512 tokens, TinyStories-656K 2048; the GGUF and Hugging Face copies of TinyStories
    # have the same 2048 tokens but split text differently (MODELS/README.md).
    cases = [(["-m", Q8_FILE, "-m", MODELS / "stories260K.gguf", "-f", TEXT], "the same vocabulary"),
             (["-m", MODELS / "TinyStories-656K", "-m", Q8_FILE, "-f", TEXT], "tokenizes the text differently"),
             (["-m", Q8_FILE, "-m", tmp_path / "missing.gguf", "-f", TEXT], "no such file"),
             (["-m", Q8_FILE, "-f", tmp_path / "missing.txt"], "cannot open"),
             (["-m", Q8_FILE, "-f", short], "fewer than one chunk")]
    for args, message in cases:
        r = run("quality", *args, *FLAGS, check=False, timeout=60)
        assert r.returncode == 1 and message in r.stderr, (args, r.stderr)
        assert r.stderr.strip().splitlines()[-1].startswith("error: ")
