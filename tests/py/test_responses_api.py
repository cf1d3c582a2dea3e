"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) through the official `openai`
client's `responses.create` / `responses.retrieve`, on Qwen2.5-Coder 0.5B.

Expected values: the same conversation through /v1/chat/completions (greedy: the Responses API is a
translation onto the chat path), /tokenize for the token counts (a previous_response_id's conversation
counted as the chat messages it stands for), and the `openai` package's own event and response types
(pydantic models, validated) for every streamed event's shape."""
import json
import time

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from conftest import cached_model
from server_util import Server

MODEL = "qwen2.5-coder-0.5b-instruct"
SYSTEM = "You are a terse assistant."
ASK = "Write one sentence about the sea."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    s = Server(cached_model(MODEL), "--responses-store", 16, name=MODEL)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def tokens(server, messages):
    status, body, _ = server.post("/tokenize", {"messages": messages})
    assert status == 200, body
    return body["count"]


def test_reply_is_the_chat_reply_as_a_response(server, client):
    r = client.responses.create(model=MODEL, input=ASK, instructions=SYSTEM, max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                          messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    Response.model_validate(r.model_dump())
    assert r.object == "response" and r.model == MODEL and r.instructions == SYSTEM and r.store is True
    assert [o.type for o in r.output] == ["message"] and r.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert (r.status, finish) in (("completed", "stop"), ("incomplete", "length"))
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == tokens(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def raw_events(server, body):
    events = []
    for name, data in server.named_events("/v1/responses", body):
        assert name == data["type"]
        pydantic.TypeAdapter(ResponseStreamEvent).validate_python(data)  # the client's own event types
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_stream_events_in_order(server, client):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    events = raw_events(server, body)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if events[-1]["response"]["status"] == "completed" else "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 9
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    whole = client.responses.create(**body)
    assert text == whole.output_text == events[-4]["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert events[-1]["response"]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_tool_round_trip_with_previous_response_id(server, client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=64)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=40,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Sunny, 24 degrees."}])
    assert answer.output_text.strip() and answer.previous_response_id == first.id
    # The same turn with the whole history as input items gives the same answer.
    again = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=40, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 degrees."}])
    assert again.output_text == answer.output_text


def test_streamed_function_call(server, client):
    body = {"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required",
            "temperature": 0, "max_output_tokens": 64}
    events = raw_events(server, body)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    whole = client.responses.create(**body)
    call = [o for o in whole.output if o.type == "function_call"][0]
    assert len(done) == 1 and done[0]["arguments"] == args == call.arguments


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"sea": {"type": "string"}, "depth_m": {"type": "integer"}},
              "required": ["sea", "depth_m"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "sea", "schema": schema, "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"sea", "depth_m"} and isinstance(value["depth_m"], int)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_stored_conversation(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Reply with OK.", temperature=0,
                                    max_output_tokens=8, instructions=SYSTEM)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=8)
    # instructions are not carried over (OpenAI's rule); the first turn and its answer are.
    assert second.usage.input_tokens == tokens(server, [
        {"role": "user", "content": "My name is Ada. Reply with OK."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.status == first.status


def test_store_false_is_not_kept(client):
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=4)


def test_full_store_drops_the_oldest():
    s = Server(cached_model(MODEL), "--responses-store", 2, name=MODEL)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        ids = [client.responses.create(model=MODEL, input=f"Say {w}.", max_output_tokens=2).id
               for w in ("one", "two", "three")]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        with pytest.raises(openai.BadRequestError, match="keeps the newest 2"):
            client.responses.create(model=MODEL, input="x", previous_response_id=ids[0], max_output_tokens=2)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("body,status,param,message", [
    ({"input": "x", "previous_response_id": "resp-nope"}, 400, "previous_response_id", "is not stored"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, 400, "input",
     "which no function_call before it made"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, "input",
     "text content parts only"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, 400, "input", "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "function tools only"),
    ({"input": "x", "background": True}, 400, "background", "unknown field 'background'"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", "never cut"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text", "'text.format' must be"),
    ({"input": []}, 400, "input", "non-empty list"),
    ({"input": "y" * (10 << 20)}, 413, None, "exceeds"),
])
def test_refusals(server, body, status, param, message):
    st, reply, _ = server.post("/v1/responses", {"max_output_tokens": 4, **body})
    assert st == status and message in reply["error"]["message"], reply
    if param:
        assert reply["error"]["param"] == param
    assert server.get("/health")[0] == 200


def test_unknown_response_id_is_404(server):
    status, text = server.get("/v1/responses/resp-0000")
    assert status == 404 and json.loads(text)["error"]["code"] == "not_found"


def test_a_client_that_hangs_up_leaves_a_cancelled_response(server, client):
    sock = server.open_stream("/v1/responses", {"model": MODEL, "input": ASK, "stream": True, "max_output_tokens": 2000,
                                                "temperature": 0})
    seen = b""
    while b"response.output_text.delta" not in seen:
        seen += sock.recv(4096)
    response_id = json.loads(seen.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    sock.close()
    for _ in range(100):  # the server notices the hang-up at once; the store gets the response as it ends
        try:
            got = client.responses.retrieve(response_id)
            break
        except openai.NotFoundError:
            time.sleep(0.1)
    assert got.status == "cancelled" and got.usage.output_tokens < 2000
