"""A model split over MPI ranks (--tp / --pp, docs/scale-out.md), the ranks forced onto TCP, one
compute thread each: pipeline stages give the bits of one process; tensor parallelism gives the
greedy tokens of one process and the bits of the one-process run that splits its sums the same way
(`--tp 2` without mpirun: the ranks as threads); a killed rank ends the others with an error."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import DATA, MODELS, SERVAL, cached_model, run

MPIRUN = shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(MPIRUN is None, reason="mpirun (OpenMPI) is not installed")
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
PROMPTS = {"stories260K": "Once upon a time", "qwen2.5-coder-0.5b-instruct": "def fibonacci(n):"}
TOKENS = {"stories260K": 24, "qwen2.5-coder-0.5b-instruct": 8}


def model_path(name):
    return MODELS / f"{name}.gguf" if name == "stories260K" else cached_model(name)


def mpirun_cmd(n_ranks, *args):
    return [MPIRUN, "--oversubscribe", "-np", str(n_ranks), "--mca", "btl", "self,tcp", str(SERVAL), *map(str, args)]


def gen_args(name, n=None):
    return ["generate", "-m", model_path(name), "-p", PROMPTS[name], "-n", n or TOKENS[name], "--temp", "0",
            "-t", "1", "--json", "--logprobs", "3"]


def events(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def one_process(name, *flags):
    return events(run(*gen_args(name), *flags, timeout=60).stdout)


def ranks(n_ranks, name, *flags):
    p = subprocess.run(mpirun_cmd(n_ranks, *gen_args(name), *flags), capture_output=True, text=True, timeout=60,
                       env=ENV)
    assert p.returncode == 0, p.stderr
    return events(p.stdout)


@needs_mpi
@pytest.mark.parametrize("name", list(PROMPTS))
def test_pipeline_is_bitwise_one_process(name):
    plain = one_process(name)
    assert len(plain) == TOKENS[name]
    assert ranks(2, name, "--pp", 2) == plain  # ids and log-probabilities, exactly


@needs_mpi
@pytest.mark.parametrize("name", list(PROMPTS))
def test_tensor_parallel_tokens_and_logits(name):
    plain, emulated = one_process(name), one_process(name, "--tp", 2)
    split = ranks(2, name, "--tp", 2)
    assert [e["id"] for e in split] == [e["id"] for e in plain]
    assert split == emulated  # the same sums in the same order: the same bits
    # Against the plain run the log-probabilities move by float rounding only.
    for a, b in zip(split, plain):
        assert abs(a["logprob"] - b["logprob"]) < 0.1


@needs_mpi
@pytest.mark.parametrize("family", ["qwen2moe", "gpt_oss", "deepseek2"])
def test_mixture_of_experts_over_ranks(family):
    """Every rank's columns of each expert and of the shared expert (DeepSeek: its heads of the latent
    attention too) over two MPI ranks: the bits of the one-process `--tp 2`; two stages: the bits of one
    process (the tiny random models of tests/data/families)."""
    args = ["generate", "-m", DATA / "families" / family, "-p", "Once upon a time", "-n", 12, "--temp", "0",
            "-t", "1", "--json", "--logprobs", "3"]
    plain = events(run(*args, timeout=60).stdout)
    assert len(plain) == 12
    for flags in (["--tp", 2], ["--pp", 2]):
        p = subprocess.run(mpirun_cmd(2, *args, *flags), capture_output=True, text=True, timeout=60, env=ENV)
        assert p.returncode == 0, p.stderr
        want = plain if flags[0] == "--pp" else events(run(*args, *flags, timeout=60).stdout)
        assert events(p.stdout) == want, flags
    assert [e["id"] for e in want] == [e["id"] for e in plain]  # TP: the same greedy tokens


@needs_mpi
def test_pipeline_perplexity_is_bitwise_one_process():
    """128-token batches run as micro-batches over the stages: the same bits all the same."""
    args = ["perplexity", "-m", model_path("stories260K"), "-f", DATA / "tinystory.txt", "-c", 128, "-t", 1]
    plain = run(*args, timeout=60).stdout
    p = subprocess.run(mpirun_cmd(2, *args, "--pp", 2), capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 0, p.stderr
    assert "Final estimate" in plain and p.stdout == plain


@needs_mpi
def test_four_ranks_tensor_and_pipeline():
    assert ranks(4, "stories260K", "--tp", 2, "--pp", 2) == one_process("stories260K", "--tp", 2)


@needs_mpi
def test_wrong_rank_count_is_an_error():
    p = subprocess.run(mpirun_cmd(2, *gen_args("stories260K"), "--tp", 2, "--pp", 2), capture_output=True,
                       text=True, timeout=60, env=ENV)
    assert p.returncode != 0
    assert "needs 4 ranks, but mpirun started 2" in p.stderr
    p = subprocess.run(mpirun_cmd(2, *gen_args("stories260K")), capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode != 0
    assert "mpirun started 2 ranks: split the model over them with --tp T --pp P" in p.stderr


def rank_pid(parent, rank):
    """The pid of MPI rank `rank` among the children of mpirun (by its OMPI_COMM_WORLD_RANK)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(pid)
    return None


