"""A bounded slice of the soak and fault test (tests/soak/soak.py, 60 s of load): mixed streaming and
non-streaming traffic with preemption, 429s, client hang-ups and a SIGTERM mid-flight on stories260K.
Asserts what soak.py asserts (see its docstring): no request lost, greedy and seeded answers equal
their solo runs, no KV block held after the load, RSS flat after warm-up, exit code 0."""
import json
import subprocess
import sys

from conftest import MODELS, ROOT, SERVAL

SOAK = ROOT / "tests" / "soak" / "soak.py"


def test_soak_slice(tmp_path):
    report = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(SOAK), "--duration", "60", "--seed", "1", "--binary", str(SERVAL),
                        "--model", str(MODELS / "stories260K.gguf"), "--report", str(report),
                        "--server-log", str(tmp_path / "server.log")],
                       capture_output=True, text=True, timeout=600)
    print(p.stdout, p.stderr)
    assert report.exists(), f"soak.py wrote no report (exit {p.returncode}):\n{p.stderr[-3000:]}"
    s = json.loads(report.read_text())
    assert s["lost"] == 0, s["failures"]
    assert s["greedy_mismatches"] == 0 and s["seeded_mismatches"] == 0, s["failures"]
    assert s["blocks_leaked"] == 0, s["failures"]
    assert s["exit_code"] == 0, s["failures"]
    assert s["ok"] and p.returncode == 0, s["failures"]
