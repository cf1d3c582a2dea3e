"""Every request field either works as OpenAI documents it or is a 400 naming it: `echo`, `suffix`
(fill in the middle), `usage.prompt_tokens_details.cached_tokens`, `user`, `metadata`, `best_of`, and
the fields Serval does not implement, against a real server with the official openai client."""
import openai
import pytest

from conftest import DEFAULT_MODEL, MODELS
from server_util import Server

MODEL = DEFAULT_MODEL  # the conftest `server` and `client` fixtures serve it
STORIES = MODELS / "stories260K.gguf"


def refused(call, param, *needles):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    assert err["param"] == param, err
    for n in needles:
        assert n in err["message"], err
    return err["message"]


def test_echo_puts_the_prompt_before_the_completion(client):
    prompt = "def add(a, b):\n"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echo.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[750, 912], max_tokens=4, temperature=0, echo=True)
    assert ids.choices[0].text.startswith("def add"), "token ids echo as their text"
    refused(lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                              suffix="x"), "echo", "'echo' with 'logprobs' and 'suffix'")


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """Each prompt token's log-probability equals the one reported when that token is generated after the
    same prefix (forced with logit_bias; the reported log-probability is the unbiased one)."""
    prompt = "def add(a, b):\n    return a + b"
    ids = server.post("/tokenize", {"prompt": prompt})[1]["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    for k in range(1, len(ids)):
        forced = client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1, temperature=0, logprobs=0,
                                           logit_bias={str(ids[k]): 100})
        assert forced.choices[0].logprobs.tokens[0] == lp.tokens[k]
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[k], abs=2e-3), k
        assert 1 <= len(lp.top_logprobs[k]) <= 2
    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True) if c.choices]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:])
    # Prompt log-probabilities are computed, never taken from the prefix cache: asking twice gives them again.
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_suffix_fills_in_the_middle(client, server):
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    fim = client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=8, temperature=0)
    # The oracle: the same prompt in the model's FIM form, written out with its special tokens.
    raw = client.completions.create(model=MODEL, prompt=f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
                                    max_tokens=8, temperature=0)
    assert fim.choices[0].text == raw.choices[0].text
    assert "a + b" in fim.choices[0].text, fim.choices[0].text
    assert fim.usage.prompt_tokens == raw.usage.prompt_tokens
    plain = client.completions.create(model=MODEL, prompt=prefix, max_tokens=1, temperature=0)
    suffix_tokens = server.post("/tokenize", {"prompt": suffix, "add_special_tokens": False})[1]["tokens"]
    assert fim.usage.prompt_tokens == plain.usage.prompt_tokens + len(suffix_tokens) + 3
    refused(lambda: client.completions.create(model=MODEL, prompt=prefix, extra_body={"suffix": 3}), "suffix",
            "'suffix' must be a string")


def test_suffix_without_fim_tokens_is_refused():
    s = Server(STORIES)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        refused(lambda: c.completions.create(model="stories260K", prompt="Once", suffix="end", max_tokens=2), "suffix",
                "fill-in-the-middle tokens", "this one has none")
    finally:
        assert s.stop() == 0


def test_cached_tokens_count_the_prefix_cache_hit(client):
    text = "Summarise this list of numbers: " + ", ".join(str(i) for i in range(150))
    messages = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 300
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Full blocks of 16 only, and at least one token is computed again for its logits.
    assert cached % 16 == 0 and n - 16 <= cached < n, (cached, n)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][0]
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_openai_fields_that_work_as_documented(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=0, user="user-1234",
        metadata={"team": "serving", "run": "7"}, store=False, service_tier="auto", modalities=["text"],
        parallel_tool_calls=True, tool_choice="none", response_format={"type": "text"}, prompt_cache_key="k1",
        safety_identifier="s1")
    assert r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="x =", max_tokens=2, user="u", best_of=1, n=1)
    assert len(c.choices) == 1
    assert len(client.completions.create(model=MODEL, prompt="x =", max_tokens=2, best_of=2, n=2).choices) == 2


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("extra, param, message", [
    ({"store": True}, "store", "this server stores no completions"),
    ({"response_format": {"type": "xml"}}, "response_format", "type 'xml' is not supported"),
    ({"response_format": "json"}, "response_format", "must be an object with a string 'type'"),
    ({"tool_choice": "required"}, "tool_choice", "needs a non-empty 'tools'"),
    # a "type" that is not a string (the fuzzer's find: it escaped as a JSON library exception)
    ({"tools": [{"type": {"f": 1}, "function": {"name": "f"}}]}, "tools", "each tool must be"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": [1], "function": {"name": "f"}}},
     "tool_choice", "'tool_choice' must be"),
    ({"service_tier": "flex"}, "service_tier", "'auto' or 'default'"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "is not supported by this server"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "one of none, minimal, low, medium, high"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "cannot set 'messages'"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "is not supported by this server"),
    ({"functions": [{"name": "f"}]}, "functions", "is not supported by this server"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"metadata": {"k": 1}}, "metadata", "values strings"),
    ({"user": 5}, "user", "must be a string"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ({"echo": True}, "echo", "unknown field 'echo' for /v1/chat/completions"),
    ({"n_predict": 5}, "n_predict", "unknown field 'n_predict'"),
])
def test_fields_not_implemented_are_400s_naming_them(server, extra, param, message):
    status, body, _ = server.post("/v1/chat/completions", {**CHAT, **extra})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and message in err["message"], err


@pytest.mark.parametrize("extra, param, message", [
    ({"best_of": 3, "n": 2}, "best_of", "best_of greater than n is not supported"),
    ({"best_of": 1, "n": 2}, "best_of", "best_of must be at least n (2), got 1"),
    ({"messages": []}, "messages", "unknown field 'messages' for /v1/completions"),
    ({"tools": []}, "tools", "unknown field 'tools'"),
    ({"cache_prompt": True}, "cache_prompt", "unknown field 'cache_prompt'"),
])
def test_completion_fields_not_implemented_are_400s_naming_them(server, extra, param, message):
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and message in err["message"], err
