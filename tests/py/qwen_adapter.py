"""The random rank-8 LoRA adapter of tests/py/test_lora_qwen.py, written as a PEFT directory with numpy
alone (so that no weights live in git and neither CI nor the test needs torch). tests/data/lora/
record_qwen.py loads the same directory into PEFT to record the reference.

Targets q_proj, v_proj and down_proj of Qwen2.5-Coder 0.5B's 24 layers; A [8, in] and B [out, 8] drawn
from N(0, std) in F16 (std 0.075 for q_proj, 0.03 otherwise: 0.02 moves the log-probabilities by < 0.1,
0.04 makes the text garbage; q_proj's update only moves attention scores, so it gets 2.5 times more for a
wrong q_proj to show), one numpy generator per tensor seeded by its index.
"""
import json
import pathlib

import numpy as np
from safetensors_np import write_safetensors

RANK, ALPHA, LAYERS = 8, 16, 24
EMBD, KV_DIM, FF = 896, 128, 4864
MODULES = {"self_attn.q_proj": (EMBD, EMBD, 0.075), "self_attn.v_proj": (KV_DIM, EMBD, 0.03),
           "mlp.down_proj": (EMBD, FF, 0.03)}  # (out, in, std)


def write_adapter(out: pathlib.Path) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors, index = {}, 0
    for layer in range(LAYERS):
        for module, (n_out, n_in, std) in MODULES.items():
            for part, shape in (("lora_A", (RANK, n_in)), ("lora_B", (n_out, RANK))):
                name = f"base_model.model.model.layers.{layer}.{module}.{part}.weight"
                tensors[name] = np.random.default_rng(index).normal(0, std, shape).astype(np.float16)
                index += 1
    write_safetensors(out / "adapter_model.safetensors", tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "bias": "none", "target_modules": sorted(m.split(".")[1] for m in MODULES)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
