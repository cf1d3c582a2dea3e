"""scripts/heads-corpus's requests, without a server: deterministic for a seed, never one of the
benchmark prompts' functions, and a rename request names a variable its function assigns."""
import ast
import functools
import importlib.machinery
import importlib.util
import random
import re

from conftest import ROOT


@functools.lru_cache(maxsize=1)  # once per session: loading it parses the standard library's functions (~15 s)
def load():
    loader = importlib.machinery.SourceFileLoader("heads_corpus", str(ROOT / "scripts" / "heads-corpus"))
    spec = importlib.util.spec_from_loader("heads_corpus", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_requests_are_deterministic_and_leave_out_the_benchmark_functions():
    hc = load()
    first, again, other = (hc.requests(random.Random(seed), 300) for seed in (1, 1, 2))
    assert first == again and first != other
    for prompt in first:
        for name in hc.EXCLUDED:
            assert f"def {name}(" not in prompt
    kinds = {"edit": sum(p.startswith("<|im_start|>") and "def " in p for p in first),
             "prose": sum(p.startswith("<|im_start|>") and "def " not in p for p in first),
             "completion": sum(not p.startswith("<|im_start|>") for p in first)}
    assert all(n > 30 for n in kinds.values()), kinds


def test_a_rename_request_names_a_variable_of_its_function_and_a_new_name():
    hc = load()
    renames = [p for p in hc.requests(random.Random(1), 600) if "Rename the variable" in p]
    assert len(renames) >= 5
    for prompt in renames:
        old, new = re.search(r"Rename the variable `(\w+)` to `(\w+)`", prompt).groups()
        source = prompt.split("\n\n", 1)[1].split("<|im_end|>")[0]
        assigned = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        assert old in assigned and new != old
        assert hc.LONGER.get(old, new) == new
    # A function that assigns nothing gets no rename request.
    assert hc.rename_request(random.Random(1), "def f(x):\n    return x\n") is None
