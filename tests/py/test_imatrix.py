"""`serval imatrix` on the real Qwen2.5-Coder 0.5B (2 chunks of 128 tokens): the GGUF file read with the
`gguf` package (names, shapes, metadata), the older .dat read with a small numpy reader, the two formats
agreeing (dat value / ncall == in_sum2 / counts), --in-file sums, small batches not counted,
--process-output, and clear errors. (Values against llama-imatrix: /tmp comparison, not in the suite.)"""
import numpy as np
import pytest
from gguf import GGUFReader

from conftest import DATA, MODELS, cached_model, run

QWEN = "qwen2.5-coder-0.5b-instruct"
TEXT = DATA / "tinystory.txt"
N_LAYER, N_EMBD, N_FF = 24, 896, 4864
KINDS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def read_dat(path):
    """llama.cpp's .dat: n; per entry: len, name, ncall, nval, values (f32); then chunk count and dataset."""
    b = path.read_bytes()
    off = 0

    def i32():
        nonlocal off
        v = int(np.frombuffer(b, np.int32, 1, off)[0])
        off += 4
        return v

    entries = {}
    for _ in range(i32()):
        n = i32()
        name = b[off:off + n].decode()
        off += n
        ncall, nval = i32(), i32()
        entries[name] = (ncall, np.frombuffer(b, np.float32, nval, off).copy())
        off += 4 * nval
    chunks, n = i32(), i32()
    dataset = b[off:off + n].decode()
    off += n
    assert off == len(b)
    return entries, chunks, dataset


def read_gguf(path):
    r = GGUFReader(path)
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("imatrix.") or f.name == "general.type":
            meta[f.name] = f.contents()
    tensors = {t.name: (list(t.shape), np.asarray(t.data, dtype=np.float64).reshape(-1)) for t in r.tensors}
    return meta, tensors


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("imatrix")
    model = cached_model(QWEN)
    g = run("imatrix", "-m", model, "-f", TEXT, "-c", 128, "--chunks", 2, "-o", d / "q.gguf", timeout=120)
    run("imatrix", "-m", model, "-f", TEXT, "-c", 128, "--chunks", 2, "-o", d / "q.dat", "--no-ppl", timeout=120)
    return d, model, g


def test_gguf_has_every_matrix_with_its_shape_and_metadata(outputs):
    d, _, _ = outputs
    meta, tensors = read_gguf(d / "q.gguf")
    assert meta["general.type"] == "imatrix"
    assert meta["imatrix.datasets"] == [str(TEXT)]
    assert meta["imatrix.chunk_count"] == 2 and meta["imatrix.chunk_size"] == 128
    names = {f"blk.{i}.{k}.weight" for i in range(N_LAYER) for k in KINDS}
    assert set(tensors) == {n + s for n in names for s in (".in_sum2", ".counts")}  # no output.weight by default
    for n in names:
        width = N_FF if n.endswith("ffn_down.weight") else N_EMBD
        shape, sum2 = tensors[n + ".in_sum2"]
        assert shape == [width, 1], n
        assert tensors[n + ".counts"][0] == [1, 1] and tensors[n + ".counts"][1][0] == 256, n  # every token
        assert np.all(np.isfinite(sum2)) and np.all(sum2 >= 0) and sum2.mean() > 0, n
    # The fused products share their input.
    assert np.array_equal(tensors["blk.3.attn_q.weight.in_sum2"][1], tensors["blk.3.attn_v.weight.in_sum2"][1])


def test_progress_and_perplexity_lines(outputs):
    _, _, g = outputs
    lines = [l for l in g.stdout.splitlines() if l.startswith("[")]
    assert [l.split()[0] for l in lines] == ["[1/2]", "[2/2]"]
    ppl = float(lines[-1].split("PPL")[1])
    assert 1.5 < ppl < 100, ppl  # a coder model on a children's story: plausible, not degenerate


def test_dat_parses_and_agrees_with_the_gguf(outputs):
    d, _, _ = outputs
    entries, chunks, dataset = read_dat(d / "q.dat")
    _, tensors = read_gguf(d / "q.gguf")
    assert chunks == 2 and dataset == str(TEXT)
    assert len(entries) == N_LAYER * len(KINDS)
    for name, (ncall, values) in entries.items():
        assert ncall == 2, name  # 256 rows in chunks of 128
        mean_gguf = tensors[name + ".in_sum2"][1] / tensors[name + ".counts"][1][0]
        np.testing.assert_allclose(values / ncall, mean_gguf, rtol=2e-6, atol=1e-30, err_msg=name)


def test_in_files_are_summed(outputs):
    d, model, _ = outputs
    run("imatrix", "-m", model, "--in-file", d / "q.gguf", "--in-file", d / "q.dat", "-c", 128, "-o", d / "sum.gguf")
    meta, tensors = read_gguf(d / "sum.gguf")
    _, one = read_gguf(d / "q.gguf")
    assert meta["imatrix.chunk_count"] == 4
    assert meta["imatrix.datasets"] == [str(TEXT), str(TEXT)]
    n = "blk.5.ffn_down.weight"
    assert tensors[n + ".counts"][1][0] == 512  # the .dat's 2 calls count as 2 chunks of 128 rows
    np.testing.assert_allclose(tensors[n + ".in_sum2"][1], 2 * one[n + ".in_sum2"][1], rtol=1e-5)


