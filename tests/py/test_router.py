"""Replicas behind an existing cache-aware router: three `serval serve` processes behind SGLang's router
(`smg`, PyPI), the reference deployment of docs/scale-out.md. A shared-prefix workload gets a clearly
higher prefix-cache hit rate with `cache_aware` than with `round_robin` (read from the workers' own
/metrics, under vLLM's names with --metrics-names vllm); `kill -9` of one worker mid-load loses only
requests that worker held, the router routes around it afterwards, and the worker restarted at its
address rejoins."""
import concurrent.futures
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import MODELS
from server_util import Server, free_port

STORIES = MODELS / "stories260K.gguf"
WORDS = ("the cat dog sun tree ball girl boy happy little big red blue park day play ran saw went "
         "friend mom dad home water sky bird fish cake toy box hat car book").split()


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from {url}/metrics"
    return float(m.group(1))


def hit_counts(workers):
    return [(metric(w.url, "vllm:prefix_cache_hits_total"), metric(w.url, "vllm:prefix_cache_queries_total"))
            for w in workers]


class Router:
    def __init__(self, policy, workers):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
             "--worker-urls", *[w.url for w in workers], "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1", "--prometheus-port", str(free_port())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, "smg exited"
            try:
                self.client.models.list()
                return
            except openai.APIError:
                time.sleep(0.5)
        raise TimeoutError("smg did not become ready")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def workers():
    ws = [Server(STORIES, "--metrics-names", "vllm", "--max-model-len", 512) for _ in range(3)]
    yield ws
    for w in ws:
        if w.proc.poll() is None:
            w.stop()


def shared_prefix_workload(rng, groups=6, per_group=8, prefix_words=120):
    prompts = []
    for _ in range(groups):
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        prompts += [prefix + " " + " ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def hit_rate(policy, workers, seed):
    router = Router(policy, workers)
    try:
        before = hit_counts(workers)
        for prompt in shared_prefix_workload(random.Random(seed)):
            router.client.completions.create(model="stories260K", prompt=prompt, max_tokens=2, temperature=0)
        after = hit_counts(workers)
    finally:
        router.stop()
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / queries


def test_cache_aware_routing_raises_the_prefix_hit_rate(workers):
    rr = hit_rate("round_robin", workers, seed=1)
    ca = hit_rate("cache_aware", workers, seed=2)  # other prefixes: nothing cached from the first run
    print(f"prefix-cache hit rate: round_robin {rr:.2f}, cache_aware {ca:.2f}")
    assert ca > rr + 0.1, (rr, ca)
    assert ca > 0.6


def test_killed_worker_loses_only_its_requests(workers):
    router = Router("round_robin", workers)
    try:
        def ask(i):
            try:
                r = router.client.completions.create(model="stories260K", prompt=f"Once upon a time {i}",
                                                     max_tokens=200, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
                return r.choices[0].finish_reason
            except (openai.APIError, openai.APIConnectionError) as e:
                return f"error: {e}"
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(ask, i) for i in range(12)]
            time.sleep(1.0)  # all in flight, four on each worker
            victim = workers[1]
            in_flight = metric(victim.url, "vllm:num_requests_running") + metric(victim.url, "vllm:num_requests_waiting")
            victim.proc.kill()  # kill -9
            results = [f.result() for f in futures]
        failed = [r for r in results if r != "length"]
        assert len(failed) <= in_flight, (in_flight, results)
        assert len(results) - len(failed) >= 12 - in_flight
        time.sleep(3)  # the router's health check (every second) marks the worker down
        after = [ask(100 + i) for i in range(6)]
        assert after == ["length"] * 6, after
        # The worker restarts at its address and rejoins: the router sends it requests again.
        workers[1] = Server(STORIES, "--metrics-names", "vllm", "--max-model-len", 512, port=victim.port)
        deadline = time.time() + 30
        while workers[1].metric("vllm:request_success_total") == 0:
            assert time.time() < deadline, "the restarted worker got no request from the router"
            assert ask(200) == "length"
        assert [ask(300 + i) for i in range(6)] == ["length"] * 6
    finally:
        router.stop()


def test_vllm_metric_names_for_gateways(workers):
    """The Gateway API Inference Extension's model-server protocol reads vLLM's gauges."""
    for name in ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "serval:num_requests_waiting"]:
        assert metric(workers[0].url, name) >= 0
    plain = Server(STORIES)
    try:
        with urllib.request.urlopen(plain.url + "/metrics", timeout=10) as r:
            assert "vllm:" not in r.read().decode()
    finally:
        plain.stop()
