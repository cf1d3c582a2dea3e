"""Model families against Hugging Face transformers: tiny random Qwen3, Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral,
Gemma 2, Gemma 3 and Phi-3 configurations, and RoPE scaling (Phi-3 LongRoPE, Qwen3 YaRN, Llama 3.1's llama3)
configurations (tests/data/families, recorded by its record.py) loaded from their safetensors directly
and through `serval convert` to GGUF (F32, F16), matching transformers' log-probabilities and greedy
tokens; Q8_0 measured by KL divergence and top-1 agreement against F32; the GGUF files read back by
the PyPI `gguf` package; a MoE model served over HTTP, its replies batch invariant.
"""
import json
import shutil
import threading

import pytest
from gguf import GGUFReader

from conftest import DATA, run
from server_util import Server

FAMILIES = DATA / "families"
REF = json.loads((FAMILIES / "reference.json").read_text())
ARCHS = sorted(REF)
# transformers ran F32 on the F16 values the files hold. An F32 GGUF leaves float rounding and score's
# 5 printed decimals (measured: at most 9.4e-6); F16 weights (the directory, an F16 GGUF) multiply
# activations rounded to F16, as llama.cpp does (measured: at most 2.9e-4).
TOL = {"f32": 2e-5, "f16": 1e-3}
# The random Gemmas are far more sensitive: embeddings scaled by sqrt(hidden) (8 here), sharp attention,
# and (Gemma 3) six layers, each amplifying the rounding of the one before; transformers' own F32 run
# carries rounding of the same size. Measured: F32 at most 2.1e-4 (Gemma 3), F16 1.1e-3, Q8_0 KL up to 1.2e-3.
WIDER = {"gemma2": 6, "gemma3": 20}


def score(model, row, *extra):
    out = run("score", "-m", model, "--cache-type", "f32", "-p", row["prompt"], "--ids",
              ",".join(map(str, row["greedy"])), *extra).stdout
    return [json.loads(line) for line in out.splitlines()]


def check_rows(model, arch, tol, *extra):
    for row in REF[arch]:
        got = score(model, row, *extra)
        assert [g["id"] for g in got] == row["greedy"]
        assert [g["argmax"] for g in got] == row["greedy"], "greedy tokens differ from transformers'"
        worst = max(abs(g["logprob"] - w) for g, w in zip(got, row["logprobs"]))
        assert worst <= tol, f"{arch}: log-probabilities differ by {worst}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    out = {}
    for arch in ARCHS:
        for t in ("f32", "f16", "q8_0"):
            out[arch, t] = d / f"{arch}-{t}.gguf"
            run("convert", FAMILIES / arch, out[arch, t], "--outtype", t, timeout=120)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_directory_matches_transformers(arch):
    check_rows(FAMILIES / arch, arch, TOL["f16"] * WIDER.get(arch, 1))


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_matches_transformers(arch, outtype, converted):
    # The prompt is encoded with the directory's tokenizer.json: the converted GGUF's SentencePiece-style
    # vocabulary encodes some prompts differently (docs/models.md), which is not what is tested here.
    check_rows(converted[arch, outtype], arch, TOL[outtype] * WIDER.get(arch, 1), "--tokenizer", FAMILIES / arch / "tokenizer.json")


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_against_f32(arch, converted, tmp_path):
    table = tmp_path / "quality.json"
    run("quality", "-m", converted[arch, "f32"], converted[arch, "q8_0"], "-f", DATA / "tinystory.txt",
        "-c", "128", "--chunks", "4", "--json", table)
    q8 = json.loads(table.read_text())["models"][1]
    # Random weights give near-uniform distributions (perplexity ~ the vocabulary size), so top-1 is
    # decided by small margins; the KL divergence is the meaningful figure (measured: 0.9e-5 .. 2.4e-5).
    assert q8["kl_mean"] < 1e-4 * 36 if arch in WIDER else q8["kl_mean"] < 1e-4
    assert q8["top1_pct"] >= 90