def test_small_batches_are_not_counted_and_process_output(tmp_path):
    # Chunks of 32 in batches of 24: the 8-token remainder of each chunk is under 16 rows, not counted.
    out = tmp_path / "s.gguf"
    run("imatrix", "-m", MODELS / "stories260K.gguf", "-f", TEXT, "-c", 32, "-b", 24, "--chunks", 2,
        "--process-output", "-o", out)
    _, tensors = read_gguf(out)
    assert tensors["blk.0.attn_q.weight.counts"][1][0] == 48
    assert tensors["output.weight.counts"][1][0] == 48
    # Batches all under 16 rows: nothing at all.
    p = run("imatrix", "-m", MODELS / "stories260K.gguf", "-f", TEXT, "-c", 32, "-b", 8, "--chunks", 1, "-o", out,
            check=False)
    assert p.returncode == 1 and "16 or more input rows" in p.stderr


def test_clear_errors(tmp_path, outputs):
    d, model, _ = outputs
    stories = MODELS / "stories260K.gguf"
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    cases = [
        (["-m", stories, "-f", tmp_path / "missing.txt"], "missing.txt"),
        (["-m", stories, "-f", short], "fewer than one chunk"),
        (["-m", stories, "-f", TEXT, "--in-file", tmp_path / "none.gguf"], "none.gguf"),
        (["-m", stories, "-f", TEXT, "--in-file", d / "q.gguf"], "another model"),
        (["-m", stories, "-f", TEXT, "--output-format", "csv"], "gguf or dat"),
        (["-m", stories], "-f"),
    ]
    for args, msg in cases:
        p = run("imatrix", *args, "-o", tmp_path / "x.gguf", check=False)
        assert p.returncode == 1 and msg in p.stderr, (args, p.stderr)
        assert p.stderr.count("\n") <= 2, p.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_mixture_of_experts_by_expert(tmp_path):
    """The tiny Qwen2-MoE (tests/data/families: 6 experts, top 3, a shared expert), converted to F32: the
    imatrix keeps a row of sums per expert (in_sum2 [n_embd, 6], counts [1, 6] as llama-imatrix writes
    stacked experts; the rows over the experts 3 x the router's), the router and shared expert as plain
    matrices; `quantize --imatrix` then weights each expert's rows by its own row (the bytes differ from
    a quantization without it, and the model still loads and runs), and the .dat form agrees."""
    f32 = tmp_path / "moe-f32.gguf"
    run("convert", DATA / "families" / "qwen2moe", f32, "--outtype", "f32")
    run("imatrix", "-m", f32, "-f", TEXT, "-c", 64, "--chunks", 2, "-o", tmp_path / "moe.gguf", "--no-ppl", timeout=120)
    run("imatrix", "-m", f32, "-f", TEXT, "-c", 64, "--chunks", 2, "-o", tmp_path / "moe.dat", "--no-ppl", timeout=120)
    _, t = read_gguf(tmp_path / "moe.gguf")
    shape, sums = t["blk.0.ffn_gate_exps.weight.in_sum2"]
    assert shape == [64, 6]  # ne order: n_per_row, then the experts
    counts = t["blk.0.ffn_gate_exps.weight.counts"][1]
    router = t["blk.0.ffn_gate_inp.weight.counts"][1]
    assert counts.sum() == 3 * router[0] and (counts > 0).sum() > 1
    np.testing.assert_allclose(sums.reshape(6, 64).sum(0), 3 * t["blk.0.ffn_gate_inp.weight.in_sum2"][1], rtol=1e-6)
    assert t["blk.0.ffn_down_exps.weight.in_sum2"][0] == [32, 6]
    assert t["blk.0.ffn_gate_shexp.weight.counts"][1][0] == router[0]
    entries, _, _ = read_dat(tmp_path / "moe.dat")
    ncall, values = entries["blk.0.ffn_gate_exps.weight"]
    mean = sums.reshape(6, 64) / np.maximum(counts, 1)[:, None]
    np.testing.assert_allclose(values.reshape(6, 64)[counts > 0] / ncall, mean[counts > 0], rtol=1e-5)
    outs = {}
    for name, extra in (("plain", []), ("gguf", ["--imatrix", tmp_path / "moe.gguf"]), ("dat", ["--imatrix", tmp_path / "moe.dat"])):
        outs[name] = tmp_path / f"moe-q4k-{name}.gguf"
        run("quantize", f32, outs[name], "Q4_K_M", *extra)
    exps = {n: next(t for t in GGUFReader(p).tensors if t.name == "blk.0.ffn_gate_exps.weight") for n, p in outs.items()}
    assert exps["plain"].tensor_type == exps["gguf"].tensor_type
    assert not np.array_equal(np.asarray(exps["plain"].data), np.asarray(exps["gguf"].data))
    run("score", "-m", outs["gguf"], "-p", "Once upon a time", "--ids", "1,2,3")
