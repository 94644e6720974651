"""What a generation returns: text, tokens, why it stopped, and how speculation went."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple


class DraftSource(enum.StrEnum):
    """Where a step's draft came from (its value is what records and reports say)."""

    NONE = ""  # nothing drafted
    MODEL = "model"  # a draft model
    LOOKUP = "lookup"  # prompt lookup: the text itself
    SUFFIX = "suffix"  # the suffix cache: earlier requests' text


class OfferScore(NamedTuple):
    """A model-free source's offer that a step did not draft, scored against what the step emitted:
    its first `compared` tokens compared, the first `matched` of them agreeing in a row, on a match
    `run` tokens long (how it would have fared as a draft)."""

    source: DraftSource
    compared: int
    matched: int
    run: int

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    class StrEnum(str, enum.Enum):  # type: ignore[no-redef]
        """An enum whose members are their string values (in JSON, str() and format() alike)."""

        def __str__(self) -> str:
            return self.value

        def __format__(self, spec: str) -> str:
            return format(self.value, spec)


class Structure(StrEnum):
    """How a generation under a JSON schema or grammar ended, as it goes out (the batch file's
    records, `Result.to_dict`)."""

    COMPLETE = "complete"  # the text is a whole instance of the schema or grammar
    INCOMPLETE = "incomplete"  # it stopped first (max_tokens, a stop string)


@dataclass(frozen=True)
class StepRecord:
    """One speculative step, as the engine ran it. Times in seconds."""

    k: int  # draft tokens the policy allowed
    drafted: int  # draft tokens proposed (fewer than k when the draft stopped early)
    accepted: int  # of those, accepted by the oracle
    draft_time: float  # proposing
    verify_time: float  # the oracle's pass over [last, d1..d_drafted] and the acceptance test
    context: int  # tokens in the oracle's cache before the verify pass
    draft_evaluated: int = 0  # tokens the draft model evaluated for this proposal (its catch-up included)
    draft_prompt_time: float = 0.0  # of draft_time, evaluating the request's prompt (the first proposal's)
    source: DraftSource = DraftSource.NONE  # where the draft came from (a hybrid proposer uses both)
    batch_seqs: int = 1  # sequences the verify pass carried (its time is the whole pass's)
    batch_tokens: int = 0  # tokens the verify pass carried (0: this step's own, drafted + 1)
    draft_host_time: float = 0.0  # of draft_time, outside llama.cpp (the policy, the proposers' Python)
    verify_host_time: float = 0.0  # of verify_time, outside llama.cpp (batch building, acceptance, rollback)
    unused: tuple[OfferScore, ...] = ()  # the model-free sources' offers the step did not draft

    @property
    def emitted(self) -> int:
        """Tokens the step produced before any stop: the accepted ones and a recovered or bonus token."""
        return self.accepted + 1