EXPECTED_KEYS = {
    "qwen3": {},
    "qwen3moe": {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_weights_norm": True},
    "qwen2moe": {"expert_count": 6, "expert_used_count": 3, "expert_feed_forward_length": 32,
                 "expert_shared_feed_forward_length": 48, "expert_weights_norm": False},
    "olmoe": {"expert_count": 8, "expert_used_count": 2, "expert_weights_norm": False},
    "mixtral": {"expert_count": 4, "expert_used_count": 2, "expert_weights_norm": True},
    "gemma2": {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "attention.sliding_window": 6,
               "attention.scale": pytest.approx(24 ** -0.5)},
    "gemma3": {"attention.sliding_window": 6},
    "phi3": {"rope.dimension_count": 8, "attention.sliding_window": 6},
    # RoPE scaling as llama.cpp's converter writes it (Phi3MiniModel, Qwen2Model's yarn, LlamaModel's
    # rope_freqs); Serval's own key where transformers' truncate=False has no llama.cpp spelling.
    "phi3_longrope": {"rope.scaling.original_context_length": 4, "rope.scaling.attn_factor": pytest.approx(3 ** 0.5)},
    "qwen3_yarn": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 256,
                   "rope.scaling.yarn_beta_fast": 16.0},
    "llama3_rope": {},
    # DeepSeek-V2 as llama.cpp's DeepseekV2Model writes it (before llama.cpp's 2025 split of attn_kv_b).
    "deepseek2": {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_shared_count": 1,
                  "leading_dense_block_count": 1, "attention.kv_lora_rank": 48, "attention.key_length": 32,
                  "attention.value_length": 24, "rope.dimension_count": 16, "rope.scaling.type": "yarn",
                  "rope.scaling.yarn_log_multiplier": pytest.approx(0.0707), "expert_weights_scale": 1.0},
    "deepseek2_qlora": {"attention.q_lora_rank": 24, "expert_group_count": 4, "expert_group_used_count": 1,
                        "expert_weights_scale": 2.0, "expert_weights_norm": False},
    "gpt_oss": {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_weights_norm": True,
                "attention.sliding_window": 6, "rope.scaling.type": "yarn", "rope.scaling.factor": 8.0},
}
GGUF_ARCH = {"mixtral": "llama", "phi3_longrope": "phi3", "qwen3_yarn": "qwen3", "llama3_rope": "llama", "gpt_oss": "gpt-oss",
             "deepseek2_qlora": "deepseek2"}  # the file's own arch
