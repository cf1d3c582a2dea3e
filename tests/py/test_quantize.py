"""`serval quantize` against llama.cpp's `llama-quantize`: on the real Qwen2.5-Coder 0.5B, every tensor's
type and bytes equal what llama-quantize wrote (recorded in tests/data/quantize_llama_cpp.json by a
script outside the repository) for F16 (from the quantized file, --allow-requantize) and, from that F16
file, Q8_0, Q4_0, Q5_0, a --pure Q4_1 mixture, and the k-quant mixtures Q4_K_M and Q6_K. Also: the output runs; refusals are
clear; an interrupted run leaves no file."""
import json
import signal
import subprocess
import time

import pytest

from conftest import DATA, SERVAL, cached_model, run
from gguf_tensors import read_tensors

RECORDED = json.loads((DATA / "quantize_llama_cpp.json").read_text())


def digest(path):
    # Tensor bytes only (gguf_tensors: GGUFReader would spend about 9 s on the vocabulary of each file).
    return {t.name: [t.tensor_type.name, t.sha256()[:16]] for t in read_tensors(path)}


def case(t, flags):
    return next(c for c in RECORDED["cases"] if c["type"] == t and c["flags"] == flags)


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    model = cached_model("qwen2.5-coder-0.5b-instruct")
    out = tmp_path_factory.mktemp("quant") / "f16.gguf"
    run("quantize", model, out, "F16", "--allow-requantize", timeout=300)
    yield out
    out.unlink(missing_ok=True)  # 1.2 GB: not kept for the rest of the session


def test_f16_from_the_quantized_file_is_llama_quantizes(f16):
    assert digest(f16) == case("F16", ["--allow-requantize"])["tensors"]


# Q5_1 and BF16 are recorded too (checked when docs/quantization.md's table was made); the suite runs
# one type of each kind of block code, to stay within its time budget.
# The k-quant mixtures: Q4_K_M (attn_v / ffn_down on more bits by layer; the 896-wide rows fall back to
# Q5_0 / Q8_0) and Q6_K; IQ4_NL is recorded too (its search is slow; the unit tests check its bytes).
@pytest.mark.parametrize("qtype,flags", [("Q8_0", []), ("Q4_0", []), ("Q5_0", []),
                                         ("Q4_1", ["--pure", "--token-embedding-type", "q8_0"]),
                                         ("Q4_K_M", []), ("Q6_K", [])])
def test_types_and_bytes_are_llama_quantizes(f16, tmp_path, qtype, flags):
    out = tmp_path / f"{qtype}.gguf"
    try:
        r = run("quantize", f16, out, qtype, *flags, timeout=300)
        assert "bits per weight" in r.stderr
        got, want = digest(out), case(qtype, flags)["tensors"]
        differ = [n for n in want if got.get(n) != want[n]]
        assert not differ and set(got) == set(want), f"{len(differ)} tensors differ, e.g. {differ[:3]}"
        if qtype == "Q4_0":  # the file runs: metadata and the tied Q8_0 embedding are usable
            g = run("generate", "-m", out, "-p", "def add(a, b):", "-n", "8", "--temp", "0", "-t", "2", timeout=120)
            assert len(g.stdout.strip()) > 0
    finally:
        out.unlink(missing_ok=True)  # up to 650 MB each


def test_refusals_are_clear(f16, tmp_path):
    model = cached_model("qwen2.5-coder-0.5b-instruct")
    cases = [((model, tmp_path / "a.gguf", "Q4_0"), "--allow-requantize"),
             ((f16, tmp_path / "b.gguf", "IQ2_XXS"), "unknown quantization type"),
             ((f16, tmp_path / "c.gguf", "Q9"), "unknown quantization type"),
             ((f16, tmp_path / "d.gguf", "Q4_0", "--output-tensor-type", "q7"), "unknown or unsupported tensor type"),
             ((f16, f16, "Q4_0"), "overwrite the input")]
    for args, message in cases:
        r = run("quantize", *args, check=False, timeout=120)
        assert r.returncode != 0 and message in r.stderr, (args, r.stderr)
    assert not list(tmp_path.iterdir()), "a refused run left a file"


def test_interrupted_run_leaves_no_file(f16, tmp_path):
    out = tmp_path / "q.gguf"
    p = subprocess.Popen([str(SERVAL), "quantize", str(f16), str(out), "Q8_0", "1"], stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "interrupted" in err
    assert not list(tmp_path.iterdir()), "an interrupted run left a file"
