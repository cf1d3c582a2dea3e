"""Bad input, limits and faults against a real `serval serve`: each gets its documented 4xx JSON
error (OpenAI's shape) and the server keeps serving; SIGTERM drains without dropping a request."""
import json
import signal
import socket
import threading
import time
import urllib.request

import pytest

from conftest import MODELS, cached_model
from server_util import Server

STORIES = MODELS / "stories260K.gguf"


@pytest.fixture(scope="module")
def server():
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--max-body-bytes", 65536, name="qwen")
    yield s
    assert s.stop() == 0


def assert_error(status, body, want_status, needle=""):
    assert status == want_status, body
    assert "error" in body and isinstance(body["error"], dict), body
    assert body["error"]["message"], body
    assert needle.lower() in body["error"]["message"].lower(), body


def still_serving(server):
    status, body, _ = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


CASES = [
    ("malformed JSON", b'{"prompt": "hi", "max_tokens": ', 400, "invalid json"),
    ("not an object", b'[1, 2, 3]', 400, "object"),
    ("invalid UTF-8", b'{"prompt": "caf\xe9"}', 400, "invalid json"),
    ("missing prompt", {"max_tokens": 4}, 400, "'prompt' is required"),
    ("wrong prompt type", {"prompt": {"a": 1}}, 400, "prompt"),
    ("wrong max_tokens type", {"prompt": "hi", "max_tokens": "ten"}, 400, "'max_tokens' must be an integer"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -5}, 400, "at least 1"),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**9}, 400, "maximum context length is 32768"),
    ("n = 0", {"prompt": "hi", "n": 0}, 400, "n must be between 1 and 16"),
    ("huge n", {"prompt": "hi", "n": 1000}, 400, "n must be between 1 and 16"),
    ("empty prompt", {"prompt": ""}, 400, "must not be empty"),
    ("bad temperature", {"prompt": "hi", "temperature": -2}, 400, "temperature"),
    ("bad top_p type", {"prompt": "hi", "top_p": "high"}, 400, "'top_p' must be a number"),
    ("bad logit_bias", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias outside vocab", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("bad stop", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ("token ids outside vocab", {"prompt": [1, 2, 999999999]}, 400, "vocabulary"),
    ("too many logprobs", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("number out of range", b'{"prompt": "hi", "temperature": 1e400}', 400, "invalid json"),
]


@pytest.mark.parametrize("name,body,status,needle", CASES, ids=[c[0] for c in CASES])
def test_completion_bad_input(server, name, body, status, needle):
    st, resp, _ = server.post("/v1/completions", body, raw=isinstance(body, bytes))
    assert_error(st, resp, status, needle)
    still_serving(server)


def test_unknown_model_is_404(server):
    st, resp, _ = server.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert_error(st, resp, 404, "does not exist")
    assert resp["error"]["code"] == "model_not_found"
    still_serving(server)


def test_chat_bad_input(server):
    for body, needle in [({"messages": "hi"}, "'messages' must be an array"), ({"messages": []}, "must not be empty"),
                         ({"messages": [{"content": "x"}]}, "role"),
                         ({"messages": [{"role": "user", "content": 5}]}, "content")]:
        st, resp, _ = server.post("/v1/chat/completions", body)
        assert_error(st, resp, 400, needle)
    still_serving(server)


def test_request_template_needs_trust(server):
    # A template is code: unless the server was started with --trust-request-chat-template, 400.
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"}
    st, resp, _ = server.post("/v1/chat/completions", body)
    assert_error(st, resp, 400, "--trust-request-chat-template")
    assert resp["error"]["param"] == "chat_template"
    still_serving(server)


def test_unsupported_template_is_400():
    s = Server(STORIES, "--trust-request-chat-template")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% include 'x.jinja' %}",
                "max_tokens": 2}
        st, resp, _ = s.post("/v1/chat/completions", body)
        assert_error(st, resp, 400, "unsupported chat template")
        body["chat_template"] = "{{ raise_exception('nope') }}"
        st, resp, _ = s.post("/v1/chat/completions", body)
        assert_error(st, resp, 400, "nope")
        body["chat_template"] = "{{ messages[0].content }} there"
        st, resp, _ = s.post("/v1/chat/completions", body)
        assert st == 200 and resp["usage"]["prompt_tokens"] > 0
    finally:
        assert s.stop() == 0


def test_over_long_prompt_says_the_numbers(server):
    # Qwen's pre-tokenizer makes every digit a token: 40000 digits are 40000 tokens in a 40 KB body.
    st, resp, _ = server.post("/v1/completions", {"prompt": "1" * 40000, "max_tokens": 4})
    assert_error(st, resp, 400, "maximum context length is 32768 tokens")
    assert "40000" in resp["error"]["message"]
    st, resp, _ = server.post("/v1/completions", {"prompt": "1" * 32760, "max_tokens": 100})
    assert_error(st, resp, 400, "32860")
    still_serving(server)


def test_body_too_large_is_413(server):
    st, resp, _ = server.post("/v1/completions", {"prompt": "x" * 100000})
    assert_error(st, resp, 413, "exceeds")
    still_serving(server)


