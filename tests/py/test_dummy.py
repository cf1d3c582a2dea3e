"""vLLM's --load-format dummy and `serval export-shape` (docs/models.md, "Models without their weights"):
a shape file is a model's GGUF header without its data, refused by the strict loader; the dummy loader
makes the weights from a stated generator, the same bytes from the shape file, from the whole GGUF and
in the whole GGUF that `export-shape --full` writes (which the PyPI `gguf` package reads as a normal
model); the values have the stated distribution; every command that runs a model takes the flag.
"""
import json

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import DATA, MODELS, run
from server_util import Server

STORIES = MODELS / "stories260K.gguf"      # F32 matrices
Q8 = MODELS / "TinyStories-656K-Q8_0.gguf"  # Q8_0 matrices


def score(model, *extra):
    out = run("score", "-m", model, "-p", "Once upon a time", "--ids", "3,4,5,6", *extra).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("dummy")
    out = {}
    for name, model in (("stories", STORIES), ("q8", Q8)):
        out[name, "shape"] = d / f"{name}.shape.gguf"
        out[name, "full"] = d / f"{name}.dummy.gguf"
        run("export-shape", model, out[name, "shape"])
        run("export-shape", out[name, "shape"], out[name, "full"], "--full")
    return out


@pytest.mark.parametrize("name,model", [("stories", STORIES), ("q8", Q8)])
def test_shape_file_is_the_header_alone(name, model, shapes):
    shape = shapes[name, "shape"]
    assert shape.stat().st_size < model.stat().st_size // 4
    p = run("info", shape, check=False)
    assert p.returncode != 0 and "--load-format dummy" in p.stderr  # the strict loader refuses it by name
    full, real = GGUFReader(shapes[name, "full"]), GGUFReader(model)
    assert "serval.shape_only" not in full.fields
    assert [(t.name, t.tensor_type, list(t.shape)) for t in full.tensors] == \
           [(t.name, t.tensor_type, list(t.shape)) for t in real.tensors]
    assert shapes[name, "full"].stat().st_size == model.stat().st_size
    assert full.fields["tokenizer.ggml.tokens"].contents() == real.fields["tokenizer.ggml.tokens"].contents()


@pytest.mark.parametrize("name,model", [("stories", STORIES), ("q8", Q8)])
def test_the_same_weights_from_shape_file_whole_file_and_written_file(name, model, shapes):
    from_shape = score(shapes[name, "shape"], "--load-format", "dummy")
    assert score(model, "--load-format", "dummy") == from_shape
    assert score(shapes[name, "full"]) == from_shape  # the written file, loaded normally
    assert score(model) != from_shape  # the real weights are something else


def test_values_have_the_stated_distribution(shapes):
    r = GGUFReader(shapes["stories", "full"])
    tensors = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}
    for name, x in tensors.items():
        if name.endswith("norm.weight"):
            assert (x == 1).all(), name
            continue
        n_in = x.shape[-1]
        assert abs(x.mean()) < 4 / np.sqrt(x.size * n_in), name
        assert x.std() * np.sqrt(n_in) == pytest.approx(1.0, rel=0.05 if x.size > 4000 else 0.2), name
    # each row from its own stream: no two rows alike
    w = tensors["blk.0.attn_q.weight"]
    assert not np.allclose(w[0], w[1])


def test_every_running_command_takes_it(shapes):
    shape = shapes["q8", "shape"]
    out = run("generate", "-m", shape, "--load-format", "dummy", "-p", "Once", "-n", "4", "--temp", "0").stdout
    assert out
    run("bench", "-m", shape, "--load-format", "dummy", "-p", "8", "-n", "4", "-r", "1")
    run("perplexity", "-m", shape, "--load-format", "dummy", "-f", DATA / "tinystory.txt", "-c", "64", "--chunks", "1")
    run("bench-serving", "-m", shape, "--load-format", "dummy", "--requests", "2", "--concurrency", "2",
        "--prompt-len", "8:8", "--output-len", "4:4", "--mode", "continuous")
    server = Server(shape, "--load-format", "dummy")
    try:
        status, body, _ = server.post("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_refusals(tmp_path):
    p = run("score", "-m", DATA / "families" / "qwen3", "-p", "x", "--ids", "1", "--load-format", "dummy", check=False)
    assert p.returncode != 0 and "GGUF file or shape file" in p.stderr
    p = run("score", "-m", STORIES, "-p", "x", "--ids", "1", "--load-format", "bogus", check=False)
    assert p.returncode != 0
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(STORIES.read_bytes()[:100000])
    p = run("info", truncated, check=False)
    assert p.returncode != 0 and "truncated" in p.stderr  # a cut real file is never taken for a shape file
