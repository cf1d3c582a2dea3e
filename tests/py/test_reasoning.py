"""Reasoning output: `serve --reasoning-parser deepseek_r1|qwen3` (llama.cpp's `--reasoning-format`) puts a
model's thinking in `message.reasoning_content` / `delta.reasoning_content` and the answer in `content`;
`chat_template_kwargs` and `reasoning_effort` reach the chat template. Through the official `openai` client.

Expected values come from the same server run without a parser: a regular expression (structured
output) makes Qwen2.5-Coder write `<think>...</think>` and an answer, and the raw text a parser-less server
returns for the same greedy request is split here by the formats' rule; stories260K with a template that
pre-fills `<think>` gives the thinking-only case, checked against the raw completion of the same prompt
tokens. The parser's every split point is tested in tests/unit/test_reasoning.cpp."""
import re

import openai
import pytest

from conftest import MODELS, cached_model, run
from server_util import Server

QWEN = "qwen2.5-coder-0.5b-instruct"
STORIES = MODELS / "stories260K.gguf"
FORCED = {"structured_outputs": {"regex": r"<think>\nI will greet [a-z ]{4,40}\n</think>\n\n[A-Z][a-z ]{4,40}"}}
MESSAGES = [{"role": "user", "content": "Think first, then say hello."}]


