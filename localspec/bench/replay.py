"""Replay recorded drafting traces through a length policy: its speed without timing anything.

A greedy speculative step's outcome depends on the text alone: the draft tokens that agree with the
oracle's answer are accepted, and the next token is the answer's. A trace (`scripts/record_traces.py`)
holds, for one prompt, the oracle's answer and, at every position of it, how many of the draft
model's greedy tokens from there agree with the answer (`agree`) and how sure the draft was of each
(`sure`: it stops after the first token under p_min). Replaying runs the engine itself (its
scheduler, step and apply) on a single stream against the trace: an oracle context whose greedy
picks are the answer's tokens (`TraceOracle`) and a draft model read from the trace (`TraceDrafter`),
beside the real prompt lookup and hybrid chooser; the policy sizes the draft, the verify accepts
what agrees, and every pass is charged to the step's clock from a cost table (measured on a
machine, or a GPU-like one), so the policy learns its costs as it would live. The simulated tokens
per second compare policies on equal terms.

What it leaves out: a probe's draft sees a window of the text, live, and is accepted less often; the
replay's sees all of it. Sampled requests and batches of several sequences are not replayed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.llama.context import shared_prefix
from localspec.outputs import DraftSource, StepRecord
from localspec.runtime.calibrate import CONTEXT, calibrate
from localspec.runtime.engine import Engine
from localspec.runtime.sequence import Request
from localspec.speculative.plan import DraftPlan, Offer
from localspec.speculative.policy import LengthPolicy, learns
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import EMPTY_DRAFT, MODEL_OFFER, Draft, HybridProposer

MAX_CATCH_UP = 16  # as DraftModelProposer's: after a pause the draft catches up on a window this long


@dataclass(frozen=True)
class Table:
    """Milliseconds for a decode of n tokens at a context, measured at a grid [contexts, ns];
    interpolated linearly between the grid's points (and held flat past its ends)."""

    contexts: tuple[int, ...]
    ns: tuple[int, ...]
    ms: np.ndarray  # [len(contexts), len(ns)]

    @classmethod
    def of(cls, d: dict) -> "Table":
        return cls(tuple(d["contexts"]), tuple(d["ns"]), np.asarray(d["ms"], dtype=np.float64))

    def seconds(self, n: int, context: int) -> float:
        by_n = [np.interp(n, self.ns, row) for row in self.ms]  # [len(contexts)]
        return float(np.interp(context, self.contexts, by_n)) / 1000.0


