"""Quantized KV cache types (--cache-type / --kv-cache-dtype: f32, f16, bf16, q8_0, fp8_e4m3) end to end:
the perplexity of Qwen2.5-0.5B and 1.5B with q8_0 and FP8 KV within the issue's bounds of F16 KV (0.5% and
1.5%), a server with a q8_0 cache answers, the start-up capacity line gives 64/34 (q8_0) and 2x (FP8)
the tokens of F16 for the same budget, and anything else is a clear error."""
import functools
import re

import pytest

from conftest import DATA, cached_model, run
from server_util import Server

QWEN = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"
FLAGS = ["-c", 256, "--chunks", 2, "-t", 2]


# Memoised: a test that needs a run another test made (same flags) reads its result.
@functools.lru_cache(maxsize=None)
def perplexity(cache_type, flag="--cache-type", model=QWEN):
    out = run("perplexity", "-m", cached_model(model), "-f", DATA / "tinystory.txt", *FLAGS, flag, cache_type).stdout
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))


@pytest.fixture(scope="module")
def f16_ppl():
    return perplexity("f16")


# The 1.5B's K bias reaches 354: before keys were centred on it (Model::KCentring), FP8 measured +18.4%
# here and +59.8% on a longer text; centred, -1.0% (docs/quantization.md).
@pytest.fixture(scope="module")
def f16_ppl_1_5b():
    return perplexity("f16", model=QWEN15)


@pytest.mark.parametrize("cache_type,bound", [("q8_0", 0.005), ("fp8_e4m3", 0.015)])
def test_1_5b_perplexity_close_to_f16_kv(f16_ppl_1_5b, cache_type, bound):
    ppl = perplexity(cache_type, model=QWEN15)
    assert abs(ppl / f16_ppl_1_5b - 1) < bound, (cache_type, ppl, f16_ppl_1_5b)


# FP8 stores V rotated per head (KvLayerView::v_rotated): without the rotation this text measured +2.2%
# (12.43 vs 12.16), as V's many small values fell into E4M3's subnormals; with it and the keys centred,
# +0.5% (docs/quantization.md).
@pytest.mark.parametrize("cache_type,bound", [("q8_0", 0.005), ("fp8_e4m3", 0.015), ("bf16", 0.005)])
def test_perplexity_close_to_f16_kv(f16_ppl, cache_type, bound):
    ppl = perplexity(cache_type, "--kv-cache-dtype")
    assert abs(ppl / f16_ppl - 1) < bound, (cache_type, ppl, f16_ppl)
    assert ppl != f16_ppl, "the cache type must change something (else the comparison is vacuous)"


def test_fp8_alias_is_fp8_e4m3():
    # Both names and both flags: `--cache-type fp8` against the `--kv-cache-dtype fp8_e4m3` run above.
    assert perplexity("fp8") == perplexity("fp8_e4m3", "--kv-cache-dtype")


def test_unknown_cache_type_is_a_clear_error():
    for cmd in (["perplexity", "-f", DATA / "tinystory.txt"], ["generate", "-p", "hi"], ["bench"]):
        p = run(*cmd, "-m", cached_model(QWEN), "--kv-cache-dtype", "q4_0", check=False)
        assert p.returncode != 0 and "unsupported KV cache type 'q4_0' (f32, f16, bf16, q8_0, fp8_e4m3)" in p.stderr


def capacity_tokens(cache_type):
    """Starts a server with a 24 MiB KV budget; returns its capacity line's token count and a reply."""
    s = Server(cached_model(QWEN), "--kv-cache-dtype", cache_type, kv_memory="24MiB")
    try:
        status, body, _ = s.post("/v1/completions", {"model": QWEN, "prompt": "def add(a, b):", "max_tokens": 8,
                                                     "temperature": 0})
    finally:
        assert s.stop() == 0
    log = s.proc.stdout.read()
    m = re.search(r"KV cache: (\w+), (\d+) bytes per token.* = (\d+) tokens", log)
    assert m, log
    assert m.group(1) == cache_type
    return int(m.group(2)), int(m.group(3)), status, body


def test_serve_capacity_and_answers_per_kv_dtype():
    f16_bytes, f16_tokens, _, _ = capacity_tokens("f16")
    assert f16_bytes == 12288  # 2 x 24 layers x 2 KV heads x 64 x 2 bytes
    for cache_type, ratio in [("q8_0", 64 / 34), ("fp8_e4m3", 2.0)]:
        nbytes, tokens, status, body = capacity_tokens(cache_type)
        assert status == 200 and body["choices"][0]["text"], body
        assert nbytes == round(f16_bytes / ratio)
        # Whole blocks of the same budget: the ratio up to one block.
        assert abs(tokens / f16_tokens - ratio) < 0.02, (cache_type, tokens, f16_tokens)


def test_plan_takes_the_same_kv_dtypes():
    f16 = run("plan", "--preset", "qwen2.5-0.5b", "--kv-dtype", "f16", "--json").stdout
    for dtype, per_token in [("q8_0", 6528), ("fp8_e4m3", 6144), ("bf16", 12288), ("f16", 12288)]:
        out = run("plan", "--preset", "qwen2.5-0.5b", "--kv-dtype", dtype, "--json").stdout
        assert re.search(rf'"kv_bytes_per_token":\s*{per_token}\b', out), out
    assert f16
