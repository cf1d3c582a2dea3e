"""Embeddings, rerank and score on encoder models, through the real server and the official openai client.

Expected values are recorded by tests/data/embeddings/record.py from independent implementations:
Hugging Face `tokenizers` (WordPiece ids), sentence-transformers (all-MiniLM-L6-v2 embeddings, FP32) and
transformers (the tiny random BERT's hidden states, the tiny cross-encoder's logits).
"""
import base64
import json
import math
import os
import shutil
import struct
import threading

import gguf
import numpy as np
import openai
import pytest

from conftest import CACHE, DATA, MODELS, run
from server_util import Server

EMB = DATA / "embeddings"
CORPUS = json.loads((EMB / "corpus.json").read_text())
REF = np.load(EMB / "minilm_reference.npz")
TINY = json.loads((EMB / "tiny_reference.json").read_text())


def split(lengths, flat):
    offs = np.concatenate([[0], np.cumsum(lengths)])
    return [flat[offs[i]:offs[i + 1]].tolist() for i in range(len(lengths))]


REF_IDS = split(REF["lengths"], REF["ids"])
REF_IDS_CASED = split(REF["lengths_cased"], REF["ids_cased"])


@pytest.fixture(scope="module")
def minilm():
    path = CACHE / "all-minilm-l6-v2"
    assert (path / "model.safetensors").exists(), f"{path} missing: run scripts/setup (it fetches the models)"
    return path


@pytest.fixture(scope="module")
def ggufs(minilm, tmp_path_factory):
    d = tmp_path_factory.mktemp("minilm")
    out = {}
    for t in ("f32", "f16", "q8_0"):
        out[t] = d / f"minilm-{t}.gguf"
        run("convert", minilm, out[t], "--outtype", t)
    return out


@pytest.fixture(scope="module")
def server(minilm):
    s = Server(minilm, name="all-minilm-l6-v2")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def embed(server, inputs, **extra):
    status, body, _ = server.post("/v1/embeddings", {"input": inputs, "encoding_format": "float", **extra})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]]), body


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# --- WordPiece against Hugging Face tokenizers ---

def test_wordpiece_ids_equal_hf_tokenizers(server):
    for text, want in zip(CORPUS, REF_IDS):
        status, body, _ = server.post("/tokenize", {"prompt": text})
        assert status == 200 and body["tokens"] == want, (text, body)


def test_cased_wordpiece_ids_equal_hf_tokenizers(minilm, tmp_path):
    """The same vocabulary without lowercasing and accent stripping (record.py builds it the same way)."""
    cased = tmp_path / "minilm-cased"
    cased.mkdir()
    for f in minilm.iterdir():
        if f.is_file() and f.name != "tokenizer.json":
            (cased / f.name).symlink_to(f)
    tok = json.loads((minilm / "tokenizer.json").read_text())
    tok["normalizer"]["lowercase"] = False
    tok["normalizer"]["strip_accents"] = False
    (cased / "tokenizer.json").write_text(json.dumps(tok))
    s = Server(cased)
    try:
        for text, want in zip(CORPUS, REF_IDS_CASED):
            assert s.post("/tokenize", {"prompt": text})[1]["tokens"] == want, text
    finally:
        assert s.stop() == 0


def test_trained_cased_vocabulary_equals_hf_tokenizers():
    """The tiny cross-encoder's own cased vocabulary, on the whole corpus."""
    s = Server(EMB / "tiny_cross_encoder")
    try:
        for text, want in zip(CORPUS, TINY["cased_ids"]):
            assert s.post("/tokenize", {"prompt": text})[1]["tokens"] == want, text
    finally:
        assert s.stop() == 0


