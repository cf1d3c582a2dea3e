"""LoRA adapters against PEFT (recorded by tests/data/lora/record.py), against merged weights computed
here with numpy, and through the real server: adapters chosen per request, mixed in one batch.
"""
import json
import math
import shutil
import threading
import time

import numpy as np
import pytest

from conftest import DATA, MODELS, run
from safetensors_np import read_safetensors, write_safetensors
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


def read_f32(path):
    tensors = read_safetensors(path)
    assert all(t.dtype == np.float32 for t in tensors.values())
    return tensors


def test_equals_merged_weights_computed_with_numpy(tmp_path):
    """W + (alpha / r) B A, merged here independently of Serval, gives the adapter's outputs."""
    name = "stories-a"
    cfg = json.loads((LORA / name / "adapter_config.json").read_text())
    factor = cfg["lora_alpha"] / cfg["r"]
    weights = read_f32(BASE / "model.safetensors")
    adapter = read_f32(LORA / name / "adapter_model.safetensors")
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


def random_peft(out, weights, modules, rank=4, alpha=8, std=0.05):
    """A PEFT directory of random A/B pairs (numpy, F32) for `modules` (names under model.layers.L) of
    every layer whose weight is in `weights`."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, key in enumerate(sorted(k for k in weights if any(k.endswith(m + ".weight") for m in modules))):
        n_out, n_in = weights[key].shape
        stem = "base_model.model." + key[:-len(".weight")]
        rng = np.random.default_rng(i)
        tensors[stem + ".lora_A.weight"] = rng.normal(0, std, (rank, n_in)).astype(np.float32)
        tensors[stem + ".lora_B.weight"] = rng.normal(0, std, (n_out, rank)).astype(np.float32)
    write_safetensors(out / "adapter_model.safetensors", tensors)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                         "bias": "none", "target_modules": list(modules)}))
    return tensors, alpha / rank


def family_dirs(tmp_path, family, adapter_modules, std=0.05):
    """The tiny random `family` of the models' tests in F32 ("base"), a random PEFT adapter on the modules
    named (suffixes under model.layers.L), and the base with W + (alpha / r) B A merged here with numpy
    ("merged"); returns (dirs, adapter dir, adapter tensors, the reference rows)."""
    fam = DATA / "families"
    src = fam / family
    weights = {k: v.astype(np.float32) for k, v in read_safetensors(src / "model.safetensors").items()}
    adapter, factor = random_peft(tmp_path / "adapter", weights, adapter_modules, std=std)
    merged = dict(weights)
    for key, a in adapter.items():
        if ".lora_A." in key:
            target = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            merged[target] = merged[target] + factor * (adapter[key.replace(".lora_A.", ".lora_B.")] @ a)
    dirs = {}
    for name, tensors in (("base", weights), ("merged", merged)):
        d = dirs[name] = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
        write_safetensors(d / "model.safetensors", tensors)
    rows = [{"prompt": r["prompt"], "continuation": r["greedy"]}
            for r in json.loads((fam / "reference.json").read_text())[family]]
    return dirs, tmp_path / "adapter", adapter, rows


def test_mixture_of_experts_attention_adapter_equals_merged_weights(tmp_path):
    """On a mixture-of-experts model (the tiny random Qwen3-MoE of the models' tests) an adapter on the
    attention projections gives the outputs of W + (alpha / r) B A merged here with numpy (both models in
    F32); PEFT's dense-FFN names on a layer whose FFN is experts are refused, never ignored."""
    dirs, adapter, _, rows = family_dirs(tmp_path, "qwen3moe", ["self_attn.q_proj", "self_attn.o_proj"])
    for row in rows:
        with_adapter = score(dirs["base"], row, "--lora", adapter)
        assert worst(with_adapter, score(dirs["merged"], row)) <= TOL
        assert worst(with_adapter, score(dirs["base"], row)) > 100 * TOL  # the adapter does something
    # PEFT's names for a dense FFN, on layers whose FFN is experts
    dense = {f"model.layers.{il}.mlp.up_proj.weight": np.zeros((32, 64), np.float32) for il in range(2)}
    random_peft(tmp_path / "ffn", dense, ["mlp.up_proj"])
    p = run("score", "-m", dirs["base"], "-p", "x", "--ids", "1", "--lora", tmp_path / "ffn", check=False)
    assert p.returncode != 0 and "mixture-of-experts layer" in p.stderr, p.stderr


def gguf_expert_adapter(path, arch, adapter, n_expert, alpha):
    """The PEFT expert adapter as llama.cpp's convert_lora_to_gguf.py writes one: each layer's experts'
    A (and B) stacked into one 3-D tensor per product, blk.L.ffn_gate_exps.weight.lora_a, ...; the
    shared expert's as blk.L.ffn_gate_shexp.weight.lora_a."""
    import gguf  # PyPI's, installed by scripts/setup
    names = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "w1": "ffn_gate", "w3": "ffn_up",
             "w2": "ffn_down"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    stacks, shared = {}, {}
    for key, x in adapter.items():
        parts = key.replace("base_model.model.model.layers.", "").split(".")
        il, ab = int(parts[0]), "a" if parts[-2] == "lora_A" else "b"
        if "experts" in parts:
            e, module = int(parts[parts.index("experts") + 1]), parts[parts.index("experts") + 2]
            stacks.setdefault((il, names[module], ab), {})[e] = x
        else:
            shared[f"blk.{il}.{names[parts[-3]]}_shexp.weight.lora_{ab}"] = x
    for (il, kind, ab), per in sorted(stacks.items()):
        assert sorted(per) == list(range(n_expert))
        w.add_tensor(f"blk.{il}.{kind}_exps.weight.lora_{ab}", np.stack([per[e] for e in range(n_expert)]))
    for name, x in sorted(shared.items()):
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family, modules, n_expert", [
    ("qwen2moe", ["experts.{}.gate_proj", "experts.{}.up_proj", "experts.{}.down_proj", "shared_expert.gate_proj",
                  "shared_expert.down_proj"], 6),
    ("mixtral", ["experts.{}.w1", "experts.{}.w2", "experts.{}.w3"], 4)])
