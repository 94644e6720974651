"""What the suffix cache costs: memory per million tokens stored, and the time of one offer (the
lookup a step makes) with a million tokens in the store, on this machine.

The store is filled with documents shaped like a server's traffic: a shared system prompt, a
request of its own, and an answer in one format with fields of its own (vocabulary of the default
pair's 49,152 tokens). Offers are timed where the text repeats what the store holds (a match: the
usual case under repetitive traffic) and where it does not (open-ended text).

    python scripts/suffix_cost.py [--tokens 1000000] [--offers 20000]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from localspec.speculative.suffix import SuffixStore

VOCAB = 49152


def documents(rng: np.random.Generator, total: int):
    """Documents of ~500 tokens until `total` tokens: system prompt, request, formatted answer."""
    system = rng.integers(0, VOCAB, 120)
    fields = [rng.integers(0, VOCAB, 4) for _ in range(6)]
    made = 0
    while made < total:
        answer = np.concatenate([np.concatenate([f, rng.integers(0, VOCAB, 12)]) for f in fields])
        doc = np.concatenate([system, rng.integers(0, VOCAB, 280), answer])
        made += len(doc) + 1
        yield doc, system, fields


def time_offers(store: SuffixStore, histories: list[list[int]], n: int) -> float:
    """Microseconds per offer, the histories taken in turn."""
    t0 = time.perf_counter()
    for i in range(n):
        store.offer(histories[i % len(histories)], 16)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--offers", type=int, default=20_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    store = SuffixStore(args.tokens)
    t0 = time.perf_counter()
    system = fields = None
    for doc, system, fields in documents(rng, args.tokens):
        store.add(doc.tolist())
    fill = time.perf_counter() - t0
    repeating = [rng.integers(0, VOCAB, 200).tolist() + system.tolist()[:40 + i] for i in range(50)]
    repeating += [rng.integers(0, VOCAB, 200).tolist() + fields[i % 6].tolist() for i in range(50)]
    fresh = [rng.integers(0, VOCAB, 240).tolist() for _ in range(100)]
    hits = sum(len(store.offer(h, 16)[0]) > 0 for h in repeating)
    result = {
        "cpu": platform.processor() or platform.machine(), "tokens_stored": store.tokens,
        "documents": store.documents, "megabytes": round(store.nbytes / 1e6, 1),
        "megabytes_per_million_tokens": round(store.nbytes / 1e6 / (store.capacity / 1e6), 1),
        "fill_seconds": round(fill, 2), "repeating_offers_found": f"{hits}/{len(repeating)}",
        "offer_us_repeating": round(time_offers(store, repeating, args.offers), 1),
        "offer_us_fresh": round(time_offers(store, fresh, args.offers), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
