#!/usr/bin/env python3
"""Record drafting traces for the policy's replay test (`localspec.bench.replay`).

For each prompt, the oracle's greedy answer alone; then, at every position of it, what the draft
model would propose there (its greedy continuation of the text so far, `--k-max` tokens) and how
sure it was of each token (its top probability: the draft stops after the first token under p_min).
A greedy step's outcome is a function of the text alone: the draft tokens that agree with the
answer are accepted, so a trace says what any draft length would have yielded at any point,
without running the models again. Also measured here: the oracle's pass and the draft's decode
times by tokens and context (the replay's cost table; the machine is named in the file).

    python scripts/record_traces.py -o tests/data/traces/smollm2.json           # the default pair
    python scripts/record_traces.py --max-tokens 400 --prompts my_prompts.txt   # one prompt a line
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from localspec import Engine
from localspec.bench.machine import machine_info
from localspec.runtime.factory import DEFAULT_P_MIN, default_threads, draft_cost_ratio

# open-ended chat prompts, not in the bench's workloads (the held-out set of the policy's issues)
PROMPTS = (
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the pros and cons of working from home? Answer in a list.",
    "Give me five tips for staying focused while studying.",
    "Describe how a bill becomes a law in the United States.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
)


def softmax_max(row: np.ndarray) -> float:
    row = row.astype(np.float64)
    e = np.exp(row - row.max())
    return float(1.0 / e.sum())  # the top token's probability


def draft_continuations(ctx, text: list[int], start: int, k_max: int) -> tuple[list[list[int]], list[list[float]]]:
    """At every position p >= start of `text`: the draft's greedy continuation of text[:p] (k_max
    tokens) and its top probability at each."""
    tokens, sure = [], []
    for p in range(start, len(text)):
        logits, _ = ctx.sync(text[:p])
        row_tokens, row_sure = [], []
        for i in range(k_max):
            row = np.asarray(logits[-1])
            token = int(np.argmax(row))
            row_tokens.append(token)
            row_sure.append(round(softmax_max(row), 3))
            if i + 1 < k_max:
                logits = ctx.decode([token])
        tokens.append(row_tokens)
        sure.append(row_sure)
        ctx.rollback(p)
    return tokens, sure


def timed(ctx, prefix: list[int], batch: list[int], *, repeats: int) -> float:
    """Median seconds for `ctx` to decode `batch` (logits at every token) after `prefix`."""
    times = []
    for _ in range(repeats):
        ctx.sync(prefix, n_logits=0)
        t0 = time.perf_counter()
        ctx.decode(batch, n_logits=len(batch))
        times.append(time.perf_counter() - t0)
        ctx.rollback(len(prefix))
    return statistics.median(times)


def cost_table(ctx, text: list[int], contexts: list[int], ns: list[int], repeats: int) -> dict:
    ms = [[round(1000 * timed(ctx, text[:c], text[c:c + n], repeats=repeats), 3) for n in ns] for c in contexts]
    return {"contexts": contexts, "ns": ns, "ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--pair", default=None, help="a pair from models.toml (default: the default pair)")
    ap.add_argument("--prompts", type=Path, help="one prompt a line (default: the built-in held-out six)")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--repeats", type=int, default=5, help="timings per cost-table entry (median)")
    args = ap.parse_args()
    prompts = [p for p in args.prompts.read_text().splitlines() if p.strip()] if args.prompts else list(PROMPTS)

    with Engine.from_pair(args.pair, n_threads=args.threads, cost_cache=False, n_ctx=2048, lookup=False) as engine:
        traces = []
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}]
            result = engine.generate(messages, max_tokens=args.max_tokens, speculative=False)
            prompt_ids = engine.tokenize_prompt(messages)
            text = prompt_ids + result.tokens
            t0 = time.perf_counter()
            draft_tokens, sure = draft_continuations(engine.draft_ctx, text, len(prompt_ids) + 1, args.k_max)
            answer = result.tokens
            # agree[p]: the draft tokens at answer position p + 1 that match the answer from there on
            agree = []
            for p, row in enumerate(draft_tokens, start=1):
                n = 0
                while n < len(row) and p + n < len(answer) and row[n] == answer[p + n]:
                    n += 1
                agree.append(n)
            print(f"{prompt[:50]!r}: {len(answer)} tokens, drafts recorded in {time.perf_counter() - t0:.0f} s, "
                  f"first-token agreement {np.mean([a > 0 for a in agree]):.2f}", flush=True)
            traces.append({"prompt": prompt, "prompt_ids": prompt_ids, "answer": answer,
                           "finish_reason": result.finish_reason, "agree": agree, "sure": sure})
        longest = max((t["prompt_ids"] + t["answer"] for t in traces), key=len)
        contexts = [c for c in (32, 128, 256, 512) if c + 2 * args.k_max < len(longest)]
        ns = [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17]
        costs = {"oracle": cost_table(engine.oracle, longest, contexts, ns, args.repeats),
                 "draft": cost_table(engine.draft_ctx, longest, contexts, [1, 2, 3, 4, 8, 16], args.repeats)}
        document = {"machine": machine_info(args.threads), "pair": args.pair or "default",
                    "oracle": engine.oracle_model.name, "draft": engine.draft_model.name,
                    "p_min": DEFAULT_P_MIN, "k_max": args.k_max, "max_tokens": args.max_tokens,
                    "draft_cost_ratio": draft_cost_ratio(engine.oracle_model, engine.draft_model), "costs": {"measured": costs}, "traces": traces}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
