"""Draft-length policies: how many tokens to draft in the next step.

The engine asks `draft_length(limit)` before each step and reports the outcome with `update(...)`,
so a policy can hide any schedule (fixed, heuristic, cost-aware) behind two calls.
"""

from __future__ import annotations

from typing import Protocol


class LengthPolicy(Protocol):
    def draft_length(self, limit: int) -> int:
        """Tokens to draft in the next step, 0..limit (0: plain oracle step)."""

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        """The outcome of the step just verified."""


class FixedLength:
    """Always draft `k` tokens (fewer near max_tokens or the end of the context)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("draft length must be >= 0")
        self.k = k

    def draft_length(self, limit: int) -> int:
        return min(self.k, limit)

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        pass
