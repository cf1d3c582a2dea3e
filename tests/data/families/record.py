#!/usr/bin/env python3
"""Records the tiny model families in this directory (not run by the test suite).

Needs torch and transformers (a scratch venv outside the repository):
    python tests/data/families/record.py

For each architecture a random configuration is built with Hugging Face transformers (weights drawn
with std 0.2 so the next-token distributions are far from uniform, then stored as F16), saved as a
Hugging Face directory with the TinyStories-656K tokenizer, and run in F32 on the stored values:
  <arch>/                  config.json, model.safetensors, tokenizer files
  reference.json           {arch: [{prompt, ids, greedy, logprobs, top}]}:
                           ids        the prompt's token ids
                           greedy     8 tokens of greedy decoding
                           logprobs   log-probabilities of the greedy tokens (teacher forcing)
                           top        the last prompt position's 16 largest logits, as [id, logit]
"""
import json
import pathlib
import sys

import torch
from transformers import (AutoTokenizer, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

HERE = pathlib.Path(__file__).resolve().parent
STORIES = HERE.parents[2].parent / "shared" / "models" / "TinyStories-656K"
PROMPTS = ["Once upon a time, there was a little girl named", "The dog ran to the park and", "Tom was sad because"]
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)


def families(vocab):
    return {
        # Qwen3: QK-norm per head, no biases, a head size that makes q_dim (128) differ from hidden (64).
        "qwen3": Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, intermediate_size=128, head_dim=32,
                                              rope_theta=1000000.0, **COMMON)),
        # Qwen3-MoE: 8 experts, top 2, renormalized; layer 1 dense (mlp_only_layers) to cover both kinds.
        "qwen3moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab, intermediate_size=96, head_dim=16,
                                                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       norm_topk_prob=True, mlp_only_layers=[1], **COMMON)),
        # Qwen2-MoE: QKV biases, routed experts not renormalized, a shared expert behind a sigmoid gate.
        "qwen2moe": Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=vocab, intermediate_size=96, num_experts=6,
                                                       num_experts_per_tok=3, moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                       **COMMON)),
        # OLMoE: QK-norm over all heads at once, 8 experts of intermediate_size, top 2, not renormalized.
        "olmoe": OlmoeForCausalLM(OlmoeConfig(vocab_size=vocab, intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0,
                                              eos_token_id=2, bos_token_id=1, **COMMON)),
        # Mixtral: a llama with 4 experts of intermediate_size, top 2 (softmax over the chosen logits).
        "mixtral": MixtralForCausalLM(MixtralConfig(vocab_size=vocab, intermediate_size=48, num_local_experts=4,
                                                    num_experts_per_tok=2, rope_theta=1000000.0, **COMMON)),
        # Gemma 2: soft-capped attention scores and logits (small caps, so tanh bends them), alternating
        # sliding-window layers (a window of 6, shorter than the prompts), query_pre_attn_scalar other
        # than the head size, four norms per layer stored as w - 1.
        "gemma2": Gemma2ForCausalLM(Gemma2Config(vocab_size=vocab, intermediate_size=96, head_dim=32,
                                                 query_pre_attn_scalar=24, sliding_window=6,
                                                 attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                 **{**COMMON, "num_hidden_layers": 3})),
        # Gemma 3 (text): QK-norm, five sliding-window layers then a global one (the layout GGUF implies),
        # two RoPE bases.
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=vocab, intermediate_size=96, head_dim=16,
                                                     query_pre_attn_scalar=16, sliding_window=6,
                                                     **{**COMMON, "num_hidden_layers": 6})),
        # Phi-3: fused QKV and gate/up matrices, half the head rotated (Phi-4-mini's partial rotary),
        # every layer in a sliding window of 6 (Phi-3 mini 4K: 2047).
        "phi3": Phi3ForCausalLM(Phi3Config(vocab_size=vocab, intermediate_size=96, partial_rotary_factor=0.5,
                                           sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)),
    }


