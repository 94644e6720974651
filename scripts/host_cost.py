#!/usr/bin/env python3
"""The controller's own cost, with nothing to hide behind: the real engine (scheduler, policy,
proposers, acceptance, text) over stand-in contexts that hand back ready logits at once.

A stand-in model's logits at every position are a fixed random row whose argmax is the "text's"
next token (the oracle's and the draft's alike, so every greedy draft token is accepted; sampled,
their distributions agree too), copied into a buffer as llama.cpp's output would be; that copy
counts as time inside llama.cpp. What is left of each step's wall time is the host's: Python, numpy
and the reads of the logits. Vocabularies of 49k (SmolLM2), 128k (Llama 3) and 262k (Gemma 3);
fixed draft lengths; 1 and 8 sequences; greedy and sampled (temperature 1). Structured output is
not covered (its grammar needs a real tokenizer).

    python scripts/host_cost.py                       # the whole grid, a table
    python scripts/host_cost.py --vocab 262144 --k 16 --seqs 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.runtime.engine import Engine
from localspec.runtime.factory import DEFAULT_P_MIN
from localspec.llama.context import shared_prefix
from localspec.speculative.policy import FixedLength
from localspec.speculative.proposers import DraftModelProposer

EOS = 1


class StandInModel:
    """A vocabulary of n tokens, each one byte of text ("a".."z" by id); token 1 ends a generation."""

    chat_template = None
    add_bos, add_eos = True, False
    vocab_type = 2
    vocab_digest = None

    def __init__(self, n_vocab: int, name: str) -> None:
        self.n_vocab, self.name = n_vocab, name
        self.bos, self.eos = 0, EOS

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        return bytes([97 + token % 26]) if token > EOS else b""

    token_text = token_piece

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return [0] * add_special + [2 + (ord(c) % 26) for c in text]


def next_token(position: int, n_vocab: int) -> int:
    """The text's token after `position` tokens: never BOS or EOS."""
    return 2 + (position * 7919) % (n_vocab - 2)


class StandInContext:
    """LlamaContext's interface; its decodes make the logits (a copy of one of a few random rows,
    the argmax set at the text's next token) and count that time as llama.cpp's."""

    flash_attn = "off"
    n_batch = 512

    def __init__(self, model: StandInModel, *, n_seq: int, n_ctx: int = 4096, rows: int = 8, seed: int = 0) -> None:
        self.model, self.n_vocab, self.n_seq, self.n_ctx = model, model.n_vocab, n_seq, n_ctx
        rng = np.random.default_rng(seed)
        self._rows = (rng.standard_normal((rows, model.n_vocab)) * 2.0).astype(np.float32)  # [rows, vocab]
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self._out = np.empty((0, model.n_vocab), dtype=np.float32)
        self.llama_seconds = 0.0
        self._greedy: set[int] = set()  # sequences "sampled on the backend": their rows' picks, no logits
        self.last_sampled: np.ndarray | None = None

    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        (self._greedy.add if on else self._greedy.discard)(seq)
        return on

    def seq_tokens(self, seq: int = 0) -> list[int]:
        return self._seqs[seq]

    def rollback(self, n_past: int, *, seq: int = 0) -> None:
        del self._seqs[seq][n_past:]

    def reset(self) -> None:
        for held in self._seqs:
            held.clear()

    def copy_seq(self, src: int, dst: int, n: int) -> None:
        self._seqs[dst] = list(self._seqs[src][:n])

    def copy_cache_from(self, other, *, seq: int = 0, other_seq: int = 0) -> bool:
        self._seqs[seq] = list(other.seq_tokens(other_seq))
        return True

    def common_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        return shared_prefix(self._seqs[seq], tokens)

    def ubatches(self, rows):
        rows = [(seq, n) for seq, n in rows if n > 0]
        return [rows] if rows else []

    def decode_rows(self, rows) -> np.ndarray:
        t0 = time.perf_counter()
        positions, backend = [], []
        for r in rows:
            held = self._seqs[r.seq]
            start = len(held)
            held.extend(int(t) for t in r.tokens)
            n = min(r.n_logits, len(r.tokens))
            positions += range(start + len(r.tokens) - n + 1, start + len(r.tokens) + 1)
            backend += [r.seq in self._greedy] * n
        self.last_sampled = np.array([next_token(p, self.n_vocab) if b else -1 for p, b in zip(positions, backend)],
                                     dtype=np.int32) if any(backend) else None
        if positions and all(backend):  # no logits cross to the host
            self.llama_seconds += time.perf_counter() - t0
            return np.zeros((len(positions), 0), dtype=np.float32)
        if len(self._out) < len(positions):
            self._out = np.empty((len(positions), self.n_vocab), dtype=np.float32)
        out = self._out[:len(positions)]  # [n_logits, vocab]: llama.cpp's output buffer
        for i, p in enumerate(positions):
            out[i] = self._rows[p % len(self._rows)]
            out[i, next_token(p, self.n_vocab)] = 50.0
        view = out.view()
        view.flags.writeable = False
        self.llama_seconds += time.perf_counter() - t0
        return view