@dataclass
class Stats:
    """Per-call counters. Times in seconds. `records` holds every step (left out of `to_dict`
    unless asked for: a long answer has hundreds)."""

    prompt_tokens: int = 0  # tokens in the prompt
    prompt_tokens_evaluated: int = 0  # of those, evaluated by the oracle (the rest came from its cache)
    completion_tokens: int = 0
    steps: int = 0  # oracle verify passes
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the oracle accepted
    lookup_drafted: int = 0  # of the drafted tokens, those prompt lookup proposed (the rest: the draft model)
    lookup_accepted: int = 0  # ... and of those, accepted
    suffix_drafted: int = 0  # of the drafted tokens, those the suffix cache proposed (earlier requests' text)
    suffix_accepted: int = 0  # ... and of those, accepted
    prompt_time: float = 0.0  # the oracle evaluating the prompt (before the first token)
    draft_prompt_time: float = 0.0  # the draft evaluating it (in its first proposal, after the first token)
    draft_time: float = 0.0  # proposing, draft_prompt_time included
    verify_time: float = 0.0  # oracle passes plus acceptance
    constraint_time: float = 0.0  # of draft + verify time, in the grammar's masks and matcher (structured output)
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    flash_attn: str = ""  # the oracle's attention kernel: "on" or "off"
    regime: str = ""  # how the request samples, as the length policy keeps its estimates apart ("greedy", ...)
    idle_steps: int = 0  # steps that could have drafted and did not (the policy judged drafting not worth it,
    # or plain batched decoding measured faster: runtime.batch_judge)
    idle_reason: str | None = None  # why, when there were some: the policy's estimate against its threshold
    draft_flash_attn: str | None = None  # the draft model's, if there is one
    # the host's own time (wall time minus time inside llama.cpp) in the steps: proposing, verifying
    # and the rest (emitting: text, stop strings, the policy's update); on a GPU it adds to every pass
    host_draft_time: float = 0.0
    host_verify_time: float = 0.0
    host_other_time: float = 0.0
    records: list[StepRecord] = field(default_factory=list, repr=False)

    def add_step(self, step: StepRecord) -> None:
        """Count one speculative step in the totals, and keep its record."""
        self.records.append(step)
        self.steps += 1
        if step.drafted:
            self.drafted += step.drafted
            self.accepted += step.accepted
            if step.source == DraftSource.LOOKUP:
                self.lookup_drafted += step.drafted
                self.lookup_accepted += step.accepted
            elif step.source == DraftSource.SUFFIX:
                self.suffix_drafted += step.drafted
                self.suffix_accepted += step.accepted
        self.draft_time += step.draft_time
        self.draft_prompt_time += step.draft_prompt_time
        self.verify_time += step.verify_time
        self.host_draft_time += step.draft_host_time
        self.host_verify_time += step.verify_host_time

    @property
    def host_time(self) -> float:
        """Seconds of the steps spent outside llama.cpp."""
        return self.host_draft_time + self.host_verify_time + self.host_other_time

    @property
    def host_ms_per_token(self) -> float:
        return 1000 * self.host_time / self.completion_tokens if self.completion_tokens else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1000 * self.host_time / self.steps if self.steps else 0.0

    def by_source(self) -> dict[str, tuple[int, int]]:
        """(drafted, accepted) of each draft source: the draft model, prompt lookup, the suffix cache."""
        model = (self.drafted - self.lookup_drafted - self.suffix_drafted,
                 self.accepted - self.lookup_accepted - self.suffix_accepted)
        return {DraftSource.MODEL.value: model, DraftSource.LOOKUP.value: (self.lookup_drafted, self.lookup_accepted),
                DraftSource.SUFFIX.value: (self.suffix_drafted, self.suffix_accepted)}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verify step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.completion_tokens / self.steps if self.steps else 0.0

    @property
    def generation_time(self) -> float:
        """Seconds generating: the total without the oracle's evaluation of the prompt. The draft's
        evaluation of it counts: it runs after the first token (in the first proposal), a cost that
        only speculation pays, and the reader waits for it."""
        return self.total_time - self.prompt_time

    @property
    def tokens_per_second(self) -> float:
        """Generation speed after the oracle's prompt evaluation (the draft's counts)."""
        t = self.generation_time
        return self.completion_tokens / t if t > 0 else 0.0

    def to_dict(self, *, records: bool = False) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "records"}
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 tokens_per_step=self.tokens_per_step, tokens_per_second=self.tokens_per_second,
                 host_ms_per_token=self.host_ms_per_token, host_ms_per_step=self.host_ms_per_step)
        if records:
            d["records"] = [asdict(r) for r in self.records]
        return d


@dataclass(frozen=True)
class TopLogprob:
    """One of the oracle's most likely tokens at a position. `bytes` is the token's own bytes; `text`
    decodes them alone (a token holding part of a UTF-8 character shows U+FFFD there)."""

    token: int
    text: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The oracle's log-probability of an emitted token (from the verify pass), and its top rivals
    (most likely first; equal log-probabilities in token id order). `bytes` and `text` as in TopLogprob."""

    token: int
    text: str
    bytes: bytes
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)
    top: tuple[TopLogprob, ...] = ()


@dataclass
class Chunk:
    """A piece of a streamed generation: the text released after one speculative step.
    `stats` are the running counters (final on the last chunk, which also has `finish_reason`;
    its text may be empty)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stats: Stats | None = None
    structure: Structure | None = None  # on the last chunk under a schema or grammar
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first chunk, when asked: each prompt token's
    # asked for (`sources=True`): `text` cut at its tokens, each piece with where its token came
    # from: "draft" (accepted from the draft model), "lookup" (accepted from prompt lookup) or
    # "oracle" (the token each step adds: recovered after a rejection, or the bonus). The pieces add
    # up to `text`, which may hold text of earlier steps' tokens (held back for a possible stop
    # string) and leave some of this step's for later
    sources: list[tuple[str, str]] | None = None


@dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] | None = None
    structure: Structure | None = None  # under a schema or grammar; None without one

    def to_dict(self) -> dict:
        d = {"text": self.text, "finish_reason": self.finish_reason, "tokens": self.tokens,
             "stats": self.stats.to_dict()}
        if self.structure is not None:
            d["structure"] = self.structure
        return d
