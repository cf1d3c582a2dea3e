"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official `anthropic`
client, on Qwen2.5-Coder 0.5B.

Expected values: the same conversation through /v1/chat/completions (greedy, so the same tokens: the
Messages API is a translation onto the chat path), /tokenize for the token counts, the `anthropic`
package's own event and message types (pydantic models validated strictly), and the event shapes of
Anthropic's streaming documentation (docs.anthropic.com, "Streaming Messages": the basic example's
message_start ... message_stop, and the tool-use example's input_json_delta), written out below."""
import json

import anthropic
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from conftest import cached_model
from server_util import Server

MODEL = "qwen2.5-coder-0.5b-instruct"
KEY = "test-key-1"
SYSTEM = "You are a terse assistant."
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
# Today's `anthropic` client has no temperature argument (Anthropic's newer models fix it); Serval takes
# the field, sent as the older clients and other tools send it.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

# The documented events' keys (Anthropic's streaming documentation), by event type and block/delta type.
DOCUMENTED = {
    "message_start": {"type", "message"},
    "message": {"id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"},
    "content_block_start": {"type", "index", "content_block"},
    "content_block_delta": {"type", "index", "delta"},
    "content_block_stop": {"type", "index"},
    "message_delta": {"type", "delta", "usage"},
    "message_delta.delta": {"stop_reason", "stop_sequence"},
    "message_stop": {"type"},
    "ping": {"type"},
    "text": {"type", "text"},
    "text_delta": {"type", "text"},
    "tool_use": {"type", "id", "name", "input"},
    "input_json_delta": {"type", "partial_json"},
}


@pytest.fixture(scope="module")
def server():
    s = Server(cached_model(MODEL), "--api-key", KEY, name=MODEL)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def count(server, messages, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + messages
    status, body, _ = server.post("/tokenize", {"messages": msgs}, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, body
    return body["count"]


def test_reply_is_the_chat_reply_with_anthropics_fields(server, claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=HELLO, extra_body=GREEDY)
    chat = oai.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}] + HELLO)
    Message.model_validate(m.model_dump(), strict=True)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(server, HELLO, SYSTEM)


def via_client(claude, body):
    """A raw body through the client: today's `anthropic` takes sampling fields only in extra_body."""
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    return claude.messages.create(**{k: v for k, v in body.items() if k not in sampling}, extra_body=sampling)


def raw_events(server, body):
    return server.named_events("/v1/messages", body, {"x-api-key": KEY})


def check_documented_shape(name, data):
    assert data["type"] == name and set(data) == DOCUMENTED[name], (name, data)
    if name == "message_start":
        assert set(data["message"]) == DOCUMENTED["message"]
    if name == "content_block_start":
        assert set(data["content_block"]) == DOCUMENTED[data["content_block"]["type"]]
    if name == "content_block_delta":
        assert set(data["delta"]) == DOCUMENTED[data["delta"]["type"]]
    if name == "message_delta":
        assert set(data["delta"]) == DOCUMENTED["message_delta.delta"]
    if name != "ping":  # documented, but not one of the client's message event types
        pydantic.TypeAdapter(RawMessageStreamEvent).validate_python(data, strict=True)


def test_stream_events_in_order_and_documented_shape(server, claude):
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "system": SYSTEM, "messages": HELLO}
    events = raw_events(server, body)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"} and len(names) > 7  # streamed, not one piece
    for name, data in events:
        check_documented_shape(name, data)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    whole = via_client(claude, body)
    assert text == whole.content[0].text
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason


def test_client_stream_helper_accumulates_the_same_message(claude):
    body = dict(model=MODEL, max_tokens=20, messages=HELLO, extra_body=GREEDY)
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == claude.messages.create(**body).content[0].text


def test_tool_round_trip(server, claude):
    first = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert first.stop_reason == "tool_use"
    call = [b for b in first.content if b.type == "tool_use"]
    assert len(call) == 1 and call[0].name == "get_weather" and isinstance(call[0].input.get("city"), str)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call[0].id,
                                             "content": "Sunny, 24 degrees."}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER], messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()


def test_streamed_tool_use_as_documented(server, claude):
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "tools": [WEATHER],
            "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    events = raw_events(server, body)
    for name, data in events:
        check_documented_shape(name, data)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    whole = via_client(claude, body)
    assert json.loads(partial) == [b for b in whole.content if b.type == "tool_use"][0].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stop_sequence(claude):
    body = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    text = claude.messages.create(**body).content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = " " + words[2]
    m = claude.messages.create(**body, stop_sequences=["@@never@@", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_output_config_format_is_enforced(claude):
    schema = {"type": "object", "properties": {"sea": {"type": "string"}, "depth_m": {"type": "integer"}},
              "required": ["sea", "depth_m"], "additionalProperties": False}
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=HELLO, extra_body=GREEDY, cache_control={"type": "ephemeral"},
                               output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "max"})
    value = json.loads(m.content[0].text)
    assert set(value) == {"sea", "depth_m"} and isinstance(value["depth_m"], int), value


def test_count_tokens_is_tokenize(server, claude):
    r = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO)
    assert r.input_tokens == count(server, HELLO, SYSTEM)
    with_tools = claude.messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > count(server, HELLO)  # the tools are rendered into the prompt


@pytest.mark.parametrize("body,status,message", [
    ({"messages": HELLO}, 400, "'max_tokens' is required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "cannot hold a 'image' block"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope",
                                                                   "content": "x"}]}]}, 400,
     "no earlier tool_use block has"),
    ({"max_tokens": 8, "messages": HELLO + [{"role": "assistant", "content": "The sea"}]}, 400, "prefill"),
    ({"max_tokens": 8, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "custom tools only"),
    ({"max_tokens": 8, "messages": HELLO, "container": "c1"}, 400, "unknown field 'container'"),
    ({"max_tokens": 8, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 10}}, 400,
     "budget_tokens"),
    ({"max_tokens": 8, "messages": HELLO, "tools": [WEATHER],
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, 400, "must be a boolean"),
    ({"max_tokens": 8, "messages": HELLO, "tools": [{"name": "f", "input_schema": "not a schema"}]}, 400, "must be a JSON schema object"),
    ({"model": "claude-opus-4", "max_tokens": 8, "messages": HELLO}, 404, "does not exist"),
    ({"max_tokens": 8, "messages": HELLO, "x": "y" * (10 << 20)}, 413, "exceeds"),
])
def test_refusals_in_anthropics_error_shape(server, claude, body, status, message):
    st, reply, _ = server.post("/v1/messages", body, headers={"x-api-key": KEY})
    assert st == status and reply["type"] == "error", reply
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}[status]
    assert reply["error"]["type"] == kind and message in reply["error"]["message"], reply
    assert server.get("/health")[0] == 200  # still serving


def test_client_raises_its_own_errors(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="no earlier tool_use"):
        right.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}])