def run(n_vocab: int, k: int, n_seqs: int, temperature: float, max_tokens: int, *, seeded: bool = False,
        host_picks: bool = False, p_min: float = DEFAULT_P_MIN) -> dict:
    """One grid point: `n_seqs` requests of `max_tokens` at a fixed draft length k (the draft
    stopping under p_min, as by default); sampled requests unseeded (speculative sampling) unless
    `seeded` (the seed's coupled noise). Greedy picks are made "in the graph" as on a GPU (the
    stand-in knows them), unless `host_picks`: then every verified row's logits are read."""
    model = StandInModel(n_vocab, f"stand-in-{n_vocab}")
    oracle = StandInContext(model, n_seq=n_seqs)
    draft = StandInContext(model, n_seq=n_seqs, seed=1)
    engine = Engine.from_parts(oracle=oracle, proposer=DraftModelProposer(draft, p_min=p_min, cache_source=oracle),
                               policy=FixedLength(k), draft=draft)
    engine.slots.backend_sampling = not host_picks  # as on a GPU: greedy picks made "in the graph" (no logits read)
    prompts = [[0] + [next_token(p, n_vocab) for p in range(1 + i, 33 + i)] for i in range(n_seqs)]
    seqs = [engine.prepare(p, max_tokens=max_tokens, temperature=temperature,
                           seed=7 if temperature and seeded else None, draft_min=0) for p in prompts]
    for seq in seqs:
        engine.scheduler.add(seq)
    t0, l0 = time.perf_counter(), engine.stepper._llama_seconds()
    while engine.scheduler.has_work:
        engine.scheduler.step()
        for seq in seqs:
            seq.outbox.clear()
    wall, llama = time.perf_counter() - t0, engine.stepper._llama_seconds() - l0
    steps = max(s.stats.steps for s in seqs)
    tokens = sum(s.stats.completion_tokens for s in seqs)
    drafted = sum(s.stats.drafted for s in seqs)
    host = wall - llama
    return {"vocab": n_vocab, "k": k, "sequences": n_seqs, "temperature": temperature, "steps": steps,
            "tokens": tokens, "drafted": drafted, "host_ms_per_step": 1000 * host / steps,
            "host_ms_per_token": 1000 * host / tokens,
            "host_ms_per_draft_token": 1000 * host / drafted if drafted else None,
            "llama_ms_per_step": 1000 * llama / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="*", default=[49152, 128256, 262144])
    ap.add_argument("--k", type=int, nargs="*", default=[0, 1, 4, 16])
    ap.add_argument("--seqs", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--temperature", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seeded", action="store_true", help="sampled requests with a seed (coupled noise)")
    ap.add_argument("--p-min", type=float, default=DEFAULT_P_MIN)
    ap.add_argument("--host-picks", action="store_true",
                    help="greedy verification reads every row's logits (the CPU's default), not picks made in the graph")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    print("| vocab | k | seqs | T | host ms/step | host ms/token | (llama ms/step) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n_vocab in args.vocab:
        for k in args.k:
            for n_seqs in args.seqs:
                for temperature in args.temperature:
                    r = run(n_vocab, k, n_seqs, temperature, args.max_tokens, seeded=args.seeded, p_min=args.p_min,
                            host_picks=args.host_picks)
                    results.append(r)
                    print(f"| {n_vocab} | {k} | {n_seqs} | {temperature:g} | {r['host_ms_per_step']:.2f} | "
                          f"{r['host_ms_per_token']:.3f} | {r['llama_ms_per_step']:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
