"""Black-box tests of `serval serve` with the official openai client, curl and raw HTTP."""
import concurrent.futures
import json
import signal
import socket
import subprocess
import time

import openai
import pytest

from conftest import DEFAULT_MODEL

MODEL = DEFAULT_MODEL  # the conftest `server` and `client` fixtures serve it


def stream_text(stream):
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += (c.text if hasattr(c, "text") and c.text else "") or ""
            if getattr(c, "delta", None) and c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    return text, finish, usage, chunks


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith(" Paris")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 13


def test_completion_stream_equals_non_stream(client, server):
    args = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    text, finish, usage, chunks = stream_text(client.completions.create(**args, stream=True,
                                                                          stream_options={"include_usage": True}))
    assert text == whole
    assert finish == "length"
    _, tokens, _ = server.post("/tokenize", {"prompt": "def fibonacci(n):"})
    assert usage.completion_tokens == 24 and usage.prompt_tokens == tokens["count"]
    assert chunks > 10


def test_chat_and_chat_stream(client):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # ended by <|im_end|>
    text, finish, usage, _ = stream_text(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert text == r.choices[0].message.content
    assert finish == "stop"
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the top one
        assert value <= 0
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)


def test_stop_strings_across_token_boundaries(client):
    base = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=40, temperature=0).choices[0].text
    # A stop string that starts inside one token and ends in another.
    idx = base.index("return")
    stop = base[idx + 2: idx + 9]
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    text, finish, _, _ = stream_text(client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=40,
                                                               temperature=0, stop=stop, stream=True))
    assert text == base[: base.index(stop)] and finish == "stop"


def test_n_choices_and_seed_reproducibility(client):
    # ignore_eos: every choice runs to max_tokens, so the usage is known whatever the draw (a sampled
    # end of text would otherwise stop a choice early and change the sum).
    args = dict(model=MODEL, prompt="Write a word:", max_tokens=12, temperature=1.0, seed=1234, n=3,
                extra_body={"ignore_eos": True})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert [c.finish_reason for c in a.choices] == ["length"] * 3
    assert a.usage.completion_tokens == 3 * 12
    other = client.completions.create(**{**args, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, world! Grüße 🦙"
    status, t, _ = server.post("/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200 and t["count"] == len(t["tokens"]) > 0
    status, d, _ = server.post("/detokenize", {"model": MODEL, "tokens": t["tokens"]})
    assert status == 200 and d["prompt"] == text


def test_curl_completion_and_stream(server):
    out = subprocess.run(["curl", "-s", server.url + "/v1/completions", "-H", "Content-Type: application/json", "-d",
                          json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})],
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout)["choices"][0]["text"].startswith(" Paris")
    out = subprocess.run(["curl", "-sN", server.url + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
                          json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})],
                         capture_output=True, text=True, timeout=120)
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_32_concurrent_streams_equal_alone(client):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]

    def one(i):
        args = dict(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0.8 if i % 2 else 0, seed=i)
        text, finish, usage, _ = stream_text(client.completions.create(**args, stream=True,
                                                                        stream_options={"include_usage": True}))
        return text, finish, usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one, range(32)))
    alone = [one(i) for i in range(32)]  # the same requests, one at a time
    for i in range(32):
        assert together[i] == alone[i], f"request {i}"
    assert all(t[1] in ("stop", "length") for t in together)


def test_metrics_have_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    _, text = server.get("/metrics")
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "request_success_total"]:
        assert f"serval:{name}" in text, name
    assert server.metric("serval:time_to_first_token_seconds_count") >= 1
    assert server.metric("serval:generation_tokens_total") >= 2


def test_prefix_cache_hits_on_repeated_prompt(server, client):
    prompt = "You are a careful assistant. " * 20 + "Question: what is 2 + 2?"
    before = server.metric("serval:prefix_cache_hits_total")
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert server.metric("serval:prefix_cache_hits_total") - before >= 16 * 5


def test_client_disconnect_aborts_and_frees_kv(server):
    def aborted():
        _, text = server.get("/metrics")
        line = next(l for l in text.splitlines() if 'finished_reason="abort"' in l)
        return float(line.rsplit(" ", 1)[1])

    aborted_before = aborted()
    sock = server.open_stream("/v1/completions", {"prompt": "Tell me a very long story.", "max_tokens": 2000,
                                                  "stream": True, "ignore_eos": True})
    data = b""
    while data.count(b"data: ") < 3:
        data += sock.recv(4096)
    assert server.metric("serval:kv_cache_usage_perc") > 0
    sock.close()
    deadline = time.time() + 20
    while time.time() < deadline and server.metric("serval:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    assert server.metric("serval:kv_cache_usage_perc") == 0
    assert aborted() == aborted_before + 1


def test_logit_bias_forces_a_token(client, server):
    _, t, _ = server.post("/tokenize", {"prompt": " banana", "add_special_tokens": False})
    assert len(t["tokens"]) == 1
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logit_bias={str(t["tokens"][0]): 100})
    assert r.choices[0].text == " banana" * 3


