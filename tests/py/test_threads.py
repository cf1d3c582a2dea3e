"""`serve -t N` computes on N threads. The engine runs on its own thread, and OpenMP's thread count is
per thread, so `-t` once reached only the main thread while the engine thread computed on every core.
Measured from outside: the CPU time of each of the server's threads (/proc/PID/task/*/stat) after a
generation-heavy load; with -t 1 only one thread does the work. Compute now runs on a pool whose
threads claim tasks dynamically (the engine thread works too), so on this tiny model the pool's
worker gets a smaller share than the engine thread: a computing thread is one with at least a tenth of
the busiest thread's CPU time, far above the HTTP threads' (which only wait and copy tokens)."""
import concurrent.futures
import os
import time

import pytest

from conftest import MODELS
from server_util import Server

STORIES = MODELS / "stories260K.gguf"
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid):
    """CPU seconds (user + system) of each thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended
        out[tid] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)
    return out


def busy_threads(server, min_busiest=0.5, deadline_s=120):
    """Runs small batches of concurrent generations until the busiest thread has `min_busiest` CPU
    seconds; returns the threads' CPU seconds, busiest first."""
    body = {"prompt": "Once upon a time there was a little girl named Lily. " * 4, "max_tokens": 100,
            "ignore_eos": True, "temperature": 0}
    deadline = time.time() + deadline_s
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        while True:
            results = list(pool.map(lambda _: server.post("/v1/completions", body), range(3)))
            assert all(st == 200 for st, _, _ in results), results[0]
            cpu = sorted(thread_cpu_seconds(server.proc.pid).values(), reverse=True)
            if cpu[0] >= min_busiest or time.time() > deadline:
                return cpu


@pytest.mark.parametrize("threads", [1, 2])
def test_serve_computes_on_the_requested_number_of_threads(threads):
    if threads > 1 and len(os.sched_getaffinity(0)) < threads:
        pytest.skip(f"needs {threads} cores")
    s = Server(STORIES, "-t", threads)
    try:
        cpu = busy_threads(s)
        busiest = cpu[0]
        assert busiest >= 0.3, f"too little work to measure: {cpu}"
        # A computing thread gets a share of the work; the HTTP threads only wait and copy tokens.
        computing = [c for c in cpu if c >= 0.1 * busiest]
        assert len(computing) == threads, f"-t {threads}: threads' CPU seconds {cpu}"
    finally:
        assert s.stop() == 0
