"""Tokenizers and chat templates against the test assets llama.cpp keeps beside its code, which
llama-cpp-python 0.3.36's source archive (PyPI) carries and scripts/setup unpacks into the model cache
as llama-cpp-assets (scripts/models.json):

- vocabulary-only GGUF files (models/ggml-vocab-*.gguf) with their test vectors (.inp: texts; .out: the
  ids Hugging Face `tokenizers` gives them, recorded by llama.cpp's convert_hf_to_gguf_update.py):
  `serval tokenize` on the vocabulary alone must give the same ids (Phi-3's SentencePiece vocabulary,
  DeepSeek's, GPT-2's, Qwen2's, Llama 3's, BERT's WordPiece, ...), or refuse the file by name;
- the chat templates of the model makers (models/templates/*.jinja: gpt-oss's harmony format, Qwen3,
  Phi-3.5, Gemma 2, DeepSeek, Llama 3.x, Mistral, ...): Serval's Jinja engine must render each as
  Jinja2 does, for plain conversations and (where the template takes them) tools and reasoning.
"""
import datetime
import json

import jinja2
import pytest

from conftest import CACHE, ROOT, run
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_chat_template import CONVERSATIONS

ASSETS = CACHE / "llama-cpp-assets"
SEPARATOR = "\n__ggml_vocab_test__\n"
# Vocabularies whose pre-tokenizer or model Serval does not implement: refused, by name.
REFUSED = {"falcon": "falcon", "mpt": "mpt", "qwen35": "qwen35", "gemma-4": "gemma4"}
# Templates that use what the engine lacks (Python's str.format; a comparison of a number with a
# string that Jinja2 allows): refused with an error, never rendered wrong.
TEMPLATES_REFUSED = {"tencent-Hy3", "ByteDance-Seed-OSS"}


def assets():
    assert (ASSETS / ".sha256").exists(), f"{ASSETS} missing: run scripts/setup (it fetches llama-cpp-assets)"
    return ASSETS


def vocabularies():
    if not (ASSETS / ".sha256").exists():
        return ["missing"]
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in ASSETS.glob("ggml-vocab-*.gguf.inp"))


@pytest.mark.parametrize("vocab", vocabularies())
def test_vocabulary_only_gguf_tokenizes_as_hugging_face(vocab, tmp_path):
    gguf = assets() / f"ggml-vocab-{vocab}.gguf"
    texts = gguf.with_suffix(".gguf.inp").read_text().split(SEPARATOR)
    want = gguf.with_suffix(".gguf.out").read_text().split("\n")
    lines = tmp_path / "texts.jsonl"
    lines.write_text("".join(json.dumps(t) + "\n" for t in texts))
    p = run("tokenize", "-m", gguf, "--jsonl", lines, "--no-bos", check=False)
    if vocab in REFUSED:
        assert p.returncode != 0 and REFUSED[vocab] in p.stderr and "Traceback" not in p.stderr
        return
    assert p.returncode == 0, p.stderr
    got = p.stdout.split("\n")
    for i, text in enumerate(texts):
        assert got[i].split() == want[i].split(), f"{vocab}: {text!r}"


def templates():
    if not (ASSETS / ".sha256").exists():
        return ["missing"]
    return sorted(p.stem for p in (ASSETS / "templates").glob("*.jinja"))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
TOOL_TURN = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]


def reference_render(source, messages, gen, **extra):
    """As transformers' apply_chat_template renders (its _compile_jinja_template): a sandbox with
    trim_blocks, lstrip_blocks and loop controls, its tojson, raise_exception and strftime_now."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)  # local time, as Serval's
    return env.from_string(source).render(messages=messages, add_generation_prompt=gen, bos_token="<s>",
                                          eos_token="</s>", **extra)


def render_both(template, messages, gen, tmp_path, **extra):
    """Jinja2's rendering (or its exception) and Serval's process, for one conversation."""
    source = template.read_text()
    try:
        want = reference_render(source, messages, gen, **extra)
    except Exception as e:  # the template raised (raise_exception) or Jinja2 refused it
        want = e
    # Serval's chat-template command takes messages; other variables are set by a wrapper template.
    wrapped = tmp_path / template.name
    prefix = "".join("{% set " + k + " = " + json.dumps(v) + " %}" for k, v in extra.items())
    wrapped.write_text(prefix + source)
    args = ["chat-template", "--template", wrapped, "--messages", json.dumps(messages), "--bos", "<s>", "--eos", "</s>"]
    return want, run(*args, *([] if gen else ["--no-generation-prompt"]), check=False)


@pytest.mark.parametrize("name", templates())
def test_model_makers_templates_render_as_jinja2(name, tmp_path):
    template = assets() / "templates" / f"{name}.jinja"
    cases = [(m, gen, {}) for m in CONVERSATIONS.values() for gen in (True, False)]
    cases.append((TOOL_TURN, True, {"tools": TOOLS}))
    if name.startswith("openai-gpt-oss"):  # harmony's own variables
        cases.append((CONVERSATIONS["full"], True, {"reasoning_effort": "high", "model_identity": "You are Serval."}))
    for messages, gen, extra in cases:
        want, p = render_both(template, messages, gen, tmp_path, **extra)
        if name in TEMPLATES_REFUSED:
            assert p.returncode != 0 and "chat template" in p.stderr
            continue
        if isinstance(want, jinja2.TemplateError):  # raise_exception(), or a template Jinja2 cannot parse
            assert p.returncode != 0, f"{name}: Jinja2 raised {want!r}; Serval rendered"
            continue
        if isinstance(want, Exception):  # Python's own error inside Jinja2 (llama-cpp-deepseek-r1 with tools:
            continue                     # tojson of a generator): nothing to compare; Serval may render
        assert p.returncode == 0, f"{name}: {p.stderr}"
        assert p.stdout == want, f"{name}: {messages} {extra}"


def test_gpt_oss_served_with_its_harmony_template():
    """The tiny gpt-oss served with gpt-oss's own chat template (harmony, from llama.cpp's assets) and the
    gpt_oss reasoning parser: chat requests with and without tools render server-side (strftime_now,
    macros, tools as TypeScript namespaces) and complete; the prompt the server built is the one Jinja2
    renders (checked through /tokenize's count against the tiny vocabulary's encoding of Jinja2's text)."""
    from server_util import Server
    template = assets() / "templates" / "openai-gpt-oss-120b.jinja"
    model = ROOT / "tests" / "data" / "families" / "gpt_oss"
    server = Server(model, "--chat-template", template, "--reasoning-parser", "gpt_oss", "--kv-cache-dtype", "f32")
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}):
            st, body, _ = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0, **extra})
            assert st == 200, body
            assert body["usage"]["prompt_tokens"] > 20 and body["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
        st, body, _ = server.post("/tokenize", {"messages": messages})
        assert st == 200
        text = reference_render(template.read_text(), messages, True)
        st2, want, _ = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert st2 == 200 and body["count"] == want["count"], (body["count"], want["count"])
    finally:
        server.stop()