def client_for(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def qwen_servers():
    plain = Server(cached_model(QWEN), name=QWEN)
    parsed = Server(cached_model(QWEN), "--reasoning-parser", "qwen3", name=QWEN)
    yield client_for(plain), client_for(parsed)
    assert plain.stop() == 0 and parsed.stop() == 0


def ask(client, **kw):
    return client.chat.completions.create(model=QWEN, messages=MESSAGES, max_tokens=60, temperature=0,
                                          extra_body=FORCED, **kw)


def test_forced_thinking_is_split_from_the_answer(qwen_servers):
    plain, parsed = qwen_servers
    raw = ask(plain).choices[0].message
    m = re.fullmatch(r"<think>\n(.*)\n</think>\n\n(.*)", raw.content, re.S)
    assert m, raw.content
    assert raw.model_extra.get("reasoning_content") is None  # no parser: no field, the tags stay in content
    r = ask(parsed)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == m.group(1).strip()
    assert msg.content == m.group(2)
    assert r.choices[0].finish_reason == "stop"


def test_streamed_thinking_comes_first_and_adds_up(qwen_servers):
    plain, parsed = qwen_servers
    expected = ask(parsed).choices[0].message
    thinking, answer, order = "", "", []
    for chunk in ask(parsed, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.model_extra.get("reasoning_content"):
            thinking += d.model_extra["reasoning_content"]
            order.append("r")
        if d.content:
            answer += d.content
            order.append("c")
    assert thinking == expected.model_extra["reasoning_content"] and answer == expected.content
    assert "r" in order and "c" in order and "".join(order).find("cr") < 0  # no thinking after the answer began
    assert len([x for x in order if x == "r"]) > 1  # streamed as it came, not in one piece


def test_tool_calls_are_parsed_from_the_answer_only(qwen_servers):
    _, parsed = qwen_servers
    tools = [{"type": "function", "function": {"name": "greet", "parameters": {"type": "object", "properties": {}}}}]
    # The thinking mentions a call's markup; the answer has none: no call is made of the thinking.
    body = {"structured_outputs": {"regex": r"<think>\n<tool_call>\n</think>\n\nHello there"}}
    r = parsed.chat.completions.create(model=QWEN, messages=MESSAGES, max_tokens=40, temperature=0, tools=tools,
                                       extra_body=body)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "<tool_call>"
    assert msg.content == "Hello there" and not msg.tool_calls and r.choices[0].finish_reason == "stop"


# stories260K behind a template that pre-fills <think> unless chat_template_kwargs turns thinking off, and
# that writes the request's reasoning_effort into the prompt.
PREFILL = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
           "{% if reasoning_effort is defined %} effort {{ reasoning_effort }}{% endif %}"
           "{% if add_generation_prompt and (enable_thinking is not defined or enable_thinking) %}<think>\n{% endif %}")


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    template = tmp_path_factory.mktemp("reasoning") / "prefill.jinja"
    template.write_text(PREFILL)
    qwen3 = Server(STORIES, "--chat-template", template, "--reasoning-format", "auto")
    r1 = Server(STORIES, "--chat-template", template, "--reasoning-parser", "deepseek_r1")
    yield qwen3, r1
    assert qwen3.stop() == 0 and r1.stop() == 0


def raw_completion(server, body):
    """The parser-less truth: the same prompt tokens through /v1/completions."""
    status, tokens, _ = server.post("/tokenize", {"messages": body["messages"], **{k: body[k] for k in body if k in
                                                   ("chat_template_kwargs", "reasoning_effort")}})
    assert status == 200, tokens
    status, out, _ = server.post("/v1/completions", {"prompt": tokens["tokens"], "max_tokens": body["max_tokens"],
                                                     "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["text"]


STORY = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 24, "temperature": 0}


@pytest.mark.parametrize("which", [0, 1], ids=["qwen3-prefilled", "deepseek_r1"])
def test_thinking_without_its_closing_tag_is_all_thinking(stories, which):
    server = stories[which]
    status, r, _ = server.post("/v1/chat/completions", STORY)
    assert status == 200, r
    msg = r["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] == raw_completion(server, STORY).lstrip()
    assert r["choices"][0]["finish_reason"] == "length"


def test_chat_template_kwargs_turn_the_prefill_off(stories):
    qwen3, r1 = stories
    body = {**STORY, "chat_template_kwargs": {"enable_thinking": False}}
    status, r, _ = qwen3.post("/v1/chat/completions", body)
    msg = r["choices"][0]["message"]
    # qwen3's rule: the prompt no longer opens <think>, the output does not either: all answer.
    assert status == 200 and msg["reasoning_content"] is None and msg["content"] == raw_completion(qwen3, body)
    # deepseek_r1's rule: the output always starts in the thinking.
    status, r, _ = r1.post("/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["message"]["content"] is None


def test_reasoning_effort_reaches_the_template(stories):
    qwen3, _ = stories
    status, tokens, _ = qwen3.post("/tokenize", {"messages": STORY["messages"], "reasoning_effort": "high"})
    assert status == 200
    status, text, _ = qwen3.post("/detokenize", {"tokens": tokens["tokens"]})
    assert "Once upon a time effort high<think>" in text["prompt"], text
    status, r, _ = qwen3.post("/v1/chat/completions", {**STORY, "reasoning_effort": "ultra"})
    assert status == 400 and r["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("name,message", [("granite", "one of deepseek_r1, qwen3, gpt_oss"),
                                          ("deepseek_v3", "one of deepseek_r1, qwen3, gpt_oss")])
def test_unknown_parser_is_refused_at_startup(name, message):
    p = run("serve", STORIES, "--reasoning-parser", name, check=False, timeout=60)
    assert p.returncode != 0 and message in p.stderr, p.stderr


def test_messages_api_gives_the_thinking_as_a_thinking_block(stories):
    _, r1 = stories
    status, chat, _ = r1.post("/v1/chat/completions", STORY)
    status, m, _ = r1.post("/v1/messages", {"max_tokens": STORY["max_tokens"], "temperature": 0,
                                            "messages": STORY["messages"]})
    assert status == 200, m
    assert m["content"] == [{"type": "thinking", "thinking": chat["choices"][0]["message"]["reasoning_content"],
                             "signature": ""}]
    assert m["stop_reason"] == "max_tokens"


def test_responses_api_gives_the_thinking_as_a_reasoning_item(stories):
    _, r1 = stories
    status, chat, _ = r1.post("/v1/chat/completions", STORY)
    status, r, _ = r1.post("/v1/responses", {"max_output_tokens": STORY["max_tokens"], "temperature": 0,
                                             "input": STORY["messages"]})
    assert status == 200, r
    assert [o["type"] for o in r["output"]] == ["reasoning"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text",
                                          "text": chat["choices"][0]["message"]["reasoning_content"]}]
    assert r["status"] == "incomplete" and r["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
