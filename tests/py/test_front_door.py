"""The server's front door against hostile or careless clients: request templates, a taken port,
clients that hang up, many connections, keep-alive and pipelining, slow and oversize requests, TLS.
Each test names the finding it guards (see docs/reliability.md)."""
import http.client
import json
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from conftest import MODELS, SERVAL, cached_model
from server_util import Server

STORIES = MODELS / "stories260K.gguf"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def trusting():
    s = Server(STORIES, "--trust-request-chat-template", "--timeout-header", 1, "--timeout-keep-alive", 1,
               "--max-seqs", 128, "--max-waiting", 512)
    yield s
    assert s.stop() == 0


def error_message(status, body, want=400):
    assert status == want, body
    return body["error"]["message"].lower()


def test_int64_min_modulo_minus_one_renders_zero(trusting):
    # This template once killed the server with SIGFPE; Python (and Jinja2) give 0.
    st, resp, _ = trusting.post("/tokenize", {"messages": CHAT, "chat_template": "{{ (-9223372036854775807 - 1) % -1 }}"})
    assert st == 200, resp
    st, text, _ = trusting.post("/detokenize", {"tokens": resp["tokens"]})
    assert text["prompt"].strip() == "0"


HOSTILE_TEMPLATES = [
    ("int64 min // -1", "{{ (-9223372036854775807 - 1) // -1 }}"),
    ("addition overflow", "{{ 9223372036854775807 + 1 }}"),
    ("multiplication overflow", "{{ 9223372036854775807 * 2 }}"),
    ("negation overflow", "{{ -(-9223372036854775807 - 1) }}"),
    ("division by zero", "{{ 1 // 0 }}"),
    ("modulo by zero", "{{ 1 % 0 }}"),
    ("huge range", "{% for i in range(1000000000000) %}x{% endfor %}"),
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    ("huge string", "{{ 'a' * 1000000000000 }}"),
    ("output bomb", "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"),
    ("list bomb", "{% set l = [1] * 1000000000 %}{{ l | length }}"),
    ("endless recursion", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"),
    ("deep nesting", "{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}"),
]


@pytest.mark.parametrize("template", [t for _, t in HOSTILE_TEMPLATES], ids=[n for n, _ in HOSTILE_TEMPLATES])
def test_hostile_request_template_is_a_400(trusting, template):
    st, resp, _ = trusting.post("/v1/chat/completions", {"messages": CHAT, "chat_template": template, "max_tokens": 2})
    assert "template" in error_message(st, resp)
    assert trusting.proc.poll() is None
    assert trusting.get("/health")[0] == 200


def test_template_that_renders_nothing_is_a_400(trusting):
    st, resp, _ = trusting.post("/v1/chat/completions", {"messages": [{"role": "us"}], "chat_template": ""})
    assert "empty prompt" in error_message(st, resp)


def test_deeply_nested_body_is_a_400(trusting):
    deep = {"messages": [{"role": "user", "content": "[" * 5000 + "]" * 5000}], "chat_template": "{{ messages[0].content }}"}
    st, _, _ = trusting.post("/tokenize", deep)
    assert st == 200
    body = b'{"messages": [{"role": "user", "content": "x", "extra": ' + b"[" * 1000000 + b"]" * 1000000 + b"}]}"
    st, resp, _ = trusting.post("/v1/chat/completions", body, raw=True)
    assert "nested deeper than 64" in error_message(st, resp)
    assert trusting.get("/health")[0] == 200


def test_second_server_on_a_taken_port_fails_clearly(trusting):
    # Once bound with SO_REUSEPORT, a second server started silently and took half the connections.
    p = subprocess.run([str(SERVAL), "serve", str(STORIES), "--port", str(trusting.port)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1
    assert f"cannot listen on 127.0.0.1:{trusting.port}: address already in use" in p.stderr.lower()


def test_keep_alive_and_pipelining(trusting):
    conn = http.client.HTTPConnection("127.0.0.1", trusting.port, timeout=30)
    for _ in range(3):  # one connection, three requests
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    sock = conn.sock
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is sock
    conn.close()
    # Two requests in one write: two answers, in order.
    with socket.create_connection(("127.0.0.1", trusting.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 2 and data.index(b'"status"') < data.index(b'"object":"list"')


def test_idle_keep_alive_connection_is_closed(trusting):
    with socket.create_connection(("127.0.0.1", trusting.port), timeout=30) as s:
        assert s.recv(1) == b""  # closed by the server after --timeout-keep-alive (1 s)


def test_slow_headers_are_cut_off_and_others_served(trusting):
    with socket.create_connection(("127.0.0.1", trusting.port), timeout=30) as s:
        closed = threading.Event()

        def trickle():  # slowloris: one header byte every 0.2 s
            try:
                for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                    s.send(bytes([b]))
                    time.sleep(0.2)
            except OSError:
                closed.set()

        t = threading.Thread(target=trickle)
        t.start()
        assert trusting.get("/health")[0] == 200  # others are served meanwhile
        t.join(timeout=60)
        assert closed.is_set()  # the server hung up (after --timeout-header, 1 s)


def test_oversize_headers_are_431(trusting):
    with socket.create_connection(("127.0.0.1", trusting.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n")
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 431")


def test_malformed_request_line_is_400(trusting):
    with socket.create_connection(("127.0.0.1", trusting.port), timeout=30) as s:
        s.sendall(b"HELLO\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 400")


def test_expect_100_continue(trusting):
    body = json.dumps({"prompt": "Once upon a time" + " and then" * 200, "max_tokens": 2})
    p = subprocess.run(["curl", "-s", "-H", "Content-Type: application/json", "-H", "Expect: 100-continue",
                        "--expect100-timeout", "30", "-d", body, trusting.url + "/v1/completions"],
                       capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout)["usage"]["completion_tokens"] == 2


def test_more_than_64_streams_at_once_and_health_answers(trusting):
    # A fixed pool of 64 HTTP threads once made the 65th client (and /health) wait silently.
    n = 100
    socks = [trusting.open_stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1500,
                                                      "stream": True, "ignore_eos": True, "temperature": 0})
             for _ in range(n)]
    try:
        for s in socks:
            s.settimeout(60)
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(4096)
            assert head.startswith(b"HTTP/1.1 200")
        # Every one of them is in the engine at the same time (none can finish soon: 1500 tokens each);
        # the gauges are read at the end of an engine step, so give them a few steps.
        deadline, held = time.time() + 30, 0
        while time.time() < deadline and held < n:
            held = trusting.metric("serval:num_requests_running") + trusting.metric("serval:num_requests_waiting")
        assert held == n
        t0 = time.time()
        assert trusting.get("/health")[0] == 200
        print(f"/health with {n} streams running: {1000 * (time.time() - t0):.1f} ms")
    finally:
        for s in socks:
            s.close()
    deadline = time.time() + 60
    while time.time() < deadline and trusting.metric("serval:num_requests_running") > 0:
        time.sleep(0.1)
    assert trusting.metric("serval:num_requests_running") == 0
    assert trusting.metric("serval:kv_cache_usage_perc") == 0


@pytest.fixture(scope="module")
def qwen():
    s = Server(cached_model("qwen2.5-coder-0.5b-instruct"), name="qwen")
    yield s
    assert s.stop() == 0


def aborted(server):
    _, text = server.get("/metrics")
    line = next(l for l in text.splitlines() if 'finished_reason="abort"' in l)
    return float(line.rsplit(" ", 1)[1])


def test_non_streaming_client_that_hangs_up_is_aborted(qwen):
    # It used to keep generating until max_tokens or the request timeout, holding KV and a slot.
    before = aborted(qwen)
    sock = qwen.open_stream("/v1/completions", {"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True})
    deadline = time.time() + 60
    while time.time() < deadline and qwen.metric("serval:num_requests_running") == 0:
        time.sleep(0.05)
    assert qwen.metric("serval:kv_cache_usage_perc") > 0
    sock.close()
    deadline = time.time() + 20  # 3000 tokens would take minutes
    while time.time() < deadline and qwen.metric("serval:kv_cache_usage_perc") > 0:
        time.sleep(0.1)
    assert qwen.metric("serval:kv_cache_usage_perc") == 0
    assert qwen.metric("serval:num_requests_running") == 0
    assert aborted(qwen) == before + 1


def test_metrics_and_health_do_not_wait_for_the_engine(qwen):
    # A 600-token prompt keeps the engine busy in long prefill steps; /metrics used to wait for the step to end.
    body = {"prompt": "1 " * 300, "max_tokens": 8, "ignore_eos": True}
    t = threading.Thread(target=qwen.post, args=("/v1/completions", body))
    t.start()
    deadline = time.time() + 60
    while time.time() < deadline and qwen.metric("serval:num_requests_running") == 0:
        time.sleep(0.02)
    lat = []
    for _ in range(10):
        for path in ("/health", "/metrics"):
            t0 = time.time()
            assert qwen.get(path)[0] == 200
            lat.append(time.time() - t0)
    t.join()
    print(f"/health and /metrics during prefill: max {1000 * max(lat):.1f} ms")


def test_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    s = Server(STORIES, "--ssl-certfile", cert, "--ssl-keyfile", key, cafile=cert)
    try:
        assert s.url.startswith("https://")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", http_client=httpx.Client(verify=str(cert)))
        r = client.completions.create(model="stories260K", prompt="Once upon", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        chunks = list(client.completions.create(model="stories260K", prompt="Once upon", max_tokens=4, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        p = subprocess.run(["curl", "-s", "--cacert", str(cert), s.url + "/health"], capture_output=True, text=True)
        assert json.loads(p.stdout)["status"] == "ok"
        p = subprocess.run(["curl", "-s", "--max-time", "10", f"http://127.0.0.1:{s.port}/health"], capture_output=True)
        assert b'"ok"' not in p.stdout  # plain HTTP on the TLS port gets nothing useful
    finally:
        assert s.stop() == 0


def test_mismatched_tls_flags_fail_clearly(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    p = subprocess.run([str(SERVAL), "serve", str(STORIES), "--port", "0", "--ssl-certfile", str(cert)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--ssl-keyfile" in p.stderr
