"""A decode's rows, and what a context offers whoever fills them: the one shape the llama.cpp layer
(`localspec.llama.context.LlamaContext` is a `DecodeContext`) and the speculative parts (a draft
model's proposer yields `Rows` and reads the logits) share, so that speculative/ needs nothing of
llama/ (tests run the same proposers over scripted contexts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class Rows:
    """One sequence's part of a batch: `tokens` appended to sequence `seq` (at the positions after
    what it holds), with logits for the last `n_logits` of them. `pad` more tokens (the last one repeated) go in
    after them and out again once the batch is decoded: llama.cpp runs rows of one length as one
    pass (`LlamaContext.ubatches`), so evening ragged rows out can save passes."""

    seq: int
    tokens: Sequence[int]
    n_logits: int = 0
    pad: int = 0  # filler tokens after `tokens`: evaluated, no logits, dropped again (rows of one length: fewer passes)


@dataclass(frozen=True)
class TopRow:
    """One output row as llama.cpp's backend top-k left it (`LlamaContext.sample_top`): the row's
    `k` largest logits and their token ids, in no order. What a draft model's proposer reads in
    place of the whole row where the device picks its tokens: a greedy draft's token is the id of
    the largest logit, and its confidence and a sampled draft's distribution are taken over these
    `k` (`sampling.top_row_pick`, `proposal.top_row_proposal`)."""

    ids: np.ndarray  # [k] int32
    logits: np.ndarray  # [k] float32


class DecodeContext(Protocol):
    """A context of `n_seq` sequences of up to `n_ctx` tokens each, over a model of `n_vocab` tokens,
    as a draft model's proposer uses it (see `localspec.llama.context.LlamaContext`)."""

    model: Any  # its `is_eog(token)` says whether a token ends a generation
    n_ctx: int
    n_vocab: int

    def seq_tokens(self, seq: int = 0) -> list[int]:
        """What sequence `seq` holds."""

    def common_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        """The length of the prefix `tokens` shares with what sequence `seq` holds."""

    def rollback(self, n_past: int, *, seq: int = 0) -> None:
        """Drop every token of sequence `seq` at position >= n_past."""

    def copy_cache_from(self, other: "DecodeContext", *, seq: int = 0, other_seq: int = 0) -> bool:
        """Take `other`'s cache of its sequence `other_seq` (where their layouts match)."""

    def decode_rows(self, rows: Sequence[Rows]) -> np.ndarray | list:
        """Evaluate the rows in one batch; their logits [sum of n_logits, vocab], in order (a list
        of each output row, a `TopRow` where the device picked the row's top, when some did)."""