def test_expert_adapter_equals_merged_weights(tmp_path, family, modules, n_expert):
    """An adapter on every routed expert's gate, up and down products (PEFT's names: Qwen-MoE's
    mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1) and on Qwen2-MoE's shared expert
    gives the outputs of the merged weights; so does the same adapter in llama.cpp's GGUF layout (the
    experts' A and B stacked per product, written here with PyPI's gguf), and as `serval convert` writes it."""
    modules = [m.format(e) for m in modules for e in range(n_expert if "{}" in m else 1)]
    dirs, adapter, tensors, rows = family_dirs(tmp_path, family, modules, std=0.3)
    assert any(".experts." in k for k in tensors)
    gguf_adapter = tmp_path / "adapter.gguf"
    arch = "llama" if family == "mixtral" else family
    gguf_expert_adapter(gguf_adapter, arch, tensors, n_expert, 8)
    converted = tmp_path / "converted.gguf"  # Serval's own conversion stacks the experts the same way
    run("convert", adapter, converted, "--base", dirs["base"], "--outtype", "f32")
    for row in rows:
        merged = score(dirs["merged"], row)
        assert worst(score(dirs["base"], row, "--lora", adapter), merged) <= TOL
        assert worst(score(dirs["base"], row, "--lora", gguf_adapter), merged) <= TOL
        assert worst(score(dirs["base"], row, "--lora", converted), merged) <= TOL
        assert worst(merged, score(dirs["base"], row)) > 100 * TOL  # the adapter does something


def test_expert_adapters_mixed_in_one_batch_are_each_alone(tmp_path):
    """The experts group a step's tokens across requests: two adapters on the routed and shared experts and
    the base, at once, give every request the bits it gets alone (each row its own adapter's update)."""
    modules = [f"experts.{e}.{p}" for e in range(6) for p in ("gate_proj", "up_proj", "down_proj")]
    modules += ["shared_expert.up_proj"]
    dirs, first, _, _ = family_dirs(tmp_path / "one", "qwen2moe", modules, std=0.3)
    weights = {k: v.astype(np.float32) for k, v in read_safetensors(dirs["base"] / "model.safetensors").items()}
    second = tmp_path / "two"
    random_peft(second, {k: v for k, v in weights.items() if "layers.1." in k}, modules, std=0.4)
    s = Server(dirs["base"], "--lora", f"x={first}", "--lora", f"y={second}", "--kv-cache-dtype", "f32", name="moe")
    try:
        alone = together_equals_alone(s, ["x", "y", "moe", "x"],
                                      ["Once upon a time", "The dog ran to the", "Tom was sad", "Lily and Ben went"], 16)
        assert len({tuple(a[1]) for a in alone[:3]}) == 3  # the two adapters and the base differ
    finally:
        assert s.stop() == 0


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


def together_equals_alone(server, models, prompts, max_tokens):
    """Each (model, prompt) completed alone, then all at once from threads, twice: the outputs (text and
    log-probabilities) must be the same bits. Returns the outputs alone."""
    alone = [complete(server, m, p, {"max_tokens": max_tokens}) for m, p in zip(models, prompts)]
    results = {}

    def worker(i):
        results[i] = complete(server, models[i], prompts[i], {"max_tokens": max_tokens})

    for _ in range(2):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(models))] == alone
    return alone


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
    together_equals_alone(server, ["a", "b", "stories-c", "stories"], prompts, 24)


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


# --- vLLM's runtime adapter updates: /v1/load_lora_adapter and /v1/unload_lora_adapter ---

def post_text(server, path, body):
    """POST a JSON body; the reply's status and text (vLLM answers these routes in plain text)."""
    import urllib.error
    import urllib.request
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def model_ids(server):
    return [m["id"] for m in json.loads(server.get("/v1/models")[1])["data"]]


