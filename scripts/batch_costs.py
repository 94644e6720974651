#!/usr/bin/env python3
"""What a pass costs with several sequences in it, for the oracle and the draft, and what that
leaves speculation: the limit of `localspec serve` with many clients (issue 29).

For each model and each number of sequences b, the median time of one decode holding n tokens of
each of b sequences (every sequence already holding `--context` tokens; logits for every row), on
localspec's own contexts (the engine's cache layout: one stream per sequence). Then, for an
acceptance rate a per draft token (`--acceptance`, e.g. what `localspec bench` measured), the best
that drafting k tokens for every sequence of the batch can give against plain batched decoding:

    plain        b tokens per oracle pass of b x 1 tokens
    drafted (k)  b * (1 - a^(k+1)) / (1 - a) tokens per step of
                 draft(b x 2) + (k - 1) * draft(b x 1)     (the catch-up on the last step's tokens, then a round per token)
                 + oracle(b x (k + 1))

    python scripts/batch_costs.py                                 # the default pair
    python scripts/batch_costs.py --draft other.gguf --draft more.gguf --json out.json

Prints a markdown table (with the CPU named) and, with --json, writes every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def pass_times(path: str, seqs: list[int], tokens: list[int], *, context: int, reps: int,
               threads: int | None) -> dict[tuple[int, int], float]:
    """Median seconds of one decode of b sequences x n tokens each, for every (b, n)."""
    from localspec.llama.context import LlamaContext, LlamaModel, Rows

    rng = np.random.default_rng(0)
    model = LlamaModel(path)
    ctx = LlamaContext(model, n_ctx=context + max(tokens) * (reps + 1) + 8, n_seq=max(seqs), flash_attn="off",
                       n_threads=threads)
    try:
        for s in range(max(seqs)):
            ctx.decode_rows([Rows(s, rng.integers(100, min(20000, model.n_vocab), context).tolist(), 0)])
        out = {}
        for b in seqs:
            for n in tokens:
                times = []
                for _ in range(reps + 1):  # the first one warms up
                    rows = [Rows(s, rng.integers(100, min(20000, model.n_vocab), n).tolist(), n) for s in range(b)]
                    t0 = time.perf_counter()
                    ctx.decode_rows(rows)
                    times.append(time.perf_counter() - t0)
                    for s in range(b):
                        ctx.rollback(context, seq=s)
                out[(b, n)] = float(np.median(times[1:]))
        return out
    finally:
        ctx.close()
        model.close()


def best_drafting(oracle: dict, draft: dict, b: int, acceptance: float, k_max: int) -> tuple[int, float]:
    """(k, tokens/s) of the best draft length for a batch of b sequences, every one drafting k."""
    best = (0, b / oracle[(b, 1)])
    for k in range(1, k_max + 1):
        if (b, k + 1) not in oracle:
            break
        expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        step = draft[(b, 2)] + (k - 1) * draft[(b, 1)] + oracle[(b, k + 1)]
        rate = b * expected / step
        if rate > best[1]:
            best = (k, rate)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", help="the oracle's GGUF (default: the default pair's)")
    ap.add_argument("--draft", action="append", help="a draft GGUF (default: the default pair's); repeatable")
    ap.add_argument("--seqs", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=150, help="tokens each sequence holds already")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.88,
                    help="per draft token (0.88: the default pair's, greedy, measured batched)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--kv-layout", action="store_true",
                    help="also llama-batched-bench of the oracle (the anchor's) with a KV stream per sequence "
                         "(localspec's layout) and with one unified cache, 128-token prompts, 256 generated")
    ap.add_argument("--json")
    args = ap.parse_args()

    from localspec.llama.backend import default_threads
    from localspec.bench.machine import machine_info
    from localspec.models import Registry

    registry = Registry.load()
    pair = registry.pair(None)
    oracle_path = args.oracle or str(registry.resolve(pair.oracle))
    drafts = args.draft or [str(registry.resolve(pair.draft))]
    seqs = [int(x) for x in args.seqs.split(",")]
    tokens = list(range(1, args.k_max + 2))
    oracle = pass_times(oracle_path, seqs, tokens, context=args.context, reps=args.reps, threads=args.threads)
    machine = machine_info(args.threads or default_threads())
    report = {"cpu": machine["cpu"], "flags": " ".join(machine["cpu_flags"]), "threads": machine["threads"],
              "context": args.context, "acceptance": args.acceptance, "oracle": Path(oracle_path).name,
              "oracle_ms": {f"{b}x{n}": round(1000 * t, 2) for (b, n), t in oracle.items()}, "drafts": []}
    lines = [f"CPU: {report['cpu']} ({report['flags']}), {report['threads']} threads; every sequence at "
             f"{args.context} tokens of context; acceptance {args.acceptance} per draft token", "",
             "| draft | sequences | oracle pass, 1 token each | draft round, 1 token each | draft / oracle "
             "| plain batched tok/s | best drafting (k) tok/s | drafting / plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in drafts:
        draft = pass_times(path, seqs, [1, 2], context=args.context, reps=args.reps, threads=args.threads)
        entry = {"draft": Path(path).name, "draft_ms": {f"{b}x{n}": round(1000 * t, 2) for (b, n), t in draft.items()},
                 "rows": []}
        for b in seqs:
            plain = b / oracle[(b, 1)]
            k, rate = best_drafting(oracle, draft, b, args.acceptance, args.k_max)
            entry["rows"].append({"sequences": b, "plain": round(plain, 1), "best_k": k, "best": round(rate, 1)})
            lines.append(f"| {Path(path).name} | {b} | {1000 * oracle[(b, 1)]:.1f} ms | {1000 * draft[(b, 1)]:.1f} ms "
                         f"| {draft[(b, 1)] / oracle[(b, 1)]:.2f} | {plain:.1f} | {rate:.1f} ({k}) | {rate / plain:.2f}x |")
        report["drafts"].append(entry)
    if args.kv_layout:
        from localspec.bench.clients import batched_bench

        layouts = {name: batched_bench(oracle=oracle_path, n_clients=seqs, prompt_tokens=128, max_tokens=256,
                                       threads=machine["threads"], anchor_bin=None, unified_kv=unified)
                   for name, unified in (("per_sequence", False), ("unified", True))}
        report["kv_layout"] = {name: {str(b): v for b, v in rates.items()} for name, rates in layouts.items()}
        lines += ["", "llama-batched-bench, the oracle alone, generation tokens/s (128-token prompts, 256 generated):",
                  "", "| sequences | a KV stream per sequence | one unified KV cache | per sequence / unified |",
                  "|---:|---:|---:|---:|"]
        for b in seqs:
            own, unified = layouts["per_sequence"].get(b), layouts["unified"].get(b)
            if own and unified:
                lines.append(f"| {b} | {own:.1f} | {unified:.1f} | {own / unified:.2f}x |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
