#!/usr/bin/env python3
"""Regenerates the committed seed corpora under tests/fuzz/<target>/seeds/ from ../shared and tests/data.

Seeds are small real inputs (a few KB each at most): safetensors headers with a few bytes of data and
tiny complete models built here, config.json files, tokenizer test strings, the chat templates and
request bodies like those of tests/py/test_server.py, and for the grammar target GBNF grammars (those of
tests/data/gbnf_llama_cpp.json and a few more), regular expressions, JSON Schemas
(tests/data/structured_schemas.json and edge cases) and tool-call outputs (tests/data/tool_calls/). Run from anywhere: tests/fuzz/make_seeds.py
(the seeds are committed; rerun only to refresh them)."""
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
OUT = ROOT / "tests" / "fuzz"


def write(target, name, data):
    d = OUT / target / "seeds"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# ---- safetensors: CONFIG_JSON "\n--safetensors--\n" SAFETENSORS_BYTES
SEP = b"\n--safetensors--\n"


def safetensors_image(tensors, metadata=None, dtype="F16"):
    """tensors: list of (name, shape) (HF order, outermost first); data is a counting byte pattern."""
    size = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        # Small values that are finite in every float format.
        blobs.append(bytes((0x00 if i % size else 0x3C) if size == 2 else (0x3F if i % 4 == 3 else 0) for i in range(nbytes)))
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def tiny_model(cfg, bias=False, lm_head=False):
    e, ff, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    h, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", e // h)
    t = [("model.embed_tokens.weight", (v, e)), ("model.norm.weight", (e,))]
    if lm_head:
        t.append(("lm_head.weight", (v, e)))
    for i in range(L):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", (e,)), (p + "self_attn.q_proj.weight", (h * d, e)),
              (p + "self_attn.k_proj.weight", (kv * d, e)), (p + "self_attn.v_proj.weight", (kv * d, e)),
              (p + "self_attn.o_proj.weight", (e, h * d)), (p + "post_attention_layernorm.weight", (e,)),
              (p + "mlp.gate_proj.weight", (ff, e)), (p + "mlp.up_proj.weight", (ff, e)),
              (p + "mlp.down_proj.weight", (e, ff))]
        if bias:
            t += [(p + "self_attn.q_proj.bias", (h * d,)), (p + "self_attn.k_proj.bias", (kv * d,)),
                  (p + "self_attn.v_proj.bias", (kv * d,))]
    return t


def safetensors_seeds():
    real_dir = SHARED / "models" / "TinyStories-656K"
    real_cfg = (real_dir / "config.json").read_bytes()
    st = (real_dir / "model.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", st[:8])
    write("safetensors", "tinystories-header", real_cfg + SEP + st[: 8 + hlen + 64])
    write("safetensors", "tinystories-config-only", real_cfg)

    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
             "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
             "num_hidden_layers": 1, "vocab_size": 16, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": True}
    write("safetensors", "tiny-llama", json.dumps(llama, indent=1).encode() + SEP + safetensors_image(
        tiny_model(llama), metadata={"format": "pt"}))
    qwen = dict(llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=2,
                rope_theta=1000000.0, tie_word_embeddings=False, head_dim=4,
                rope_scaling={"type": "linear", "factor": 2.0})
    write("safetensors", "tiny-qwen2", json.dumps(qwen, indent=1).encode() + SEP + safetensors_image(
        tiny_model(qwen, bias=True, lm_head=True), dtype="BF16"))
    f32 = dict(llama, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4})
    write("safetensors", "tiny-llama-f32", json.dumps(f32).encode() + SEP + safetensors_image(
        tiny_model(f32), dtype="F32"))


