#!/usr/bin/env python3
"""Records the Qwen LoRA test's adapter and reference outputs (tests/py/test_lora_qwen.py; not run by the
suite or CI).

Needs torch, transformers, peft and gguf (a scratch venv outside the repository): python record_qwen.py
Base model: the cached default model, $SERVAL_MODEL_CACHE (default ~/.cache/serval/models)/
qwen2.5-coder-0.5b-instruct.gguf (fetched by scripts/setup). Its quantized weights are dequantized with
the gguf package into a Hugging Face Qwen2ForCausalLM in F32 (names mapped back; no Q/K permutation:
llama.cpp's converter does not permute qwen2's; this GGUF has its own output.weight, the embeddings would
be tied without one); the tokenizer is transformers' own conversion of the GGUF's vocabulary. Writes,
beside this script (the adapter itself is not kept: tests/py/qwen_adapter.py writes it with numpy, for
this script and for the test alike):
  reference_qwen.json per prompt: the prompt's ids (no BOS, as the GGUF and Qwen's tokenizer encode it),
                      PEFT's greedy continuation, its log-probabilities (teacher forcing) and at each
                      position the gap between the best two log-probabilities (margins); the base model's
                      log-probabilities of that same continuation; the base model's own greedy continuation,
                      its log-probabilities and margins. All FP32.
"""
import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from peft import PeftModel
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "py"))
from qwen_adapter import write_adapter  # noqa: E402
CACHE = pathlib.Path(os.environ.get("SERVAL_MODEL_CACHE", pathlib.Path.home() / ".cache" / "serval" / "models"))
GGUF = CACHE / "qwen2.5-coder-0.5b-instruct.gguf"
NAME = "qwen-r8"
PROMPTS = ["def fibonacci(n):", "The capital of France is"]
N_NEW = 10

LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
for p in "qkv":
    for kind in ("weight", "bias"):
        LAYER_NAMES[f"attn_{p}.{kind}"] = f"self_attn.{p}_proj.{kind}"


def hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def load_base() -> Qwen2ForCausalLM:
    reader = GGUFReader(GGUF)
    f = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.")}
    assert f["general.architecture"] == "qwen2"
    weights = {}
    for t in reader.tensors:
        # t.shape is GGUF's [ne0 (in), ne1 (out)]; HF stores [out, in]. Q/K rows stay as they are.
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        weights[hf_name(t.name)] = torch.from_numpy(w.copy())
    tied = "lm_head.weight" not in weights
    config = Qwen2Config(
        vocab_size=weights["model.embed_tokens.weight"].shape[0], hidden_size=f["qwen2.embedding_length"],
        intermediate_size=f["qwen2.feed_forward_length"], num_hidden_layers=f["qwen2.block_count"],
        num_attention_heads=f["qwen2.attention.head_count"], num_key_value_heads=f["qwen2.attention.head_count_kv"],
        max_position_embeddings=f["qwen2.context_length"], rms_norm_eps=f["qwen2.attention.layer_norm_rms_epsilon"],
        rope_theta=f["qwen2.rope.freq_base"], rope_parameters={"rope_type": "default", "rope_theta": f["qwen2.rope.freq_base"]},
        tie_word_embeddings=tied, use_sliding_window=False, torch_dtype="float32")
    model = Qwen2ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), (missing, unexpected)
    if tied:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def logprobs(model, ids, cont):
    """Each continuation token's log-probability, and the gap between the best two at its position."""
    logp = torch.log_softmax(model(torch.tensor([ids + cont])).logits[0].float(), -1)
    top2 = logp[len(ids) - 1:-1].topk(2, -1).values
    return [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(cont)], (top2[:, 0] - top2[:, 1]).tolist()


def greedy(model, ids):
    cont = []
    for _ in range(N_NEW):
        cont.append(int(model(torch.tensor([ids + cont])).logits[0, -1].argmax()))
    return cont


def main() -> None:
    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    base = load_base()
    with tempfile.TemporaryDirectory() as tmp:  # the test writes the same adapter (tests/py/qwen_adapter.py)
        model = PeftModel.from_pretrained(base, str(write_adapter(pathlib.Path(tmp) / NAME))).float().eval()
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            cont = greedy(model, ids)
            row = {"prompt": prompt, "ids": ids, "continuation": cont}
            row["logprobs"], row["margins"] = logprobs(model, ids, cont)
            with model.disable_adapter():
                row["base_logprobs"] = logprobs(model, ids, cont)[0]
                row["base_continuation"] = greedy(model, ids)
                row["base_continuation_logprobs"], row["base_margins"] = logprobs(model, ids, row["base_continuation"])
            print(prompt, "->", repr(tok.decode(cont)), "| base:", repr(tok.decode(row["base_continuation"])))
            rows.append(row)
    (HERE / "reference_qwen.json").write_text(json.dumps({NAME: rows}, indent=1))


if __name__ == "__main__":
    main()