@dataclass(frozen=True)
class Costs:
    """What each pass costs in a replay: the oracle's verify of n tokens, the draft's decode of n
    tokens (a catch-up batch, or one drafted token), and the host's own time per step."""

    name: str
    oracle: Table
    draft: Table
    host_step: float = 0.0  # seconds of the controller's own work per step (outside llama.cpp)
    host_draft_token: float = 0.0  # ... and per token the draft model drafts (picking it from its logits)
    gpu: bool = False  # the engine times both models at load there (`runtime.calibrate`), and so does a replay

    def calibrate(self, policy: LengthPolicy, context: int = CONTEXT) -> None:
        """What the engine's `runtime.calibrate.measure` teaches `policy` at load, from this
        table: the costs it has not learned yet."""
        if not learns(policy):
            return
        verify, draft = policy.needs_costs()
        calibrate(policy, verify=(lambda n: self.oracle.seconds(n, context)) if verify else None,
                  draft=(lambda k: self.proposal(k, 2, context)) if draft else None, context=context)

    def proposal(self, drafted: int, catch_up: int, context: int) -> float:
        """Seconds for the draft model to propose `drafted` tokens after catching up on `catch_up`
        (one decode of those, then one a drafted token but the last)."""
        return (self.draft.seconds(max(1, catch_up), context)
                + (drafted - 1) * self.draft.seconds(1, context) + drafted * self.host_draft_token)

    @classmethod
    def gpu_like(cls, *, oracle_ms: float = 10.0, draft_ms: float = 2.5) -> "Costs":
        """An 8B oracle and a 1B draft on a workstation GPU (issue 38's figures): a pass of up to 17
        tokens costs hardly more than one, and a draft token a quarter of an oracle pass."""
        ns = (1, 2, 4, 8, 17)
        oracle = Table((0, 2048), ns, np.array([[oracle_ms * (1 + 0.01 * (n - 1)) for n in ns]] * 2))
        draft = Table((0, 2048), ns, np.array([[draft_ms * (1 + 0.02 * (n - 1)) for n in ns]] * 2))
        return cls("gpu-like", oracle, draft, host_step=0.0003, gpu=True)

    @classmethod
    def h200_smollm2(cls) -> "Costs":
        """The default pair on an NVIDIA H200 (CUDA 13.0, every layer offloaded; ../shared/gpu/
        h200-2026-11-27): both models launch-bound, so a draft token (1.4-1.8 ms) costs more than the
        oracle's one-token pass (1.2-1.3 ms, a CUDA graph of matrix-vector kernels), and a pass of two
        or more tokens 2.5-3.7x that (3.1 ms at 2, 4.4 at 17). Host time: 0.07-0.10 ms a plain step,
        2.2-3.2 ms a speculative one (~0.4 ms a drafted token)."""
        ns = (1, 2, 5, 9, 17)
        oracle = Table((0, 2048), ns, np.array([[1.25, 3.1, 3.4, 3.7, 4.4], [1.3, 3.2, 3.5, 3.8, 4.6]]))
        draft = Table((0, 2048), ns, np.array([[1.4, 3.0, 3.3, 3.6, 4.2], [1.5, 3.1, 3.4, 3.7, 4.4]]))
        return cls("h200-smollm2", oracle, draft, host_step=0.0001, host_draft_token=0.0004, gpu=True)

    @classmethod
    def h200_as_8b(cls, *, host_draft_token: float = 0.0004) -> "Costs":
        """ESTIMATED, not measured: the 8B-shaped widened oracle (`smollm2-135m-as-8b`, F16, 7.2B
        parameters: 14.4 GB of weights a pass) on an H200, with the default Q4_1 draft as the H200
        ran it. The oracle's pass reads its weights once at ~3.9 TB/s (80% of the card's 4.8), 3.7 ms
        for one token, a pass of 17 25% more; the draft's figures and the host's per step are
        `h200_smollm2`'s (measured). `host_draft_token`: the host's time per drafted token, 0.4 ms
        as measured there with whole rows read on the host; the draft's picks from its rows' top
        k kept on the device are meant to bring it near 0.1 ms (unmeasured on a GPU so far)."""
        ns = (1, 2, 5, 9, 17)
        oracle = Table((0, 2048), ns, np.array([[3.7, 3.9, 4.0, 4.2, 4.6], [3.9, 4.1, 4.2, 4.4, 4.9]]))
        draft = cls.h200_smollm2().draft
        return cls("h200-as-8b (estimated)", oracle, draft, host_step=0.0001, host_draft_token=host_draft_token,
                   gpu=True)


@dataclass(frozen=True)
class Trace:
    """One prompt's recording (see the module docstring). agree[j] and sure[j] are of the draft's
    continuation after answer[:j + 1] (the first token comes from the prompt's pass)."""

    prompt: str
    prompt_ids: tuple[int, ...]
    answer: tuple[int, ...]
    agree: np.ndarray  # [len(answer) - 1] int
    sure: np.ndarray  # [len(answer) - 1, k_max] float
    max_tokens: int  # the request's (an answer that ended before it stopped at the end-of-generation token)

    def model_draft(self, emitted: int, k: int, p_min: float) -> tuple[int, int]:
        """(drafted, accepted) for a draft model's greedy draft of at most k tokens after `emitted`
        answer tokens: it stops after its first token under p_min."""
        sure = self.sure[emitted - 1, :k]  # [<=k]
        unsure = np.flatnonzero(sure < p_min)
        drafted = int(unsure[0]) + 1 if unsure.size else len(sure)
        agree = int(self.agree[emitted - 1])
        if len(self.answer) < self.max_tokens and emitted + agree == len(self.answer):
            # the answer ended at the end-of-generation token, which the draft proposed too: it stops there
            drafted = min(drafted, agree + 1)
        return drafted, min(drafted, agree)


def load_traces(path: str | Path) -> tuple[list[Trace], dict]:
    """The traces of a recording and its document's other fields (machine, costs, p_min)."""
    doc = json.loads(Path(path).read_text())
    traces = [Trace(t["prompt"], tuple(t["prompt_ids"]), tuple(t["answer"]), np.asarray(t["agree"], dtype=np.int64),
                    np.asarray(t["sure"], dtype=np.float64), int(doc.get("max_tokens", len(t["answer"]))))
              for t in doc.pop("traces")]
    return traces, doc


def measured_costs(doc: dict, *, host_step: float = 0.002) -> Costs:
    """The cost table a recording measured (host_step: the controller's time per step there)."""
    measured = doc["costs"]["measured"]
    return Costs("measured", Table.of(measured["oracle"]), Table.of(measured["draft"]), host_step=host_step)


