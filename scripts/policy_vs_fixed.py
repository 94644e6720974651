#!/usr/bin/env python3
"""The adaptive policy against fixed draft lengths, in one process, paired and interleaved.

One engine per configuration (each learns alone, `cost_cache=False`: nothing from earlier
processes), the held-out prompts of scripts/record_traces.py, greedy; each round runs every
configuration on every prompt in a rotated order, and each speedup is over the oracle alone on the
same prompt in the same round (this VM drifts by up to 15% between runs of identical work).

    python scripts/policy_vs_fixed.py --reps 2 --configs baseline,adaptive,k8+lookup,k16+lookup,k16,model
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record_traces import PROMPTS  # noqa: E402

from localspec import Engine  # noqa: E402
from localspec.bench.machine import machine_info  # noqa: E402
from localspec.runtime.factory import default_threads  # noqa: E402

ORACLE, DRAFT = "smollm2-135m-instruct-f32", "smollm2-135m-instruct-q4_1"


def options(name: str) -> dict:
    """Engine options of a configuration: baseline, adaptive, model (adaptive, no lookup), kN, kN+lookup."""
    if name == "baseline":
        return {"draft": None}
    if name == "adaptive":
        return {}
    if name == "model":
        return {"lookup": False}
    k, _, lookup = name[1:].partition("+")
    return {"draft_length": int(k), "lookup": bool(lookup)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--configs", default="baseline,adaptive,k8+lookup,k16+lookup,k16,model")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = args.configs.split(",")
    if names[0] != "baseline":
        raise SystemExit("the first configuration must be baseline")
    engines = {}
    for name in names:
        kw = options(name)
        engines[name] = Engine(ORACLE, kw.pop("draft", DRAFT), cost_cache=False, **kw)
    runs: dict[str, list[list[dict]]] = {n: [[] for _ in PROMPTS] for n in names}
    for rep in range(args.reps):
        for i, prompt in enumerate(PROMPTS):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                s = engines[name].generate([{"role": "user", "content": prompt}], max_tokens=args.max_tokens).stats
                runs[name][i].append({"tokens_per_second": s.tokens_per_second, "tokens": s.completion_tokens,
                                      "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
                                      "lookup_drafted": s.lookup_drafted, "idle_steps": s.idle_steps})
        print(f"round {rep + 1} of {args.reps} done", file=sys.stderr, flush=True)
    summary = {}
    for name in names[1:]:
        speedups = [run["tokens_per_second"] / base["tokens_per_second"]
                    for mine, bases in zip(runs[name], runs["baseline"]) for run, base in zip(mine, bases)]
        summary[name] = {"mean": statistics.mean(speedups), "min": min(speedups), "max": max(speedups)}
        print(f"{name:12} {summary[name]['mean']:.3f}x the oracle alone (range {min(speedups):.2f}-{max(speedups):.2f})")
    if "adaptive" in summary:
        fixed = {n: v["mean"] for n, v in summary.items() if n.startswith("k")}
        if fixed:
            best = max(fixed, key=fixed.get)
            print(f"adaptive / best fixed ({best}): {summary['adaptive']['mean'] / fixed[best]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(default_threads()), "summary": summary,
                                         "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
