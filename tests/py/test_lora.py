"""LoRA adapters against PEFT (recorded by tests/data/lora/record.py), against merged weights computed
here with numpy, and through the real server: adapters chosen per request, mixed in one batch.
"""
import json
import math
import shutil
import struct
import threading

import numpy as np
import pytest

from conftest import DATA, MODELS, run
from server_util import Server

LORA = DATA / "lora"
REF = json.loads((LORA / "reference.json").read_text())
BASE = MODELS / "TinyStories-656K"
TOKENIZER = BASE / "tokenizer.json"
# F32 KV: the comparison is then limited by float rounding and score's 5 printed decimals.
TOL = 5e-5


def score(model, row, *extra):
    out = run("score", "-m", model, "--cache-type", "f32", "-p", row["prompt"], "--ids",
              ",".join(map(str, row["continuation"])), *extra).stdout
    return [json.loads(line)["logprob"] for line in out.splitlines()]


def worst(got, want):
    return max(abs(a - b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "stories-f32.gguf"
    run("convert", BASE, path, "--outtype", "f32")
    return path


@pytest.mark.parametrize("name", sorted(REF))
def test_peft_adapter_equals_peft(name):
    for row in REF[name]:
        base = score(BASE, row)
        got = score(BASE, row, "--lora", LORA / name)
        assert worst(got, row["logprobs"]) <= TOL
        assert worst(base, row["logprobs"]) > 0.05  # the adapter changes the output


@pytest.mark.parametrize("name", sorted(REF))
def test_gguf_base_and_gguf_adapter_equal_peft(name, gguf_base, tmp_path):
    adapter = tmp_path / f"{name}.gguf"
    run("convert", LORA / name, adapter, "--base", BASE, "--outtype", "f32")
    row = REF[name][0]
    tok = ("--tokenizer", TOKENIZER)  # the converted GGUF's SentencePiece-style encoding differs (docs/models.md)
    assert worst(score(gguf_base, row, "--lora", LORA / name, *tok), row["logprobs"]) <= TOL  # PEFT on GGUF: Q/K permuted
    assert worst(score(gguf_base, row, "--lora", adapter, *tok), row["logprobs"]) <= TOL
    assert worst(score(BASE, row, "--lora", adapter), row["logprobs"]) <= TOL  # GGUF adapter on the HF base


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32"
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(info["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_equals_merged_weights_computed_with_numpy(tmp_path):
    """W + (alpha / r) B A, merged here independently of Serval, gives the adapter's outputs."""
    name = "stories-a"
    cfg = json.loads((LORA / name / "adapter_config.json").read_text())
    factor = cfg["lora_alpha"] / cfg["r"]
    weights = read_safetensors(BASE / "model.safetensors")
    adapter = read_safetensors(LORA / name / "adapter_model.safetensors")
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        target = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + factor * (b @ a)
    merged = tmp_path / "merged"
    merged.mkdir()
    for f in BASE.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, merged / f.name)
    write_safetensors(merged / "model.safetensors", weights)
    for row in REF[name]:
        assert worst(score(merged, row), score(BASE, row, "--lora", LORA / name)) <= TOL


@pytest.fixture(scope="module")
def server():
    s = Server(BASE, "--lora", f"a={LORA / 'stories-a'}", "--lora", f"b={LORA / 'stories-b'}",
               "--lora-scaled", LORA / "stories-c", "1.0", "--kv-cache-dtype", "f32", name="stories")
    yield s
    assert s.stop() == 0


def complete(server, model, prompt, extra=None):
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 1, **(extra or {})}
    status, out, _ = server.post("/v1/completions", body)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    return out["choices"][0]["text"], lp["token_logprobs"]


def test_models_and_lora_adapters_list_them(server):
    status, body = server.get("/v1/models")
    ids = [m["id"] for m in json.loads(body)["data"]]
    assert ids == ["stories", "a", "b", "stories-c"]
    assert all(m.get("parent") == "stories" for m in json.loads(body)["data"][1:])
    adapters = json.loads(server.get("/lora-adapters")[1])
    assert [(a["id"], a["name"], a["rank"]) for a in adapters] == [(0, "a", 8), (1, "b", 8), (2, "stories-c", 4)]


def test_requests_choose_adapters_and_match_peft(server):
    """By model name (vLLM) and by the lora field (llama-server); the base first, so that a prefix cache
    keyed without the adapter would hand the adapter the base model's KV."""
    for name, model in (("stories-a", "a"), ("stories-b", "b"), ("stories-c", "stories-c")):
        row = REF[name][0]
        complete(server, "stories", row["prompt"])  # fills the prefix cache with the base model's blocks
        text, lps = complete(server, model, row["prompt"])
        assert worst(lps, row["logprobs"]) <= 1e-4, name
    idx = {"stories-a": 0, "stories-b": 1}
    for name, i in idx.items():
        row = REF[name][1]
        _, lps = complete(server, "stories", row["prompt"], {"lora": [{"id": i, "scale": 1.0}]})
        assert worst(lps, row["logprobs"]) <= 1e-4


def test_mixed_adapters_in_one_batch_are_each_alone(server):
    """Three adapters and the base at once: every request's tokens and log-probabilities are the bits it
    gets alone."""
    prompts = [REF["stories-a"][2]["prompt"], REF["stories-b"][0]["prompt"], REF["stories-c"][1]["prompt"],
               "Lily and Ben went"]
    models = ["a", "b", "stories-c", "stories"]
    alone = [complete(server, m, p, {"max_tokens": 24}) for m, p in zip(models, prompts)]
    results = {}

    def worker(i):
        results[i] = complete(server, models[i], prompts[i], {"max_tokens": 24})

    for _ in range(2):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(4)] == alone


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "nope", "prompt": "x"}, 404, "LoRA adapters"),
    ({"prompt": "x", "lora": [{"id": 3, "scale": 1}]}, 400, "not loaded"),
    ({"prompt": "x", "lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]}, 400, "at most one"),
    ({"prompt": "x", "lora": [{"id": 0}]}, 400, "each 'lora' entry"),
    ({"prompt": "x", "lora": "a"}, 400, "'lora' must be a list"),
    ({"model": "a", "prompt": "x", "lora": [{"id": 1, "scale": 1}]}, 400, "names one LoRA adapter"),
])
def test_bad_adapter_requests(server, body, status, needle):
    got, reply, _ = server.post("/v1/completions", {"max_tokens": 2, **body})
    assert got == status and needle in reply["error"]["message"], reply


