"""Shared fixtures for the black-box tests: the real `serval` binary, shared models, the model cache."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
# SERVAL_BIN runs the tests against another build of the binary (scripts/sanitize: the TSan one).
SERVAL = pathlib.Path(os.environ["SERVAL_BIN"]).resolve() if os.environ.get("SERVAL_BIN") else BUILD / "serval"
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"
CACHE = pathlib.Path(os.environ.get("SERVAL_MODEL_CACHE", pathlib.Path.home() / ".cache" / "serval" / "models"))
DATA = ROOT / "tests" / "data"


def run(*args, check=True, timeout=600, **kw):
    """Runs serval with `args`; returns the CompletedProcess (text mode)."""
    p = subprocess.run([str(SERVAL), *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"serval {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr}")
    return p


def cached_model(name: str) -> pathlib.Path:
    """Path of a model fetched by scripts/setup; a missing model is a test failure, not a skip."""
    path = CACHE / f"{name}.gguf"
    assert path.exists(), f"{path} missing: run scripts/setup (it fetches the models)"
    return path


@pytest.fixture(scope="session")
def serval_bin():
    assert SERVAL.exists(), f"{SERVAL} missing: run scripts/setup"
    return SERVAL


# The default model's server and an official openai client for it, once per test module; a module
# that needs other flags or another model defines its own `server` (and `client`).
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def server():
    from server_util import Server  # server_util imports this module
    s = Server(cached_model(DEFAULT_MODEL), name=DEFAULT_MODEL)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
