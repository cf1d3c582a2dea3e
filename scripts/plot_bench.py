#!/usr/bin/env python3
"""Plots a `serval bench-serving --url ... --json FILE` report: output tokens/s and TTFT p50/p99
against concurrency (or request rate, for an open-loop run).

    scripts/plot_bench.py REPORT.json OUT.png

`serval bench-serving --plot OUT.png` runs this script itself.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def axis(results):
    """The x values and their label: concurrency, or request rate for open-loop runs."""
    if all(r.get("request_rate") is not None for r in results):
        return [r["request_rate"] for r in results], "request rate (req/s)"
    return [r["concurrency"] for r in results], "concurrency"


def plot(report, out):
    results = report["results"]
    meta = report.get("metadata", {})
    x, xlabel = axis(results)
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    tput.plot(x, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    tput.set_ylabel("output tokens/s")
    ttft.plot(x, [r["ttft_ms"]["p50"] for r in results], "o-", label="TTFT p50")
    ttft.plot(x, [r["ttft_ms"]["p99"] for r in results], "s--", label="TTFT p99")
    ttft.set_ylabel("time to first token (ms)")
    for ax in (tput, ttft):
        ax.set_xlabel(xlabel)
        if len(x) > 1 and min(x) > 0 and max(x) / min(x) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{v:g}" for v in x])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{meta.get('model', '?')} at {meta.get('url', '?')} ({meta.get('endpoint', 'completions')}, "
                 f"{meta.get('output_len', '?')} output tokens, {meta.get('date', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} REPORT.json OUT.png")
    with open(sys.argv[1]) as f:
        report = json.load(f)
    if not report.get("results"):
        sys.exit(f"{sys.argv[1]}: no results to plot")
    plot(report, sys.argv[2])


if __name__ == "__main__":
    main()