class TraceDrafter:
    """The draft model, read from a trace: a proposer whose proposals decode nothing. It keeps what
    the real one would hold in its cache, so a draft's catch-up is charged as it would be."""

    draft_context = None

    def __init__(self, trace: Trace, p_min: float, costs: Costs | None = None, clock: Charges | None = None) -> None:
        self.trace, self.p_min, self.costs, self.clock = trace, p_min, costs, clock
        self.held = 0  # tokens of the text the draft holds
        self.catch_up = True

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.held, self.catch_up = 0, catch_up  # (the prompt: copied from the oracle's cache, as the default pair's)

    def resync(self) -> None:
        self.catch_up = True

    def fork(self, seq: int) -> "TraceDrafter":
        return self

    def describe(self) -> str:
        return "model"

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        return MODEL_OFFER

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling=None, rng=None,
                      constraint=None):
        if plan.resync:
            self.resync()
        if plan.source != DraftSource.MODEL or plan.length <= 0:
            return EMPTY_DRAFT
        max_len = plan.length
        emitted = len(history) - len(self.trace.prompt_ids)
        if emitted >= len(self.trace.answer):  # the answer is out: what the draft made of its end is not recorded
            return EMPTY_DRAFT
        drafted, accepted = self.trace.model_draft(emitted, max_len, self.p_min)
        if self.held < len(self.trace.prompt_ids):  # a new prompt: the oracle's cache of it is copied
            self.held = len(self.trace.prompt_ids)
        unseen = len(history) - self.held
        evaluated = unseen if self.catch_up or unseen <= MAX_CATCH_UP else MAX_CATCH_UP
        self.catch_up = False
        answer = self.trace.answer
        tokens = list(answer[emitted:emitted + accepted]) + [-1] * (drafted - accepted)  # -1: not the answer's
        self.held = len(history) + drafted - 1  # the last drafted token is never decoded
        if self.clock is not None and drafted:
            self.clock.charge(self.costs.proposal(drafted, evaluated, len(history) - 1))
        return Draft(np.asarray(tokens, dtype=np.int32), None, evaluated + drafted - 1, source=DraftSource.MODEL)
        yield  # a generator, as a proposer's propose_steps is


@dataclass
class ReplayResult:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    lookup_drafted: int = 0
    records: list[StepRecord] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, *, gained: int, drafted: int, accepted: int, seconds: float) -> None:
        """Count one step that yielded `gained` tokens in `seconds`."""
        self.tokens += gained
        self.seconds += seconds
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted


class Charges:
    """The replay's clock (it stands in for time.perf_counter in the engine's step): time passes only
    as passes are charged, each `seconds` times a lognormal factor of sigma `noise` and, for the share
    `stalls` of them, three times as long (a shared machine's timings)."""

    def __init__(self, *, noise: float = 0.0, stalls: float = 0.0, rng: np.random.Generator | None = None) -> None:
        self.now, self.noise, self.stalls = 0.0, noise, stalls
        self.rng = rng if rng is not None else np.random.default_rng(0)

    def __call__(self) -> float:
        return self.now

    def charge(self, seconds: float, *, noisy: bool = True) -> float:
        """Let `seconds` pass (a pass's: with the noise; the controller's own time, `noisy=False`: as is)."""
        if not noisy:
            self.now += seconds
            return seconds
        if self.noise:
            seconds *= float(np.exp(self.noise * self.rng.standard_normal()))
        if self.stalls and self.rng.random() < self.stalls:
            seconds *= 3.0
        self.now += seconds
        return seconds


END = -2  # the end-of-generation token of a replay (-1 is a draft token the answer does not have)


class TraceModel:
    """The oracle model as a replay needs it: ids without text, and the end of generation."""

    name, chat_template, bos, eos, n_vocab, n_layer = "trace", "", END, END, 1 << 31, 0

    def is_eog(self, token: int) -> bool:
        return token == END

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        return b""


class HostCharged:
    """A proposer whose offers charge the controller's own time on a step's drafting side (half of
    `Costs.host_step`; the verify pass charges the other half)."""

    draft_context = None

    def __init__(self, inner, seconds: float, clock: Charges) -> None:
        self.inner, self.seconds, self.clock = inner, seconds, clock

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        self.clock.charge(self.seconds, noisy=False)
        return self.inner.offer(history, limit, constraint)

    def propose_steps(self, *args, **kwargs):
        return self.inner.propose_steps(*args, **kwargs)

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.inner.start(catch_up=catch_up, pool=pool, prompt=prompt)

    def fork(self, seq: int) -> "HostCharged":
        return self

    def describe(self) -> str:
        return self.inner.describe()


