"""The step: plan -> execute, for every running sequence at once. It returns what happened.

One speculative step, as in llama.cpp's speculative-simple:

    history = prompt + emitted tokens; the oracle's cache holds history[:-1], and the last token
              is kept out of it until the next step evaluates it (a prompt's last token goes in
              with the chunk that ends the prompt, whose logits there give the first token)
    offer   = proposer.offer(history, limit)                 # what it could draft, found without decoding
    plan    = policy.plan(offer, limit, context)             # which source drafts how many (DraftPlan)
    draft   = the proposer carries the plan out              # k tokens, maybe fewer (Draft.stop says why)
    logits  = oracle.decode([last, d1..dk])                  # ONE pass, logits at all k+1 positions
    out     = accepted draft tokens + a recovered or bonus token
    oracle cache trimmed to history + accepted (seq_rm); the draft's cache is synced lazily

With no draft (or k = 0) the same loop is plain oracle decoding: the baseline.

Many sequences (`Seq`, each in a slot: a sequence id of both contexts) step together, as
llama-server's slots do: `Step.run(running, prefill)` plans every running sequence's draft (each
with its fork of the length policy, priced for the shared pass), drafts for all of them (one
draft-model decode per draft position: `proposers.drive_all`), builds ONE verify batch of every
sequence's [last, d1..dk] and chunks of prompts being filled, decodes it, accepts and rolls back
each sequence on its own rows.

Execute writes nothing a request owns (its history, outbox, stats or status): it returns a
`StepOutput`, a `SeqResult` a sequence (the tokens, how many were accepted, the step's record, the
cuts made to its draft and why) and the pass's `PassRecord`; `runtime.apply.Apply` lands them on
the requests and the scheduler changes their statuses (vLLM's `update_from_output`). What executing
does change is what executing is: the contexts' caches (a rejected draft rolled back), a grammar
walk's depth, the proposers' state and each request's random generator.

Under a JSON schema or a grammar (`constraints.ConstraintWalk`), the draft proposes only allowed
tokens (pushing them onto the walk), every verified row of the oracle's logits gets the mask of its
position before acceptance (so the target is the constrained oracle distribution, and recovered and
bonus tokens come from it), and the walk pops back to the accepted prefix.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import accumulate
from typing import Callable, Mapping, Sequence

import numpy as np

from localspec.batch import Rows
from localspec.outputs import StepRecord, TokenLogprob, TopLogprob
from localspec.runtime.learning import Learner
from localspec.runtime.sequence import Seq
from localspec.speculative.acceptance import accept
from localspec.speculative.plan import NO_DRAFT, NO_OFFER, DraftPlan, Offer, SharedPass, all_or_none
from localspec.speculative.policy import learns
from localspec.speculative.proposers import EMPTY_DRAFT, Draft, drive_all
from localspec.speculative.sampling import log_softmax, top_ids

# a padded decode must be predicted this much cheaper than the ragged one: the pass-cost fit is off
# by about this much on one pass (costs.NOISE: a step here varies 10-20%), and a filler token that
# buys nothing must not be paid for on a guess (measured on the reference CPU, records answered a
# second time, big verify rows: taking savings of 2-5% made the passes slower)
EVEN_OUT_MARGIN = 0.1

ALL_OR_NONE = "all-or-none"  # a cut's reason: another sequence of a closed batch drafted nothing
DRAFT_MIN = "draft_min"  # ... the draft came back shorter than the request's draft_min


@dataclasses.dataclass(frozen=True)
class Cut:
    """A draft made shorter than its plan after the policy made it, and why: the proposer's own
    stop (`Draft.stop`: "p_min", "end", "grammar", "match") or the step's (ALL_OR_NONE, DRAFT_MIN)."""

    reason: str
    length: int  # the draft's length after it