def test_parameter_boundaries_are_inclusive(server, client):
    """The last accepted value of each bounded field is accepted, the next one refused (a 400 naming it)."""
    base = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 1, "temperature": 0}
    status, body, _ = server.post("/v1/completions", {**base, "n": 16})
    assert status == 200 and len(body["choices"]) == 16
    status, body, _ = server.post("/v1/completions", {**base, "n": 17})
    assert status == 400 and body["error"]["param"] == "n"
    status, body, _ = server.post("/v1/completions", {**base, "speculative": {"draft_max": 64}})
    assert status == 200, body
    status, body, _ = server.post("/v1/completions", {**base, "speculative": {"draft_max": 65}})
    assert status == 400 and body["error"]["param"] == "speculative"


def test_null_content_and_logprobs_without_top(server, client):
    # An assistant turn with "content": null (as after a tool call) is a valid message.
    msgs = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": None},
            {"role": "user", "content": "Again."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
    assert r.choices[0].message.content
    # logprobs without top_logprobs: the chosen tokens' log-probabilities and no alternatives.
    r = client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=3, temperature=0, logprobs=True)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 3 and all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)


def test_content_parts_are_joined_and_non_text_parts_refused(server, client):
    parts = [{"type": "text", "text": "What is 2 + 2?"}, {"type": "text", "text": "Answer with a number."}]
    as_parts = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": parts}])
    as_text = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "What is 2 + 2?\nAnswer with a number."}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    status, body, _ = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert status == 400 and "only text parts" in body["error"]["message"]
    status, body, _ = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "video", "text": "a text field on a part that is not text"}]}]})
    assert status == 400 and "only text parts" in body["error"]["message"]


def test_unknown_model_is_a_404_naming_both(server, client):
    status, body, _ = server.post("/v1/completions", {"model": "gpt-9", "prompt": "x", "max_tokens": 1})
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert body["error"]["message"] == f"The model 'gpt-9' does not exist; this server serves '{MODEL}'"


def test_stop_token_ids_stop_and_bad_ones_are_refused(server, client):
    base = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0}
    status, plain, _ = server.post("/v1/completions", base)
    assert status == 200 and plain["choices"][0]["finish_reason"] == "length"
    _, tok, _ = server.post("/tokenize", {"model": MODEL, "prompt": plain["choices"][0]["text"],
                                          "add_special_tokens": False})
    stop_id = tok["tokens"][2]
    status, body, _ = server.post("/v1/completions", {**base, "stop_token_ids": [stop_id]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] <= 3
    # Every id of the list counts, not only the first.
    never = tok["tokens"][0] + 1 if tok["tokens"][0] + 1 not in tok["tokens"] else 0
    status, body, _ = server.post("/v1/completions", {**base, "stop_token_ids": [never, stop_id]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] <= 3
    for bad in ["x", [-1], list(range(65)), [stop_id, 10**9]]:
        status, body, _ = server.post("/v1/completions", {**base, "stop_token_ids": bad})
        assert status == 400 and body["error"]["param"] == "stop_token_ids", (bad, body)


def test_empty_prompt_and_overflowing_numbers_are_400s(server):
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"] == "'prompt' must not be empty"
    # JSON has no infinity: a number too large for a double is refused by the parser itself.
    raw = b'{"model": "%s", "prompt": "x", "max_tokens": 1, "temperature": 1e999}' % MODEL.encode()
    status, body, _ = server.post("/v1/completions", raw, raw=True)
    assert status == 400 and "number overflow" in body["error"]["message"]


@pytest.mark.parametrize("stop", [["a", 5], 7, ["x"] * 17, {"a": 1}])
def test_bad_stop_is_a_400_naming_it(server, stop):
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "stop": stop})
    assert status == 400 and body["error"]["param"] == "stop"
    assert body["error"]["message"] == "'stop' must be a string or a list of at most 16 strings"


def test_request_shape_errors_say_what_is_wrong(server):
    # The body must be an object; `model`, if given, a string; `stop: null` means no stop strings.
    status, body, _ = server.post("/v1/completions", b"[1, 2]", raw=True)
    assert status == 400 and body["error"]["message"] == "The request body must be a JSON object"
    status, body, _ = server.post("/v1/completions", {"model": 5, "prompt": "x", "max_tokens": 1})
    assert status == 400 and body["error"]["message"] == "'model' must be a string"
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "stop": None})
    assert status == 200, body


def test_text_parts_render_as_their_lines(server):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    _, a, _ = server.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    _, b, _ = server.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "first\nsecond"}]})
    assert a["tokens"] == b["tokens"]


def test_count_and_list_bounds_at_the_edges(server):
    base = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    status, body, _ = server.post("/v1/completions", {**base, "n": 0})
    assert status == 400 and body["error"]["message"] == "n must be between 1 and 16, got 0"
    status, body, _ = server.post("/v1/completions", {**base, "stop": [f"s{i}" for i in range(16)]})
    assert status == 200, body
    # A list of one empty string encodes to no tokens (this model adds no BOS).
    status, body, _ = server.post("/v1/completions", {**base, "prompt": [""]})
    assert status == 400 and body["error"]["message"] == "'prompt' must not be empty"
    assert body["error"]["param"] == "prompt"
