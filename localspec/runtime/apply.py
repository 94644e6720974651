"""Apply: where what a step did lands on the requests (vLLM's `Scheduler.update_from_output`).

`Step.run` returns a `StepOutput` and writes nothing a request owns. `Apply` is the one place that
does: it appends each step's tokens to the history until one ends the generation (end of
generation, a stop string, max_tokens, a full context), sends the released text to the outbox,
counts the step in the stats, hands the step's record to the request's policy, and when a request
finishes, keeps what its policy learned (the cost store) and feeds its text to the suffix cache.
The costs every request shares learn from the pass here too (`Learner.observe`). It returns each
sequence's `StepOutcome`, whose status the scheduler then changes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from localspec.constraints import ConstraintWalk
from localspec.outputs import DraftSource, Stats, Structure
from localspec.runtime.learning import Learner
from localspec.runtime.sequence import Seq, StepOutcome
from localspec.runtime.step import SeqResult, StepOutput
from localspec.speculative.plan import unused_offers

_DRAFT_SOURCES = {DraftSource.MODEL: "draft", DraftSource.LOOKUP: "lookup", DraftSource.SUFFIX: "suffix"}  # a Draft's source -> a token's (Chunk.sources)


class Apply:
    """Lands steps' results on their requests: `apply(output)` -> the outcomes for the scheduler.
    `model`: the oracle's (its end-of-generation tokens); `n_ctx`: the oracle's context; `suffix`:
    the suffix cache's pools finished requests feed (None: off); `oracle`, `draft`: the contexts
    the shared costs' passes ran on."""

    def __init__(self, *, model, oracle, draft=None, learner: Learner, suffix=None,
                 clock: Callable[[], float] | None = None) -> None:
        self.model, self.oracle, self.draft, self.learner, self.suffix = model, oracle, draft, learner, suffix
        self.clock = clock if clock is not None else lambda: time.perf_counter()

    def __call__(self, output: StepOutput) -> list[StepOutcome]:
        outcomes = [self._step(r) if r.record is not None else self._chunk(r) for r in output.results]
        self.learner.observe(output.batch, self.oracle, self.draft)
        self.learner.observe_batch(output)
        # after the verify: the results built, the prompt chunks' logprobs, emitting, the policies' updates
        other = self.clock() - output.verified
        for r in output.results:
            if r.record is not None:
                r.seq.stats.host_other_time += other
        return outcomes

    def _chunk(self, r: SeqResult) -> StepOutcome:
        if r.prompt_logprobs:
            r.seq.prompt_logprobs += r.prompt_logprobs
        return StepOutcome(r.seq, prompt_done=r.prompt_done)

    def _step(self, r: SeqResult) -> StepOutcome:
        """Emit what `seq`'s step yielded and count the step (its policy learns from it, unless the
        step was its prompt's last pass: not a verify pass of one token)."""
        seq, stats, step = r.seq, r.seq.stats, r.record
        emitted, finish = self._emit(r.tokens, seq, _sources(step.source, r.accepted, len(r.tokens))
                                     if seq.request.sources else None)
        unused = unused_offers(r.offer, step.source, emitted) if not finish else ()
        if unused:  # (most steps have none: no copy of the record then)
            step = dataclasses.replace(step, unused=unused)
        if r.prompt_done:  # the first token, from its prompt's last pass: the prompt evaluated by then
            stats.prompt_time = self.clock() - seq.t_start
        elif seq.request.speculative:  # a request that does not draft teaches the policy nothing
            seq.policy.observe(step)
            idle = (r.limit > 0 or r.batched > 0) and not step.drafted
            stats.idle_steps += idle
            if idle and r.batched:
                seq.plain_batched, seq.plain_batched_at = seq.plain_batched + 1, r.batched
        stats.add_step(step)
        structure = None
        if seq.walk is not None:
            stats.constraint_time = seq.walk.seconds
            if finish:
                finish, structure = self._structure(seq.walk, r.tokens, emitted, finish, stats)
        if stats.time_to_first_token == 0.0:
            stats.time_to_first_token = self.clock() - seq.t_start
        logprobs = r.logprobs[:len(emitted)] if r.logprobs is not None else None
        if not finish:
            if emitted:
                seq.emit(seq.text.release(), emitted, logprobs)  # stats so far
            return StepOutcome(seq, prompt_done=r.prompt_done)
        piece = seq.text.finish()
        stats.total_time = self.clock() - seq.t_start
        if seq.speculative:
            if stats.idle_steps:
                stats.idle_reason = self._idle_reason(seq)
            self.learner.save(seq.policy)
            if self.suffix is not None:  # later requests of its pool may draft from its text
                self.suffix.add(seq.pool, [seq.history])
        seq.emit(piece, emitted, logprobs, finish_reason=finish, structure=structure)
        return StepOutcome(seq, finish_reason=finish, structure=structure)

    def _idle_reason(self, seq: Seq) -> str | None:
        """Why `seq` had idle steps: its policy's reason for its own, the batch judge's for the steps
        it ran as plain batched decoding."""
        reasons = [seq.policy.explain() if seq.stats.idle_steps > seq.plain_batched else None,
                   self.learner.batch.explain(seq.plain_batched_at) if seq.plain_batched else None]
        return "; ".join(r for r in reasons if r) or None

    def _emit(self, out: list[int], seq: Seq, sources: list[str] | None = None) -> tuple[list[int], str | None]:
        """Append a step's tokens to the history until one of them ends the generation:
        end-of-generation token, stop string, max_tokens, or a full context. `sources`: where
        each token came from, for a request that asked (its text is labelled with them)."""
        emitted: list[int] = []
        stats, history = seq.stats, seq.history
        for i, token in enumerate(out):
            if self.model.is_eog(token):
                return emitted, "stop"
            emitted.append(token)
            history.append(token)
            stats.completion_tokens += 1
            if seq.text.add(token, sources[i] if sources else ""):
                return emitted, "stop"
            if stats.completion_tokens >= seq.request.max_tokens or len(history) > self.oracle.n_ctx:
                return emitted, "length"
        return emitted, None

    def _structure(self, walk: ConstraintWalk, out: list[int], emitted: list[int], finish: str,
                   stats: Stats) -> tuple[str, Structure]:
        """(finish_reason, structure) of a constrained generation that just ended.
        Complete: it ended with the end-of-generation token (allowed only once the text is a whole
        instance of the grammar), or it reached max_tokens where nothing but the end could follow
        (then it stopped as it would have: "stop"). Anything else, e.g. max_tokens in the middle
        of a JSON object or a stop string, is incomplete."""
        if len(emitted) < len(out) and self.model.is_eog(out[len(emitted)]):
            return finish, Structure.COMPLETE
        walk.pop(walk.depth - stats.completion_tokens)  # the step's tokens after the end
        if finish == "length" and walk.complete:
            return "stop", Structure.COMPLETE
        return finish, Structure.INCOMPLETE


def _sources(source: DraftSource, n_accepted: int, n: int) -> list[str]:
    """Where each of a step's `n` tokens came from: the accepted draft tokens from the draft's
    source, the last one (recovered or bonus) from the oracle."""
    return [_DRAFT_SOURCES.get(source, "draft")] * n_accepted + ["oracle"] * (n - n_accepted)
