#!/usr/bin/env python3
"""Side-by-side prompt-processing and decode throughput: Serval's `serval bench` and llama.cpp's
`llama-bench`, run alternately in one session on the same GGUF files and thread count.

The peer is not part of this repository: build llama.cpp yourself, outside the tree, and pass its
llama-bench binary. Each test runs `--rounds` times per engine, alternating, each run being a median
of `-r` repetitions; the table reports the median over rounds and the ratio Serval / llama.cpp.

  scripts/bench_peer.py --llama-bench /path/to/llama-bench -m MODEL.gguf [-m ...] \
      --tests pp512,pp4096,tg128 -t 2 --json out.json
  scripts/bench_peer.py ... --serval before/serval --serval build/serval   # a change and the peer in one run
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_test(name):
    m = re.fullmatch(r"(pp|tg)(\d+)", name)
    if not m:
        sys.exit(f"bad test '{name}' (ppN or tgN)")
    return m.group(1), int(m.group(2))


def run_serval(serval, model, kind, n, threads, reps):
    args = [serval, "bench", "-m", model, "-t", str(threads), "-r", str(reps)]
    args += ["-p", str(n), "-n", "0"] if kind == "pp" else ["-p", "0", "-n", str(n)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1] == f"{kind}{n}":
            return float(cells[2])
    raise RuntimeError(f"no {kind}{n} row in serval bench output:\n{out}")


def run_llama(llama_bench, model, kind, n, threads, reps):
    args = [llama_bench, "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json"]
    args += ["-p", str(n), "-n", "0"] if kind == "pp" else ["-p", "0", "-n", str(n)]
    rows = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    row = next(r for r in rows if (r["n_prompt"], r["n_gen"]) == ((n, 0) if kind == "pp" else (0, n)))
    return statistics.median(row["samples_ts"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary (built outside the repo)")
    ap.add_argument("--serval", action="append",
                    help="a serval binary (default build/serval); several (a before and an after) run in the same "
                         "rounds, each in a column of its own")
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--tests", default="pp512,tg128")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions inside each run (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per engine (default 3)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    binaries = a.serval or [str(ROOT / "build" / "serval")]
    names = [f"Serval ({b})" for b in binaries] if len(binaries) > 1 else ["Serval"]
    results = []
    print("| model | test | llama.cpp t/s | " + " | ".join(f"{n} t/s | ratio" for n in names) + " |")
    print("|---|---|---|" + "---|---|" * len(names))
    for model in a.model:
        for test in a.tests.split(","):
            kind, n = parse_test(test)
            peer, ours = [], [[] for _ in binaries]
            for _ in range(a.rounds):
                peer.append(run_llama(a.llama_bench, model, kind, n, a.threads, a.reps))
                for runs, binary in zip(ours, binaries):
                    runs.append(run_serval(binary, model, kind, n, a.threads, a.reps))
            p = statistics.median(peer)
            cells = []
            for runs, binary in zip(ours, binaries):
                s = statistics.median(runs)
                results.append({"model": Path(model).name, "test": test, "serval_binary": binary, "llama_cpp": p,
                                "serval": s, "ratio": s / p, "llama_cpp_runs": peer, "serval_runs": runs})
                cells.append(f"{s:.1f} | {s / p:.2f}x")
            print(f"| {Path(model).name} | {test} | {p:.1f} | " + " | ".join(cells) + " |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
