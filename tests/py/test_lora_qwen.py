"""LoRA on the default model, the real Qwen2.5-Coder 0.5B GGUF (issue 42): a random rank-8 adapter (q_proj,
v_proj, down_proj; F16; written by tests/py/qwen_adapter.py with numpy, nothing of it in git) against PEFT
on the GGUF's weights dequantized to F32 (recorded by tests/data/lora/record_qwen.py), as a PEFT directory
and converted to a GGUF adapter.

The adapter is compared on the same weights as an F32 GGUF (`serval quantize --allow-requantize --pure
... F32`, made here): measured largest |difference| of a token's log-probability 1.5e-4 and 6.1e-4 (PEFT
0.21, transformers 5.25), bound 2e-3, while the adapter moves them by 12.4 and 10.0. On the quantized file
Serval multiplies with int8 activations: the base model's greedy continuations stay within 0.060 of PEFT
(bound 0.15), but the adapter's garbled continuations (flat distributions) move by up to 2.3, too close to
its effect for a bound that means anything, so there the test only checks that the adapter is applied and
that the converted GGUF adapter gives the PEFT directory's bits.
"""
import json

import pytest

from conftest import DATA, DEFAULT_MODEL, cached_model, run
from qwen_adapter import write_adapter

LORA = DATA / "lora"
NAME = "qwen-r8"
REF = json.loads((LORA / "reference_qwen.json").read_text())[NAME]
TOL_BASE = 0.15  # the quantized base model (measured 0.060)
TOL = 2e-3  # with the adapter, on the F32 GGUF (measured 6.1e-4)
EFFECT = 2.4  # the adapter moves some log-probability by more than this (measured 10.0 and 12.4)


def score(model, prompt, ids, *extra):
    """Teacher-forced log-probabilities of `ids` after `prompt`, and the model's argmax at each position."""
    out = run("score", "-m", model, "--cache-type", "f32", "-p", prompt, "--ids", ",".join(map(str, ids)), *extra).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    return [r["logprob"] for r in rows], [r["argmax"] for r in rows]


def worst(got, want):
    return max(abs(a - b) for a, b in zip(got, want))


def greedy_agrees(argmax, want, margins, tol):
    """Serval's argmax is PEFT's token wherever PEFT's best two are more than 2 tol apart."""
    return all(a == w for a, w, m in zip(argmax, want, margins) if m > 2 * tol)


@pytest.fixture(scope="module")
def qwen():
    return cached_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """The recorded adapter, written again with numpy (tests/py/qwen_adapter.py)."""
    return write_adapter(tmp_path_factory.mktemp("lora") / NAME)


@pytest.fixture(scope="module")
def qwen_f32(qwen, tmp_path_factory):
    """The default model's weights dequantized into an F32 GGUF: the values PEFT ran with."""
    out = tmp_path_factory.mktemp("f32") / "qwen-f32.gguf"
    run("quantize", "--allow-requantize", "--pure", qwen, out, "F32")
    return out


@pytest.fixture(scope="module")
def adapted(qwen_f32, adapter):
    """Serval with the PEFT directory on each prompt's PEFT greedy continuation (one model load each)."""
    return [score(qwen_f32, row["prompt"], row["continuation"], "--lora", adapter) for row in REF]


def test_the_recorded_adapter_changes_the_output():
    for row in REF:
        assert worst(row["logprobs"], row["base_logprobs"]) > 3 * EFFECT
    assert all(row["continuation"] != row["base_continuation"] for row in REF)


@pytest.mark.parametrize("i", range(len(REF)))
def test_base_equals_peft_base(qwen, i):
    row = REF[i]
    lps, argmax = score(qwen, row["prompt"], row["base_continuation"])
    assert worst(lps, row["base_continuation_logprobs"]) <= TOL_BASE
    assert greedy_agrees(argmax, row["base_continuation"], row["base_margins"], TOL_BASE)


def test_peft_adapter_equals_peft(adapted):
    for row, (lps, argmax) in zip(REF, adapted):
        assert worst(lps, row["logprobs"]) <= TOL
        assert worst(lps, row["base_logprobs"]) > EFFECT  # the adapter was applied
        assert greedy_agrees(argmax, row["continuation"], row["margins"], TOL)


# The base's config.json, all that `serval convert` reads of a Hugging Face base (the architecture and the
# heads; Qwen2.5-Coder-0.5B-Instruct's values; the loader checks every matrix against the GGUF model).
QWEN_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
               "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
               "vocab_size": 151936, "tie_word_embeddings": True}


def test_adapter_applied_on_the_quantized_file(qwen, adapter):
    for row in REF:
        lps, _ = score(qwen, row["prompt"], row["continuation"], "--lora", adapter)
        base, _ = score(qwen, row["prompt"], row["continuation"])
        assert worst(lps, base) > EFFECT


def test_gguf_adapter_equals_the_peft_directory(qwen_f32, adapter, adapted, tmp_path):
    base = tmp_path / "qwen-hf"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(QWEN_CONFIG))
    out = tmp_path / f"{NAME}.gguf"
    run("convert", adapter, out, "--base", base, "--outtype", "f16")  # the F16 values as they are
    row = REF[0]
    got = score(qwen_f32, row["prompt"], row["continuation"], "--lora", out)
    assert got == adapted[0]  # bitwise: the same numbers reach the same products
    assert worst(got[0], row["logprobs"]) <= TOL
