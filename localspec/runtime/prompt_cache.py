"""Finished requests' oracle caches kept in host memory, for later requests that start the same way
(llama-server's `--cache-ram`, vLLM's prefix caching).

A slot holds one sequence's KV cache, and a new request in the slot keeps what it shares with it,
or copies a longer shared prefix from another slot (`Engine.admit`). What a slot held beyond that
would be lost when the next request overwrites it; with a `PromptCache` it is kept instead
(llama.cpp's sequence state, copied to host memory: `LlamaContext.save_seq`), up to a budget in
bytes, the least recently used going first. A later request whose prompt shares a longer prefix
with a kept state than with any slot has it loaded back (a copy of memory) instead of evaluating
those tokens again: the same requests sent again, an agent's next turn after other clients took its
slot, a batch job's few-shot prefix.

Entries are kept per pool (an API key's requests), as the suffix cache's are: a cached prefix
changes timing, never text, and timing could tell one client what another sent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from localspec.llama.context import SeqState, shared_prefix


class PromptCache:
    """Sequence states by pool, at most `capacity` bytes in all (see the module)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a prompt cache holds at least one byte")
        self.capacity = capacity
        self.nbytes = 0
        # (pool, tokens) -> state, the least recently used first
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], SeqState] = OrderedDict()
        self.hits = 0  # states loaded back (counted by the caller: `used`)
        self.tokens_reused = 0  # prompt tokens those spared evaluating

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, state: SeqState, pool: str = "") -> bool:
        """Keep `state` for `pool`, making room by dropping the least recently used states; a kept
        state that is a prefix of this one goes (this one serves every prompt it served), and this
        one is not kept where a kept state already holds it. Returns whether it was kept."""
        if state.nbytes > self.capacity:
            return False
        for (owner, tokens), kept in list(self._entries.items()):
            if owner != pool:
                continue
            shared = shared_prefix(tokens, state.tokens)
            if shared == len(state.tokens):  # held already (by it, or by a longer one)
                self._entries.move_to_end((owner, tokens))
                return False
            if shared == len(tokens):
                self._drop((owner, tokens))
        while self.nbytes + state.nbytes > self.capacity:
            self._drop(next(iter(self._entries)))
        self._entries[(pool, state.tokens)] = state
        self.nbytes += state.nbytes
        return True

    def match(self, tokens: Sequence[int], pool: str = "") -> tuple[SeqState | None, int]:
        """The kept state of `pool` that shares the longest prefix with `tokens`, and that length
        ((None, 0) when none shares any)."""
        best, length = None, 0
        for (owner, held), state in self._entries.items():
            if owner == pool:
                n = shared_prefix(held, tokens)
                if n > length:
                    best, length = state, n
        return best, length

    def used(self, state: SeqState, pool: str, tokens: int) -> None:
        """`state` was loaded back, sparing `tokens` evaluations: it becomes the most recently used."""
        key = (pool, state.tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
        self.hits += 1
        self.tokens_reused += tokens

    def _drop(self, key: tuple[str, tuple[int, ...]]) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
