"""`serval bench-serving --url`: the HTTP load generator, against a real `serval serve` on the tiny
stories260K model (it has no chat template of its own: without --chat-template the chat endpoint
gives a real 400 to report, with the ChatML one it streams chat chunks)."""
import json

import pytest

from conftest import DATA, MODELS, run
from server_util import Server, free_port

STORIES = MODELS / "stories260K.gguf"
NAME = "stories"
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server():
    s = Server(STORIES, name=NAME)
    yield s
    assert s.stop() == 0


def bench(server, *args, check=True):
    return run("bench-serving", "--url", server.url, *args, check=check, timeout=120)


def assert_level(level, requests, output_len):
    assert level["completed"] == requests and level["failed"] == 0 and level["errors"] == {}
    assert level["total_output_tokens"] == requests * output_len  # ignore_eos: every request gives all its tokens
    assert level["total_input_tokens"] > 0  # from the server's usage
    assert level["request_throughput"] > 0 and level["output_throughput"] > 0
    for metric in METRICS:  # chunks read together share a time: an ITL may be 0
        d = level[metric]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"] and d["mean"] >= 0, (metric, d)
    assert level["ttft_ms"]["p50"] > 0 and level["e2e_ms"]["p50"] > 0
    assert level["ttft_ms"]["n"] == requests and level["e2e_ms"]["n"] == requests
    assert level["ttft_ms"]["p99"] <= level["e2e_ms"]["p99"]


def test_concurrency_sweep_reports_every_request(server, tmp_path):
    report_path = tmp_path / "bench.json"
    p = bench(server, "--requests", 8, "--concurrency", "1,4", "--output-len", 8, "--prompt-words", 20,
              "--json", report_path)
    report = json.loads(report_path.read_text())
    meta = report["metadata"]
    assert meta["url"] == server.url and meta["model"] == NAME and meta["requests"] == 8 and meta["output_len"] == 8
    assert meta["prompts"] == {"source": "synthetic", "prompt_words": 20, "prompt_file": None, "shared_prefix_words": 0}
    assert [r["concurrency"] for r in report["results"]] == [1, 4]
    for level in report["results"]:
        assert_level(level, 8, 8)
        assert level["goodput"] == level["request_throughput"]  # no SLO: every request counts
    assert "| 1 | 8 | 0 |" in p.stdout and "| 4 | 8 | 0 |" in p.stdout  # the human-readable table
    assert "| 4 | TTFT |" in p.stdout


def test_request_rate_prompt_file_shared_prefix_and_slo(server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe little dog ran\nLily saw a big red ball\n")
    report_path = tmp_path / "bench.json"
    bench(server, "--requests", 6, "--request-rate", 40, "--output-len", 5, "--prompt-file", prompts,
          "--shared-prefix-words", 10, "--slo-ttft-ms", 0.001, "--json", report_path)
    report = json.loads(report_path.read_text())
    assert report["metadata"]["mode"] == "request-rate"
    assert report["metadata"]["prompts"]["source"] == "file"
    [level] = report["results"]
    assert level["request_rate"] == 40 and level["concurrency"] is None
    assert_level(level, 6, 5)
    assert level["good_requests"] == 0 and level["goodput"] == 0  # no TTFT is a microsecond


def test_chat_endpoint_counts_content_chunks(tmp_path):
    chat_server = Server(STORIES, "--chat-template", DATA / "chat_templates" / "chatml.jinja", name=NAME)
    try:
        report_path = tmp_path / "bench.json"
        bench(chat_server, "--endpoint", "chat", "--requests", 4, "--concurrency", 2, "--output-len", 6,
              "--prompt-words", 10, "--json", report_path)
    finally:
        assert chat_server.stop() == 0
    report = json.loads(report_path.read_text())
    assert report["metadata"]["endpoint"] == "chat"
    assert_level(report["results"][0], 4, 6)


def test_plot_writes_a_png(server, tmp_path):
    png = tmp_path / "bench.png"
    bench(server, "--requests", 4, "--concurrency", "1,2", "--output-len", 4, "--prompt-words", 8, "--plot", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "bench.png.json").exists()  # the report it plotted was temporary


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p = run("bench-serving", "--url", url, "--requests", 2, check=False, timeout=60)
    assert p.returncode == 1
    assert p.stderr.startswith(f"error: cannot reach {url}: connect failed: "), p.stderr
    assert "refused" in p.stderr.lower()


@pytest.mark.parametrize("args,message", [
    (["--url", "ftp://127.0.0.1/"], "expected http://HOST[:PORT][/PATH]"),
    (["--url", "https://127.0.0.1/"], "https is not supported"),
    (["--url", "http://127.0.0.1:99999"], "bad port '99999'"),
    (["--url", "http://:8080"], "no host"),
    (["--url", "http://127.0.0.1:1", "--concurrency", "1,x"], "--concurrency '1,x': expected positive numbers"),
    (["--url", "http://127.0.0.1:1", "--endpoint", "embeddings"], "--endpoint is completions or chat"),
    (["--url", "http://127.0.0.1:1", "-m", STORIES], "--model is for the in-process mode"),
    (["--prompt-words", 5, "-m", STORIES], "--prompt-words needs --url"),
    (["--requests", 4], "--model is required (or --url"),
])
def test_bad_options_are_clear_errors(args, message):
    p = run("bench-serving", *args, check=False, timeout=60)
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert "terminate" not in p.stderr and "Traceback" not in p.stderr


def test_http_error_replies_fail_clearly(server):
    p = bench(server, "--requests", 2, "--served-model", "no-such-model", check=False)
    assert p.returncode == 1
    assert "the test request" in p.stderr and "HTTP 404" in p.stderr and "no-such-model" in p.stderr, p.stderr
    p = bench(server, "--requests", 2, "--endpoint", "chat", check=False)  # stories260K has no chat template
    assert p.returncode == 1 and "HTTP 400" in p.stderr and "chat template" in p.stderr, p.stderr
