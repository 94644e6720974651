#!/usr/bin/env python3
"""The controller's own cost, with nothing to hide behind: the real engine (scheduler, policy,
proposers, acceptance, text) over stand-in contexts that hand back ready logits at once.

A stand-in model's logits at every position are a fixed random row shaped as a language model's (a
bulk, a hundred plausible tokens, the next one well above them) whose argmax is the "text's" next
token (the oracle's and the draft's alike, so every greedy draft token is accepted; sampled, their
distributions mostly agree), copied into a buffer as llama.cpp's output would be; that copy
counts as time inside llama.cpp. What is left of each step's wall time is the host's: Python, numpy
and the reads of the logits. Vocabularies of 49k (SmolLM2), 128k (Llama 3) and 262k (Gemma 3);
fixed draft lengths; 1 and 8 sequences; greedy and sampled (temperature 1). Structured output is
not covered (its grammar needs a real tokenizer).

`--adaptive` runs the engine's default instead of fixed lengths: prompt lookup beside the draft
model, the adaptive policy. With `--gpu-like` each decode also takes what the default pair's took
on an H200 (the oracle 1.25 ms for one token, 3.1 ms for two, +0.087 ms a token after; the draft
1.5 ms a decode: ../shared/gpu/h200-2026-11-27), spent as a busy wait that counts as llama.cpp's
time, so the policy rests as it does there (a draft as dear as its oracle) and what is measured is
an idle step's host time. `--text repetitive` draws the text from 16 tokens, so prompt lookup finds
a match most steps (and is right 1 time in 16), as a real text's repeated word pairs make it.

    python scripts/host_cost.py                       # the whole grid, a table
    python scripts/host_cost.py --vocab 262144 --k 16 --seqs 1 --json out.json
    python scripts/host_cost.py --adaptive --gpu-like --text repetitive --vocab 49152 --seqs 1 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.batch import TopRow
from localspec.runtime.engine import Engine
from localspec.runtime.factory import DEFAULT_P_MIN, default_policy
from localspec.llama.context import shared_prefix
from localspec.speculative.policy import FixedLength
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import DEVICE_TOP_K, DraftModelProposer, HybridProposer

EOS = 1
PLAUSIBLE, NEXT_LOGIT = 100, 16.0  # a stand-in row's plausible tokens, and its next token's logit (see StandInContext)
TEXTS = ("distinct", "repetitive")
REPETITIVE_ALPHABET = 16
_repetitive = np.random.default_rng(1234).integers(2, 2 + REPETITIVE_ALPHABET, size=1 << 16)  # [positions]
TEXT = "distinct"  # which text next_token reads (main sets it)
# the default pair's decodes on an H200 (seconds): the oracle's t(1), t(2), each token after; a draft decode
GPU_LIKE = {"oracle_one": 1.25e-3, "oracle_two": 3.1e-3, "oracle_token": 0.087e-3, "draft": 1.5e-3}


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
    """The text's token after `position` tokens: never BOS or EOS (`TEXT`: distinct tokens, or 16
    drawn at random)."""
    if TEXT == "repetitive":
        return int(_repetitive[position % len(_repetitive)])
    return 2 + (position * 7919) % (n_vocab - 2)


def spin(seconds: float) -> None:
    """Wait `seconds` busily (a GPU's pass, as the host waits for it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandInContext:
    """LlamaContext's interface; its decodes make the logits (a copy of one of a few random rows,
    the argmax set at the text's next token) and count that time as llama.cpp's."""

    flash_attn = "off"
    n_batch = 512

    def __init__(self, model: StandInModel, *, n_seq: int, n_ctx: int = 4096, rows: int = 8, seed: int = 0,
                 cost=None) -> None:
        """`cost`: seconds a decode of n tokens takes beyond the stand-in's own work (None: none)."""
        self.model, self.n_vocab, self.n_seq, self.n_ctx = model, model.n_vocab, n_seq, n_ctx
        self.cost = cost
        rng = np.random.default_rng(seed)
        # shaped as a language model's: a bulk (sd 1), a hundred plausible tokens 6-10 above it, the
        # next token 16 (then the default draft's real rows: the tokens within log(vocab) + 3 nats of
        # the top, over the temperature, ~100 at T = 0.7 and ~800 at T = 1 here, 111 and 1271 there)
        self._rows = rng.standard_normal((rows, model.n_vocab)).astype(np.float32)  # [rows, vocab]
        for row in self._rows:
            row[rng.choice(model.n_vocab, PLAUSIBLE, replace=False)] += rng.uniform(6.0, 10.0, PLAUSIBLE)
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self._out = np.empty((0, model.n_vocab), dtype=np.float32)
        self.llama_seconds = 0.0
        self._greedy: set[int] = set()  # sequences "sampled on the backend": their rows' picks, no logits
        self._top: dict[int, int] = {}  # sequences whose rows' top k the "backend" keeps (TopRow)
        self._row_tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each random row's top k: ids, logits
        self.last_sampled: np.ndarray | None = None

    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        (self._greedy.add if on else self._greedy.discard)(seq)
        return on

    def sample_top(self, seq: int, k: int = 0) -> bool:
        if k > 0:
            self._top[seq] = k
        else:
            self._top.pop(seq, None)
        return k > 0

    def _top_row(self, position: int, k: int) -> TopRow:
        """What a device's top-k keeps of the row at `position` (the next token's logit on top)."""
        base = position % len(self._rows)
        if base not in self._row_tops:
            ids = np.argpartition(self._rows[base], -k)[-k:].astype(np.int32)
            self._row_tops[base] = ids, self._rows[base][ids]
        ids, logits = self._row_tops[base]
        ids, logits = ids.copy(), logits.copy()
        token = next_token(position, self.n_vocab)
        at = np.flatnonzero(ids == token)
        i = int(at[0]) if at.size else int(np.argmin(logits))
        ids[i], logits[i] = token, NEXT_LOGIT
        return TopRow(ids, logits)

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
        positions, backend, tops = [], [], []
        for r in rows:
            held = self._seqs[r.seq]
            start = len(held)
            held.extend(int(t) for t in r.tokens)
            n = min(r.n_logits, len(r.tokens))
            positions += range(start + len(r.tokens) - n + 1, start + len(r.tokens) + 1)
            backend += [r.seq in self._greedy] * n
            tops += [self._top.get(r.seq, 0)] * n
        if self.cost is not None:
            spin(self.cost(sum(len(r.tokens) for r in rows)))
        self.last_sampled = np.array([next_token(p, self.n_vocab) if b else -1 for p, b in zip(positions, backend)],
                                     dtype=np.int32) if any(backend) else None
        if any(tops):  # (a draft's rows: each one's top k, as LlamaContext.decode_rows hands them)
            out = [self._top_row(p, k) for p, k in zip(positions, tops)]
            self.llama_seconds += time.perf_counter() - t0
            return out
        if positions and all(backend):  # no logits cross to the host
            self.llama_seconds += time.perf_counter() - t0
            return np.zeros((len(positions), 0), dtype=np.float32)
        if len(self._out) < len(positions):
            self._out = np.empty((len(positions), self.n_vocab), dtype=np.float32)
        out = self._out[:len(positions)]  # [n_logits, vocab]: llama.cpp's output buffer
        for i, p in enumerate(positions):
            out[i] = self._rows[p % len(self._rows)]
            out[i, next_token(p, self.n_vocab)] = NEXT_LOGIT
        view = out.view()
        view.flags.writeable = False
        self.llama_seconds += time.perf_counter() - t0
        return view


def gpu_like_costs() -> tuple:
    """The oracle's and the draft's decode costs (seconds for n tokens) of `GPU_LIKE`."""
    g = GPU_LIKE
    oracle = lambda n: g["oracle_one"] if n <= 1 else g["oracle_two"] + (n - 2) * g["oracle_token"]  # noqa: E731
    return oracle, lambda n: g["draft"]


def run(n_vocab: int, k: int | None, n_seqs: int, temperature: float, max_tokens: int, *, seeded: bool = False,
        host_picks: bool = False, draft_host_picks: bool = False, p_min: float = DEFAULT_P_MIN,
        gpu_like: bool = False, rounds: int = 1) -> dict:
    """One grid point: `n_seqs` requests of `max_tokens` at a fixed draft length k (the draft
    stopping under p_min, as by default), or the engine's default where k is None (prompt lookup
    and the draft model, the adaptive policy); sampled requests unseeded (speculative sampling)
    unless `seeded` (the seed's coupled noise). Greedy picks are made "in the graph" as on a GPU
    (the stand-in knows them), unless `host_picks`: then every verified row's logits are read; and
    the draft's rows are each row's top DEVICE_TOP_K as a GPU keeps them, unless `host_picks` or
    `draft_host_picks` (whole rows).
    `gpu_like`: decodes cost what the H200's did (`GPU_LIKE`). `rounds`: the requests run this many
    times (the policy learning as it goes); the last round is measured."""
    model = StandInModel(n_vocab, f"stand-in-{n_vocab}")
    oracle_cost, draft_cost = gpu_like_costs() if gpu_like else (None, None)
    oracle = StandInContext(model, n_seq=n_seqs, cost=oracle_cost)
    draft = StandInContext(model, n_seq=n_seqs, seed=1, cost=draft_cost)
    proposer = DraftModelProposer(draft, p_min=p_min, cache_source=oracle)
    if k is None:
        proposer = HybridProposer(PromptLookupProposer(is_end=model.is_eog), proposer)
    engine = Engine.from_parts(oracle=oracle, proposer=proposer,
                               policy=default_policy(proposer) if k is None else FixedLength(k), draft=draft)
    engine.slots.backend_sampling = not host_picks  # as on a GPU: greedy picks made "in the graph" (no logits read)
    engine.slots.draft_top = 0 if host_picks or draft_host_picks else DEVICE_TOP_K  # ... the draft's rows' top k there
    for round_ in range(rounds):
        prompts = [[0] + [next_token(p, n_vocab) for p in range(1 + i + 40 * round_, 33 + i + 40 * round_)]
                   for i in range(n_seqs)]
        seqs = [engine.prepare(p, max_tokens=max_tokens, temperature=temperature,
                               seed=7 if temperature and seeded else None, draft_min=0) for p in prompts]
        for seq in seqs:
            engine.scheduler.add(seq)
        t0, l0 = time.perf_counter(), engine.stepper._llama_seconds()
        idle_host, step_host = [], []  # each step's host time: of every step, of the steps that drafted nothing
        while engine.scheduler.has_work:
            s0, sl0, steps0 = time.perf_counter(), engine.stepper._llama_seconds(), seqs[0].stats.steps
            engine.scheduler.step()
            host_s = (time.perf_counter() - s0) - (engine.stepper._llama_seconds() - sl0)
            for seq in seqs:
                seq.outbox.clear()
            if n_seqs == 1 and seqs[0].stats.steps > max(1, steps0):  # a step after the first token's
                step_host.append(host_s)
                if not seqs[0].stats.records[-1].drafted:
                    idle_host.append(host_s)
        wall, llama = time.perf_counter() - t0, engine.stepper._llama_seconds() - l0
    steps = max(s.stats.steps for s in seqs)
    tokens = sum(s.stats.completion_tokens for s in seqs)
    drafted = sum(s.stats.drafted for s in seqs)
    host = wall - llama
    return {"vocab": n_vocab, "k": "adaptive" if k is None else k, "sequences": n_seqs, "temperature": temperature,
            "gpu_like": gpu_like, "text": TEXT, "steps": steps, "tokens": tokens, "drafted": drafted,
            "idle_steps": sum(s.stats.idle_steps for s in seqs), "host_ms_per_step": 1000 * host / steps,
            "host_ms_per_token": 1000 * host / tokens,
            "host_ms_per_draft_token": 1000 * host / drafted if drafted else None,
            "llama_ms_per_step": 1000 * llama / steps,
            # single stream: the median step's host time, and the median of the steps that drafted nothing
            "host_ms_median": 1000 * float(np.median(step_host)) if step_host else None,
            "idle_host_ms_median": 1000 * float(np.median(idle_host)) if idle_host else None,
            "idle_host_ms_mean": 1000 * float(np.mean(idle_host)) if idle_host else None}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


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
    ap.add_argument("--draft-host-picks", action="store_true",
                    help="the draft model picks from its whole rows (as on a CPU), not from their top k kept on the device")
    ap.add_argument("--adaptive", action="store_true",
                    help="the engine's default (prompt lookup and the draft model, the adaptive policy), not --k")
    ap.add_argument("--gpu-like", action="store_true", help="decodes cost what the default pair's did on an H200")
    ap.add_argument("--text", choices=TEXTS, default="distinct")
    ap.add_argument("--rounds", type=int, default=1, help="run the requests this many times; the last is measured")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    global TEXT
    TEXT = args.text
    results = []
    print("| vocab | k | seqs | T | host ms/step | host ms/token | (llama ms/step) | idle steps | idle step: median | mean |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n_vocab in args.vocab:
        for k in [None] if args.adaptive else args.k:
            for n_seqs in args.seqs:
                for temperature in args.temperature:
                    r = run(n_vocab, k, n_seqs, temperature, args.max_tokens, seeded=args.seeded, p_min=args.p_min,
                            host_picks=args.host_picks, draft_host_picks=args.draft_host_picks,
                            gpu_like=args.gpu_like, rounds=args.rounds)
                    results.append(r)
                    print(f"| {n_vocab} | {r['k']} | {n_seqs} | {temperature:g} | {r['host_ms_per_step']:.3f} | "
                          f"{r['host_ms_per_token']:.3f} | {r['llama_ms_per_step']:.2f} | {r['idle_steps']} | "
                          f"{_ms(r['idle_host_ms_median'])} | {_ms(r['idle_host_ms_mean'])} |",
                          flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