@dataclasses.dataclass(eq=False)
class SeqResult:
    """What one pass did for one sequence: a speculative step's tokens and record, or a prompt
    chunk's progress. Nothing here has landed on the request yet (`runtime.apply`)."""

    seq: Seq
    tokens: list[int] = dataclasses.field(default_factory=list)  # accepted draft tokens + a recovered or bonus one
    accepted: int = 0  # draft tokens accepted
    logprobs: list[TokenLogprob] | None = None  # of `tokens`, when the request asked
    record: StepRecord | None = None  # the step's (None: a prompt chunk); `unused` is filled on landing
    offer: Offer = NO_OFFER  # what the proposer offered (the offers left unused are scored on landing)
    limit: int = 0  # draft tokens the step could have drafted (0: the first token, no room, not drafting)
    batched: int = 0  # the sequences of plain batched decoding the batch judge ran this step as (0: it did not)
    cuts: tuple[Cut, ...] = ()
    prompt_done: bool = False  # a prompt chunk: the prompt is all in the oracle's cache now
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # a chunk's, when asked


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """The oracle's pass and the draft's decodes of one step, for the costs shared by every request."""

    rows: list[Rows]  # the verify pass, in slot order
    contexts: dict[int, int]  # tokens each row's sequence held before it
    rounds: list  # the draft model's decodes (`proposers.Round`s)
    prefill: int  # the most prompt tokens one of its rows carried (0: it filled no prompt)
    seconds: float  # the verify pass's decode
    running: int  # sequences that stepped
    drafted: int | None  # of those, the ones whose proposer came back with tokens, before any cut (None: none ran)


@dataclasses.dataclass
class StepOutput:
    results: list[SeqResult]  # the running sequences' steps (slot order), then the prompt chunks
    batch: PassRecord
    verified: float  # the step's clock when its verify ended: what comes after is the host's "other" time


@dataclasses.dataclass(eq=False)
class Proposal:
    """One running sequence's part of a step, from plan to result: what its proposer offered, the
    plan its policy made of that, the draft that came of it, the cuts made to it and the grammar
    walk's depth before the draft was pushed. It lives for one step, never on the request's `Seq`."""

    offer: Offer = NO_OFFER
    plan: DraftPlan = NO_DRAFT
    draft: Draft = EMPTY_DRAFT
    limit: int = 0
    batched: int = 0  # plain batched decoding of this many sequences ran instead of the policy's plan
    walk_base: int = 0
    cuts: list[Cut] = dataclasses.field(default_factory=list)