# ---- tokenizer: one byte picks the vocabulary (see fuzz/fuzz_tokenizer.cpp), then the text
def tokenizer_seeds():
    sep = "\n__ggml_vocab_test__\n"
    vocabs = sorted(p.name for p in (SHARED / "tokenizer-tests").glob("*.gguf"))
    strings = []
    for i, name in enumerate(vocabs):
        text = (SHARED / "tokenizer-tests" / (name + ".inp")).read_bytes().decode()
        pieces = text.split(sep)[:-1]
        strings = pieces
        for j, s in enumerate(pieces):
            write("tokenizer", f"{i}-{name.removeprefix('ggml-vocab-').removesuffix('.gguf')}-{j:02d}",
                  bytes([i]) + s.encode())
    # stories260K, TinyStories tokenizer.json, gpt-2 with the llama-bpe and qwen2 pre-tokenizers, the two
    # WordPiece vocabularies of tests/data/embeddings.
    extra = ["stories260K", "tinystories-json", "gpt2-llama3-pre", "gpt2-qwen2-pre", "wordpiece-uncased",
             "wordpiece-cased"]
    special = ["<s>Once upon a time</s>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
               "<|endoftext|>Hello<|endoftext|>", "<unk> <0x41> \u2581x", "<|end|><|user|>a",
               "[CLS] Caf\u00e9 \u6771\u4eac [SEP] \u0130stanbul \t\u00a0x##y", "unaffable" * 20]
    picks = [s for s in strings if s][:12] + special
    for k, name in enumerate(extra):
        for j, s in enumerate(picks):
            write("tokenizer", f"{len(vocabs) + k}-{name}-{j:02d}", bytes([len(vocabs) + k]) + s.encode())
    for i in range(len(vocabs)):
        for j, s in enumerate(special):
            write("tokenizer", f"{i}-special-{j:02d}", bytes([i]) + s.encode())


# ---- chat templates: the real ones and small constructs
def chat_template_seeds():
    for p in sorted((ROOT / "tests" / "data" / "chat_templates").glob("*.jinja")):
        write("chat_template", p.stem, p.read_bytes())
    snippets = {
        "loop-vars": "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role | upper }}"
                     "{% if not loop.last %}, {% endif %}{% endfor %}",
        "namespace": "{% set ns = namespace(found=false, n=0) %}{% for m in messages %}{% if m.role == 'tool' %}"
                     "{% set ns.found = true %}{% set ns.n = ns.n + 1 %}{% endif %}{% endfor %}{{ ns.found }} {{ ns.n }}",
        "filters": "{{ messages | map(attribute='role') | join(',') }} {{ tools | length }} "
                   "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ 'a b' | title }}"
                   " {{ ' x ' | trim }} {{ [3,1,2] | reverse | list }} {{ 'abc' | replace('b', 'B') }}",
        "tojson": "{{ tools | tojson }}{{ messages[2].tool_calls[0].function.arguments | tojson(indent=2) }}",
        "slices": "{{ messages[1:] | length }}{{ messages[-1].content }}{{ 'hello'[1:3] }}{{ 'hello'[::-1] }}",
        "arith": "{{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ -3 / 2 }} {{ 1.5 * 4 }} {{ '%' ~ 5 }} {{ 10 - 3 * 2 }}",
        "string-methods": "{{ 'Hello'.startswith('He') }}{{ 'a,b'.split(',') }}{{ ' x'.lstrip() }}{{ 'X'.lower() }}"
                          "{{ 'abc'.endswith('c') }}{{ eos_token.strip() }}",
        "tests": "{{ x is defined }}{{ messages is iterable }}{{ 3 is odd }}{{ none is none }}"
                 "{{ tools is mapping }}{{ 'a' is string }}{{ 1 is number }}",
        "dict-items": "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}{{ {'a': 1}.get('a') }}"
                      "{{ messages[0].keys() | list }}",
        "raise": "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}",
        "whitespace": "{%- for m in messages -%}\n  {{- m.content -}}\n{%- endfor -%}\n{# comment #}\n{%+ if true +%}x{% endif %}",
        "range-default": "{% for i in range(3) %}{{ i }}{% endfor %}{{ undefined_var | default('d') }}"
                         "{{ (messages | first).role }}{{ (messages | last).role }}{{ range(1, 10, 3) | list }}",
        "inline-if": "{{ 'yes' if add_generation_prompt else 'no' }}{{ bos_token if bos_token else '' }}"
                     "{{ messages | rejectattr('role', 'eq', 'system') | map(attribute='role') | list }}",
        "macro": "{% macro greet(x) %}hi {{ x }}{% endmacro %}{{ greet('a') }}",
        "strftime": "{{ strftime_now('%Y-%m-%d') }}{{ 'abc' | indent(2) }}{{ 12 | string }}{{ '3' | int + 1 }}",
    }
    # Edges of the engine's limits and integer arithmetic (each must end in text or a clean error).
    limits = {
        "int-edges": "{{ (-9223372036854775807 - 1) % -1 }}{{ (-9223372036854775807 - 1) // -1 }}"
                     "{{ 9223372036854775807 + 1 }}{{ -(-9223372036854775807 - 1) }}{{ 2 ** 63 }}",
        "zero-division": "{{ 1 / 0 }}{{ 1 // 0 }}{{ 1 % 0 }}{{ 7.5 % 0.0 }}",
        "big-repeat": "{{ 'ab' * 9999999999 }}{{ ([1] * 1000000000) | length }}",
        "big-range": "{{ range(999999999999) | length }}{{ range(0, 10, 0) | list }}",
        "big-indent": "{{ 'x\ny' | indent(999999999) }}{{ messages | tojson(indent=999999999) }}",
        "slices-edges": "{{ 'abc'[9223372036854775807:] }}{{ 'abc'[::-9223372036854775807-1] }}{{ [1][-9223372036854775807-1] }}",
        "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "nesting": "{{ " + "(" * 200 + "1" + ")" * 200 + " }}{{ " + "[" * 200 + "]" * 200 + " }}",
        "doubling": "{% set ns = namespace(s='ab', l=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                    "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.s | length }}",
        "number-literals": "{{ 99999999999999999999999 }}{{ 1e999 }}{{ '99999999999999999999' | int }}{{ 1e300 | int }}",
    }
    snippets.update({"limits-" + k: v for k, v in limits.items()})
    for name, src in snippets.items():
        write("chat_template", name, src)


