#!/usr/bin/env python3
"""A fresh `localspec generate` process against `--no-draft`, as a user runs it (issue 48's first
targets): the default pair, each prompt's default and oracle-alone processes interleaved, each run
twice on one cost cache: "fresh" (an empty one: what a first run on a machine does) and "again"
(what the first run stored). Two prompts: an open-ended answer, and a code rewrite whose answer
copies much of its prompt (prompt lookup's case).

`--threads-probe N`: then the open prompt again, with llama.cpp's CPU threads at N and at the default
(every core), each system fresh, interleaved. Where every layer runs on a GPU, those threads only look
up the prompt's embedding rows; with OpenMP they spin after each decode, which may take cores from the
Python threads (the controller's, the server's): this measures whether it does.

Per process: its wall clock (load included) and the generation's tokens/s from `--json`'s stats,
its steps, drafted and idle steps, host ms a step. Greedy, so the text of the default and of the
oracle alone is compared too.

    python scripts/fresh_generate.py --out DIR [--reps 2] [--max-tokens 200] [--localspec BIN] [--threads-probe 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = {
    "open": "Explain how a refrigerator works, step by step.",
    "code-rewrite": "Add type hints to this function and return the whole function:\n\n"
                    "def mean_and_spread(values, weights=None):\n"
                    "    if weights is None:\n"
                    "        weights = [1.0] * len(values)\n"
                    "    total = sum(weights)\n"
                    "    mean = sum(v * w for v, w in zip(values, weights)) / total\n"
                    "    spread = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / total\n"
                    "    return mean, spread ** 0.5\n",
}
KEPT = ("tokens_per_second", "steps", "drafted", "accepted", "idle_steps", "host_ms_per_step", "completion_tokens")


def run_one(binary: str, prompt: str, *, no_draft: bool, max_tokens: int, cost_cache: str,
            threads: int | None = None) -> dict:
    cmd = [binary, "generate", "--json", "--max-tokens", str(max_tokens)] + (["--no-draft"] if no_draft else [])
    cmd += (["--threads", str(threads)] if threads else []) + [prompt]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LOCALSPEC_COST_CACHE": cost_cache})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout)
    return {"wall_s": wall, "text": out["text"], **{k: out["stats"].get(k) for k in KEPT}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--localspec", default="localspec")
    ap.add_argument("--threads-probe", type=int, default=0, metavar="N",
                    help="then the open prompt with --threads N against the default, each system fresh")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(args.reps):
        for name, prompt in PROMPTS.items():
            with tempfile.TemporaryDirectory() as default_cache, tempfile.TemporaryDirectory() as alone_cache:
                for phase in ("fresh", "again"):
                    for no_draft in ((False, True) if rep % 2 == 0 else (True, False)):  # interleaved
                        r = run_one(args.localspec, prompt, no_draft=no_draft, max_tokens=args.max_tokens,
                                    cost_cache=alone_cache if no_draft else default_cache)
                        runs.append({"prompt": name, "phase": phase, "rep": rep,
                                     "system": "no-draft" if no_draft else "default", **r})
                        print(f"fresh_generate: {name} {phase} {runs[-1]['system']}: "
                              f"{r['tokens_per_second']:.1f} tok/s, wall {r['wall_s']:.2f} s", file=sys.stderr)
    rows = []
    for name in PROMPTS:
        for phase in ("fresh", "again"):
            of = {s: [r for r in runs if r["prompt"] == name and r["phase"] == phase and r["system"] == s]
                  for s in ("default", "no-draft")}
            tps = {s: statistics.median(r["tokens_per_second"] for r in rs) for s, rs in of.items()}
            wall = {s: statistics.median(r["wall_s"] for r in rs) for s, rs in of.items()}
            same = sum(a["text"] == b["text"] for a, b in zip(of["default"], of["no-draft"]))
            d = of["default"]
            rows.append({"prompt": name, "phase": phase, "default_tok_s": tps["default"], "no_draft_tok_s": tps["no-draft"],
                         "ratio": tps["default"] / tps["no-draft"], "wall_ratio": wall["no-draft"] / wall["default"],
                         "default_steps": statistics.median(r["steps"] for r in d),
                         "default_drafted": statistics.median(r["drafted"] for r in d),
                         "default_idle_steps": statistics.median(r["idle_steps"] for r in d),
                         "default_host_ms_per_step": statistics.median(r["host_ms_per_step"] for r in d),
                         "no_draft_host_ms_per_step": statistics.median(r["host_ms_per_step"] for r in of["no-draft"]),
                         "same_text": f"{same}/{len(d)}"})
    threads = probe_threads(args) if args.threads_probe else []
    (args.out / "generate.json").write_text(json.dumps({"rows": rows, "runs": runs, "threads": threads}, indent=1) + "\n")
    lines = ["# A fresh `localspec generate` process: the default against --no-draft",
             "",
             f"{args.reps} interleaved repetitions, {args.max_tokens} tokens, greedy; medians. fresh: an empty cost "
             "cache; again: the cache the fresh run left. Targets (issue 48): open fresh >= 0.95x, again >= 0.98x; "
             "code-rewrite >= 1.0x.",
             "",
             "| prompt | run | default tok/s | --no-draft tok/s | ratio | wall ratio | steps | drafted | idle steps "
             "| host ms a step (default / alone) | same text |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['phase']} | {r['default_tok_s']:.1f} | {r['no_draft_tok_s']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['wall_ratio']:.2f}x | {r['default_steps']:.0f} | {r['default_drafted']:.0f} | "
                     f"{r['default_idle_steps']:.0f} | {r['default_host_ms_per_step']:.3f} / "
                     f"{r['no_draft_host_ms_per_step']:.3f} | {r['same_text']} |")
    if threads:
        lines += ["", f"CPU threads (the open prompt, fresh, {args.max_tokens} tokens): "
                  + "; ".join(f"{t['system']} --threads {t['threads']}: {t['tokens_per_second']:.1f} tok/s, "
                              f"host {t['host_ms_per_step']:.3f} ms a step" for t in threads)]
    (args.out / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def probe_threads(args) -> list[dict]:
    """The open prompt at --threads N and at the default, --no-draft and the default, each fresh."""
    out = []
    for no_draft in (True, False):
        for threads in (args.threads_probe, None):
            with tempfile.TemporaryDirectory() as cache:
                r = run_one(args.localspec, PROMPTS["open"], no_draft=no_draft, max_tokens=args.max_tokens,
                            cost_cache=cache, threads=threads)
            out.append({"system": "no-draft" if no_draft else "default", "threads": threads or "default",
                        **{k: v for k, v in r.items() if k != "text"}})
            print(f"fresh_generate: threads {out[-1]['threads']} {out[-1]['system']}: "
                  f"{r['tokens_per_second']:.1f} tok/s, host {r['host_ms_per_step']:.3f} ms a step", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
