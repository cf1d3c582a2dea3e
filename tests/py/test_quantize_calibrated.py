"""`serval quantize --imatrix` and `--method awq` on TinyStories-656K (an F16 file made from its Q8_0 by
`serval quantize`): an importance matrix written here in llama.cpp's older .dat layout (by this test's own
writer, so the reader is checked against the format, not against itself) is read, recorded in the output's
metadata and changes the bytes; AWQ's folded scales keep the model's function (a wrong fold would wreck
it: KL against the F16 reference stays at the level of plain quantization) and change the norms it folds
into; refusals are clear. The bytes of the weighted searches themselves are checked against llama.cpp in
tests/unit/test_quantize.cpp."""
import json
import struct

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import DATA, MODELS, run

Q8_FILE = MODELS / "TinyStories-656K-Q8_0.gguf"
TEXT = DATA / "tinystory.txt"


def write_dat(path, entries, chunks=3, dataset="synthetic.txt"):
    """llama.cpp's .dat: count, then per entry name, ncall, nval, values (mean square x ncall); then the
    chunk count and the dataset name."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, values in entries.items():
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 2, len(values)))
            f.write((np.asarray(values, dtype=np.float32) * 2).tobytes())
        f.write(struct.pack("<ii", chunks, len(dataset)) + dataset.encode())


def tensors(path):
    return {t.name: np.asarray(t.data).copy() for t in GGUFReader(path).tensors}


def metadata(path):
    r = GGUFReader(path)
    return {k: f for k, f in r.fields.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("calibrated")
    f16 = d / "tiny-F16.gguf"
    run("quantize", Q8_FILE, f16, "F16", "--allow-requantize", timeout=120)
    rng = np.random.default_rng(5)
    entries = {}
    for t in GGUFReader(f16).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            # a few salient input channels with large activations, as real models have
            entries[t.name] = np.exp(rng.standard_normal(int(t.shape[0])) * 1.5) * 0.1
    write_dat(d / "im.dat", entries)
    return {"dir": d, "f16": f16, "im": d / "im.dat", "n_entries": len(entries)}


def kl_against(tmp_path, ref, *cands):
    out = tmp_path / "q.json"
    run("quality", "-m", ref, *[a for c in cands for a in ("-m", c)], "-f", TEXT, "-c", 128, "--chunks", 4, "-t", 2,
        "--json", out)
    rows = json.loads(out.read_text())
    rows = rows["models"] if isinstance(rows, dict) else rows
    return [r["kl_mean"] for r in rows[1:]]


def test_imatrix_is_read_recorded_and_changes_the_bytes(files, tmp_path):
    plain, weighted = tmp_path / "plain.gguf", tmp_path / "im.gguf"
    run("quantize", files["f16"], plain, "Q4_K_S", timeout=120)
    r = run("quantize", "--imatrix", files["im"], files["f16"], weighted, "Q4_K_S", timeout=120)
    assert f"{files['n_entries']} entries" in r.stderr
    meta = metadata(weighted)
    assert bytes(meta["quantize.imatrix.dataset"].parts[-1]).decode() == "synthetic.txt"
    assert int(meta["quantize.imatrix.entries_count"].parts[-1][0]) == files["n_entries"]
    assert int(meta["quantize.imatrix.chunks_count"].parts[-1][0]) == 3
    a, b = tensors(plain), tensors(weighted)
    assert not np.array_equal(a["blk.0.attn_q.weight"], b["blk.0.attn_q.weight"]), "the importances changed nothing"
    assert np.array_equal(a["token_embd.weight"], b["token_embd.weight"]), "a tensor without an entry must not change"


def test_awq_folds_scales_and_keeps_the_function(files, tmp_path):
    plain, awq = tmp_path / "plain.gguf", tmp_path / "awq.gguf"
    run("quantize", "--imatrix", files["im"], files["f16"], plain, "Q4_0", timeout=120)
    r = run("quantize", "--imatrix", files["im"], "--method", "awq", files["f16"], awq, "Q4_0", timeout=300)
    scaled, groups = map(int, __import__("re").search(r"awq: (\d+) of (\d+) groups scaled", r.stderr).groups())
    assert groups == 6 and scaled > 0, r.stderr  # 2 layers x (q/k/v, gate/up, down)
    before, after = tensors(files["f16"]), tensors(awq)
    changed = [n for n in before if n.endswith("_norm.weight") and not np.array_equal(before[n], after[n])]
    assert changed, "AWQ scaled some group, so the norm it folds into must change"
    kl_plain, kl_awq = kl_against(tmp_path, files["f16"], plain, awq)
    assert kl_awq < 2 * kl_plain + 0.01, (kl_plain, kl_awq)


def test_gptq_rounds_every_layer_matrix_and_lowers_the_kl(files, tmp_path):
    """GPTQ against round-to-nearest at 4 bits (Q4_0: a 32-column grid, as 64-wide rows allow). The
    calibration text is also the evaluation text here (the only one in the model's domain), so the gain
    is an in-sample one; docs/quantization.md measures the real models on separate texts."""
    plain, gptq = tmp_path / "plain.gguf", tmp_path / "gptq.gguf"
    run("quantize", files["f16"], plain, "Q4_0", timeout=120)
    r = run("quantize", "--method", "gptq", "--calib-file", TEXT, "--calib-ctx", 64, "--calib-chunks", 4,
            files["f16"], gptq, "Q4_0", timeout=300)
    assert "gptq: 14 matrices rounded" in r.stderr, r.stderr  # 2 layers x q, k, v, o, gate, up, down
    a, b = tensors(plain), tensors(gptq)
    assert np.array_equal(a["token_embd.weight"], b["token_embd.weight"]), "GPTQ leaves the embedding to RTN"
    assert not np.array_equal(a["blk.1.ffn_down.weight"], b["blk.1.ffn_down.weight"])
    kl_plain, kl_gptq = kl_against(tmp_path, files["f16"], plain, gptq)
    assert kl_gptq < 0.8 * kl_plain, (kl_plain, kl_gptq)


def test_gptq_measured_a_layer_at_a_time_gives_the_same_file(files, tmp_path):
    """--gptq-layers 1: one run over the text per layer, holding one layer's Hessians at a time; the
    forward passes are deterministic, so the sums and the bytes are the same as from one run."""
    args = ["--method", "gptq", "--calib-file", TEXT, "--calib-ctx", 64, "--calib-chunks", 2, files["f16"]]
    run("quantize", *args, tmp_path / "one.gguf", "Q4_K_S", timeout=300)
    r = run("quantize", "--gptq-layers", 1, *args, tmp_path / "each.gguf", "Q4_K_S", timeout=300)
    assert r.stderr.count("calibration of 1 layers (blk.0 ...): chunk 1/2") == 1, r.stderr
    assert r.stderr.count("calibration of 1 layers (blk.1 ...): chunk 1/2") == 1, r.stderr
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "each.gguf").read_bytes()


@pytest.mark.parametrize("args,message", [
    (["--method", "awq"], "needs --imatrix"),
    (["--method", "gptq", "--imatrix", "IM"], "needs calibration text (--calib-file)"),
    (["--method", "gptq", "--calib-file", "/nonexistent.txt"], "/nonexistent.txt"),
    (["--method", "gptq", "--calib-file", "TEXT", "--calib-ctx", "100000"], "fewer than one chunk"),
    (["--method", "gptq", "--calib-file", "TEXT", "--gptq-damp", "-1"], "--gptq-damp"),
    (["--method", "gptq", "--calib-file", "TEXT", "--gptq-layers", "-1"], "--gptq-layers"),
    (["--method", "fancy", "--imatrix", "IM"], "unknown --method"),
    (["--imatrix", "/nonexistent.dat"], "cannot open imatrix file"),
])
def test_refusals_are_clear(files, tmp_path, args, message):
    args = [{"IM": str(files["im"]), "TEXT": str(TEXT)}.get(a, a) for a in args]
    r = run("quantize", *args, files["f16"], tmp_path / "x.gguf", "Q4_0", check=False, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.gguf").exists()
