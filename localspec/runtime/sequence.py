"""One request as the engine runs it: `Request`, what was asked, and `Seq`, all of its state in one
place (llama-server's `server_slot`, vLLM's `Request`).

A sequence waits, then takes a slot (a sequence id in the oracle's context and in the draft's),
fills the oracle's cache with its prompt (in chunks, beside other sequences' steps), then runs
speculative steps until it finishes or is aborted. What it emits waits in `outbox` as `Chunk`s for
whoever consumes it (`Engine.stream`, the server's worker, a batch file's runner).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from localspec.options import OPTIONS, GenerationOptions
from localspec.outputs import Chunk, Stats, Structure, TokenLogprob
from localspec.speculative.sampling import SamplingParams

if TYPE_CHECKING:
    from localspec.constraints import Constraint, ConstraintWalk
    from localspec.speculative.policy import LengthPolicy
    from localspec.speculative.proposers import Proposer
    from localspec.runtime.text import TextStream

_ids = itertools.count(1)


class PromptTooLongError(ValueError):
    """The prompt does not fit in the context."""


@dataclass(frozen=True)
class Request:
    """One generation request as the loop runs it: the options of a `GenerationOptions`, with the
    sampling ones gathered and the schema or grammar compiled (`Request.of`). Its values are taken
    as given: building the `GenerationOptions` checked them (a request is checked once)."""

    max_tokens: int = OPTIONS["max_tokens"].default
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; n >= 0: the emitted token's logprob and the top n
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (every one evaluated, none reused)
    speculative: bool = True
    draft_max: int | None = None  # per-request cap on the draft length
    draft_min: int | None = None  # a shorter draft is dropped before verification
    draft_p_min: float | None = None  # the draft model's confidence floor for this request (None: the engine's)
    sources: bool = False  # each chunk says where its text's tokens came from (Chunk.sources)
    constraint: Constraint | None = None  # a JSON schema or grammar the output must follow

    @classmethod
    def of(cls, options: GenerationOptions) -> "Request":
        return cls(max_tokens=options.max_tokens, sampling=SamplingParams.of(options), stop=options.stop,
                   logprobs=options.logprobs, prompt_logprobs=options.prompt_logprobs,
                   speculative=options.speculative, draft_max=options.draft_max, draft_min=options.draft_min,
                   draft_p_min=options.draft_p_min, sources=options.sources, constraint=options.constraint)


class Status(enum.Enum):
    WAITING = "waiting"  # not yet in a slot
    PREFILL = "prefill"  # in a slot, its prompt (all but the last token) filling the oracle's cache
    RUNNING = "running"  # speculative steps
    FINISHED = "finished"  # stopped: end of generation, stop string, max_tokens, full context
    ABORTED = "aborted"  # cancelled (client gone, time limit, shutdown) or failed


@dataclass(eq=False)
class Seq:
    """A request's state: its tokens (prompt + emitted, `history`), what each context holds of
    them (the contexts' own mirrors, under `slot`), its sampling state and generator, stop strings
    (`text`), grammar walk, its fork of the length policy and of the proposer, stats and output."""

    history: list[int]  # the prompt, then every emitted token
    request: "Request"
    rng: np.random.Generator
    text: "TextStream"
    stats: Stats
    policy: "LengthPolicy"  # this request's fork of the engine's policy (learned state shared)
    speculative: bool  # it drafts (a proposer exists and the request did not turn drafting off)
    walk: "ConstraintWalk | None" = None
    proposer: "Proposer | None" = None  # this request's fork, on its slot (set when it takes one)
    pool: str = ""  # whose earlier requests the suffix cache drafts from (e.g. an API key's)
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: int | None = None
    prompt_len: int = 0
    t_start: float = 0.0  # when it was added (time to first token counts from here)
    finish_reason: str | None = None
    structure: Structure | None = None
    error: BaseException | None = None  # why it was aborted, when it failed
    outbox: deque[Chunk] = field(default_factory=deque)
    prompt_logprobs: list | None = None  # the prompt's TokenLogprobs as its prefill computes them (when asked)
    backend_greedy: bool = False  # llama.cpp picks its oracle's greedy tokens (LlamaContext.sample_greedy)
    draft_picks: bool = False  # ... and keeps the top k of its draft's rows, which its draft picks from (sample_top)
    plain_batched: int = 0  # idle steps the batch judge ran as plain batched decoding (`runtime.batch_judge`)
    plain_batched_at: int = 0  # ... the sequences the last of them carried

    def __post_init__(self) -> None:
        self.prompt_len = len(self.history)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def completion_tokens(self) -> list[int]:
        return self.history[self.prompt_len:]

    def emit(self, text: str, tokens: list[int], logprobs: list[TokenLogprob] | None, *,
             finish_reason: str | None = None, structure: str | None = None) -> None:
        """Send `text`, just released by `self.text`, and the step's tokens (with their sources when
        the request asked: the released text's spans, which add up to it; the prompt's logprobs on the
        first chunk when asked). The last chunk carries why the generation ended."""
        sources = self.text.spans() if self.request.sources else None
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        self.outbox.append(Chunk(text, tokens, logprobs, finish_reason=finish_reason, stats=self.stats,
                                 structure=structure, prompt_logprobs=prompt_logprobs, sources=sources))


@dataclass(frozen=True)
class StepOutcome:
    """What one pass did to a sequence, for the scheduler to apply (it alone changes a status)."""

    seq: Seq
    finish_reason: str | None = None  # it ended in this step: "stop" or "length"
    structure: str | None = None  # ... a constrained one complete or not (see Apply._structure)
    prompt_done: bool = False  # its prompt is in the oracle's cache: it steps from the next pass
