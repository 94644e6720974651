#!/usr/bin/env python3
"""Does what the length policy learns from sampled requests switch drafting off for greedy ones?

The experiment of issue 33, as a user meets it, on a fresh cost cache (a temporary directory: the
user's own is left alone), in one process on the default pair:

  1. a greedy request, fresh state                    tokens/s, tokens drafted
  2. the oracle alone on it                           tokens/s
  3. `--sampled N` short requests at `--temperature`  (what an OpenAI client sends when it sets none)
  4. the same greedy request again                    tokens/s, tokens drafted
  5. fixed K=8 on it                                  tokens/s

then `--fresh N` fresh `localspec generate --json` processes of the greedy request on the cost cache
the process left (wall time, tokens/s, drafted), each beside one `--no-draft` process. Prints a
table, and with `--json PATH` writes every figure.

    python scripts/greedy_after_sampled.py                       # the issue's prompt
    python scripts/greedy_after_sampled.py --held-out            # held-out prompts, one after another
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ISSUE_PROMPT = "Give me five tips for staying focused while studying."
HELD_OUT = (  # not in the bench's workloads
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the pros and cons of working from home? Answer in a list.",
)
SAMPLED = (  # the short sampled requests of the warm-up
    "Tell me a fun fact about octopuses.", "Suggest a name for a coffee shop.",
    "What is a good way to start learning the guitar?", "Describe autumn in two sentences.",
    "Give me an idea for a weekend project.", "Why is the sky blue?",
    "Write a haiku about rain.", "What should I cook tonight?",
    "Recommend a board game for four players.", "How do bees make honey?",
)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(engine, prompt, **options) -> dict:
    r = engine.generate([{"role": "user", "content": prompt}], **options)
    s = r.stats
    return {"tokens_per_second": round(s.tokens_per_second, 1), "tokens": s.completion_tokens,
            "drafted": s.drafted, "accepted": s.accepted, "lookup_drafted": s.lookup_drafted, "idle_steps": getattr(s, "idle_steps", None),
            "idle_reason": getattr(s, "idle_reason", None), "text": r.text}


def fresh_process(prompt: str, max_tokens: int, env: dict, *extra: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "localspec.cli", "generate", prompt, "--max-tokens", str(max_tokens),
                          "--json", *extra], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    s = json.loads(out.stdout)["stats"]
    return {"wall": round(wall, 3), "tokens_per_second": round(s["tokens_per_second"], 1),
            "drafted": s["drafted"], "tokens": s["completion_tokens"], "idle_reason": s.get("idle_reason")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sampled", type=int, default=40, help="short sampled requests between the greedy ones")
    ap.add_argument("--sampled-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--fresh", type=int, default=2, help="fresh processes afterwards")
    ap.add_argument("--held-out", action="store_true", help="the held-out prompts instead of the issue's")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    cache = tempfile.mkdtemp(prefix="localspec-costs-")
    os.environ["LOCALSPEC_COST_CACHE"] = cache
    from localspec import Engine
    from localspec.speculative.policy import FixedLength

    prompts = HELD_OUT if args.held_out else (ISSUE_PROMPT,)
    results = {"cpu": cpu_name(), "threads": os.cpu_count(), "cost_cache": cache, "prompts": []}
    with Engine.from_pair() as engine:
        engine.generate("Hello", max_tokens=8)  # warm-up (the first pass pays for page-ins)
        for prompt in prompts:
            row: dict = {"prompt": prompt}
            row["fresh_state"] = run(engine, prompt, max_tokens=args.max_tokens)
            row["oracle_alone"] = run(engine, prompt, max_tokens=args.max_tokens, speculative=False)
            t0 = time.perf_counter()
            sampled = [run(engine, SAMPLED[i % len(SAMPLED)], max_tokens=args.sampled_tokens,
                           temperature=args.temperature) for i in range(args.sampled)]
            row["sampled"] = {"requests": len(sampled), "seconds": round(time.perf_counter() - t0, 2),
                              "drafted": sum(r["drafted"] for r in sampled),
                              "accepted": sum(r["accepted"] for r in sampled),
                              "tokens": sum(r["tokens"] for r in sampled),
                              "tokens_per_second": round(sum(r["tokens"] for r in sampled) / max(
                                  1e-9, sum(r["tokens"] / r["tokens_per_second"] for r in sampled
                                            if r["tokens_per_second"])), 1)}
            row["after_sampled"] = run(engine, prompt, max_tokens=args.max_tokens)
            with engine.using_policy(FixedLength(8)):
                row["fixed_k8"] = run(engine, prompt, max_tokens=args.max_tokens)
            results["prompts"].append(row)
    env = dict(os.environ)
    for row in results["prompts"]:
        row["fresh_processes"] = [fresh_process(row["prompt"], args.max_tokens, env) for _ in range(args.fresh)]
        row["fresh_no_draft"] = [fresh_process(row["prompt"], args.max_tokens, env, "--no-draft")
                                 for _ in range(args.fresh)]

    print(f"CPU: {results['cpu']}, {results['threads']} threads; cost cache {cache}")
    for row in results["prompts"]:
        base = row["oracle_alone"]["tokens_per_second"]
        print(f"\n{row['prompt']}")
        for name in ("fresh_state", "oracle_alone", "after_sampled", "fixed_k8"):
            r = row[name]
            print(f"  {name:14} {r['tokens_per_second']:6.1f} tok/s ({r['tokens_per_second'] / base:.2f}x), "
                  f"drafted {r['drafted']:3} (lookup {r['lookup_drafted']:3}), accepted {r['accepted']:3}"
                  + (f"  [{r['idle_reason']}]" if r.get("idle_reason") else ""))
        s = row["sampled"]
        print(f"  sampled        {s['requests']} requests, {s['tokens_per_second']} tok/s, drafted {s['drafted']}, "
              f"accepted {s['accepted']}")
        for fresh, alone in zip(row["fresh_processes"], row["fresh_no_draft"]):
            print(f"  fresh process  {fresh['wall']:.2f} s ({fresh['tokens_per_second']} tok/s, drafted "
                  f"{fresh['drafted']}) against --no-draft {alone['wall']:.2f} s ({alone['tokens_per_second']} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
