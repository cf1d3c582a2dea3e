"""Connection scale against a real `serval serve` on stories260K: 1,000 concurrent streaming clients all
held open at once and all served in full while /health keeps answering; idle keep-alive connections
and a slowloris client do not block anyone else.

A server with a fixed pool of HTTP threads (cpp-httplib's 64) fails both: connections past the pool
wait in the accept queue (a held keep-alive connection pins its thread for at least the 5 s
keep-alive timeout, so 1,000 held clients need more than 15 such rounds), and /health waits with them.
Time limits below are generous failure detectors, not measurements; the latencies are printed."""
import asyncio
import re
import subprocess
import time


from conftest import MODELS, SERVAL
from load_util import Conn, HttpError, SseParser, get, merge_chunks, metric, percentile, post_json, raise_fd_limit
from server_util import Server

STORIES = MODELS / "stories260K.gguf"
HOST = "127.0.0.1"
CLIENTS = 1000
PROMPTS = ["Once upon a time", "Lily and Tom", "One day, a little dog", "The sun was"]
MAX_TOKENS = 32
ALL_HEADERS_TIMEOUT = 300  # every client must have its response headers by then (a held-open check)
HEALTH_TIMEOUT = 10       # each /health poll must answer within this


def body(prompt, stream):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


def peak_connections_logged(server):
    """The server's own count of connections open at once, if it prints one at exit."""
    out = server.proc.stdout.read() if server.proc.stdout else ""
    m = re.search(r"at most (\d+) connections were open at once", out or "")
    return int(m.group(1)) if m else None


