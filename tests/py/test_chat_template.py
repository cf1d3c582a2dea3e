"""Serval's Jinja engine against the reference Jinja2 (PyPI), rendering real chat templates the way
transformers does (trim_blocks, lstrip_blocks, raise_exception, tojson), plus known renderings."""
import json
import pathlib

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conftest import ROOT, run

TEMPLATES = sorted((ROOT / "tests" / "data" / "chat_templates").glob("*.jinja"))

CONVERSATIONS = {
    "full": [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"},
             {"role": "assistant", "content": "   I am an assistant   "}, {"role": "user", "content": "Another question"}],
    "single": [{"role": "user", "content": "How are you?"}],
    "unicode": [{"role": "user", "content": "Grüße, 世界! 🦙\n\nTwo lines\twith tabs"}],
    "no-system-multi": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}],
}


def reference_render(source, messages, add_generation_prompt=True, **extra):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token="<s>", eos_token="</s>", **extra)


def serval_render(path, messages, add_generation_prompt=True):
    args = ["chat-template", "--template", path, "--messages", json.dumps(messages), "--bos", "<s>", "--eos", "</s>"]
    if not add_generation_prompt:
        args.append("--no-generation-prompt")
    return run(*args, check=False)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
@pytest.mark.parametrize("conv", list(CONVERSATIONS), ids=str)
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_matches_jinja2(template, conv, gen):
    messages = CONVERSATIONS[conv]
    try:
        expected = reference_render(template.read_text(), messages, gen)
    except jinja2.exceptions.TemplateError as e:
        p = serval_render(template, messages, gen)
        assert p.returncode == 1 and "raised" in p.stderr, f"Jinja2 raised {e}; Serval must too"
        return
    p = serval_render(template, messages, gen)
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected


# qwen2.5-coder-1.5b (the template in the GGUF file scripts/setup fetches) writes "{{\"name\": ...}}"
# inside a string in a {{- ... }} tag: the tag ends at the "}}" outside the string.
@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-coder-1.5b"])
def test_qwen_template_with_tools_matches_jinja2(name):
    source = (ROOT / "tests" / "data" / "chat_templates" / f"{name}.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    expected = reference_render(source, messages, True, tools=tools)
    # Serval's chat-template command has no --tools; render through a template that sets them.
    wrapper = "{% set tools = " + json.dumps(tools) + " %}" + source
    path = ROOT / "build" / f"{name}-tools.jinja"
    path.write_text(wrapper)
    assert serval_render(path, messages).stdout == expected


KNOWN = {  # formats documented by the model makers
    "chatml": "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    "qwen2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma3": "<s><start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
    "mistral-v1": "<s> [INST] How are you? [/INST]",
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_renderings(name):
    path = ROOT / "tests" / "data" / "chat_templates" / f"{name}.jinja"
    assert serval_render(path, CONVERSATIONS["single"]).stdout == KNOWN[name]


def test_unsupported_template_is_a_clear_error(tmp_path):
    bad = tmp_path / "include.jinja"
    bad.write_text("{% include 'other.jinja' %}hi")
    p = serval_render(bad, CONVERSATIONS["single"])
    assert p.returncode == 1
    assert "unsupported statement" in p.stderr