class TraceOracle:
    """The oracle's context, read from a trace: a decode picks the answer's token at each row (as
    llama.cpp picks a greedy request's tokens on the device: `sample_greedy`), the end of
    generation after it, and charges a verify pass to the clock from the cost table (and half the
    controller's time for a step, `HostCharged` the other)."""

    flash_attn, n_seq, n_batch = "off", 1, 512

    def __init__(self, trace: Trace, costs: Costs, clock: Charges) -> None:
        self.trace, self.costs, self.clock = trace, costs, clock
        self.model = TraceModel()
        self.n_ctx = len(trace.prompt_ids) + trace.max_tokens + 2
        self.held: list[int] = []
        self.last_sampled: np.ndarray | None = None
        self.llama_seconds = 0.0

    def decode_rows(self, rows) -> np.ndarray:
        picks = []
        for r in rows:
            start = len(self.held)
            self.held += [int(t) for t in r.tokens]
            if r.n_logits:  # a verify pass (a prompt's chunk is not generation time: not charged)
                self.llama_seconds += self.clock.charge(self.costs.oracle.seconds(len(r.tokens), start))
                self.clock.charge(self.costs.host_step / 2, noisy=False)  # the controller's, on the verify side
            answer_at = len(self.held) - len(self.trace.prompt_ids)  # the answer's index the last row predicts
            for j in range(answer_at - r.n_logits + 1, answer_at + 1):
                picks.append(self.trace.answer[j] if j < len(self.trace.answer) else END)
        self.last_sampled = np.asarray(picks, dtype=np.int64)  # [sum of n_logits]
        return np.zeros((len(picks), 0), dtype=np.float32)  # no logits: the picks are all a verify reads

    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        return on

    def seq_tokens(self, seq: int = 0) -> list[int]:
        return self.held

    def rollback(self, n_past: int, *, seq: int = 0) -> None:
        del self.held[n_past:]

    def common_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        return shared_prefix(self.held, tokens)

    def ubatches(self, rows):
        return [[(seq, n) for seq, n in rows if n > 0]]


def replay(trace: Trace, policy: LengthPolicy, costs: Costs, *, lookup: bool = True, model: bool = True,
           p_min: float = 0.3, noise: float = 0.0, stalls: float = 0.0,
           rng: np.random.Generator | None = None) -> ReplayResult:
    """One request of `trace` run by the engine (`Engine.from_parts`: its scheduler, step and apply)
    as a greedy single stream under `policy` (the engine's own: the request runs on a fork of it, as
    live), drafting from the draft model and/or prompt lookup, over a context and a draft model that
    read the trace and charge a clock from `costs`. A shared machine's timings: `noise`, each pass's
    time multiplied by a lognormal factor of this sigma; `stalls`, the share of passes that take
    three times as long. The prompt's pass is not generation time (as in the engine's Stats)."""
    if costs.gpu:
        costs.calibrate(policy)  # as the engine does at load on a GPU (a no-op once the costs are known)
    clock = Charges(noise=noise, stalls=stalls, rng=rng)
    drafter = TraceDrafter(trace, p_min, costs, clock)
    finder = PromptLookupProposer()
    proposer = HybridProposer(finder, drafter) if lookup and model else drafter if model else finder
    engine = Engine.from_parts(oracle=TraceOracle(trace, costs, clock), proposer=HostCharged(proposer, costs.host_step / 2, clock),
                               policy=policy, clock=clock)
    engine.slots.backend_sampling = True
    seq = engine.new_seq(list(trace.prompt_ids), Request(max_tokens=trace.max_tokens))
    for _ in engine.scheduler.run(seq):
        pass
    stats = seq.stats
    return ReplayResult(tokens=stats.completion_tokens, seconds=stats.draft_time + stats.verify_time,
                        steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                        lookup_drafted=stats.lookup_drafted, records=list(stats.records))


def hindsight(trace: Trace, costs: Costs, *, k_max: int = 16) -> ReplayResult:
    """The most any draft length could make of the draft model on `trace`: each step drafts exactly
    the tokens that will be accepted, plus one that will not (none where the first would fail),
    knowing the answer. No policy reaches it; how far the best fixed K sits under it bounds what a
    policy can gain over that K."""
    out = ReplayResult()
    prompt, answer = len(trace.prompt_ids), len(trace.answer)
    out.add(gained=1, drafted=0, accepted=0, seconds=costs.oracle.seconds(1, prompt - 1) + costs.host_step)
    emitted = 1
    while emitted < answer:
        context = prompt + emitted - 1
        agree = int(trace.agree[emitted - 1])
        drafted = min(agree + 1, k_max, max(0, trace.max_tokens - emitted - 1)) if agree else 0
        accepted = min(drafted, agree)
        seconds = costs.oracle.seconds(drafted + 1, context) + costs.host_step
        if drafted:
            seconds += costs.proposal(drafted, 2 if out.steps > 1 else 1, context)
        gained = min(accepted + 1, answer - emitted)
        emitted += gained
        out.add(gained=gained, drafted=drafted, accepted=accepted, seconds=seconds)
    return out
