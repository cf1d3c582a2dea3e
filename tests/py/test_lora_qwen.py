"""LoRA on the default model, the real Qwen2.5-Coder 0.5B GGUF (issue 42): a random rank-8 PEFT adapter
(q_proj, v_proj, down_proj; F16) against PEFT on the GGUF's weights dequantized to F32 (recorded by
tests/data/lora/record_qwen.py), as a PEFT directory and converted to a GGUF adapter.

Serval multiplies the quantized weights with int8-quantized activations, PEFT with F32 ones, so even the
base model differs from PEFT's by more than float rounding. Measured (F32 KV; PEFT 0.21, transformers
5.25), the largest |difference| of a token's log-probability: 0.060 on the base model's greedy
continuations, 0.21 and 0.39 with the adapter on PEFT's (whose text is garbled: flatter distributions,
larger errors; 0.07 and 0.18 on average). With the same weights dequantized to an F32 GGUF (`serval quantize
--allow-requantize --pure ... F32`) Serval is within 1e-4 of PEFT in all of them: the dequantization, the
unpermuted Q/K rows and the tokenization are PEFT's, and the rest is the int8 activations. The bounds
cover those with margin; the adapter changes the log-probabilities by up to 12.0 and 8.1, and the tests
assert that it changes them by more than EFFECT. A wrong adapter fails: scale 0.9 or 1.1 (up to 3.8 and
4.5), q_proj, v_proj or down_proj left out (7.0, 4.1, 9.2), Q's rows permuted as for llama (3.4).
"""
import json

import pytest

from conftest import DATA, DEFAULT_MODEL, cached_model, run

LORA = DATA / "lora"
NAME = "qwen-r8"
ADAPTER = LORA / NAME
REF = json.loads((LORA / "reference_qwen.json").read_text())[NAME]
TOL_BASE = 0.15  # the base model (measured 0.060)
TOL = 0.6  # with the adapter (measured 0.39)
EFFECT = 4 * TOL


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
def adapted(qwen):
    """Serval with the PEFT directory on each prompt's PEFT greedy continuation (one model load each)."""
    return [score(qwen, row["prompt"], row["continuation"], "--lora", ADAPTER) for row in REF]


def test_the_recorded_adapter_changes_the_output():
    for row in REF:
        assert worst(row["logprobs"], row["base_logprobs"]) > 2 * EFFECT
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


def test_gguf_adapter_equals_the_peft_directory(qwen, adapted, tmp_path):
    base = tmp_path / "qwen-hf"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(QWEN_CONFIG))
    out = tmp_path / f"{NAME}.gguf"
    run("convert", ADAPTER, out, "--base", base, "--outtype", "f16")  # the F16 values as they are
    row = REF[0]
    got = score(qwen, row["prompt"], row["continuation"], "--lora", out)
    assert got == adapted[0]  # bitwise: the same numbers reach the same products
    assert worst(got[0], row["logprobs"]) <= TOL
