"""Structured output and tool calls against a real server with the official openai client: every
json_object / json_schema response parses and validates (Python `jsonschema`, an independent
validator) over a suite of schemas x prompts; regex, choice and GBNF outputs match (Python `re`);
tool calls round-trip through the client's types, streaming and not; unsupported schemas and bad
grammars are 400s naming the field."""
import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from conftest import DATA, DEFAULT_MODEL

MODEL = DEFAULT_MODEL
SCHEMAS = json.loads((DATA / "structured_schemas.json").read_text())


def prompts_for(name, schema):
    return [
        [{"role": "system", "content": "You reply with JSON only."},
         {"role": "user", "content": f"Give one example value valid under this JSON schema:\n{json.dumps(schema)}"}],
        [{"role": "user", "content": f"Invent realistic sample data called '{name}'. Keep it short."}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello! Who are you?"}],
    ]


def validate(schema, text):
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return value


def refs(node):
    """The $defs names a schema (or part of one) refers to."""
    if isinstance(node, dict):
        own = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(refs(v) for k, v in node.items() if k != "$defs"))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def recursive(schema):
    """Whether a $defs entry reaches itself through $refs (a document of any depth is valid)."""
    defs = schema.get("$defs", {})
    for start in defs:
        seen, todo = set(), list(refs(defs[start]))
        while todo:
            name = todo.pop()
            if name == start:
                return True
            if name not in seen and name in defs:
                seen.add(name)
                todo.extend(refs(defs[name]))
    return False


def is_json_prefix(text):
    """Whether `text` is the start of a JSON document: the parser only runs out of input (at its
    end, or in a string it never saw closed), never meets a wrong character."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string"):
            return is_json_prefix(text[:e.pos] + '""')
        return e.pos >= len(text.rstrip())


def ask_schema(client, name, schema, messages):
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    return name, schema, r.choices[0]


def test_json_schema_suite_always_validates(client):
    assert len(SCHEMAS) >= 30
    jobs = [(n, s, m) for n, s in SCHEMAS.items() for m in prompts_for(n, s)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # constrained requests share batches
        results = list(pool.map(lambda j: ask_schema(client, *j), jobs))
    failures = []
    assert recursive(SCHEMAS["recursive_tree"]) and not recursive(SCHEMAS["defs_ref"])
    assert is_json_prefix('{"value": 4, "children": [{"val') and is_json_prefix('{"a": [1, {"b": "x')
    assert not is_json_prefix('{"value": 4, "children": x') and not is_json_prefix('{"a": 1}}')
    for name, schema, choice in results:
        try:
            if choice.finish_reason == "length" and recursive(schema):
                # A recursive schema lets a greedy model nest without end (as it would under
                # llama.cpp's or vLLM's grammars): the reply then stops at max_tokens, and what
                # it holds so far must be the start of a document (the grammar never let it stray).
                assert is_json_prefix(choice.message.content), "not the start of a JSON document"
                continue
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            validate(schema, choice.message.content)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {e}\n  output: {choice.message.content!r}")
    assert not failures, "\n".join(failures)


def test_json_object_mode_parses_streaming_and_not(client):
    for prompt in ["Describe a cat as JSON.", "List three fruits.", "What is 2+2?"]:
        msgs = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0,
                                                response_format={"type": "json_object"}, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == r.choices[0].message.content


def test_completions_endpoint_takes_json_schema_and_sampling(client):
    schema = SCHEMAS["person"]
    for seed in range(4):  # sampled, not greedy: the mask holds for any draw
        r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=80, temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
        validate(schema, r.choices[0].text)


REGEXES = [r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]+ [A-Z][a-z]+", r"0x[0-9a-f]{2,8}", r"(\w{1,12}@[a-z]{1,10}\.com)",
           r"v\d+\.\d+\.\d+"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(client, pattern):
    for field in ["guided_regex", "structured_outputs"]:
        body = {field: pattern} if field == "guided_regex" else {field: {"regex": pattern}}
        r = client.completions.create(model=MODEL, prompt="Example:", max_tokens=40, temperature=0.7, seed=1,
                                      extra_body=body)
        assert re.fullmatch(pattern, r.choices[0].text), (pattern, r.choices[0].text)


def test_choice_and_gbnf_outputs_match(client):
    choices = ["positive", "negative", "neutral"]
    for body in [{"guided_choice": choices}, {"structured_outputs": {"choice": choices}}]:
        r = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0, extra_body=body,
                                           messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}])
        assert r.choices[0].message.content in choices
    gbnf = 'root ::= "(" [0-9]{3} ") " [0-9]{3} "-" [0-9]{4}'
    for body in [{"grammar": gbnf}, {"guided_grammar": gbnf}, {"structured_outputs": {"grammar": gbnf}}]:
        r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=30, temperature=0.8, seed=3,
                                      extra_body=body)
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].text), r.choices[0].text


def test_llama_server_json_schema_field(client):
    schema = SCHEMAS["book"]
    r = client.completions.create(model=MODEL, prompt="A famous book as JSON:", max_tokens=200, temperature=0,
                                  extra_body={"json_schema": schema})
    validate(schema, r.choices[0].text)


def bad(call, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    assert needle in e.value.body["message"], e.value.body


def test_refusals_name_the_field(client):
    msgs = [{"role": "user", "content": "hi"}]
    chat = lambda **kw: client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, **kw)
    bad(lambda: chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), "response_format", "uniqueItems")
    bad(lambda: chat(response_format={"type": "grammar"}), "response_format", "not supported")
    bad(lambda: chat(extra_body={"grammar": "root ::= undefined-rule"}), "grammar", "never defined")
    bad(lambda: chat(extra_body={"guided_regex": "(a)\\1"}), "guided_regex", "")
    bad(lambda: chat(extra_body={"guided_choice": []}), "guided_choice", "list of 1 to 1024")
    bad(lambda: chat(extra_body={"grammar": 'root ::= "a"', "guided_regex": "b"}), "grammar", "send one")
    bad(lambda: chat(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs",
        "exactly one")
    bad(lambda: chat(extra_body={"guided_whitespace_pattern": " *"}), "guided_whitespace_pattern", "not supported")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def check_call(call, tools):
    fn = {t["function"]["name"]: t["function"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in fn
    jsonschema.validate(json.loads(call.function.arguments), fn[call.function.name]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_round_trip(client, tool_choice):
    tools = [WEATHER, CLOCK]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                       max_tokens=120, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    for call in msg.tool_calls:
        check_call(call, tools)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    # Streamed: the client's chunks reassemble into the same call.
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                            max_tokens=120, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]


def test_tool_result_flows_back_and_auto_choice(client):
    tools = [WEATHER]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert msg.content or msg.tool_calls
    for c in msg.tool_calls or []:
        check_call(c, tools)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="none",
                                          max_tokens=30, temperature=0)
    assert none.choices[0].message.tool_calls is None
    bad(lambda: client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=5, tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", "nope")
    bad(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tool_choice="required"),
        "tool_choice", "needs a non-empty 'tools'")


def test_streamed_tool_calls_keep_their_logprobs(client):
    """Text held back as a possible call still sends each token's log-probability as it comes."""
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0, stream=True, logprobs=True,
                                            stream_options={"include_usage": True})
    n_logprobs, usage = 0, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            n_logprobs += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    assert usage and n_logprobs == usage.completion_tokens