def test_tokenize_reads_only_the_vocabulary(ggufs, tmp_path):
    """`serval tokenize` on a GGUF with the vocabulary and no tensors (as llama.cpp's vocab-only files)."""
    src = gguf.GGUFReader(ggufs["f32"])
    w = gguf.GGUFWriter(tmp_path / "vocab.gguf", "bert")
    for field in src.fields.values():
        if field.name.startswith("tokenizer.") and field.name != "tokenizer.ggml.token_type_count":
            v = field.contents()
            w.add_key_value(field.name, v, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ids = run("tokenize", "-m", tmp_path / "vocab.gguf", "-p", CORPUS[1]).stdout.split()
    assert [int(i) for i in ids] == REF_IDS[1]


# --- all-MiniLM-L6-v2 against sentence-transformers ---

def test_embeddings_equal_sentence_transformers_f32(server):
    got, body = embed(server, CORPUS)
    cos = cosines(got, REF["embeddings"])
    assert cos.min() >= 0.9999, (cos.argmin(), cos.min())
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == int(REF["lengths"].sum()) == body["usage"]["total_tokens"]
    assert [d["index"] for d in body["data"]] == list(range(len(CORPUS)))


def cpu_flags():
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# Whether the server's default level runs the encoder's products in BF16 tiles (AMX-BF16; ops.h,
# prepare_bf16_tiles), read from the CPU's flags rather than from the server.
BF16_TILES = {"amx_bf16", "avx512_bf16"} <= cpu_flags() and os.environ.get("SERVAL_ISA", "amx") == "amx"
INT8_LEVEL = {"SERVAL_ISA": "avx512"}  # below the tiles: Q8_0 with int8 activations, F16 as it is


@pytest.mark.parametrize("outtype,env,min_cos,mean_cos", [
    ("f32", None, 0.9999, 0.99999),
    # BF16 tiles round weights and activations to BF16: measured min 0.99996, mean 0.999989
    ("f16", None, 0.9999, 0.99998 if BF16_TILES else 0.99999),
    # BF16 activations rather than int8 ones: every text >= 0.999 (measured min 0.99947); with int8
    # activations (as llama.cpp) short texts such as "." lose most (min 0.9983; docs/embeddings.md)
    ("q8_0", None, 0.999 if BF16_TILES else 0.997, 0.9998 if BF16_TILES else 0.999),
    pytest.param("f16", INT8_LEVEL, 0.9999, 0.99999, marks=pytest.mark.skipif(not BF16_TILES, reason="no BF16 tiles")),
    pytest.param("q8_0", INT8_LEVEL, 0.997, 0.999, marks=pytest.mark.skipif(not BF16_TILES, reason="no BF16 tiles")),
])
def test_converted_gguf_embeddings(ggufs, outtype, env, min_cos, mean_cos):
    """`serval convert` output, at the default level and, where that runs BF16 tiles, at the level below."""
    s = Server(ggufs[outtype], env=env)
    try:
        got, _ = embed(s, CORPUS)
    finally:
        assert s.stop() == 0
    cos = cosines(got, REF["embeddings"])
    assert cos.min() >= min_cos and cos.mean() >= mean_cos, (outtype, cos.min(), cos.mean())


def test_converted_gguf_reads_back_with_gguf_package(ggufs):
    r = gguf.GGUFReader(ggufs["q8_0"])
    meta = {f.name: f for f in r.fields.values()}
    assert meta["general.architecture"].contents() == "bert"
    assert meta["tokenizer.ggml.model"].contents() == "bert"
    assert meta["bert.pooling_type"].contents() == 1 and meta["bert.attention.causal"].contents() is False
    assert meta["bert.context_length"].contents() == 512 and meta["bert.block_count"].contents() == 6
    tokens = meta["tokenizer.ggml.tokens"].contents()
    assert tokens[101] == "[CLS]" and tokens[7592] == "\u2581hello" and tokens[2015] == "s"  # "##s" -> "s"
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.5.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(tensors["blk.5.ffn_up.weight"].shape) == [384, 1536]
    assert tensors["position_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert {"token_embd.weight", "token_types.weight", "token_embd_norm.bias", "blk.0.attn_output_norm.weight",
            "blk.0.layer_output_norm.bias"} <= set(tensors)


def test_openai_client_base64_and_float(client):
    texts = CORPUS[:5]
    b64 = client.embeddings.create(model="all-minilm-l6-v2", input=texts)  # the client asks for base64
    flt = client.embeddings.create(model="all-minilm-l6-v2", input=texts, encoding_format="float")
    assert [d.embedding for d in b64.data] == [d.embedding for d in flt.data]
    assert b64.usage.prompt_tokens == sum(len(i) for i in REF_IDS[:5])
    assert cosines(np.array([d.embedding for d in flt.data]), REF["embeddings"][:5]).min() >= 0.9999
    models = client.models.list()
    assert [m.id for m in models.data] == ["all-minilm-l6-v2"]


def test_base64_is_little_endian_float32(server):
    status, body, _ = server.post("/v1/embeddings", {"input": "Hello world", "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(body["data"][0]["embedding"])
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(values) == 384
    assert list(values) == embed(server, "Hello world")[0][0].tolist()


def test_token_id_inputs_equal_text_inputs(server):
    by_text, _ = embed(server, CORPUS[:4])
    by_ids, body = embed(server, REF_IDS[:4])
    assert np.array_equal(by_text, by_ids)
    one, _ = embed(server, REF_IDS[2])  # a single list of ids
    assert np.array_equal(one[0], by_text[2])


def test_batch_invariance_alone_batched_and_concurrent(server):
    """An input's embedding is the same bits alone, in a batch, and while other requests are batched with it."""
    texts = CORPUS[40:72]
    batched, _ = embed(server, texts)
    alone = np.array([embed(server, t)[0][0] for t in texts[:8]])
    assert np.array_equal(alone, batched[:8])
    results = {}

    def worker(k):
        results[k] = embed(server, texts[k::4])[0]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert np.array_equal(results[k], batched[k::4])


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    long_text = "word " * 600
    status, body, _ = server.post("/v1/embeddings", {"input": long_text})
    assert status == 400 and "longer than the model's maximum of 512" in body["error"]["message"]
    got, body = embed(server, long_text, truncate_prompt_tokens=-1)
    assert body["usage"]["prompt_tokens"] == 512
    got2, body2 = embed(server, long_text, truncate_prompt_tokens=20)
    assert body2["usage"]["prompt_tokens"] == 20
    assert cosines(got, got2)[0] < 0.9999  # a different input


@pytest.mark.parametrize("body,status,needle", [
    ({"input": ""}, 400, "empty string"),
    ({"input": []}, 400, "'input' must be"),
    ({"input": ["ok", ""]}, 400, "empty string"),
    ({"input": ["x"] * 10000}, 400, "at most 2048"),
    ({"input": [[]]}, 400, "must not be empty"),
    ({"input": [1, 2, 30522]}, 400, "token ids must be integers in [0, 30522)"),
    ({"input": [1, "a"]}, 400, "token ids"),
    ({"input": [{"text": "a"}]}, 400, "each item of 'input'"),
    ({"input": 5}, 400, "'input' must be"),
    ({}, 400, "'input' is required"),
    ({"input": "a", "dimensions": 8}, 400, "not Matryoshka-trained"),
    ({"input": "a", "encoding_format": "int8"}, 400, "'encoding_format'"),
    ({"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "a", "pooling": "max"}, 400, "'pooling' is not supported"),
    ({"input": "a", "model": "text-embedding-3-small"}, 404, "does not exist"),
])
def test_bad_embedding_requests_get_clear_errors(server, body, status, needle):
    got, reply, _ = server.post("/v1/embeddings", body)
    assert got == status and needle in reply["error"]["message"], reply


def test_malformed_json_and_wrong_routes(server):
    status, body, _ = server.post("/v1/embeddings", b"{not json", raw=True)
    assert status == 400
    status, body, _ = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "embedding model" in body["error"]["message"]
    status, body, _ = server.post("/v1/rerank", {"query": "a", "documents": ["b"]})
    assert status == 400 and "cross-encoder" in body["error"]["message"]
    assert server.get("/health")[0] == 200


def test_decoder_model_refuses_pooling_routes():
    s = Server(MODELS / "stories260K.gguf")
    try:
        status, body, _ = s.post("/v1/embeddings", {"input": "hi"})
        assert status == 400 and "encoder model" in body["error"]["message"] and "--embeddings" in body["error"]["message"]
    finally:
        assert s.stop() == 0


def test_other_paths_and_pooling_flag(minilm):
    """llama-server's /embeddings and --pooling cls (llama.cpp's names)."""
    s = Server(minilm, "--pooling", "cls")
    try:
        status, body, _ = s.post("/embeddings", {"input": "Hello world"})
        assert status == 200
        cls = np.array(body["data"][0]["embedding"])
        assert cosines(cls[None], REF["embeddings"][:1])[0] < 0.99  # not the mean pooling of the reference
    finally:
        assert s.stop() == 0


# --- the tiny random BERT: poolings against transformers' hidden states ---

@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_tiny_bert_poolings_equal_transformers(pooling):
    rows = TINY["tiny_bert"]
    args = ["embed", "-m", EMB / "tiny_bert", "--pooling", pooling, "--no-normalize"]
    for r in rows:
        args += ["-p", r["text"]]
    out = json.loads(run(*args).stdout)
    assert out["pooling"] == pooling
    for got, r in zip(out["data"], rows):
        assert got["tokens"] == len(r["ids"])
        assert np.abs(np.array(got["embedding"]) - np.array(r[pooling])).max() <= 1e-5 * max(1, np.abs(r[pooling]).max())


def test_tiny_bert_from_gguf_equals_safetensors(tmp_path):
    run("convert", EMB / "tiny_bert", tmp_path / "tiny.gguf", "--outtype", "f32")
    texts = [r["text"] for r in TINY["tiny_bert"][:10]]
    a = json.loads(run("embed", "-m", EMB / "tiny_bert", *sum((["-p", t] for t in texts), [])).stdout)
    b = json.loads(run("embed", "-m", tmp_path / "tiny.gguf", *sum((["-p", t] for t in texts), [])).stdout)
    assert [d["embedding"] for d in a["data"]] == [d["embedding"] for d in b["data"]]


# --- the tiny cross-encoder: rerank and score against transformers' logits ---

@pytest.fixture(scope="module")
def reranker():
    s = Server(EMB / "tiny_cross_encoder", "--reranking", name="tiny-reranker")
    yield s
    assert s.stop() == 0


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def pairs_for(query):
    return [p for p in TINY["tiny_cross_encoder"] if p["query"] == query]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_equals_transformers(reranker, path):
    for query in ("What is the capital of France?", "Café résumé"):
        pairs = pairs_for(query)
        status, body, _ = reranker.post(path, {"model": "tiny-reranker", "query": query,
                                               "documents": [p["document"] for p in pairs]})
        assert status == 200, body
        res = body["results"]
        assert len(res) == len(pairs)
        scores = [r["relevance_score"] for r in res]
        assert scores == sorted(scores, reverse=True)
        for r in res:
            assert abs(r["relevance_score"] - sigmoid(pairs[r["index"]]["logit"])) <= 1e-5
        assert body["usage"]["total_tokens"] == sum(len(p["ids"]) for p in pairs)


def test_rerank_top_n_documents_objects_and_return_documents(reranker):
    pairs = pairs_for("How do I reset my password?")
    docs = [{"text": p["document"]} for p in pairs]
    status, body, _ = reranker.post("/v1/rerank", {"query": pairs[0]["query"], "documents": docs, "top_n": 3,
                                                   "return_documents": True})
    assert status == 200 and len(body["results"]) == 3
    best = max(range(len(pairs)), key=lambda i: pairs[i]["logit"])
    assert body["results"][0]["index"] == best and body["results"][0]["document"]["text"] == pairs[best]["document"]


def test_score_one_to_many_and_pairs(reranker):
    pairs = pairs_for("What is the capital of France?")[:6]
    status, body, _ = reranker.post("/score", {"text_1": pairs[0]["query"], "text_2": [p["document"] for p in pairs]})
    assert status == 200 and [d["index"] for d in body["data"]] == list(range(6))
    for d, p in zip(body["data"], pairs):
        assert abs(d["score"] - sigmoid(p["logit"])) <= 1e-5
    status, body, _ = reranker.post("/v1/score", {"text_1": [p["query"] for p in pairs], "text_2": [p["document"] for p in pairs]})
    assert status == 200 and len(body["data"]) == 6


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "'query'"),
    ("/v1/rerank", {"query": "a"}, "'documents' is required"),
    ("/v1/rerank", {"query": "a", "documents": "b"}, "must be a list"),
    ("/v1/rerank", {"query": "a", "documents": []}, "non-empty list"),
    ("/v1/rerank", {"query": "a", "documents": [3]}, "a document must be"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "'top_n'"),
    ("/v1/rerank", {"query": "a", "documents": ["b " * 200]}, "longer than the model's maximum of 128"),
    ("/v1/rerank", {"query": "a", "documents": ["b"] * 3000}, "at most 2048"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "same length"),
    ("/score", {"text_1": "a"}, "required"),
])
def test_bad_rerank_requests(reranker, path, body, needle):
    status, reply, _ = reranker.post(path, body)
    assert status == 400 and needle in reply["error"]["message"], reply


def test_cli_rerank_equals_transformers():
    pairs = pairs_for("Café résumé")[:8]
    out = json.loads(run("rerank", "-m", EMB / "tiny_cross_encoder", "-q", pairs[0]["query"],
                         *sum((["-d", p["document"]] for p in pairs), [])).stdout)
    for r in out["results"]:
        assert abs(r["logit"] - pairs[r["index"]]["logit"]) <= 1e-5


def test_cli_embed_on_the_cached_model():
    out = json.loads(run("embed", "-m", "all-minilm-l6-v2", "-p", CORPUS[0], "-p", CORPUS[1]).stdout)
    got = np.array([d["embedding"] for d in out["data"]])
    assert out["pooling"] == "mean" and cosines(got, REF["embeddings"][:2]).min() >= 0.9999
    p = run("embed", "-m", MODELS / "stories260K.gguf", "-p", "x", "--pooling", "cls", check=False)
    assert p.returncode == 1 and "last token or the mean" in p.stderr


# --- decoders as embedders: last-token pooling in the engine's continuous batch ---

@pytest.mark.parametrize("name,path", [("tiny_qwen2", EMB / "tiny_qwen2"), ("tinystories", MODELS / "TinyStories-656K")])
def test_decoder_last_token_embeddings_equal_transformers(name, path):
    rows = TINY["decoders"][name]
    s = Server(path, "--embeddings")
    try:
        for r in rows:
            assert s.post("/tokenize", {"prompt": r["text"]})[1]["tokens"] == r["ids"], r["text"]
        got, body = embed(s, [r["text"] for r in rows])
        assert body["usage"]["prompt_tokens"] == sum(len(r["ids"]) for r in rows)
        cos = cosines(got, np.array([r["last"] for r in rows]))
        assert cos.min() >= 0.99999, cos.min()
    finally:
        assert s.stop() == 0


def test_qwen3_last_token_embedding_is_transformers_last_hidden_state():
    """Qwen3 (QK-norm) as a last-token embedder, as Qwen3-Embedding runs: the tiny random Qwen3 of the
    models' tests. transformers' recorded top-16 logits at a prompt's last position are W h for its final
    hidden state h, so the output rows of those tokens times Serval's (normalised) embedding must be
    proportional to them, with a positive factor (|h|). The directory's F16 weights multiply activations
    rounded to F16 (as test_families.py's TOL["f16"]): measured at most 2.7e-4 off."""
    from safetensors_np import read_safetensors
    fam = DATA / "families"
    ref = json.loads((fam / "reference.json").read_text())["qwen3"]
    w = read_safetensors(fam / "qwen3" / "model.safetensors")
    out = np.asarray(w.get("lm_head.weight", w["model.embed_tokens.weight"]), dtype=np.float64)  # tied
    s = Server(fam / "qwen3", "--embeddings", "--kv-cache-dtype", "f32")
    try:
        for row in ref:
            got, _ = embed(s, [row["ids"]])
            ids = [i for i, _ in row["top"]]
            want = np.array([v for _, v in row["top"]])
            proj = out[ids] @ got[0]
            scale = float(proj @ want / (proj @ proj))
            assert scale > 0
            assert np.abs(scale * proj - want).max() <= 1e-3, (scale * proj, want)
    finally:
        assert s.stop() == 0


def test_decoder_embeddings_beside_generation_are_batch_invariant():
    """Embedding requests share the engine's steps with generating ones; each result is the same bits as
    when it runs alone, and the generation is unchanged."""
    rows = TINY["decoders"]["tinystories"]
    texts = [r["text"] for r in rows]
    s = Server(MODELS / "TinyStories-656K", "--task", "embed", name="stories")
    try:
        alone = np.array([embed(s, t)[0][0] for t in texts[:5]])
        gen_body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
        ref_text = s.post("/v1/completions", gen_body)[1]["choices"][0]["text"]
        results = {}

        def generate():
            results["text"] = s.post("/v1/completions", gen_body)[1]["choices"][0]["text"]

        g = threading.Thread(target=generate)
        g.start()
        batched, _ = embed(s, texts)
        g.join()
        assert np.array_equal(batched[:5], alone)
        assert results["text"] == ref_text
        status, body, _ = s.post("/v1/rerank", {"query": "a", "documents": ["b"]})
        assert status == 400 and "rerank and score" in body["error"]["message"]
    finally:
        assert s.stop() == 0
    p = run("serve", MODELS / "TinyStories-656K", "--port", "0", "--reranking", check=False)
    assert p.returncode == 1 and "'yes' is not in the vocabulary" in p.stderr  # a decoder reranker needs its tokens


# --- decoders: mean pooling, and yes/no rerankers (tests/data/embeddings/decoder_heads.json) ---

HEADS = json.loads((EMB / "decoder_heads.json").read_text())


def test_decoder_mean_pooling_equals_transformers():
    """Every prompt position's final hidden state, averaged; prompts split over several steps (16 tokens
    per step) and asked twice (the second time their blocks are in the prefix cache, which mean pooling
    must not use)."""
    rows = HEADS["mean"]
    texts = [r["text"] for r in rows]
    s = Server(EMB / "tiny_qwen2", "--pooling", "mean", "--embeddings", "--max-num-batched-tokens", "16")
    try:
        got, body = embed(s, texts)
        assert body["usage"]["prompt_tokens"] == sum(len(r["ids"]) for r in rows)
        want = np.array([r["mean"] for r in rows])
        assert cosines(got, want).min() >= 0.99999, cosines(got, want).min()
        last = np.array([r["last"] for r in TINY["decoders"]["tiny_qwen2"] if r["text"] in texts])
        assert cosines(got[:len(last)], last).max() < 0.99  # mean is not the last token's state
        again = np.array([embed(s, t)[0][0] for t in texts])
        assert np.array_equal(again, got)  # alone, from a warm prefix cache: the same bits
    finally:
        assert s.stop() == 0


def rerank_scores(server, query, documents, path="/v1/rerank"):
    status, body, _ = server.post(path, {"query": query, "documents": documents, "top_n": len(documents)})
    assert status == 200, body
    return {r["index"]: r["relevance_score"] for r in body["results"]}, body


@pytest.mark.parametrize("flags", [["--reranking"], ["--task", "score"]])
def test_decoder_reranker_equals_transformers(flags):
    pairs = HEADS["rerank"]
    s = Server(EMB / "tiny_qwen2", *flags, "--classifier-from-token", ",".join(HEADS["tokens"]),
               "--rerank-template", EMB / "rerank_template.txt")
    try:
        template = (EMB / "rerank_template.txt").read_text()
        p = pairs[0]
        text = template.replace("{query}", p["query"]).replace("{document}", p["document"])
        assert s.post("/tokenize", {"prompt": text})[1]["tokens"] == p["ids"]
        for query in dict.fromkeys(p["query"] for p in pairs):
            rows = [p for p in pairs if p["query"] == query]
            scores, body = rerank_scores(s, query, [r["document"] for r in rows])
            assert max(abs(scores[i] - r["score"]) for i, r in enumerate(rows)) <= 1e-4
            got = [r["relevance_score"] for r in body["results"]]
            assert got == sorted(got, reverse=True)
            assert body["usage"]["prompt_tokens"] == sum(len(r["ids"]) for r in rows)
            status, body, _ = s.post("/score", {"text_1": query, "text_2": [r["document"] for r in rows]})
            assert status == 200 and max(abs(d["score"] - r["score"]) for d, r in zip(body["data"], rows)) <= 1e-4
        status, body, _ = s.post("/v1/embeddings", {"input": "x"})
        assert status == 400 and "embeddings" in body["error"]["message"]  # rerank only: no --embeddings
    finally:
        assert s.stop() == 0


def test_decoder_reranker_with_one_token_and_bad_tokens():
    pairs = HEADS["rerank"][:4]
    s = Server(EMB / "tiny_qwen2", "--reranking", "--classifier-from-token", HEADS["tokens"][1],
               "--rerank-template", EMB / "rerank_template.txt")
    try:
        scores, _ = rerank_scores(s, pairs[0]["query"], [p["document"] for p in pairs])
        want = [1 / (1 + math.exp(-p["logits"][1])) for p in pairs]
        assert max(abs(scores[i] - w) for i, w in enumerate(want)) <= 1e-4
    finally:
        assert s.stop() == 0
    for tokens, needle in (("nope,good", "'nope' is not in the vocabulary"), ("a,b,c", "classifier-from-token")):
        p = run("serve", EMB / "tiny_qwen2", "--port", "0", "--reranking", "--classifier-from-token", tokens, check=False)
        assert p.returncode != 0 and needle in p.stderr, p.stderr
    p = run("serve", EMB / "tiny_qwen2", "--port", "0", "--embeddings", "--pooling", "cls", check=False)
    assert p.returncode == 1 and "last token or the mean" in p.stderr


def test_cli_embed_and_rerank_on_a_decoder():
    """`serval embed` and `serval rerank` run a decoder through the engine as the server does."""
    rows = HEADS["mean"][:4]
    texts = [x for r in rows for x in ("-p", r["text"])]
    out = json.loads(run("embed", "-m", EMB / "tiny_qwen2", "--pooling", "mean", *texts).stdout)
    got = np.array([d["embedding"] for d in out["data"]])
    assert out["pooling"] == "mean" and cosines(got, np.array([r["mean"] for r in rows])).min() >= 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    last = {r["text"]: r["last"] for r in TINY["decoders"]["tiny_qwen2"]}
    out = json.loads(run("embed", "-m", EMB / "tiny_qwen2", *texts).stdout)
    assert out["pooling"] == "last"
    want = np.array([last[r["text"]] for r in rows])
    assert cosines(np.array([d["embedding"] for d in out["data"]]), want).min() >= 0.99999
    pairs = [p for p in HEADS["rerank"] if p["query"] == HEADS["rerank"][0]["query"]]
    docs = [x for p in pairs for x in ("-d", p["document"])]
    out = json.loads(run("rerank", "-m", EMB / "tiny_qwen2", "-q", pairs[0]["query"], *docs, "--classifier-from-token",
                         ",".join(HEADS["tokens"]), "--rerank-template", EMB / "rerank_template.txt").stdout)
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)
    assert max(abs(r["relevance_score"] - pairs[r["index"]]["score"]) for r in out["results"]) <= 1e-4