async def thousand_clients(port, solo):
    all_headers = asyncio.Event()
    stop_polling = asyncio.Event()
    with_headers = 0
    health_latencies, health_failures, admitted_peak, header_times = [], [], [0], []

    async def client(i):
        nonlocal with_headers
        prompt = PROMPTS[i % len(PROMPTS)]
        conn = await Conn.open(HOST, port, timeout=ALL_HEADERS_TIMEOUT)
        try:
            await conn.send(conn.request_bytes("POST", "/v1/completions", body(prompt, True)))
            status, headers = await conn.read_head()
            assert status == 200, f"client {i}: status {status}"
            with_headers += 1
            header_times.append(time.monotonic() - t0)
            if with_headers == CLIENTS:
                all_headers.set()
            # Nobody reads its stream before everyone has its headers: the server holds all at once.
            await all_headers.wait()
            parser, events = SseParser(), []
            async for chunk in conn.body_chunks(headers):
                events += parser.feed(chunk)
                if "[DONE]" in events:
                    break
            texts, finish, usage, done = merge_chunks(events)
            assert done, f"client {i}: no [DONE] after {len(events)} events"
            assert finish == {0: "length"}, f"client {i}: finish {finish}"
            assert usage and usage["completion_tokens"] == MAX_TOKENS, f"client {i}: usage {usage}"
            assert texts[0] == solo[prompt], f"client {i}: {texts[0]!r} != solo {solo[prompt]!r}"
        finally:
            conn.close()

    async def poll_health():
        while not stop_polling.is_set():
            try:
                status, _, dt = await get(HOST, port, "/health", timeout=HEALTH_TIMEOUT)
                health_latencies.append(dt)
                if status != 200:
                    health_failures.append(f"status {status}")
            except (OSError, HttpError, asyncio.TimeoutError) as e:
                health_failures.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(0.2)

    async def poll_metrics():
        while not stop_polling.is_set():
            try:
                status, text, _ = await get(HOST, port, "/metrics", timeout=HEALTH_TIMEOUT)
                if status == 200:
                    admitted = metric(text, "serval:num_requests_running") + metric(text, "serval:num_requests_waiting")
                    admitted_peak[0] = max(admitted_peak[0], int(admitted))
            except (OSError, HttpError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.25)

    pollers = [asyncio.ensure_future(poll_health()), asyncio.ensure_future(poll_metrics())]
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(client(i)) for i in range(CLIENTS)]
    # Until everyone has headers; a /health failure ends the wait early (the test fails on it).
    deadline = t0 + ALL_HEADERS_TIMEOUT
    while not all_headers.is_set() and not health_failures and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(all_headers.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    t_headers = time.monotonic() - t0
    got_headers = with_headers
    if got_headers < CLIENTS:
        for t in tasks:
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    stop_polling.set()
    await asyncio.gather(*pollers)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    return {"got_headers": got_headers, "t_headers": t_headers, "t_total": time.monotonic() - t0, "errors": errors,
            "health": health_latencies, "health_failures": health_failures, "admitted_peak": admitted_peak[0],
            "header_times": header_times}


def test_thousand_concurrent_streams():
    raise_fd_limit(CLIENTS * 2 + 256)
    s = Server(STORIES, "--max-seqs", 256, "--max-waiting", 1024)
    try:
        solo = {}
        for p in PROMPTS:
            st, resp, _ = s.post("/v1/completions", body(p, False))
            assert st == 200 and resp["usage"]["completion_tokens"] == MAX_TOKENS, resp
            solo[p] = resp["choices"][0]["text"]
        r = asyncio.run(thousand_clients(s.port, solo))
        h = r["health"]
        print(f"\n{r['got_headers']}/{CLIENTS} clients had response headers at once after {r['t_headers']:.1f} s; "
              f"all done in {r['t_total']:.1f} s; peak running+waiting {r['admitted_peak']}; /health polls {len(h)}, "
              f"p50 {percentile(h, 50) * 1000:.1f} ms, p99 {percentile(h, 99) * 1000:.1f} ms, "
              f"max {max(h, default=0) * 1000:.1f} ms, failures {len(r['health_failures'])}")
        ht = r["header_times"]
        print("headers at (s): " + ", ".join(f"p{q} {percentile(ht, q):.1f}" for q in (10, 50, 90, 100)))
        assert h and not r["health_failures"], f"/health failed under load: {r['health_failures'][:5]}"
        assert r["got_headers"] == CLIENTS, (
            f"only {r['got_headers']} of {CLIENTS} streaming clients got response headers within "
            f"{ALL_HEADERS_TIMEOUT} s: the server does not hold {CLIENTS} connections at once")
        assert not r["errors"], f"{len(r['errors'])} clients failed, e.g. {r['errors'][0]!r}"
        assert s.get("/health")[0] == 200
    finally:
        code = s.stop()
    peak = peak_connections_logged(s)
    if peak is not None:
        print(f"server-reported peak connections: {peak}")
        assert peak >= CLIENTS, peak
    assert code == 0


def supports(flag):
    out = subprocess.run([str(SERVAL), "serve", "--help"], capture_output=True, text=True).stdout
    return flag in out


async def idle_and_slowloris(port, header_timeout):
    stop = asyncio.Event()
    keepalive_failures, normal_failures, normal_latencies, reconnects = [], [], [], [0]
    slow = {"closed_after": None, "bytes_sent": 0}

    async def keep_alive_client(i):
        """Keeps one connection open, a request on it every 3 s (under any keep-alive timeout)."""
        conn = await Conn.open(HOST, port)
        try:
            while not stop.is_set():
                for attempt in range(2):
                    try:
                        await conn.send(conn.request_bytes("GET", "/health"))
                        status, headers = await asyncio.wait_for(conn.read_head(), HEALTH_TIMEOUT)
                        await conn.read_body(headers)
                        if status != 200:
                            keepalive_failures.append(f"{i}: status {status}")
                        break
                    except (HttpError, ConnectionError) as e:
                        if attempt:  # a server may close an idle connection; a fresh one must work
                            keepalive_failures.append(f"{i}: {e!r}")
                        conn.close()
                        reconnects[0] += 1
                        conn = await Conn.open(HOST, port)
                    except asyncio.TimeoutError:
                        keepalive_failures.append(f"{i}: no answer within {HEALTH_TIMEOUT} s")
                        return
                try:
                    await asyncio.wait_for(stop.wait(), 3)
                except asyncio.TimeoutError:
                    pass
        finally:
            conn.close()

    async def slowloris():
        conn = await Conn.open(HOST, port)
        t0 = time.monotonic()
        payload = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
        try:
            for i in range(len(payload)):
                if stop.is_set():
                    return
                conn.writer.write(payload[i:i + 1])
                await conn.writer.drain()
                slow["bytes_sent"] += 1
                try:  # anything from the server (a 408, or EOF) means it gave up on us
                    data = await asyncio.wait_for(conn.reader.read(4096), 1.0)
                    slow["closed_after"] = time.monotonic() - t0
                    slow["answer"] = data[:40]
                    return
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            slow["closed_after"] = time.monotonic() - t0
        finally:
            conn.close()

    async def normal_requests():
        await asyncio.sleep(1)
        for k in range(6):
            t0 = time.monotonic()
            try:
                st, _, resp = await post_json(HOST, port, "/v1/completions",
                                              {"prompt": "Once", "max_tokens": 4, "temperature": 0}, timeout=HEALTH_TIMEOUT)
                st2, _, _ = await get(HOST, port, "/health", timeout=HEALTH_TIMEOUT)
                normal_latencies.append(time.monotonic() - t0)
                if st != 200 or st2 != 200:
                    normal_failures.append(f"request {k}: {st} / {st2}")
            except (OSError, HttpError, asyncio.TimeoutError) as e:
                normal_failures.append(f"request {k}: {type(e).__name__} {e}")
            await asyncio.sleep(2)

    keepers = [asyncio.ensure_future(keep_alive_client(i)) for i in range(100)]
    await asyncio.sleep(0.5)
    loris = asyncio.ensure_future(slowloris())
    await normal_requests()
    if header_timeout:  # give the slow client until well past the header timeout
        try:
            await asyncio.wait_for(asyncio.shield(loris), header_timeout * 3 + 5)
        except asyncio.TimeoutError:
            pass
    stop.set()
    await asyncio.gather(*keepers, loris)
    return keepalive_failures, normal_failures, normal_latencies, slow, reconnects[0]


def test_idle_keep_alive_and_slowloris_do_not_block_others():
    header_timeout = 3 if supports("--timeout-header") else None
    s = Server(STORIES, *(["--timeout-header", header_timeout] if header_timeout else []))
    try:
        keepalive_failures, normal_failures, latencies, slow, reconnects = asyncio.run(
            idle_and_slowloris(s.port, header_timeout))
        print(f"\nnormal requests beside 100 keep-alive connections and a slowloris: "
              f"{len(latencies)} answered, max {max(latencies, default=0) * 1000:.0f} ms; keep-alive reconnects "
              f"{reconnects}; slowloris sent {slow['bytes_sent']} bytes, closed after {slow['closed_after']} s")
        assert not normal_failures, normal_failures
        assert len(latencies) == 6
        assert not keepalive_failures, keepalive_failures[:5]
        if header_timeout:
            assert slow["closed_after"] is not None, "the slow-header client was never closed"
        assert s.get("/health")[0] == 200
    finally:
        assert s.stop() == 0
