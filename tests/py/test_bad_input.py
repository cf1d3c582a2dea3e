"""Bad model files and impossible parameters: a clear one-line error and exit code 1, never a crash."""
import os
import random

import pytest

from conftest import MODELS, run

STORIES = MODELS / "stories260K.gguf"


def assert_clean_error(p, *needles):
    assert p.returncode == 1, f"expected exit 1, got {p.returncode} (a negative code is a crash)\n{p.stderr}"
    assert p.stderr.startswith("error: "), p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr


def corrupted(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_wrong_magic(tmp_path):
    data = bytearray(STORIES.read_bytes())
    data[:4] = b"GGUX"
    path = corrupted(tmp_path, "magic.gguf", bytes(data))
    assert_clean_error(run("info", path, check=False), str(path), "bad magic")


@pytest.mark.parametrize("fraction", [0.0001, 0.001, 0.01, 0.3, 0.9, 0.999])
def test_truncated(tmp_path, fraction):
    data = STORIES.read_bytes()
    path = corrupted(tmp_path, "cut.gguf", data[: int(len(data) * fraction)])
    assert_clean_error(run("generate", "-m", path, "-p", "hi", "-n", 1, check=False), str(path), "truncated")


def test_random_garbage_after_header(tmp_path):
    rng = random.Random(3)
    data = bytearray(STORIES.read_bytes()[:24]) + bytes(rng.getrandbits(8) for _ in range(4096))
    p = run("info", corrupted(tmp_path, "garbage.gguf", bytes(data)), check=False)
    assert_clean_error(p)


def test_random_byte_flips_never_crash(tmp_path):
    base = STORIES.read_bytes()
    rng = random.Random(11)
    for i in range(40):
        data = bytearray(base)
        for _ in range(8):
            pos = rng.randrange(0, 20000)  # header, metadata and tensor index
            data[pos] = rng.getrandbits(8)
        p = run("info", corrupted(tmp_path, f"flip{i}.gguf", bytes(data)), check=False)
        assert p.returncode in (0, 1), f"flip set {i}: exit {p.returncode}\n{p.stderr}"


def test_missing_file_and_directory(tmp_path):
    assert_clean_error(run("info", tmp_path / "nope.gguf", check=False), "nope.gguf")
    assert_clean_error(run("info", tmp_path, check=False), "model.safetensors")


def test_empty_file(tmp_path):
    assert_clean_error(run("info", corrupted(tmp_path, "empty.gguf", b""), check=False), "bad magic")


def test_safetensors_with_bad_header(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text((MODELS / "TinyStories-656K" / "config.json").read_text())
    (d / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert_clean_error(run("info", d, check=False), "header length")
    (d / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops")
    assert_clean_error(run("info", d, check=False), "invalid safetensors JSON")


@pytest.mark.parametrize("args,needle", [
    (["--temp", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--min-p", "2"], "min_p"),
    (["--logit-bias", "99999+1"], "logit_bias"),
    (["--logit-bias", "nonsense"], "--logit-bias"),
    (["-n", "-5"], "-n"),
    (["--cache-type", "q9"], "cache type"),
    (["-c", "3"], "does not fit"),
])
def test_impossible_parameters(args, needle):
    p = run("generate", "-m", STORIES, "-p", "Once upon a time", *args, check=False)
    assert_clean_error(p, needle)


def test_unknown_cached_model_name():
    assert_clean_error(run("info", "no-such-model", check=False), "serval pull")
