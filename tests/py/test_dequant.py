"""Every tensor type against an independent implementation: the gguf package's numpy dequantizers.

Random blocks (random bytes with finite, modest f16 scales) and real tensors from the fetched models.
"""
import functools
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from conftest import BUILD, MODELS, cached_model
from gguf_tensors import read_tensors

TOOL = BUILD / "dequant_tool"

# Offsets of the f16 scale fields inside one block, from the block layouts.
HALF_FIELDS = {T.Q4_0: [0], T.Q5_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q2_K: [80, 82],
               T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0]}
BLOCK = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q5_1: (32, 24), T.Q8_0: (32, 34),
         T.Q2_K: (256, 84), T.Q3_K: (256, 110), T.Q4_K: (256, 144), T.Q5_K: (256, 176), T.Q6_K: (256, 210),
         T.IQ4_NL: (32, 18),
         T.F16: (1, 2), T.BF16: (1, 2), T.F32: (1, 4)}


def random_blocks(qtype, n_blocks, rng):
    elems, size = BLOCK[qtype]
    if qtype == T.F32:
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", list(BLOCK), ids=lambda t: t.name)
def test_random_blocks_match_gguf_package(qtype, tmp_path):
    rng = np.random.default_rng(int(qtype))
    elems, size = BLOCK[qtype]
    n_blocks = 64 if elems > 1 else 4096
    raw = random_blocks(qtype, n_blocks, rng)
    n = n_blocks * elems
    (tmp_path / "in.bin").write_bytes(raw.tobytes())
    subprocess.run([TOOL, "raw", str(int(qtype)), tmp_path / "in.bin", str(n), tmp_path / "out.f32"], check=True)
    ours = np.fromfile(tmp_path / "out.f32", dtype=np.float32)
    theirs = dequantize(raw.reshape(1, -1), qtype).reshape(-1).astype(np.float32)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


REAL_TENSORS = [
    (MODELS / "TinyStories-656K-Q8_0.gguf", "blk.0.attn_q.weight"),
    ("qwen2.5-coder-0.5b-instruct", "blk.0.ffn_down.weight"),   # Q6_K
    ("qwen2.5-coder-0.5b-instruct", "blk.0.attn_q.weight"),     # Q5_0
    ("qwen2.5-coder-1.5b-instruct", "blk.1.attn_output.weight"),  # Q4_K
    ("gemma-3-270m", "token_embd.weight"),                      # Q8_0, 262144 x 640
]


# The tensors' bytes are located by gguf_tensors (GGUFReader parses every metadata array element by
# element: about 9 s for a Qwen file's 151,646-token vocabulary); the gguf package dequantizes them.
@functools.lru_cache(maxsize=None)
def tensors(path):
    return {t.name: t for t in read_tensors(path)}


@pytest.mark.parametrize("model,tensor", REAL_TENSORS, ids=lambda x: str(x).split("/")[-1])
def test_real_tensors_match_gguf_package(model, tensor, tmp_path):
    path = model if not isinstance(model, str) else cached_model(model)
    subprocess.run([TOOL, "gguf", path, tensor, tmp_path / "out.f32"], check=True)
    ours = np.fromfile(tmp_path / "out.f32", dtype=np.float32)
    t = tensors(path)[tensor]
    theirs = dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float32)
    # Bitwise equal is the usual outcome and takes a second; assert_allclose alone took 9 s on Gemma's
    # 168 M-value embedding (its temporaries), so it runs only to report a difference within or past the bound.
    if not np.array_equal(ours, theirs):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