class Step:
    """Plan and execute one pass over the running sequences and the prompts being filled (the
    module's docstring). `learner`: the engine's policy and shared costs (read here, taught on
    landing); `clock`: seconds, as time.perf_counter (a replay's advances only while it decodes)."""

    def __init__(self, *, oracle, draft=None, learner: Learner, clock: Callable[[], float] | None = None) -> None:
        self.oracle, self.draft_ctx, self.learner = oracle, draft, learner
        self.clock = clock if clock is not None else lambda: time.perf_counter()
        self.last_pass = (0, 0)  # the last oracle pass: sequences and tokens it carried
        self.accept = accept  # the acceptance rule (`acceptance.accept`; a test may wrap it to watch)

    def run(self, running: Sequence[Seq], prefill: Mapping[Seq, int] | None = None, *,
            queued: bool = False) -> StepOutput:
        """ONE pass of the oracle: a speculative step of each running sequence and the next
        `prefill[seq]` prompt tokens of each sequence filling its cache. `queued`: requests wait for
        a slot (one that finishes sooner lets the next one in)."""
        prefill = dict(prefill or {})
        running = sorted(running, key=lambda seq: seq.slot)  # rows in slot order: llama.cpp's fewest passes
        t0, l0 = self.clock(), self._llama_seconds()
        closed = len(running) > 1 and not queued
        props = self._plan(running, n_seqs=len(running) + len(prefill), closed=closed)
        rounds, drafted = self._propose(running, props, closed=closed)
        t1, l1 = self.clock(), self._llama_seconds()
        # prompt chunks that end the history (its last token too): their last row gives the first token
        first = {seq: Proposal(walk_base=seq.walk.depth if seq.walk is not None else 0) for seq, n in prefill.items()
                 if len(self.oracle.seq_tokens(seq.slot)) + n == len(seq.history)}
        rows = self._rows(prefill, props, first)
        contexts = {r.seq: len(self.oracle.seq_tokens(r.seq)) for r in rows}
        rows = self._even_out(rows, contexts, {seq.slot for seq in running})
        logits = self.oracle.decode_rows(rows)  # [sum of n_logits, vocab], in slot order
        picked = self.oracle.last_sampled  # [sum of running's k+1] the backend's greedy ids, or None
        t_decoded = self.clock()
        self.last_pass = (len(rows), sum(len(r.tokens) for r in rows))
        offsets = dict(zip((r.seq for r in rows), accumulate((r.n_logits for r in rows), initial=0)))
        verified = [self._verify(seq, props[seq], *self._rows_of(seq, props[seq], logits, picked, offsets[seq.slot]))
                    for seq in running]
        firsts = {seq: self._verify(seq, prop, *self._rows_of(seq, prop, logits, picked, offsets[seq.slot]))
                  for seq, prop in first.items()}
        t2, l2 = self.clock(), self._llama_seconds()
        times = dict(draft_time=t1 - t0, verify_time=t2 - t1, draft_host_time=(t1 - t0) - (l1 - l0),
                     verify_host_time=(t2 - t1) - (l2 - l1), batch_seqs=len(rows),
                     batch_tokens=self.last_pass[1] if len(rows) > 1 else 0)
        results = [self._result(seq, props[seq], out, logprobs, n_accepted, times)
                   for seq, (out, logprobs, n_accepted) in zip(running, verified)]
        results += [self._chunk(seq, n, logits, offsets[seq.slot]) if seq not in first else
                    dataclasses.replace(self._result(seq, first[seq], *firsts[seq], times), prompt_done=True)
                    for seq, n in prefill.items()]
        batch = PassRecord(rows, contexts, rounds, max(prefill.values(), default=0), t_decoded - t1, len(running),
                           drafted)
        return StepOutput(results, batch, t2)

    # -- plan

    def _plan(self, running: Sequence[Seq], *, n_seqs: int, closed: bool) -> dict[Seq, Proposal]:
        """Each running sequence's part of the step (in slot order): what its proposer offers and
        the plan its policy makes of it, priced for the shared pass when other sequences share it.
        `closed`: nobody waits for a slot, so the batch's plans are all drafts or none
        (`plan.all_or_none`)."""
        shared = SharedPass([len(seq.history) - 1 for seq in running], self.learner.drafting) if n_seqs > 1 else None
        # several sequences: plain batched decoding where it measured faster than drafting (or is measured now)
        plain = len(running) > 1 and self.learner.batch.plain(len(running), lambda: self._one_token_pass(running))
        props = {}
        for seq in running:
            # the first token came with the prompt's pass; a step before any oracle pass was measured
            # (a fresh process on a CPU) is plain too: it measures what every draft is priced against
            limit = self.draft_limit(seq) if seq.stats.steps and not _measuring(seq.policy) else 0
            if limit > 0 and plain and learns(seq.policy):
                props[seq] = Proposal(batched=len(running))  # an idle step, the judge's (its reason is kept apart)
            elif limit > 0:
                offer = seq.proposer.offer(seq.history, limit, seq.walk)
                props[seq] = Proposal(offer, seq.policy.plan(offer, limit, len(seq.history) - 1, shared), limit=limit)
            else:
                props[seq] = Proposal()
        if closed:
            eligible = [props[seq] for seq in running if props[seq].limit > 0]
            for prop, plan in zip(eligible, all_or_none([prop.plan for prop in eligible])):
                prop.plan = plan
        return props

    def _one_token_pass(self, running: Sequence[Seq]) -> float | None:
        """Seconds of one sequence's one-token pass at the batch's longest context, as learned."""
        seq = max(running, key=lambda s: len(s.history))
        return self.learner.decode_time(self.oracle, [(seq.slot, 1)], {seq.slot: len(seq.history) - 1})

    def draft_limit(self, seq: Seq) -> int:
        """Most draft tokens worth proposing now: each step emits up to k+1 tokens, and the oracle
        must hold history + k."""
        request = seq.request
        if not seq.speculative:
            return 0
        limit = min(request.max_tokens - seq.stats.completion_tokens - 1, self.oracle.n_ctx - len(seq.history))
        if request.draft_max is not None:
            limit = min(limit, request.draft_max)
        return max(0, limit)

    # -- execute: draft

    def _propose(self, running: Sequence[Seq], props: Mapping[Seq, Proposal], *,
                 closed: bool) -> tuple[list, int | None]:
        """Every running sequence's draft (`Proposal.draft`), each proposer carrying out its plan:
        the draft model drafts for all of them together, one decode per draft position. Returns the
        draft decodes (`proposers.Round`s) and how many drafts came back with tokens (None: no
        proposer ran).

        A draft shorter than its plan says why (`Draft.stop`); one shorter than the request's
        `draft_min` is dropped, as asked. With nobody waiting for a slot (`closed`), the batch runs
        until its longest answer ends: a draft that speeds one sequence up and slows the pass for
        all of them shortens nothing (the others still need as many passes) unless every sequence
        drafts, so when one of them came back empty every draft is dropped. (Measured on the
        reference CPU, 8 clients of 256-token answers: a few prompt-lookup copies and short model
        drafts for some sequences, probes among them, left the passes as many and made them dearer,
        0.85x plain batched decoding.)"""
        proposals, drafting = [], []
        for seq in running:
            prop = props[seq]
            prop.walk_base = seq.walk.depth if seq.walk is not None else 0
            if prop.plan.drafts or prop.plan.resync:
                proposals.append(seq.proposer.propose_steps(seq.history, prop.plan, prop.offer, seq.request.sampling,
                                                            seq.rng, seq.walk))
                drafting.append(seq)
        if not proposals:
            return [], None
        drafts, rounds = drive_all(proposals, self.draft_ctx)
        for seq, draft in zip(drafting, drafts):
            prop = props[seq]
            prop.draft = draft
            if len(draft) < prop.plan.length and draft.stop:
                prop.cuts.append(Cut(draft.stop, len(draft)))
            if len(draft) < (seq.request.draft_min or 0):  # too short to be worth verifying, as asked
                self._drop(seq, prop, DRAFT_MIN)
        if closed:
            eligible = [seq for seq in running if props[seq].limit > 0]
            if any(len(props[seq].draft) for seq in eligible) and not all(len(props[seq].draft) for seq in eligible):
                for seq in eligible:
                    self._drop(seq, props[seq], ALL_OR_NONE)
        return rounds, sum(1 for d in drafts if len(d))

    @staticmethod
    def _drop(seq: Seq, prop: Proposal, reason: str) -> None:
        """`seq`'s step runs without its draft (its tokens come off the grammar walk too)."""
        if len(prop.draft):
            prop.cuts.append(Cut(reason, 0))
        if seq.walk is not None:
            seq.walk.pop(len(prop.draft))
        prop.draft = EMPTY_DRAFT

    # -- execute: the verify pass

    def _rows(self, prefill: Mapping[Seq, int], props: Mapping[Seq, Proposal], first=()) -> list[Rows]:
        """The verify pass's rows in slot order: each prompt chunk being filled (the logits of its
        last token where it ends the history: the sequences in `first`), each running sequence's
        [last, d1..dk]."""
        rows = [Rows(seq.slot, seq.history[len(self.oracle.seq_tokens(seq.slot)):][:n],
                     1 if seq in first else n if seq.request.prompt_logprobs is not None else 0)
                for seq, n in prefill.items()]
        rows += [Rows(seq.slot, [seq.history[-1]] + p.draft.tokens.tolist(), len(p.draft) + 1) for seq, p in props.items()]
        return sorted(rows, key=lambda r: r.seq)

    def _even_out(self, rows: list[Rows], contexts: Mapping[int, int], verifying: set[int]) -> list[Rows]:
        """The verify rows (of the sequences in `verifying`), the short ones padded with filler up to
        the length that makes the decode cheapest as the policy learned the oracle's passes:
        llama.cpp runs consecutive sequences of one length as one pass and splits ragged rows into
        several (`LlamaContext.ubatches`), each reading the weights again. A pass that costs little
        per token (a GPU; a memory-bound CPU pass) is evened out; one that pays for every token
        seldom is: a saving under EVEN_OUT_MARGIN of the pass is within the fit's error and not
        taken. Unchanged before a pass was measured, and for a policy that does not learn."""
        if len(rows) < 2:  # one row: nothing to even out (a single stream's every step)
            return rows
        sizes = [(r.seq, len(r.tokens)) for r in rows]
        lengths = sorted({n for seq, n in sizes if seq in verifying})
        if len(lengths) < 2:
            return rows
        least = self.learner.decode_time(self.oracle, sizes, contexts)
        if least is None:
            return rows
        bar, best = least * (1.0 - EVEN_OUT_MARGIN), None
        for target in lengths[1:]:
            padded = [(seq, max(n, target) if seq in verifying else n) for seq, n in sizes]
            t = self.learner.decode_time(self.oracle, padded, contexts)
            if t < min(least, bar):
                best, least = target, t
        if best is None:
            return rows
        return [dataclasses.replace(r, pad=best - len(r.tokens)) if r.seq in verifying and len(r.tokens) < best else r
                for r in rows]

    @staticmethod
    def _rows_of(seq: Seq, prop: Proposal, logits: np.ndarray, picked: np.ndarray | None,
                 offset: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`seq`'s verified rows of the pass: logits [k+1, vocab] and, when llama.cpp picked its
        greedy tokens, those picks [k+1]."""
        n = len(prop.draft) + 1
        return logits[offset:offset + n], picked[offset:offset + n] if seq.backend_greedy else None

    def _verify(self, seq: Seq, prop: Proposal, logits: np.ndarray,
                picked: np.ndarray | None = None) -> tuple[list[int], list[TokenLogprob] | None, int]:
        """Accept `seq`'s draft against its rows of the verify pass (logits [k+1, vocab], or the
        oracle's greedy picks [k+1] made on the backend) and trim its caches: (the tokens it
        yields, their logprobs if asked, draft tokens accepted)."""
        draft, walk, request = prop.draft, seq.walk, seq.request
        # under a grammar the target is the constrained oracle: each row masked at its position
        masks = walk.masks(prop.walk_base) if walk is not None and picked is None else None  # [k+1, vocab]
        out, n_accepted = self.accept(draft.tokens, draft.probs, logits, request.sampling, seq.rng,
                                 position=len(seq.history), masks=masks, picked=picked)
        if walk is not None:
            walk.pop(len(draft) - n_accepted)
            walk.push(int(out[-1]))  # drawn from a masked row: allowed
            walk.settle()
        self.oracle.rollback(len(seq.history) + n_accepted, seq=seq.slot)  # keep last + accepted; the new last stays out
        # the logits stay valid until the next decode: logprobs are not part of the verify time
        model = self.oracle.model
        logprobs = token_logprobs(model, logits[:len(out)], out, request.logprobs) if request.logprobs is not None else None
        return out.tolist(), logprobs, n_accepted

    # -- what happened

    @staticmethod
    def _result(seq: Seq, prop: Proposal, out: list[int], logprobs: list[TokenLogprob] | None, n_accepted: int,
                times: Mapping[str, float]) -> SeqResult:
        draft = prop.draft
        record = StepRecord(k=prop.plan.length, drafted=len(draft), accepted=n_accepted, context=len(seq.history) - 1,
                            draft_evaluated=draft.evaluated, draft_prompt_time=draft.prompt_time, source=draft.source,
                            **times)
        return SeqResult(seq, out, n_accepted, logprobs, record, prop.offer, prop.limit, prop.batched, tuple(prop.cuts))

    def _chunk(self, seq: Seq, n: int, logits: np.ndarray, offset: int) -> SeqResult:
        """A prompt chunk's result: whether the prompt is in, and the logprobs of its tokens for a
        request that asked (row j of a chunk predicts the token after the j-th of it). A chunk that
        ends the history gives the first token instead, as a step that drafted nothing (`run`)."""
        prompt_logprobs = []
        if seq.request.prompt_logprobs is not None:
            start = len(seq.prompt_logprobs)
            targets = np.asarray(seq.history[start:start + n])  # [n]
            prompt_logprobs = token_logprobs(self.oracle.model, logits[offset:offset + n], targets,
                                             seq.request.prompt_logprobs)
        done = len(self.oracle.seq_tokens(seq.slot)) >= len(seq.history) - 1
        return SeqResult(seq, prompt_done=done, prompt_logprobs=prompt_logprobs)

    def _llama_seconds(self) -> float:
        """Seconds spent inside llama.cpp so far, on every context."""
        return self.oracle.llama_seconds + (self.draft_ctx.llama_seconds if self.draft_ctx is not None else 0.0)


def _measuring(policy) -> bool:
    """Whether `policy` learns the oracle's pass costs and has measured none yet (none kept from an
    earlier process, none timed at load): its one-token pass is what every draft is priced against,
    and a draft planned before it is blind (a probe then lost 3-4% on the replay's short answers)."""
    return learns(policy) and policy.needs_costs()[0]


def token_logprobs(model, logits: np.ndarray, tokens: np.ndarray, top_n: int) -> list[TokenLogprob]:
    """The oracle's own log-probabilities (raw model distribution) of `tokens` [n] from logits
    [n, vocab], with each token's real bytes; the top `top_n` most likely first, ties by token id."""
    logp = log_softmax(logits)  # [n, vocab]
    out = []
    for row, token in zip(logp, tokens.tolist()):
        top = tuple(TopLogprob(t, *text_and_bytes(model, t), float(row[t])) for t in top_ids(row, top_n).tolist())
        out.append(TokenLogprob(token, *text_and_bytes(model, token), float(row[token]), top))
    return out


def text_and_bytes(model, token: int) -> tuple[str, bytes]:
    piece = model.token_piece(token)
    return piece.decode(errors="replace"), piece
