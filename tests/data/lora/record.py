#!/usr/bin/env python3
"""Records the LoRA tests' adapters and reference outputs (not run by the suite or CI).

Needs torch, transformers and peft (a scratch venv outside the repository): python record.py
Base model: ../shared/models/TinyStories-656K (a real Llama, F32 safetensors). Writes, beside this script:
  stories-a/, stories-b/, stories-c/   random rank-8 PEFT adapters (all seven projections; c: rank 4,
                                       q/v only, use_rslora) as PEFT saves them
  reference.json                       per adapter and prompt: the prompt's ids (the HF tokenizer, BOS
                                       added), continuation ids, and PEFT's log-probabilities of each
                                       continuation token (teacher forcing), FP32
"""
import json
import pathlib

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = pathlib.Path(__file__).parent
BASE = HERE.parents[2].parent / "shared" / "models" / "TinyStories-656K"
PROMPTS = ["Once upon a time, there was a little girl named", "The dog ran to the park and", "Tom was sad because"]
ADAPTERS = {
    "stories-a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=1),
    "stories-b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=2),
    "stories-c": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True, seed=3),
}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(BASE)
    ref = {}
    for name, spec in ADAPTERS.items():
        spec = dict(spec)
        torch.manual_seed(spec.pop("seed"))
        base = AutoModelForCausalLM.from_pretrained(BASE).float().eval()
        model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec)).eval()
        for n, p in model.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.1)  # PEFT starts B at zero: make the update visible
        model.save_pretrained(HERE / name, safe_serialization=True)
        rows = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = tok(prompt)["input_ids"]
                cont = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
                full = torch.tensor([ids + cont])
                logp = torch.log_softmax(model(full).logits[0].float(), -1)
                lps = [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(cont)]
                rows.append({"prompt": prompt, "ids": ids, "continuation": cont, "logprobs": lps})
        ref[name] = rows
    (HERE / "reference.json").write_text(json.dumps(ref, indent=1))


if __name__ == "__main__":
    main()
