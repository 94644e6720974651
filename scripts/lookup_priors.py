#!/usr/bin/env python3
"""Measure how often a prompt-lookup guess holds, by the length of the match it extends: the table
behind `policy.LOOKUP_PRIORS` (what a new install expects of each of `policy.LOOKUP_RUNS`).

    python scripts/lookup_priors.py                       # the default pair's oracle, the bundled workloads
    python scripts/lookup_priors.py --pair qwen2.5-7b --prompts 4 --json tokens.json

The oracle alone answers each prompt (greedy); then, at every position of every answer where prompt
lookup finds a match, the guess is compared with what the oracle went on to write. Each guessed token
up to the first wrong one is a trial, counted in the bucket of the match length it extends (the
tokens before the guess's source that agree with the text's last ones, plus its place in the guess).
Acceptance is a property of the text and the model, not of the machine: no timings are involved.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from localspec.bench import workloads
from localspec.runtime.engine import Engine
from localspec.models import Registry
from localspec.options import GenerationOptions
from localspec.speculative.policy import LOOKUP_RUNS, AcceptanceByPlace
from localspec.speculative.lookup import PromptLookupProposer

WORKLOADS = ("chat", "code", "copy", "grounded", "long")


def answers(pair: str | None, prompts: int, max_tokens: int, threads: int | None) -> dict[str, dict]:
    """{prompt id: {"workload", "prompt": tokens, "out": the oracle's greedy answer's tokens}}."""
    oracle = Registry.load().pair(pair).oracle
    out = {}
    with Engine(oracle, None, n_threads=threads, cost_cache=False) as engine:
        for p in workloads.load(WORKLOADS, max_prompts=prompts, max_tokens=max_tokens):
            result = engine.generate(p.request, GenerationOptions(max_tokens=p.max_tokens))
            out[p.id] = {"workload": p.workload, "prompt": engine.tokenize_prompt(p.request), "out": list(result.tokens)}
            print(f"{p.id}: {len(result.tokens)} tokens", flush=True)
    return out


def trials(texts: dict[str, dict], edges=LOOKUP_RUNS) -> dict[tuple[str, int], list[int]]:
    """{(workload, bucket): [trials, accepted]}."""
    lookup = PromptLookupProposer()
    place = AcceptanceByPlace(0.0, edges)  # the length policy's own buckets
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for text in texts.values():
        prompt, answer = text["prompt"], text["out"]
        for t in range(len(answer)):
            guess = lookup.propose(prompt + answer[:t], 64)
            for i, token in enumerate(guess.tokens.tolist()[:len(answer) - t]):
                ok = token == answer[t + i]
                cell = counts[(text["workload"], place.key(i, guess.match_length))]
                cell[0] += 1
                cell[1] += ok
                if not ok:
                    break
    return counts


def table(counts: dict[tuple[str, int], list[int]], edges=LOOKUP_RUNS) -> str:
    lows = (0,) + tuple(edges)
    heads = [f"{lo}-{hi - 1}" for lo, hi in zip(lows, edges)] + [f"{edges[-1]}+"]
    rows = ["| workload | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for name in sorted({w for w, _ in counts}) + ["all"]:
        cells = []
        for b in range(len(heads)):
            n, ok = (sum(c[i] for (w, bb), c in counts.items() if bb == b and name in ("all", w)) for i in (0, 1))
            cells.append(f"{ok / n:.0%} ({n})" if n else "–")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default=None, help="model pair from models.toml (default: the default pair)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="keep the answers' tokens here (reused when it exists)")
    args = parser.parse_args()
    kept = Path(args.json) if args.json else None
    if kept is not None and kept.is_file():
        texts = json.loads(kept.read_text())
    else:
        texts = answers(args.pair, args.prompts, args.max_tokens, args.threads)
        if kept is not None:
            kept.write_text(json.dumps(texts))
    print(table(trials(texts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
