"""One request as the engine runs it: `Seq`, all of its state in one place (llama-server's
`server_slot`, vLLM's `Request`).

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

from .outputs import Chunk, Stats, TokenLogprob

if TYPE_CHECKING:
    from .constraints import ConstraintWalk
    from .engine import Request
    from .policy import LengthPolicy
    from .proposers import Draft, Proposer
    from .text import TextStream

_ids = itertools.count(1)


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
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: int | None = None
    prompt_len: int = 0
    t_start: float = 0.0  # when it was added (time to first token counts from here)
    finish_reason: str | None = None
    structure: str | None = None
    error: BaseException | None = None  # why it was aborted, when it failed
    outbox: deque[Chunk] = field(default_factory=deque)
    draft: "Draft | None" = None  # the step's draft, between proposing and verifying
    walk_base: int = 0  # the grammar walk's depth before the step's draft was pushed

    def __post_init__(self) -> None:
        self.prompt_len = len(self.history)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def completion_tokens(self) -> list[int]:
        return self.history[self.prompt_len:]

    def emit(self, text: str, tokens: list[int], logprobs: list[TokenLogprob] | None, *, final: bool = False) -> None:
        self.outbox.append(Chunk(text, tokens, logprobs, finish_reason=self.finish_reason if final else None,
                                 stats=self.stats, structure=self.structure if final else None))