def scaled_families(vocab):
    """RoPE scaling, recorded after the families above with a seed of its own (so theirs stay as they were)."""
    d = 16  # rotary pairs 0..7 (head size 16), or 16 pairs for Qwen3's 32
    return {
        # Phi-3 LongRoPE (Phi-3 128K / Phi-3.5 / Phi-4-mini): an original context of 4 tokens, shorter
        # than every prompt, so transformers takes the long factors throughout (as Serval does when its
        # context exceeds the original); attention factor sqrt(1 + ln 16 / ln 4).
        "phi3_longrope": Phi3ForCausalLM(Phi3Config(
            vocab_size=vocab, intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            **{**COMMON, "max_position_embeddings": 64}, original_max_position_embeddings=4,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(d // 2)],
                          "long_factor": [1.0 + 2.5 * i for i in range(d // 2)]})),
        # Qwen3 with YaRN (Qwen3's documented long-context setting): factor 4 over an original 256
        # positions, beta_fast 16 and truncate false (gpt-oss's) so the ramp is fractional.
        "qwen3_yarn": Qwen3ForCausalLM(Qwen3Config(
            vocab_size=vocab, intermediate_size=128, head_dim=32, **{**COMMON, "max_position_embeddings": 1024},
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "beta_fast": 16.0, "beta_slow": 1.0,
                             "truncate": False})),
        # Llama 3.1's scaling: pair 0 smoothed, the rest divided by the factor.
        "llama3_rope": LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, intermediate_size=128, **COMMON,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    }


def gpt_oss_family(vocab):
    """gpt-oss, recorded with a seed of its own: attention sinks, biases everywhere, 4 experts top 2
    (softmax over the chosen logits), OpenAI's clamped SwiGLU (a limit of 1.5, so the clamps bind on
    these random weights), alternating sliding-window layers (a window of 6) and YaRN (truncate false)."""
    return {
        "gpt_oss": GptOssForCausalLM(GptOssConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
            swiglu_limit=1.5, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    }


def deepseek2_family(vocab):
    """DeepSeek-V2, recorded with a seed of its own: multi-head latent attention (a 48-value latent and a
    16-value RoPE key per token; 4 heads of 16 + 16 query/key values and 24 value values), layer 0
    dense (first_k_dense_replace), then 8 routed experts, top 2, softmax not renormalized, plus a shared
    expert. deepseek2: V2-Lite's layout (no query compression, greedy routing) with V2's YaRN
    (mscale = mscale_all_dim, which also scales the softmax); deepseek2_qlora: V2's compressed query,
    group-limited routing (4 groups of 2, the best one: both its experts run) and a routed scaling factor, no RoPE scaling."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return {
        "deepseek2": DeepseekV2ForCausalLM(DeepseekV2Config(
            q_lora_rank=None, topk_method="greedy", **common,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
        "deepseek2_qlora": DeepseekV2ForCausalLM(DeepseekV2Config(
            q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=2.0,
            **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }


def record_gpt_oss_mxfp4(tok):
    """gpt_oss written as OpenAI's MXFP4 checkpoint (tests/py/gpt_oss_mxfp4.py, numpy, rerun by the test)
    and loaded by transformers' own MXFP4 support (dequantized): gpt_oss_mxfp4.json."""
    import tempfile
    from transformers import Mxfp4Config
    sys.path.insert(0, str(HERE.parents[1] / "py"))
    import gpt_oss_mxfp4
    with tempfile.TemporaryDirectory() as d:
        gpt_oss_mxfp4.write(d)
        model = GptOssForCausalLM.from_pretrained(d, quantization_config=Mxfp4Config(dequantize=True),
                                                  torch_dtype=torch.float32).eval()
        (HERE / "gpt_oss_mxfp4.json").write_text(json.dumps(record(model, tok), indent=1) + "\n")


def record(model, tok):
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            seq = list(ids)
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            logits = model(torch.tensor([seq])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            greedy = seq[len(ids):]
            lp = [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(greedy)]
            last = logits[len(ids) - 1]
            top = torch.topk(last, 16)
            rows.append({"prompt": prompt, "ids": ids, "greedy": greedy, "logprobs": lp,
                         "top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)]})
    return rows


def save(name, model, tok, reference):
    model.eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model = model.half()  # stored as F16; the reference runs in F32 on the same values
    d = HERE / name
    d.mkdir(exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).write_bytes((STORIES / f).read_bytes())
    reference[name] = record(model.float(), tok)


def main():
    torch.manual_seed(41)
    tok = AutoTokenizer.from_pretrained(STORIES)
    reference = {}
    # --group scaled|gpt_oss|deepseek2: re-record only that group, keeping the rest of reference.json
    only = sys.argv[sys.argv.index("--group") + 1] if "--group" in sys.argv else None
    only_scaled = only is not None
    if only_scaled:
        reference = json.loads((HERE / "reference.json").read_text())
    for name, model in ({} if only_scaled else families(tok.vocab_size)).items():
        save(name, model, tok, reference)
    for group, (seed, make) in {"scaled": (42, scaled_families), "gpt_oss": (43, gpt_oss_family),
                               "deepseek2": (44, deepseek2_family)}.items():
        if only not in (None, group):
            continue
        torch.manual_seed(seed)
        for name, model in make(tok.vocab_size).items():
            save(name, model, tok, reference)
    if only in (None, "gpt_oss", "gpt_oss_mxfp4"):
        record_gpt_oss_mxfp4(tok)
    (HERE / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