# ---- HTTP request bodies: a control byte (see fuzz/fuzz_http_request.cpp: bit 0 chat, bits 1-3
# template, bit 4 trust request templates, bits 5-6 tokenize / detokenize / Anthropic messages or, with bit 4,
# OpenAI responses), then the JSON body
def http_request_seeds():
    def body(chat, obj, control=0):
        return bytes([control | (1 if chat else 0)]) + json.dumps(obj).encode()
    msgs = [{"role": "user", "content": "Hello!"}]
    seeds = {
        "completion": (False, {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
        "completion-stream": (False, {"prompt": "Once upon a time", "max_tokens": 16, "stream": True,
                                      "stream_options": {"include_usage": True}, "seed": 7}),
        "completion-ids": (False, {"prompt": [1, 403, 407, 261, 378], "max_tokens": 4, "logprobs": 3, "echo": False}),
        "completion-stop": (False, {"prompt": "Once", "max_tokens": 32, "stop": ["\n", "the"], "n": 2, "seed": 1,
                                    "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05}),
        "completion-penalties": (False, {"prompt": "Lily", "max_tokens": 10, "presence_penalty": 0.5,
                                         "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                                         "logit_bias": {"403": 100, "2": -100}}),
        "chat": (True, {"model": "stories260K", "messages": msgs, "max_tokens": 8}),
        "chat-stream": (True, {"messages": [{"role": "system", "content": "Be brief."}] + msgs, "stream": True,
                               "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2}),
        "chat-tools": (True, {"messages": msgs + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        "chat-parts": (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                              "add_generation_prompt": True, "n": 1, "stop": "x"}),
        "chat-template": (True, {"messages": msgs, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                          0x10),
        "chat-qwen-template": (True, {"messages": msgs, "max_tokens": 4}, 0x08),
        "chat-llama3-template": (True, {"messages": msgs, "stream": True}, 0x04),
        "tokenize": (False, {"prompt": "Once upon a time", "add_special_tokens": False}, 0x20),
        "tokenize-chat": (False, {"messages": msgs}, 0x20),
        "detokenize": (False, {"tokens": [1, 403, 407, 261, 378]}, 0x40),
        "bad-model": (True, {"model": "nope", "messages": msgs}),
        "bad-max-tokens": (False, {"prompt": "x", "max_tokens": -1}),
        "chat-reasoning": (True, {"messages": msgs, "reasoning_effort": "low",
                                  "chat_template_kwargs": {"enable_thinking": False}}, 0x08),
        # Anthropic's Messages API (bits 5-6 = 3; bit 0: count_tokens)
        "messages": (False, {"model": "stories260K", "max_tokens": 8, "system": "Be brief.", "messages": msgs,
                             "stop_sequences": ["\n"], "temperature": 0, "metadata": {"user_id": "u1"}}, 0x60),
        "messages-tools": (False, {"max_tokens": 16, "messages": msgs + [
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                         {"type": "text", "text": "And now?"}]}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 0x68),
        "messages-count-tokens": (True, {"model": "stories260K", "system": [{"type": "text", "text": "S"}],
                                         "messages": msgs}, 0x60),
        # OpenAI's Responses API (bits 5-6 = 3 with bit 4)
        "responses": (False, {"model": "stories260K", "input": "Hello!", "instructions": "Be brief.",
                              "max_output_tokens": 8, "store": False, "text": {"format": {"type": "text"}}}, 0x70),
        "responses-items": (False, {"input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"}],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
            "reasoning": {"effort": "low", "summary": "auto"}}, 0x78),
        # The pooling APIs of an encoder (bits 5-6 = 2 with bit 4; bits 1-2: embeddings, rerank, score)
        "embeddings": (False, {"model": "tiny-reranker", "input": ["Hello world", "Café"], "encoding_format": "base64"}, 0x50),
        "embeddings-ids": (False, {"input": [[2, 40, 41, 3], [5]], "truncate_prompt_tokens": 3}, 0x50),
        "rerank": (False, {"query": "capital of France", "documents": ["Paris", {"text": "Berlin"}], "top_n": 1,
                           "return_documents": True}, 0x52),
        "score": (False, {"text_1": "capital of France", "text_2": ["Paris", "Rome"]}, 0x54),
    }
    for name, (chat, obj, *control) in seeds.items():
        write("http_request", name, body(chat, obj, *control))


# ---- grammar: one mode byte (see fuzz/fuzz_grammar.cpp: 0 GBNF [+ '\0' + bytes to feed], 1 regex,
# 2 JSON value / schema, 3 model output or a tools array), then the text
def grammar_seeds():
    def put(mode, name, text):
        data = bytes([mode]) + (text if isinstance(text, bytes) else text.encode())
        assert len(data) <= 4096, name
        write("grammar", f"{mode}-{name}", data)

    recorded = json.loads((ROOT / "tests" / "data" / "gbnf_llama_cpp.json").read_text())
    for g in recorded["grammars"]:
        accepted = [c for c, ok in g["cases"] if ok]
        put(0, "gbnf-" + g["name"], g["grammar"] + ("\0" + accepted[-1] if accepted else ""))
    gbnf = {
        # llama.cpp's grammars/json.gbnf
        "json": r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}''' + "\0" + '{"a": [1, -2.5e3, "x\\u00e9"], "b": {"c": null}}',
        "arithmetic": r'''root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*''' + "\0" + "(a + 12) * b = x\n",
        "list": r'''root ::= item+
# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"''' + "\0" + "- first item\n- second: é 中\n",
        "japanese": r'''root        ::= (jp-char | space)+
jp-char     ::= hiragana | katakana | punctuation | cjk
hiragana    ::= [ぁ-ゟ]
katakana    ::= [ァ-ヿ]
punctuation ::= [、-〾]
cjk         ::= [一-鿿]
space       ::= [ \t\n]''' + "\0" + "こんにちは、世界 カタカナ",
        "choice": 'root ::= "yes" | "no" | "maybe" | "I don\\u0027t know"\0maybe',
        "counts": 'root ::= ("ab"{2} [0-9]{1,3} | [x-z]{0,}){1,4} "."{0,2}\0abab123zz.',
        "utf8-ranges": r'root ::= [\u0080-\u07FF] [\u0800-\uFFFF] [\U00010000-\U0010FFFF] [^\x00-\x7F]+' + "\0é€😀ü",
        "tool-call": 'root ::= "<tool_call>" ws "{" ws "\\"name\\":" ws "\\"get_weather\\"" ws "}" ws "</tool_call>"\n'
                     'ws ::= [ \\t\\n]{0,8}\0<tool_call>{"name": "get_weather"}</tool_call>',
        "nested-nullable": 'root ::= (a | b)* "!"\na ::= "x"? "y"?\nb ::= ("z" a)?\0xyzx!',
        "nested-repeat": 'root ::= (("a"? "b"){0,20} "c"?){1,3} "d"\0abbcabd',
    }
    for name, text in gbnf.items():
        put(0, "gbnf-" + name, text)

    regexes = {
        "phone": r"\d{3}-\d{4}", "email": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.(com|org|net)", "date": r"^\d{4}-\d{2}-\d{2}$",
        "alternation": "(ab|c)*d?", "choice": "(?:yes|no|maybe)", "counts": "a{2,5}b{,3}c{2,}", "word": r"^\w+\s\W?$",
        "string-body": r'[^"\\]{1,8}', "latin1": "[\u00e9-\u00ff]+é", "abb": "(a|b)*abb", "named": "(?P<x>a+)(?<y>b)?",
        "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", "dot": r".\..+?", "anchored-alts": "(^a|^b)c$",
        "classes": r"[-a-c_\]]+[^\s\d]*", "escapes": r"\x41\u00e9\u{1F600}\t\/\-", "lookahead": "a(?=b)", "nested-counts": "((ab?){0,20}c?){1,3}",
    }
    for name, pattern in regexes.items():
        put(1, "regex-" + name, pattern)

    schemas = json.loads((ROOT / "tests" / "data" / "structured_schemas.json").read_text())
    for name, schema in schemas.items():
        put(2, "schema-" + name, json.dumps(schema))
    extra = {
        "true": True, "false": False, "empty": {},
        "const-object": {"const": {"a": [1, "x", None], "b": 2.5}},
        "enum-mixed": {"enum": ["red", 1, None, True, [1, 2], {"k": "v"}, 1e300, -0.0]},
        "ref-recursive": {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                             "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                                            "required": ["value"], "additionalProperties": False}},
                          "$ref": "#/$defs/node"},
        "bounds": {"type": "object", "properties": {
            "i": {"type": "integer", "minimum": -12345678901234567890, "exclusiveMaximum": 99999999999999999999},
            "n": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 1e3},
            "s": {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-c]+$"},
            "a": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
            "t": {"type": ["string", "null"], "format": "date"}}, "required": ["i", "s"]},
        "any-of": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]},
        "type-list": {"type": ["integer", "boolean"], "nullable": True},
        "value-object": {"name": "x", "list": [1, 2.5, "é", None, {"deep": [[[]]]}], "unicode": "\u00e9\ud83d\ude00\n"},
        "value-array": [1, {"a": {}}, "x"],
    }
    for name, schema in extra.items():
        put(2, "schema-" + name, json.dumps(schema))

    for p in sorted((ROOT / "tests" / "data" / "tool_calls").glob("*.txt")):
        put(3, "output-" + p.stem, p.read_bytes())
    for text in [
        "Sure.\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "ping", "parameters": null}<|eom_id|>',
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS][{"name": "ping", "arguments": {}}]',
        '```json\n[{"name": "get_time", "arguments": {"city": "Sydney"}}, {{"name": "ping", "arguments": {}}}]\n```',
    ]:
        put(3, f"output-constructed-{len(text)}", text)
    tools = json.loads((ROOT / "tests" / "data" / "tool_calls" / "tools.json").read_text())
    for name, lst in tools.items():
        put(3, "tools-" + name, json.dumps(lst))
    put(3, "tools-no-parameters", json.dumps([{"type": "function", "function": {"name": "ping"}},
                                              {"name": "bare \"quoted\" é", "parameters": None},
                                              {"type": "function", "function": {"name": "enum_args", "parameters": {
                                                  "properties": {"mode": {"enum": ["a", "b"]}}, "required": ["mode"]}}}]))


if __name__ == "__main__":
    safetensors_seeds()
    tokenizer_seeds()
    chat_template_seeds()
    http_request_seeds()
    grammar_seeds()
