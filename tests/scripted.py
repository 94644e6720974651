"""Test doubles for the pure-numpy maths."""

from __future__ import annotations


class ScriptedRng:
    """Stands in for np.random.Generator: returns the given uniforms in order, counts the calls."""

    def __init__(self, *us: float):
        self.us = list(us)
        self.calls = 0

    def random(self) -> float:
        self.calls += 1
        return self.us.pop(0)
