"""Writes gpt-oss's tiny random model (tests/data/families/gpt_oss) as OpenAI's MXFP4 checkpoint layout,
as the real gpt-oss-20b / 120b are published: each expert matrix as `<name>_blocks` (U8 [E, rows, in/32, 16],
value 2k in the low nibble of byte k and 2k + 1 in the high one) and `<name>_scales` (U8 E8M0 [E, rows, in/32]),
rows being output features (gate and up interleaved), plus config.json's quantization_config. The values
are rounded by the PyPI `gguf` package's MXFP4 quantizer; numpy only, so the test suite can run it.

    python tests/py/gpt_oss_mxfp4.py OUT_DIR
"""
import json
import pathlib
import shutil
import sys

import numpy as np
import gguf.quants
from gguf.constants import GGMLQuantizationType as T
from safetensors_np import read_safetensors, write_safetensors  # noqa: F401 (the tests use them from here too)

SRC = pathlib.Path(__file__).resolve().parents[1] / "data" / "families" / "gpt_oss"


def openai_mxfp4(w):
    """w [E, rows, in] (float) -> blocks [E, rows, in/32, 16], scales [E, rows, in/32]."""
    e, rows, cols = w.shape
    q = gguf.quants.quantize(w.reshape(-1, cols).astype(np.float32), T.MXFP4).reshape(e, rows, cols // 32, 17)
    scales, qs = q[..., 0], q[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGUF: value j low, j + 16 high
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # OpenAI: 2k low, 2k + 1 high
    return blocks, scales.astype(np.uint8)


def write(out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = read_safetensors(SRC / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).astype(np.float32).transpose(0, 2, 1)  # x @ W: [E, in, out] -> [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = openai_mxfp4(w)
    write_safetensors(out / "model.safetensors", tensors)
    config = json.loads((SRC / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(SRC / f, out / f)
    return out


if __name__ == "__main__":
    write(sys.argv[1])
