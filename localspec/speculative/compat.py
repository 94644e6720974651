"""Can this draft propose tokens for this oracle? llama.cpp's own rules
(`common_speculative_are_compatible`): same vocabulary type, same BOS/EOS handling, vocabulary sizes
within 128, and identical token text for ids 5..min(size)."""

from __future__ import annotations

from typing import Protocol

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5

_VOCAB_TYPES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}


class IncompatibleModels(ValueError):
    """The draft's vocabulary cannot be used token-for-token with the oracle's."""


class Vocab(Protocol):
    name: str
    n_vocab: int
    vocab_type: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    vocab_digest: bytes | None  # of the token texts as stored (see llama.gguf.GgufHeader); None: unknown

    def token_text(self, token: int) -> bytes: ...


def first_difference(oracle: Vocab, draft: Vocab) -> str | None:
    """A sentence naming the first rule the pair breaks, or None when they are compatible."""
    if oracle.vocab_type != draft.vocab_type:
        return (f"vocabulary types differ: oracle {_VOCAB_TYPES.get(oracle.vocab_type, oracle.vocab_type)}, "
                f"draft {_VOCAB_TYPES.get(draft.vocab_type, draft.vocab_type)}")
    for what in ("add_bos", "add_eos", "bos", "eos"):
        o, d = getattr(oracle, what), getattr(draft, what)
        if o != d:
            return f"{what} differs: oracle {o}, draft {d}"
    if abs(oracle.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
                f"oracle {oracle.n_vocab}, draft {draft.n_vocab}")
    if oracle.vocab_digest is not None and oracle.vocab_digest == draft.vocab_digest:
        return None  # the same token texts: the check below would find no difference
    for token in range(VOCAB_CHECK_START_TOKEN_ID, min(oracle.n_vocab, draft.n_vocab)):
        o, d = oracle.token_text(token), draft.token_text(token)
        if o != d:
            return f"token {token} differs: oracle {o!r}, draft {d!r}"
    return None


def check_compatible(oracle: Vocab, draft: Vocab) -> None:
    """Raise IncompatibleModels with a clear message naming the first difference."""
    diff = first_difference(oracle, draft)
    if diff is not None:
        raise IncompatibleModels(
            f"draft {draft.name!r} cannot draft for oracle {oracle.name!r}: {diff}. "
            "Pick a draft from the oracle's model family (same tokenizer), or draft through text with "
            "--cross-tokenizer (cross_tokenizer=True in Python), which accepts fewer tokens than a same-family draft.")
