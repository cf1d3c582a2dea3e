#!/usr/bin/env python3
"""Soak and fault test of `serval serve` on a small model.

The server runs with a KV cache of a few dozen blocks (preemption is constant), few running
sequences and a short waiting queue (429s). Many concurrent asyncio clients send mixed traffic:
streaming and not, prompts of random lengths built on shared prefixes, n > 1, greedy and seeded
sampling, clients that hang up mid-stream, before a non-streaming answer or in the middle of sending
their request, bursts past the queue limit. Then SIGTERM while requests are in flight.

Checks, all reported in one summary line and as JSON (--report):
  * every request is accounted for exactly once: completed, aborted by its own client, rejected
    with 429/503 and Retry-After (or, only after SIGTERM, refused at connect); lost must be 0;
  * every completed greedy answer equals the solo answer to the same request (taken on the same
    server before the load), and seeded sampled answers equal their solo re-runs;
  * no KV block is held once the load has drained (/engine/state), nothing running or waiting;
  * RSS is flat after warm-up: the RSS after the load drains is at most the RSS sampled at the end
    of the warm-up (a quarter of the load) plus --rss-tolerance-mib (5 MiB by default: the KV pool
    is allocated once at start and the weights are an mmap, so only the heap can grow; 5 MiB leaves
    room for allocator arenas and fragmentation while a leak of even 1 KiB per request shows after
    a few thousand requests);
  * the scenario exercised what it claims (preemptions > 0, some 429s, faults injected);
  * after SIGTERM the in-flight requests end properly ([DONE] / a full JSON answer), new ones are
    refused, and the server exits with code 0.

Usage: tests/soak/soak.py [--duration 180] [--seed 1] [--binary build/serval] [--model M] [--report F]
"""
import argparse
import asyncio
import json
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))

from load_util import (Conn, HttpError, SseParser, blocks_held, get, merge_chunks, metric,  # noqa: E402
                       post_json, raise_fd_limit, rss_bytes)