def test_zero_scale_entries_mean_the_base_model(server):
    row = REF["stories-a"][0]
    base = complete(server, "stories", row["prompt"])
    assert complete(server, "stories", row["prompt"], {"lora": [{"id": 0, "scale": 0}]}) == base


@pytest.mark.parametrize("args,needle", [
    (["--lora", LORA / "stories-a"], "does not fit"),  # an adapter of another model's shape
    (["--lora-modules", f"x={LORA / 'stories-a'}"], "needs --enable-lora"),
    (["--lora", "/nonexistent/adapter"], "no such LoRA adapter"),
])
def test_bad_adapters_refused_at_startup(args, needle):
    model = DATA / "embeddings" / "tiny_qwen2" if needle == "does not fit" else BASE
    p = run("serve", model, "--port", "0", *args, check=False, timeout=60)
    assert p.returncode == 1 and needle in p.stderr, p.stderr


def test_vllm_lora_modules_and_generate(tmp_path):
    s = Server(BASE, "--enable-lora", "--lora-modules", f"sql={LORA / 'stories-b'}",
               "--lora-modules", json.dumps({"name": "json-form", "path": str(LORA / "stories-a")}), name="stories")
    try:
        ids = [m["id"] for m in json.loads(s.get("/v1/models")[1])["data"]]
        assert ids == ["stories", "sql", "json-form"]
    finally:
        assert s.stop() == 0
    row = REF["stories-a"][0]
    out = run("generate", "-m", BASE, "-p", row["prompt"], "-n", "10", "--temp", "0", "--lora", LORA / "stories-a").stdout
    base = run("generate", "-m", BASE, "-p", row["prompt"], "-n", "10", "--temp", "0").stdout
    assert out != base