def test_unknown_path_is_404_json(server):
    status, text = server.get("/v1/nothing")
    assert status == 404 and "error" in json.loads(text)


def test_api_key_required():
    s = Server(STORIES, "--api-key", "sekret")
    try:
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
        assert_error(st, resp, 401, "api key")
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
        assert_error(st, resp, 401, "api key")
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2}, headers={"Authorization": "Bearer sekret"})
        assert st == 200
        assert s.get("/health")[0] == 200  # health stays open for probes
    finally:
        assert s.stop() == 0


def test_full_queue_is_429_with_retry_after():
    # The default model decodes at tens of tokens per second: a 200-token request runs for seconds.
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--max-seqs", 1, "--max-waiting", 1)
    try:
        results = []

        def long_request():
            results.append(s.post("/v1/completions", {"prompt": "Once", "max_tokens": 200, "ignore_eos": True}))

        threads = [threading.Thread(target=long_request) for _ in range(2)]  # one running, one waiting
        threads[0].start()
        deadline = time.time() + 20
        while time.time() < deadline and s.metric("serval:num_requests_running") < 1:
            time.sleep(0.02)
        threads[1].start()
        while time.time() < deadline and s.metric("serval:num_requests_waiting") < 1:
            time.sleep(0.05)
        time.sleep(0.3)  # the queue length the server checks is refreshed after each engine step
        st, resp, headers = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
        assert_error(st, resp, 429, "busy")
        assert headers.get("Retry-After") == "1"
        for t in threads:
            t.join()
        assert all(r[0] == 200 for r in results)
        st, _, _ = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
        assert st == 200
    finally:
        assert s.stop() == 0


def read_sse(sock, until=b"[DONE]", timeout=60):
    sock.settimeout(timeout)
    data = b""
    while until not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_sigterm_drains_and_exits_zero():
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--drain-timeout", 30)
    # An in-flight streaming request and an in-flight non-streaming one.
    sock = s.open_stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 60, "stream": True,
                                             "ignore_eos": True})
    first = sock.recv(4096)
    assert b"200" in first.split(b"\r\n")[0]
    plain = []
    t = threading.Thread(target=lambda: plain.append(s.post("/v1/completions", {"prompt": "Lily", "max_tokens": 60,
                                                                               "ignore_eos": True})))
    t.start()
    deadline = time.time() + 20  # both requests admitted before the signal
    while time.time() < deadline and s.metric("serval:num_requests_running") + s.metric("serval:num_requests_waiting") < 2:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # New requests are refused while draining.
    try:
        st, resp, _ = s.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert st == 503
    except OSError:
        pass  # or the listener is already closed
    rest = read_sse(sock)
    events = [l[6:] for l in (first + rest).decode(errors="replace").split("\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]", "the stream must end properly"
    finals = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"] and json.loads(e)["choices"][0]["finish_reason"]]
    # Both requests were in flight when the signal came; the drain lets them finish.
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "length"
    t.join()
    assert plain and plain[0][0] == 200 and plain[0][1]["choices"][0]["finish_reason"] == "length"
    assert plain[0][1]["usage"]["completion_tokens"] == 60
    assert s.proc.wait(timeout=60) == 0


def test_request_timeout_aborts():
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--request-timeout", 1)
    try:
        t0 = time.time()
        st, resp, _ = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 500, "ignore_eos": True})
        assert st == 200 and resp["choices"][0]["finish_reason"] == "abort"
        assert time.time() - t0 < 5
        assert 0 < resp["usage"]["completion_tokens"] < 500
        # The metrics are a snapshot taken after each engine step: the one after the abort may still
        # be on its way when the reply arrives.
        deadline = time.time() + 5
        while s.metric("serval:kv_cache_usage_perc") != 0 and time.time() < deadline:
            time.sleep(0.05)
        assert s.metric("serval:kv_cache_usage_perc") == 0
    finally:
        assert s.stop() == 0


def test_cors_headers_and_preflight():
    s = Server(STORIES, "--cors")
    try:
        req = urllib.request.Request(s.url + "/v1/completions", method="OPTIONS",
                                     headers={"Origin": "http://example.test", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "*"
        st, _, headers = s.post("/v1/completions", {"prompt": "Once", "max_tokens": 2}, headers={"Origin": "http://example.test"})
        assert st == 200 and headers.get("Access-Control-Allow-Origin") == "*"
    finally:
        assert s.stop() == 0


def test_sigterm_past_the_drain_timeout_aborts_with_final_events():
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), "--drain-timeout", 1)
    sock = s.open_stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1000, "stream": True,
                                             "ignore_eos": True})
    first = sock.recv(4096)
    s.proc.send_signal(signal.SIGTERM)
    rest = read_sse(sock)
    events = [l[6:] for l in (first + rest).decode(errors="replace").split("\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"] and json.loads(e)["choices"][0]["finish_reason"]]
    assert finals[-1]["choices"][0]["finish_reason"] == "abort"
    assert s.proc.wait(timeout=60) == 0
