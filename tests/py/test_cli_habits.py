"""What users of llama.cpp and vLLM type, on the real `serval` binary: the model as `-m/--model` or as
the positional on every command that takes one, llama.cpp's multi-letter single-dash flags (`-ngl`,
`-np`, `-md`, ...), llama-server's `-c/-np/-t/--host/--port` on `serve`, vLLM's `--max-num-seqs`,
`serval --version`, and an unknown flag's message naming the nearest known one.

Expected values: the recorded greedy continuation of stories260K (../shared/models/README.md, as in
test_cli.py), the KV capacity arithmetic (ceil(N / block size) blocks), and the flag names themselves."""
import json
import re
import subprocess
import urllib.request

import pytest

from conftest import MODELS, SERVAL, run
from server_util import free_port

STORIES = MODELS / "stories260K.gguf"
CONTINUATION = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
GREEDY = ["-p", "Once upon a time", "-n", 32, "--temp", 0]


@pytest.mark.parametrize("model_args", [["-m", STORIES], ["--model", STORIES], [STORIES]], ids=["-m", "--model", "positional"])
def test_generate_takes_the_model_every_way(model_args):
    out = run("generate", *model_args, *GREEDY)
    assert out.stdout.startswith(CONTINUATION)


@pytest.mark.parametrize("command,extra", [("info", []), ("tokenize", ["-p", "Once upon a time"]),
                                           ("plan", ["--memory", "1GiB", "--json"])])
def test_model_flag_and_positional_are_the_same(command, extra):
    by_flag = run(command, "-m", STORIES, *extra).stdout
    assert by_flag and by_flag == run(command, STORIES, *extra).stdout


def test_ngl_is_accepted_and_explained_on_the_cpu():
    out = run("generate", "-m", STORIES, *GREEDY, "-ngl", 99)
    assert out.stdout.startswith(CONTINUATION)  # as before: it changes nothing but the note
    assert "-ngl/--n-gpu-layers 99: this build of Serval has no GPU backend; every layer runs on the CPU" in out.stderr
    assert "no GPU backend" not in run("generate", "-m", STORIES, *GREEDY, "-ngl=0").stderr


def test_llama_cpp_multi_letter_flag_serval_lacks_fails_by_its_long_name():
    # -fa would have been read as "-f a" (a prompt file named "a"); it becomes --flash-attn, which fails clearly.
    p = run("generate", "-m", STORIES, *GREEDY, "-fa", "on", check=False)
    assert p.returncode != 0 and "--flash-attn" in p.stderr and "Traceback" not in p.stderr


def start(*args):
    port = free_port()
    proc = subprocess.Popen([str(SERVAL), "serve", *map(str, args), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:  # the lines up to "ready" (or the end of a failed start)
        log.append(line)
        if "serval: ready" in line:
            break
    return proc, port, "".join(log)


def test_serve_takes_llama_server_flags():
    # llama-server's habits: -m, -c (here the KV cache's tokens over all requests), -np, -t, -ngl, --host.
    proc, port, log = start("-m", STORIES, "--host", "127.0.0.1", "-c", 1000, "-np", 3, "-t", 1, "-ngl", 99)
    try:
        assert proc.poll() is None, log
        m = re.search(r"(\d+) blocks of (\d+) tokens = (\d+) tokens", log)
        assert m and m.groups() == ("63", "16", "1008"), log  # ceil(1000 / 16) = 63 blocks
        assert "at most 3 running requests" in log, log
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert CONTINUATION.startswith("Once upon a time" + json.load(r)["choices"][0]["text"])
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_serve_takes_vllm_names():
    proc, _, log = start(STORIES, "--max-num-seqs", 5, "--max-num-batched-tokens", 256)
    try:
        assert "at most 5 running requests, 256 tokens per step" in log, log
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_version():
    out = run("--version").stdout
    assert re.match(r"serval \d+\.\d+\.\d+\nbuilt with (gcc|clang) [\d.]+; CPU kernels on this machine: "
                    r"(scalar|avx2|avx512|amx); GPU backends: none\n", out), out


@pytest.mark.parametrize("args,typed,meant", [
    (["generate", "-m", STORIES, "-p", "x", "--n-predcit", "4"], "--n-predcit", "--n-predict"),
    (["serve", STORIES, "--max-num-seq", "4"], "--max-num-seq", "--max-num-seqs"),
    (["serve", STORIES, "--kv-cache-memroy", "1GiB"], "--kv-cache-memroy", "--kv-cache-memory"),
    (["genrate", "-m", STORIES], "genrate", "generate"),
])
def test_unknown_flag_names_the_nearest(args, typed, meant):
    p = run(*args, check=False, timeout=60)
    assert p.returncode != 0
    assert f"{typed}: did you mean '{meant}'?" in p.stderr, p.stderr


def test_unknown_flag_far_from_any_gets_no_guess():
    p = run("generate", "-m", STORIES, "--zzzzzzzzzzzz", check=False, timeout=60)
    assert p.returncode != 0 and "not expected: --zzzzzzzzzzzz" in p.stderr and "did you mean" not in p.stderr