ROPE_TENSORS = {"phi3_longrope": ["rope_factors_long.weight", "rope_factors_short.weight"], "llama3_rope": ["rope_freqs.weight"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_package_reads_what_convert_writes(arch, converted):
    r = GGUFReader(converted[arch, "f16"])
    gguf_arch = GGUF_ARCH.get(arch, arch)
    assert r.fields["general.architecture"].contents() == gguf_arch
    for key, value in EXPECTED_KEYS[arch].items():
        assert r.fields[f"{gguf_arch}.{key}"].contents() == value, key
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    cfg = json.loads((FAMILIES / arch / "config.json").read_text())
    e, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or e // heads
    for name in ROPE_TENSORS.get(arch, []):
        assert shapes[name] == [d // 2]
    if arch == "qwen3_yarn":
        assert r.fields["serval.rope.yarn_truncate"].contents() is False
    if arch.startswith("deepseek2"):
        return check_deepseek2_shapes(cfg, shapes)
    if arch.startswith("phi3"):  # fused: Q, K, V rows in one matrix; gate and up rows in another
        assert shapes["blk.0.attn_qkv.weight"] == [e, (heads + 2 * kv) * d]
        assert shapes["blk.0.ffn_up.weight"] == [e, 2 * cfg["intermediate_size"]]
        return
    assert shapes["blk.0.attn_q.weight"] == [e, heads * d]
    assert shapes["blk.0.attn_k.weight"] == [e, kv * d]
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        assert shapes["blk.0.attn_q_norm.weight"] == [d]
    if arch.startswith("gemma"):
        assert shapes["blk.0.post_attention_norm.weight"] == [e] and shapes["blk.0.post_ffw_norm.weight"] == [e]
    if arch == "olmoe":
        assert shapes["blk.0.attn_q_norm.weight"] == [heads * d]  # one norm over all heads
    if "expert_count" in EXPECTED_KEYS[arch]:
        n, ff = cfg.get("num_experts") or cfg["num_local_experts"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        assert shapes["blk.0.ffn_gate_inp.weight"] == [e, n]
        assert shapes["blk.0.ffn_gate_exps.weight"] == [e, ff, n]
        assert shapes["blk.0.ffn_up_exps.weight"] == [e, ff, n]
        assert shapes["blk.0.ffn_down_exps.weight"] == [ff, e, n]
        assert {t.name: t.tensor_type.name for t in r.tensors}["blk.0.ffn_gate_inp.weight"] == "F32"
    if arch == "gpt_oss":  # llama.cpp's names: sinks per head, biases per expert, the pre-FFN norm
        n, ff = cfg["num_local_experts"], cfg["intermediate_size"]
        assert shapes["blk.0.attn_sinks.weight"] == [heads]
        assert shapes["blk.0.attn_output.bias"] == [e] and shapes["blk.0.ffn_gate_inp.bias"] == [n]
        assert shapes["blk.0.ffn_gate_exps.bias"] == [ff, n] and shapes["blk.0.ffn_down_exps.bias"] == [e, n]
        assert shapes["blk.0.post_attention_norm.weight"] == [e] and "blk.0.ffn_norm.weight" not in shapes
        assert r.fields["serval.swiglu_limit"].contents() == 1.5
    if arch == "qwen2moe":
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == [e]
        assert shapes["blk.0.ffn_gate_shexp.weight"] == [e, cfg["shared_expert_intermediate_size"]]
    if arch == "qwen3moe":  # mlp_only_layers=[1]: layer 1 is a dense FFN
        assert "blk.1.ffn_gate.weight" in shapes and "blk.1.ffn_gate_inp.weight" not in shapes


def check_deepseek2_shapes(cfg, shapes):
    e, heads, rope, lat = cfg["hidden_size"], cfg["num_attention_heads"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    qk, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
    if cfg["q_lora_rank"]:
        q = cfg["q_lora_rank"]
        assert shapes["blk.0.attn_q_a.weight"] == [e, q] and shapes["blk.0.attn_q_a_norm.weight"] == [q]
        assert shapes["blk.0.attn_q_b.weight"] == [q, heads * qk] and "blk.0.attn_q.weight" not in shapes
    else:
        assert shapes["blk.0.attn_q.weight"] == [e, heads * qk]
    assert shapes["blk.0.attn_kv_a_mqa.weight"] == [e, lat + rope] and shapes["blk.0.attn_kv_a_norm.weight"] == [lat]
    assert shapes["blk.0.attn_kv_b.weight"] == [lat, heads * (cfg["qk_nope_head_dim"] + v)]
    assert shapes["blk.0.attn_output.weight"] == [heads * v, e]
    # first_k_dense_replace = 1: layer 0 dense, layer 1 routed experts plus an ungated shared expert
    assert "blk.0.ffn_gate.weight" in shapes and "blk.0.ffn_gate_inp.weight" not in shapes
    n, ff = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    assert shapes["blk.1.ffn_gate_inp.weight"] == [e, n] and shapes["blk.1.ffn_down_exps.weight"] == [ff, e, n]
    assert shapes["blk.1.ffn_up_shexp.weight"] == [e, ff * cfg["n_shared_experts"]]
    assert "blk.1.ffn_gate_inp_shexp.weight" not in shapes


def split_kv_b(src, dst):
    """llama.cpp's later deepseek2 layout (2025-04 on), written with the PyPI gguf package from a file in the
    earlier one: attn_kv_b split per head into attn_k_b [n_head][kv_lora][nope] (transposed) and attn_v_b
    [n_head][v_head][kv_lora]; key_length / value_length become the cache row's (kv_lora + rope, kv_lora),
    the head sizes move to key_length_mla / value_length_mla, one KV head."""
    import numpy as np
    from gguf import GGUFWriter, GGUFValueType
    r = GGUFReader(src)
    a = "deepseek2."
    get = lambda k: r.fields[a + k].contents()
    heads, lat, rope = get("attention.head_count"), get("attention.kv_lora_rank"), get("rope.dimension_count")
    k_len, v_len = get("attention.key_length"), get("attention.value_length")
    nope = k_len - rope
    w = GGUFWriter(dst, "deepseek2")
    replaced = {a + "attention.key_length": lat + rope, a + "attention.value_length": lat, a + "attention.head_count_kv": 1}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = replaced.get(name, f.contents())
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    w.add_uint32(a + "attention.key_length_mla", k_len)
    w.add_uint32(a + "attention.value_length_mla", v_len)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name.endswith("attn_kv_b.weight"):
            kv_b = data.reshape(heads, nope + v_len, lat)
            w.add_tensor(t.name.replace("attn_kv_b", "attn_k_b"), np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1)))
            w.add_tensor(t.name.replace("attn_kv_b", "attn_v_b"), np.ascontiguousarray(kv_b[:, nope:, :]))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["deepseek2", "deepseek2_qlora"])
def test_deepseek2_split_kv_b_layout(arch, converted, tmp_path):
    out = tmp_path / "split.gguf"
    split_kv_b(converted[arch, "f32"], out)
    names = {t.name for t in GGUFReader(out).tensors}
    assert "blk.0.attn_k_b.weight" in names and "blk.0.attn_kv_b.weight" not in names
    check_rows(out, arch, TOL["f32"], "--tokenizer", FAMILIES / arch / "tokenizer.json")


def complete(server, ids, n=8):
    status, body, _ = server.post("/v1/completions", {"prompt": ids, "max_tokens": n, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_moe_served_over_http_is_batch_invariant(arch):
    # deepseek2: greedy decoding, one token per step over the latent cache, gives transformers' tokens.
    server = Server(FAMILIES / arch, "--kv-cache-dtype", "f32")
    try:
        want = {}
        for row in REF[arch]:
            # The continuation's text: prompt + greedy tokens decoded, less the prompt decoded (a first
            # token alone would lose its leading space).
            texts = [server.post("/detokenize", {"tokens": ids})[1]["prompt"] for ids in (row["ids"], row["ids"] + row["greedy"])]
            assert texts[1].startswith(texts[0])
            want[row["prompt"]] = texts[1][len(texts[0]):]
            assert complete(server, row["ids"]) == want[row["prompt"]]  # alone: transformers' greedy tokens
        # Together: the rows share steps (and experts); each reply stays what it was alone.
        results, threads = {}, []
        for row in REF[arch] * 3:
            def go(r=row):
                results.setdefault(r["prompt"], []).append(complete(server, r["ids"]))
            threads.append(threading.Thread(target=go))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for prompt, texts in results.items():
            assert texts == [want[prompt]] * 3
        status, metrics = server.get("/metrics")
        assert "serval:moe_expert_tokens_total" in metrics
    finally:
        server.stop()


def refused(tmp_path, arch, change, *, convert=True):
    d = tmp_path / arch
    shutil.copytree(FAMILIES / arch, d)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    args = ("convert", d, tmp_path / "out.gguf") if convert else ("info", d)
    p = run(*args, check=False)
    assert p.returncode != 0 and not (tmp_path / "out.gguf").exists()
    return p.stderr


def test_configurations_gguf_cannot_hold_are_refused(tmp_path):
    # A sliding-window layout other than Gemma 3's five-of-six has no GGUF spelling.
    err = refused(tmp_path, "gemma3", lambda c: c.update(layer_types=["full_attention"] * 6))
    assert "layer 0" in err and "sliding_attention" in err


@pytest.mark.parametrize("convert", [True, False])
def test_unknown_rope_is_refused_not_defaulted(tmp_path, convert):
    """transformers 5's rope_parameters with a RoPE type Serval does not implement: an error naming it,
    whether converting or loading the directory, never a silent default (issue #41)."""
    err = refused(tmp_path, "qwen3", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}),
                  convert=convert)
    assert "dynamic" in err


@pytest.mark.parametrize("convert", [True, False])
@pytest.mark.parametrize("change,named", [
    (lambda c: c.update(scoring_func="sigmoid"), "sigmoid"),             # DeepSeek-V3's router
    (lambda c: c.update(topk_method="noaux_tc"), "noaux_tc"),
    (lambda c: c.update(attention_bias=True), "attention biases"),
    (lambda c: c.update(kv_lora_rank=0), "kv_lora_rank"),
    (lambda c: c.update(topk_method="group_limited_greedy", n_group=3, topk_group=1), "expert groups"),  # 8 % 3
    (lambda c: c.pop("qk_rope_head_dim"), "qk_rope_head_dim"),
])
def test_deepseek2_configurations_it_cannot_run_are_refused(tmp_path, convert, change, named):
    err = refused(tmp_path, "deepseek2", change, convert=convert)
    assert named in err, err


def test_gpt_oss_mxfp4_experts_match_the_gguf_package(converted, tmp_path):
    """llama-quantize's MXFP4_MOE on gpt-oss: the experts in MXFP4 (byte for byte what the PyPI `gguf`
    package's MXFP4 quantizer writes from the same F32 values), the rest Q8_0; the model then runs
    through the packed MXFP4 kernels within a KL divergence of F32 that 4-bit experts explain."""
    import numpy as np
    import gguf.quants
    from gguf.constants import GGMLQuantizationType as T
    out = tmp_path / "mxfp4.gguf"
    run("quantize", converted["gpt_oss", "f32"], out, "MXFP4_MOE")
    f32 = {t.name: t for t in GGUFReader(converted["gpt_oss", "f32"]).tensors}
    experts = [t for t in GGUFReader(out).tensors if t.name.endswith("_exps.weight")]
    assert len(experts) == 12
    for t in experts:
        assert t.tensor_type == T.MXFP4, t.name
        want = gguf.quants.quantize(np.array(f32[t.name].data, dtype=np.float32), T.MXFP4)
        assert np.array_equal(np.array(t.data).reshape(-1), want.reshape(-1)), t.name
    table = tmp_path / "quality.json"
    run("quality", "-m", converted["gpt_oss", "f32"], out, "-f", DATA / "tinystory.txt", "-c", "128", "--chunks", "4",
        "--json", table)
    mx = json.loads(table.read_text())["models"][1]
    assert mx["kl_mean"] < 1e-3  # measured 3.0e-4 (Q8_0 alone: ~2e-5)


def test_gpt_oss_openai_mxfp4_checkpoint(converted, tmp_path):
    """gpt-oss as OpenAI publishes it: experts as MXFP4 `_blocks`/`_scales` (tests/py/gpt_oss_mxfp4.py
    writes the tiny model so). Served from the directory and converted to GGUF (experts kept MXFP4, not
    widened), it matches transformers' run of the same checkpoint (gpt_oss_mxfp4.json, recorded by
    record.py with transformers' MXFP4 loader); the converted experts are byte for byte what
    MXFP4_MOE makes of the F32 values, so the nibble order of the two layouts agrees."""
    import gpt_oss_mxfp4
    from gguf.constants import GGMLQuantizationType as T
    rows = json.loads((FAMILIES / "gpt_oss_mxfp4.json").read_text())
    d = gpt_oss_mxfp4.write(tmp_path / "gpt-oss-mxfp4")
    gguf_path = tmp_path / "gpt-oss-mxfp4.gguf"
    run("convert", d, gguf_path, "--outtype", "f16")
    quantized = tmp_path / "mxfp4-moe.gguf"
    run("quantize", converted["gpt_oss", "f32"], quantized, "MXFP4_MOE")
    want = {t.name: t for t in GGUFReader(quantized).tensors if t.name.endswith("_exps.weight")}
    got = {t.name: t for t in GGUFReader(gguf_path).tensors if t.name.endswith("_exps.weight")}
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert t.tensor_type == T.MXFP4 and bytes(t.data) == bytes(want[name].data), name
    # MXFP4 products take Q8_0 activations (as llama.cpp's): int8 rounding of every expert input, so the
    # bound is wider than F16's and a near-tie may flip (this random model's distributions are nearly
    # flat). Measured: at most 2.9e-3, 23 of 24 greedy tokens.
    for model in (d, gguf_path):
        agree = total = 0
        for row in rows:
            out = score(model, row, "--tokenizer", FAMILIES / "gpt_oss" / "tokenizer.json")
            agree += sum(g["argmax"] == w for g, w in zip(out, row["greedy"]))
            total += len(row["greedy"])
            worst = max(abs(g["logprob"] - w) for g, w in zip(out, row["logprobs"]))
            assert worst <= 6e-3, f"{model}: log-probabilities differ by {worst}"
        assert agree >= 0.9 * total, f"{model}: {agree} of {total} greedy tokens"


def test_gpt_oss_mxfp4_blocks_and_scales_that_disagree_are_refused(tmp_path):
    """A hostile MXFP4 checkpoint: scales whose shape does not match the blocks (one row short), or
    blocks that are not U8, are refused with an error naming the tensor, never read past their end."""
    import numpy as np
    import gpt_oss_mxfp4
    for damage in ("short scales", "float blocks"):
        d = gpt_oss_mxfp4.write(tmp_path / damage.replace(" ", "-"))
        tensors = gpt_oss_mxfp4.read_safetensors(d / "model.safetensors")
        name = "model.layers.0.mlp.experts.down_proj"
        if damage == "short scales":
            tensors[name + "_scales"] = np.ascontiguousarray(tensors[name + "_scales"][:, :-1, :])
        else:
            tensors[name + "_blocks"] = tensors[name + "_blocks"].astype(np.float16)
        gpt_oss_mxfp4.write_safetensors(d / "model.safetensors", tensors)
        p = run("info", d, check=False)
        assert p.returncode != 0 and "MXFP4 blocks and scales" in p.stderr and "Traceback" not in p.stderr, damage


def test_deepseek2_latent_attention_is_the_same_at_every_isa_level():
    """The absorbed attention (one 64-value KV head shared by 4 query heads, V read from K's rows) through
    the tiled kernel of each level this CPU has: the same bits as the portable level's (F16 cache)."""
    import os
    args = ("score", "-m", FAMILIES / "deepseek2", "--cache-type", "f16", "-p", "Once upon a time", "--ids", "5,6,7,8")
    want = run(*args, env={**os.environ, "SERVAL_ISA": "scalar"}).stdout
    assert run(*args).stdout == want  # the best level detected
    assert run(*args, env={**os.environ, "SERVAL_ISA": "avx2"}).stdout == want