HOST = "127.0.0.1"
SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her big red ball.",
    "One day, a small dog came to the park and wanted to play too.",
    "Tom and his mom went to the store to buy some apples.",
    "The sun was shining and the birds were singing in the tall trees.",
    "Ben had a toy car that he liked very much.",
    "The old cat sat by the window and looked at the rain.",
    "Mia found a shiny stone near the river and put it in her pocket.",
]
GREEDY_MAX_TOKENS = [8, 24, 48]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180, help="seconds of mixed load (default 180)")
    p.add_argument("--seed", type=int, default=1, help="seed of the traffic mix (default 1)")
    p.add_argument("--binary", default=str(ROOT / "build" / "serval"))
    p.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260K.gguf"))
    p.add_argument("--report", help="write the summary as JSON to this file")
    p.add_argument("--clients", type=int, default=24, help="concurrent client tasks (default 24)")
    p.add_argument("--kv-cache-memory", default="409600", help="KV budget (default 409600 bytes: 40 blocks on stories260K)")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--max-waiting", type=int, default=6)
    p.add_argument("--rss-tolerance-mib", type=float, default=5.0)
    p.add_argument("--server-log", help="keep the server's output in this file")
    return p.parse_args(argv)


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Ledger:
    """One entry per request the clients started; each ends in exactly one outcome."""

    OUTCOMES = ("completed", "client_aborted", "rejected", "refused_after_sigterm", "lost")

    def __init__(self):
        self.entries = {}
        self.next_id = 0
        self.problems = []  # (request id, what was wrong): lost requests and wrong answers

    def open(self, kind, phase):
        rid = self.next_id
        self.next_id += 1
        self.entries[rid] = {"kind": kind, "phase": phase, "outcome": None}
        return rid

    def close(self, rid, outcome, detail=None):
        e = self.entries[rid]
        assert outcome in self.OUTCOMES, outcome
        if e["outcome"] is not None:
            self.problems.append((rid, f"accounted twice: {e['outcome']} then {outcome}"))
            return
        e["outcome"] = outcome
        if detail:
            e["detail"] = detail
        if outcome == "lost":
            self.problems.append((rid, f"{e['kind']}: {detail}"))

    def count(self, outcome=None, phase=None):
        return sum(1 for e in self.entries.values()
                   if (outcome is None or e["outcome"] == outcome) and (phase is None or e["phase"] == phase))


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.port = free_port()
        self.ledger = Ledger()
        self.faults = {"stream_hangup": 0, "wait_hangup": 0, "partial_request": 0, "sigterm": 0}
        self.solo = {}  # (prompt index, max_tokens) -> greedy text alone
        self.greedy_checked = 0
        self.seeded = []  # (body, texts by choice) of completed seeded sampled requests
        self.mismatches = []
        self.rss = []  # (seconds since load start, bytes)
        self.rejections = 0
        self.proc = None
        self.stop_load = asyncio.Event()
        self.sigterm_sent = False
        self.prompts = self.make_prompts()

    # ---- the server ----

    def start_server(self):
        cmd = [self.args.binary, "serve", self.args.model, "--port", str(self.port),
               "--kv-cache-memory", self.args.kv_cache_memory, "--max-seqs", str(self.args.max_seqs),
               "--max-waiting", str(self.args.max_waiting), "--max-model-len", "256", "--drain-timeout", "30"]
        log = open(self.args.server_log, "w") if self.args.server_log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready")
            try:
                status, text, _ = await get(HOST, self.port, "/health", timeout=2)
                if status == 200:
                    return
            except (OSError, HttpError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("server not ready")

    async def engine_state(self):
        status, text, _ = await get(HOST, self.port, "/engine/state", timeout=30)
        assert status == 200, (status, text)
        return json.loads(text)

    async def metrics(self):
        status, text, _ = await get(HOST, self.port, "/metrics", timeout=30)
        assert status == 200, status
        return text

    # ---- traffic ----

    def make_prompts(self):
        """Eight prompts on two shared prefixes of different lengths (so that prefix caching shares
        blocks), with different tails; from 2 to about 170 tokens: at most 380 characters (this
        tokenizer makes about 2.2 characters a token), so that with the longest max_tokens (64) every
        request fits the 256-token context whatever the seed."""
        r = random.Random(self.args.seed * 7919 + 1)
        long_prefix = " ".join(SENTENCES[:5])
        short_prefix = SENTENCES[0]
        prompts = ["Once", "Lily"]
        for prefix in (long_prefix, short_prefix):
            for _ in range(3):
                while len(p := prefix + " " + " ".join(r.sample(SENTENCES[3:], r.randint(1, 3)))) > 380:
                    pass
                prompts.append(p)
        return prompts

    def greedy_body(self, rng, stream, long=False):
        pi = rng.randrange(2, len(self.prompts)) if long else rng.randrange(len(self.prompts))
        mt = GREEDY_MAX_TOKENS[-1] if long else rng.choice(GREEDY_MAX_TOKENS)
        body = {"prompt": self.prompts[pi], "max_tokens": mt, "temperature": 0, "n": rng.choice([1, 1, 2]),
                "stream": stream}
        return body, (pi, mt)

    async def greedy_request(self, rng, phase, kind="greedy", long=False):
        """A greedy request; each choice that completes must equal the solo answer."""
        body, key = self.greedy_body(rng, rng.random() < 0.5, long)
        res = await self.exchange(self.ledger.open(kind, phase), body)
        if res:
            texts, finish = res
            for i, t in texts.items():
                if finish[i] in ("length", "stop"):
                    self.greedy_checked += 1
                    if t != self.solo[key]:
                        self.mismatches.append({"kind": "greedy", "body": body, "choice": i, "got": t,
                                                "solo": self.solo[key]})

    def sampled_body(self, rng, stream):
        return {"prompt": rng.choice(self.prompts), "max_tokens": rng.randint(4, 48), "temperature": 0.9,
                "top_p": 0.95, "seed": rng.randrange(1 << 31), "n": rng.choice([1, 2, 3]), "stream": stream}

    async def exchange(self, rid, body, *, hangup_after_events=None, hangup_after_s=None, timeout=120):
        """Sends `body` to /v1/completions on a new connection and settles the request's outcome."""
        stream = bool(body.get("stream"))
        try:
            conn = await Conn.open(HOST, self.port, timeout=30)
        except (OSError, asyncio.TimeoutError) as e:
            self.ledger.close(rid, "refused_after_sigterm" if self.sigterm_sent else "lost", f"connect: {e!r}")
            return None
        try:
            await conn.send(conn.request_bytes("POST", "/v1/completions", body))
            if hangup_after_s is not None and not stream:
                try:
                    status, headers = await asyncio.wait_for(conn.read_head(), hangup_after_s)
                except asyncio.TimeoutError:
                    conn.close()
                    self.faults["wait_hangup"] += 1
                    self.ledger.close(rid, "client_aborted")
                    return None
            else:
                status, headers = await asyncio.wait_for(conn.read_head(), timeout)
            if status in (429, 503):
                await asyncio.wait_for(conn.read_body(headers), timeout)
                if "retry-after" not in headers:
                    self.ledger.close(rid, "lost", f"{status} without Retry-After")
                elif status == 503 and not self.sigterm_sent:
                    self.ledger.close(rid, "lost", "503 while not shutting down")
                else:
                    self.ledger.close(rid, "rejected", str(status))
                    self.rejections += 1
                return None
            if status != 200:
                raw = await asyncio.wait_for(conn.read_body(headers), timeout)
                self.ledger.close(rid, "lost", f"status {status}: {raw[:200]!r}")
                return None
            if not stream:
                raw = await asyncio.wait_for(conn.read_body(headers), timeout)
                j = json.loads(raw)
                texts = {c["index"]: c["text"] for c in j["choices"]}
                finish = {c["index"]: c["finish_reason"] for c in j["choices"]}
                return self.settle_completed(rid, body, texts, finish)
            parser, events = SseParser(), []
            deadline = time.monotonic() + timeout
            async for chunk in conn.body_chunks(headers):
                events += parser.feed(chunk)
                if hangup_after_events is not None and len(events) >= hangup_after_events and "[DONE]" not in events:
                    conn.close()
                    self.faults["stream_hangup"] += 1
                    self.ledger.close(rid, "client_aborted")
                    return None
                if "[DONE]" in events or time.monotonic() > deadline:
                    break
            texts, finish, _, done = merge_chunks(events)
            if not done:
                self.ledger.close(rid, "lost", f"stream ended without [DONE] after {len(events)} events")
                return None
            return self.settle_completed(rid, body, texts, finish)
        except (HttpError, OSError, asyncio.TimeoutError, ValueError, KeyError) as e:
            self.ledger.close(rid, "lost", f"{type(e).__name__}: {e}")
            return None
        finally:
            conn.close()

    def settle_completed(self, rid, body, texts, finish):
        n = body.get("n", 1)
        if sorted(finish) != list(range(n)):
            self.ledger.close(rid, "lost", f"choices {sorted(texts)} / finish {finish}, want {n}")
            return None
        allowed = ("length", "stop", "abort") if self.sigterm_sent else ("length", "stop")
        if any(f not in allowed for f in finish.values()):
            self.ledger.close(rid, "lost", f"finish_reason {finish}")
            return None
        self.ledger.close(rid, "completed")
        return texts, finish

    async def partial_request(self, rid, rng):
        """Sends part of a request (inside the headers, or half the body), then hangs up."""
        try:
            conn = await Conn.open(HOST, self.port, timeout=30)
        except (OSError, asyncio.TimeoutError) as e:
            self.ledger.close(rid, "refused_after_sigterm" if self.sigterm_sent else "lost", f"connect: {e!r}")
            return
        raw = conn.request_bytes("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 8})
        cut = rng.randint(5, len(raw) - 2)
        try:
            await conn.send(raw[:cut])
            await asyncio.sleep(rng.uniform(0, 0.3))
        except OSError:
            pass
        conn.close()
        self.faults["partial_request"] += 1
        self.ledger.close(rid, "client_aborted")

    async def one_request(self, rng, phase):
        roll = rng.random()
        stream = rng.random() < 0.5
        if roll < 0.35:
            await self.greedy_request(rng, phase)
        elif roll < 0.6:
            body = self.sampled_body(rng, stream)
            rid = self.ledger.open("sampled", phase)
            res = await self.exchange(rid, body)
            if res and all(f in ("length", "stop") for f in res[1].values()):
                self.seeded.append((body, res[0]))
        elif roll < 0.75:
            body = {"prompt": rng.choice(self.prompts), "max_tokens": 64, "ignore_eos": True, "stream": True,
                    "temperature": rng.choice([0, 0.8]), "n": rng.choice([1, 2])}
            rid = self.ledger.open("stream_hangup", phase)
            await self.exchange(rid, body, hangup_after_events=rng.randint(0, 12))
        elif roll < 0.9:
            body = {"prompt": rng.choice(self.prompts), "max_tokens": 64, "ignore_eos": True, "stream": False,
                    "temperature": 0.8}
            rid = self.ledger.open("wait_hangup", phase)
            await self.exchange(rid, body, hangup_after_s=rng.uniform(0.0, 0.4))
        else:
            rid = self.ledger.open("partial_request", phase)
            await self.partial_request(rid, rng)

    async def client(self, index):
        rng = random.Random(self.args.seed * 1000003 + index)
        while not self.stop_load.is_set():
            before = self.rejections
            await self.one_request(rng, "load")
            # Refused (429, Retry-After: 1): back off for part of the advised second, as a client would.
            await asyncio.sleep(rng.uniform(0.3, 1.0) if self.rejections > before else rng.uniform(0, 0.05))

    async def bursts(self):
        """Every few seconds, a burst of requests at once: alternately short ones, past --max-waiting
        (429s), and --max-seqs long greedy ones whose KV exceeds the pool (preemption, and the
        preempted answers are checked against their solo runs)."""
        rng = random.Random(self.args.seed * 31 + 7)
        k = 0
        while not self.stop_load.is_set():
            await asyncio.sleep(rng.uniform(2, 5))
            if self.stop_load.is_set():
                break
            k += 1
            burst = []
            if k % 2:
                for _ in range(self.args.max_seqs + 2 * self.args.max_waiting):
                    body = {"prompt": rng.choice(self.prompts), "max_tokens": rng.randint(2, 16), "temperature": 0.5}
                    burst.append(self.exchange(self.ledger.open("burst", "load"), body))
            else:
                burst = [self.greedy_request(rng, "load", "long_burst", long=True) for _ in range(self.args.max_seqs)]
            await asyncio.gather(*burst)

    async def sample_rss(self, t0):
        while self.proc.poll() is None and not self.sigterm_sent:
            self.rss.append((time.monotonic() - t0, rss_bytes(self.proc.pid)))
            await asyncio.sleep(2)

    # ---- phases ----

    async def solo_runs(self):
        for pi in range(len(self.prompts)):
            for mt in GREEDY_MAX_TOKENS:
                status, _, j = await post_json(HOST, self.port, "/v1/completions",
                                               {"prompt": self.prompts[pi], "max_tokens": mt, "temperature": 0})
                assert status == 200, (status, j)
                self.solo[(pi, mt)] = j["choices"][0]["text"]

    async def wait_drained(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            st = await self.engine_state()
            if not st["running"] and not st["waiting"]:
                return st
            if time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.2)

    async def check_seeded(self, limit=24):
        """Seeded sampled answers from the load, re-run alone: the same text."""
        checked = 0
        for body, texts in self.seeded[:limit]:
            solo_body = dict(body, stream=False)
            status, _, j = await post_json(HOST, self.port, "/v1/completions", solo_body)
            assert status == 200, (status, j)
            for c in j["choices"]:
                checked += 1
                if texts.get(c["index"]) != c["text"]:
                    self.mismatches.append({"kind": "seeded", "body": body, "choice": c["index"],
                                            "got": texts.get(c["index"]), "solo": c["text"]})
        return checked

    async def shutdown_phase(self):
        """Requests in flight, then SIGTERM, then late requests; in-flight ones must end properly."""
        rng = random.Random(self.args.seed * 17 + 3)
        in_flight = []
        for i in range(6):  # 6 x 200 tokens, 3 at a time in the KV pool: late requests arrive while these drain
            body = {"prompt": rng.choice(self.prompts[:2]), "max_tokens": 200, "ignore_eos": True,
                    "stream": i % 2 == 0, "temperature": 0}
            in_flight.append(asyncio.ensure_future(self.exchange(self.ledger.open("in_flight", "sigterm"), body)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = await self.metrics()
            admitted = metric(text, "serval:num_requests_running") + metric(text, "serval:num_requests_waiting")
            if admitted >= 6:
                break
            await asyncio.sleep(0.02)
        self.sigterm_sent = True
        self.faults["sigterm"] += 1
        self.proc.send_signal(signal.SIGTERM)
        late = []
        for _ in range(6):
            await asyncio.sleep(0.02)
            late.append(asyncio.ensure_future(self.exchange(self.ledger.open("late", "sigterm"),
                                                            {"prompt": "Once", "max_tokens": 4})))
        await asyncio.gather(*in_flight, *late)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, lambda: self.proc.wait(timeout=90))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "timeout"

    async def run(self):
        raise_fd_limit(4096)
        self.start_server()
        summary = {"seed": self.args.seed, "duration_s": self.args.duration, "clients": self.args.clients}
        failures = []
        try:
            await self.wait_ready()
            t_solo = time.monotonic()
            await self.solo_runs()
            summary["solo_runs_s"] = round(time.monotonic() - t_solo, 1)
            # Before the mixed load, one burst of --max-seqs long greedy requests on an idle server:
            # their KV is about three times the pool, so preemption happens whatever the machine's speed.
            prng = random.Random(self.args.seed * 13 + 5)
            await asyncio.gather(*[self.greedy_request(prng, "preempt", "long_burst", long=True)
                                   for _ in range(self.args.max_seqs)])
            summary["preemptions_first_burst"] = int(metric(await self.metrics(), "serval:num_preemptions_total"))
            rss_start = rss_bytes(self.proc.pid)
            t0 = time.monotonic()
            sampler = asyncio.ensure_future(self.sample_rss(t0))
            tasks = [asyncio.ensure_future(self.client(i)) for i in range(self.args.clients)]
            tasks.append(asyncio.ensure_future(self.bursts()))
            warmup_at = max(5.0, self.args.duration / 4)
            await asyncio.sleep(warmup_at)
            rss_warm = rss_bytes(self.proc.pid)
            await asyncio.sleep(max(0.0, self.args.duration - warmup_at))
            self.stop_load.set()
            await asyncio.gather(*tasks)
            load_s = time.monotonic() - t0
            state = await self.wait_drained()
            await asyncio.sleep(1.0)
            rss_end = rss_bytes(self.proc.pid)
            text = await self.metrics()
            seeded_checked = await self.check_seeded()
            leaked = blocks_held(state)
            summary.update({
                "load_s": round(load_s, 1),
                "running_after": len(state["running"]), "waiting_after": len(state["waiting"]),
                "blocks_leaked": leaked, "kv_usage_after": state["kv_usage"],
                "kv_usage_metric_after": metric(text, "serval:kv_cache_usage_perc"),
                "preemptions": int(metric(text, "serval:num_preemptions_total")),
                "prefix_cache_hits": int(metric(text, "serval:prefix_cache_hits_total")),
                "rss_start_mib": round(rss_start / 2**20, 2), "rss_warmup_mib": round(rss_warm / 2**20, 2),
                "rss_end_mib": round(rss_end / 2**20, 2),
                "rss_max_mib": round(max([b for _, b in self.rss] + [rss_end]) / 2**20, 2),
                "greedy_checked": self.greedy_checked, "seeded_checked": seeded_checked,
            })
            if leaked or state["running"] or state["waiting"] or state["kv_usage"] != 0:
                failures.append(f"after the load: {leaked} KV blocks held, {len(state['running'])} running, "
                                f"{len(state['waiting'])} waiting, kv_usage {state['kv_usage']}")
            if rss_end > rss_warm + self.args.rss_tolerance_mib * 2**20:
                failures.append(f"RSS grew after warm-up: {rss_warm / 2**20:.1f} MiB -> {rss_end / 2**20:.1f} MiB")
            exit_code = await self.shutdown_phase()
            summary["exit_code"] = exit_code
            if exit_code != 0:
                failures.append(f"exit code after SIGTERM: {exit_code}")
            sampler.cancel()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        L = self.ledger
        unsettled = [rid for rid, e in L.entries.items() if e["outcome"] is None]
        rejected_429 = sum(1 for e in L.entries.values() if e["outcome"] == "rejected" and e.get("detail") == "429")
        summary.update({
            "requests": len(L.entries), "completed": L.count("completed"), "client_aborted": L.count("client_aborted"),
            "rejected": L.count("rejected"), "rejected_429": rejected_429,
            "refused_after_sigterm": L.count("refused_after_sigterm"), "lost": L.count("lost") + len(unsettled),
            "faults_injected": sum(self.faults.values()), "faults": dict(self.faults),
            "sigterm_in_flight_completed": sum(1 for e in L.entries.values()
                                               if e["kind"] == "in_flight" and e["outcome"] == "completed"),
            "greedy_mismatches": sum(1 for m in self.mismatches if m["kind"] == "greedy"),
            "seeded_mismatches": sum(1 for m in self.mismatches if m["kind"] == "seeded"),
        })
        if summary["lost"]:
            failures.append(f"{summary['lost']} requests lost: " + "; ".join(f"#{r} {w}" for r, w in L.problems[:8]))
        if self.mismatches:
            m = self.mismatches[0]
            failures.append(f"{len(self.mismatches)} answers differ from their solo runs, e.g. {m['kind']} "
                            f"{json.dumps(m['body'])} choice {m['choice']}: {m['got']!r} != solo {m['solo']!r}")
        if summary["requests"] != sum(
                summary[k] for k in ("completed", "client_aborted", "rejected", "refused_after_sigterm", "lost")):
            failures.append("the ledger does not add up")
        if summary.get("preemptions", 0) == 0:
            failures.append("no preemption happened: the KV budget did not bind")
        if rejected_429 == 0:
            failures.append("no request got 429: the queue limit was not reached")
        if self.greedy_checked == 0:
            failures.append("no greedy answer was checked")
        late = [e for e in L.entries.values() if e["kind"] == "late"]
        summary["after_sigterm"] = [f"{e['outcome']}" + (f" ({e['detail']})" if e.get("detail") else "") for e in late]
        if any(e["outcome"] == "completed" for e in late):
            failures.append("a request sent after SIGTERM was served")
        summary["failures"] = failures
        summary["ok"] = not failures
        return summary


def summary_line(s):
    return (f"soak: requests {s['requests']}, completed {s['completed']}, client-aborted {s['client_aborted']}, "
            f"rejected {s['rejected']} (429: {s['rejected_429']}), refused after SIGTERM {s['refused_after_sigterm']}, "
            f"faults injected {s['faults_injected']}, lost {s['lost']}, blocks leaked {s.get('blocks_leaked', '?')}, "
            f"preemptions {s.get('preemptions', '?')}, greedy checked {s.get('greedy_checked', 0)} "
            f"(mismatches {s['greedy_mismatches']}), seeded checked {s.get('seeded_checked', 0)} "
            f"(mismatches {s['seeded_mismatches']}), RSS start/warm-up/end {s.get('rss_start_mib', '?')}/"
            f"{s.get('rss_warmup_mib', '?')}/{s.get('rss_end_mib', '?')} MiB, exit code {s.get('exit_code', '?')}")


def main(argv=None):
    args = parse_args(argv)
    summary = asyncio.run(Soak(args).run())
    print(summary_line(summary))
    for f in summary["failures"]:
        print("FAIL:", f)
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