def test_runtime_lora_updates_are_off_unless_asked(server):
    status, text = post_text(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(LORA / "stories-a")})
    assert status == 404 and "--allow-runtime-lora" in text
    assert post_text(server, "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 404
    assert model_ids(server) == ["stories", "a", "b", "stories-c"]


@pytest.fixture(scope="module")
def runtime_server():
    s = Server(BASE, "--allow-runtime-lora", "--max-loras", "2", "--kv-cache-dtype", "f32", name="stories")
    yield s
    assert s.stop() == 0


def test_load_use_replace_and_unload_at_run_time(runtime_server):
    s = runtime_server
    row_a, row_b = REF["stories-a"][0], REF["stories-b"][0]
    base = complete(s, "stories", row_a["prompt"])
    status, text = post_text(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(LORA / "stories-a")})
    assert status == 200 and text == "Success: LoRA adapter 'a' added successfully."
    assert model_ids(s) == ["stories", "a"]
    assert worst(complete(s, "a", row_a["prompt"])[1], row_a["logprobs"]) <= 1e-4
    status, text = post_text(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(LORA / "stories-b")})
    assert status == 400 and "already been loaded" in text
    # load_inplace: the name now means stories-b (a new id, so no prefix-cache block of the old one is reused)
    assert post_text(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(LORA / "stories-b"),
                                                  "load_inplace": True})[0] == 200
    assert worst(complete(s, "a", row_b["prompt"])[1], row_b["logprobs"]) <= 1e-4
    assert [x["id"] for x in json.loads(s.get("/lora-adapters")[1])] == [1]
    status, text = post_text(s, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 200 and text == "Success: LoRA adapter 'a' removed successfully."
    assert model_ids(s) == ["stories"]
    status, reply, _ = s.post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 2})
    assert status == 404
    status, reply, _ = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "lora": [{"id": 0, "scale": 1}]})
    assert status == 400 and "not loaded" in reply["error"]["message"]
    assert complete(s, "stories", row_a["prompt"]) == base


@pytest.mark.parametrize("body,status,needle", [
    ({"lora_name": "c", "lora_path": "/nonexistent/adapter"}, 400, "no such LoRA adapter"),
    ({"lora_name": "c", "lora_path": str(DATA / "embeddings" / "tiny_qwen2")}, 400, "adapter_config.json"),
    ({"lora_name": "stories", "lora_path": str(LORA / "stories-a")}, 400, "base model's name"),
    ({"lora_name": "", "lora_path": str(LORA / "stories-a")}, 400, "lora_name"),
    ({"lora_name": "c"}, 400, "lora_path"),
    ({"lora_name": "c", "lora_path": str(LORA / "stories-a"), "lora_int_id": 3}, 400, "unknown field 'lora_int_id'"),
    ({"lora_name": "c", "lora_path": str(LORA / "stories-a"), "load_inplace": "yes"}, 400, "load_inplace"),
])
def test_bad_runtime_loads(runtime_server, body, status, needle):
    got, text = post_text(runtime_server, "/v1/load_lora_adapter", body)
    assert got == status and needle in text, text


def test_unload_unknown_and_max_loras(runtime_server):
    s = runtime_server
    status, text = post_text(s, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert status == 404 and "cannot be found" in text
    for name in ("x", "y"):
        assert post_text(s, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(LORA / "stories-c")})[0] == 200
    status, text = post_text(s, "/v1/load_lora_adapter", {"lora_name": "z", "lora_path": str(LORA / "stories-c")})
    assert status == 400 and "--max-loras" in text
    for name in ("x", "y"):
        assert post_text(s, "/v1/unload_lora_adapter", {"lora_name": name, "lora_int_id": 5})[0] == 200


def test_unload_while_a_request_uses_the_adapter(monkeypatch):
    """vLLM's environment variable turns the routes on. A generation that started with the adapter
    finishes with it, token for token, though the adapter is unloaded while it runs."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    s = Server(BASE, "--kv-cache-dtype", "f32", name="stories")
    try:
        assert post_text(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(LORA / "stories-a")})[0] == 200
        prompt = REF["stories-a"][1]["prompt"]
        alone = complete(s, "a", prompt, {"max_tokens": 200})
        results = {}
        t = threading.Thread(target=lambda: results.update(r=complete(s, "a", prompt, {"max_tokens": 200})))
        t.start()
        while s.metric("serval:num_requests_running") < 1:  # it is in the engine: unloading cannot refuse it
            time.sleep(0.01)
        assert post_text(s, "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200
        t.join()
        assert results["r"] == alone
        # the next load frees the unloaded adapter's slot, and serves the new one
        assert post_text(s, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(LORA / "stories-b")})[0] == 200
        row = REF["stories-b"][0]
        assert worst(complete(s, "b", row["prompt"])[1], row["logprobs"]) <= 1e-4
    finally:
        assert s.stop() == 0
