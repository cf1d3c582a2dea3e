#!/usr/bin/env python3
"""Records the byte-level BPE pre-tokenizer vectors in this directory (not run by the test suite).

Needs Hugging Face `tokenizers` (a scratch venv outside the repository):
    python tests/data/tokenizers/record.py

For each pre-tokenizer style of a real model family it trains a small byte-level BPE (1000 tokens) on
tests/data/tinystory.txt plus corpus.json's training text, with the very pre_tokenizer and normalizer
blocks that family's tokenizer.json carries, and writes
  <style>.tokenizer.json   the trained tokenizer (what Serval loads)
  reference.json           {style: [ids of each corpus.json "texts" entry]} from Hugging Face tokenizers
The vocabularies are toys; what the vectors pin down is the splitting: the regexes, their order, the
NFC normalizer. The real vocabularies are checked on real files elsewhere (tests/py/test_tokenizer_json.py).
"""
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers, decoders

HERE = Path(__file__).resolve().parent
DATA = HERE.parent

# Split regexes as the families' tokenizer.json files spell them.
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
O200K = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# DeepSeek-V2's letter class: the cased letters (Unicode LC) as code point ranges, written with chr()
# so that no editor's normalization can change them (several are canonical singletons such as U+2126).
_LC = [(0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
       (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
       (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
       (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
       (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
       (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
       (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
       (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
       (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
       (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
       (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
       (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
       (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
       (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
       (0x1E900, 0x1E943)]


def _cls(ranges):
    return "".join(chr(a) if a == b else chr(a) + "-" + chr(b) for a, b in ranges)


DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[" + _cls(_LC) + "]+",
    "\\s?[" + _cls([(0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002)]) + "]+",
    "\\s+$",
    "[" + _cls([(0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF)]) + "]+",
    "\\p{N}+",
]


def split(regex):
    return pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)


def byte_level(use_regex):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=use_regex)


STYLES = {
    # Qwen2 / Qwen2.5 / Qwen3: one split, NFC first.
    "qwen2": (normalizers.NFC(), pre_tokenizers.Sequence([split(QWEN2), byte_level(False)])),
    # Llama 3: digits in runs of up to three.
    "llama3": (None, pre_tokenizers.Sequence([split(LLAMA3), byte_level(False)])),
    # GPT-2: the regex lives inside ByteLevel (use_regex).
    "gpt2": (None, byte_level(True)),
    # gpt-oss / GPT-4o (o200k): case-aware word splits.
    "o200k": (None, pre_tokenizers.Sequence([split(O200K), byte_level(False)])),
    # DeepSeek-V2 (deepseek-llm): six splits in sequence.
    "deepseek-llm": (None, pre_tokenizers.Sequence([split(r) for r in DEEPSEEK_LLM] + [byte_level(False)])),
    # A Digits step (individual digits), as some files have it before the split.
    "digits-llama3": (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split(LLAMA3), byte_level(False)])),
}


def main():
    corpus = json.loads((HERE / "corpus.json").read_text())
    training = [(DATA / "tinystory.txt").read_text()] + corpus["training"] + corpus["texts"]
    reference = {}
    for name, (norm, pre) in STYLES.items():
        tok = Tokenizer(models.BPE())
        if norm is not None:
            tok.normalizer = norm
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>"], show_progress=False)
        tok.train_from_iterator(training, trainer)
        tok.save(str(HERE / f"{name}.tokenizer.json"))
        reference[name] = [tok.encode(t, add_special_tokens=False).ids for t in corpus["texts"]]
    (HERE / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