@needs_mpi
@pytest.mark.parametrize("flags,victim", [(["--pp", 2], 1), (["--tp", 2], 1), (["--tp", 2], 0)])
def test_killed_rank_ends_the_replica(flags, victim):
    args = gen_args("qwen2.5-coder-0.5b-instruct", n=4000) + ["--ignore-eos", *flags]
    p = subprocess.Popen(mpirun_cmd(2, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert p.stdout.readline().startswith("{")  # generating
        pid = rank_pid(p.pid, victim)
        assert pid, f"rank {victim} not found"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        p.wait(timeout=15)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert elapsed < 10, f"the other rank took {elapsed:.1f} s to end"
    assert f"rank {victim}" in p.stderr.read()  # mpirun names the rank that died


def test_one_process_splits_without_mpirun():
    """Without mpirun the ranks are threads: --pp 2 is still the bits of the whole model."""
    assert one_process("stories260K", "--pp", 2) == one_process("stories260K")
    assert [e["id"] for e in one_process("stories260K", "--tp", 2, "--pp", 2)] == [e["id"] for e in one_process("stories260K")]


def test_plan_shows_memory_per_rank():
    out = run("plan", cached_model("qwen2.5-coder-0.5b-instruct"), "--tp", 2, "--pp", 2, "-c", 4096).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    # rank 0: stage 0, TP rank 0, layers 0-11, 7 of 14 heads, 1 of 2 KV heads, a quarter of the KV per token
    assert rows[0].split(" | ")[:6] == ["| 0", "0", "0", "0-11", "7", "1"]
    assert "3.00 KiB" in rows[0]  # 2 x 12 layers x 1 KV head x 64 x 2 bytes
    assert rows[3].split(" | ")[3] == "12-23"


@needs_mpi
def test_serve_split_over_ranks():
    """`serve --tp 2` under mpirun: only rank 0 binds the port; its greedy completions are those of one
    process that splits its sums the same way; SIGTERM to mpirun ends every rank."""
    from server_util import Server, free_port
    import urllib.request
    body = {"prompt": PROMPTS["stories260K"], "max_tokens": 16, "temperature": 0}
    alone = Server(MODELS / "stories260K.gguf", "-t", "1", "--tp", 2)  # the ranks as threads
    try:
        want = alone.post("/v1/completions", body)[1]["choices"][0]["text"]
    finally:
        alone.stop()
    port = free_port()
    proc = subprocess.Popen(mpirun_cmd(2, "serve", MODELS / "stories260K.gguf", "--port", port, "-t", 1, "--tp", 2,
                                       "--kv-cache-memory", "64MiB"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.load(r)["status"] == "ok":
                        break
            except OSError:
                assert time.time() < deadline, "the split server did not become ready"
                time.sleep(0.3)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["choices"][0]["text"] == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert "each of 2 ranks" in out, out  # the capacity line: the KV budget is per rank


def test_plan_per_rank_from_a_preset():
    """No file: even shares. Llama 3 70B at 32K, F16 KV, --tp 4: 80 layers x 2 of 8 KV heads x 128 x 2 x 2 bytes =
    80 KiB per token, 2.5 GiB per sequence; a quarter of the weights per rank."""
    out = run("plan", "--preset", "llama3-70b", "--weight-bits", 16, "-c", 32768, "--memory", "141GiB", "--tp", 4).stdout
    row = [line for line in out.splitlines() if line.startswith("| 0 |")][0].split("|")
    assert row[2].strip() == "0-79" and row[4].strip() == "2"
    assert row[5].strip() == "80.00 KiB" and row[6].strip() == "2.50 GiB"
    assert row[3].strip() == "32.88 GiB"  # 70.6e9 x 2 bytes / 4
    assert int(row[7]) == int((141 * 2**30 - 70.6e9 * 2 / 4) // (2.5 * 2**30))
    assert "need a model file" not in out
