"""Backend sampling: the sampler chains llama.cpp runs inside a context's graph for some of its
sequences, so that what a decode hands back for their output rows is a pick, not a row of logits.

Two kinds, one chain per sequence (llama.cpp's `llama_set_sampler`):

- greedy (an oracle's verify pass, `LlamaContext.sample_greedy`): each output row's argmax, one id;
- top-k (a draft model's rows, `LlamaContext.sample_top`): each row's k largest logits and their
  ids (`batch.TopRow`), from which the host takes a greedy draft's token and its confidence or a
  sampled draft's distribution over those k.

Where the model's output layer runs on a GPU, neither row crosses to the host: the vocabulary-wide
work (an argmax, a top-k) runs where the logits are, and the host reads an id or 2k numbers.
"""

from __future__ import annotations

import numpy as np

from localspec.batch import TopRow
from localspec.llama.bindings import llama_cpp

GREEDY = 0  # a chain's k: 0 picks the argmax, k > 0 keeps the k largest logits


class Picks:
    """Which of one context's sequences llama.cpp picks for in its graph, with the chains it runs
    for them. Owns the chains: `close` frees them, after the context that used them is freed."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self._chains: dict[int, tuple[int, object]] = {}  # seq -> (k, chain)

    def set(self, seq: int, k: int | None) -> bool:
        """Pick sequence `seq`'s output rows by a chain of `k` (GREEDY, or the top k), or by none
        (None: its rows' logits again). Returns whether `seq` is picked for as asked (False where
        llama.cpp cannot, e.g. a tensor-split model: logits as before). Takes effect at the next
        decode (llama.cpp re-plans its graph once)."""
        held = self._chains.get(seq)
        if held is not None and held[0] == k:
            return True
        if held is not None:
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            llama_cpp.llama_sampler_free(self._chains.pop(seq)[1])
        if k is None:
            return False
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy() if k == GREEDY
                                          else llama_cpp.llama_sampler_init_top_k(int(k)))
        if not llama_cpp.llama_set_sampler(self._ctx, seq, chain):
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            llama_cpp.llama_sampler_free(chain)
            return False
        self._chains[seq] = (k, chain)
        return True

    def greedy(self, seq: int) -> bool:
        """Whether `seq`'s rows come back as greedy ids."""
        held = self._chains.get(seq)
        return held is not None and held[0] == GREEDY

    def top(self, seq: int) -> bool:
        """Whether `seq`'s rows come back as their top k (`TopRow`)."""
        held = self._chains.get(seq)
        return held is not None and held[0] != GREEDY

    def __bool__(self) -> bool:
        """Whether any sequence is picked for."""
        return bool(self._chains)

    def sampled_id(self, i: int) -> int:
        """The greedy id of the last decode's batch row `i`."""
        return llama_cpp.llama_get_sampled_token_ith(self._ctx, i)

    def top_row(self, i: int) -> TopRow:
        """The top k of the last decode's batch row `i` (a copy: the next decode overwrites it)."""
        n = llama_cpp.llama_get_sampled_logits_count_ith(self._ctx, i)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_logits_ith(self._ctx, i), shape=(n,)).copy()
        ids = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_candidates_ith(self._ctx, i), shape=(n,)).copy()
        return TopRow(ids, logits)

    def close(self) -> None:
        for _, chain in self._chains.values():
            llama_cpp.llama_sampler_free(chain)
        self._chains = {}
