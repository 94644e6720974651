"""Slots and the prefix cache: what each slot of the oracle's cache holds, and how a request that
takes a slot finds its prompt there (llama-server's slot reuse and `--cache-reuse`, vLLM's prefix
caching).

A slot is a sequence id of both contexts. A request that takes one keeps what the slot's cache
shares with its prompt, or copies a longer shared prefix that another slot holds or the prompt
cache kept (a copy of a cache costs 0.01-0.03 ms a token here, an evaluation ~2 ms). What the slot
held that the prompt does not share is first moved to a free slot, for a request that comes back
to it, or kept in the prompt cache. Only a prefix of the same pool (`Seq.pool`: an API key's
requests) is reused. The scheduler picks the slot (`Scheduler._admit`); this room fills it.
"""

from __future__ import annotations

from typing import Sequence

from localspec.llama.context import shared_prefix
from localspec.runtime.prompt_cache import PromptCache
from localspec.runtime.sequence import Seq, Status
from localspec.speculative.proposers import Proposer, draft_picks_suffice, set_draft_p_min

# a prefix another slot holds is copied (not evaluated) when it is this many tokens longer than
# the slot's own: a copy of a sequence's cache costs 0.01-0.03 ms a token here, an evaluation ~2 ms
COPY_MIN = 16


class Slots:
    """The oracle's `n_slots` sequences: whose text each holds, and readying one for a request.
    `proposer`: the engine's, forked onto each request's slot; `prompt_cache`: finished sequences'
    caches in host memory (None: off); `backend_sampling`: llama.cpp may pick a greedy request's
    tokens on the device (`Engine`); `draft_top`: ... and keep the top k of each of a request's
    `draft` rows, for the draft model to pick from (0: never)."""

    def __init__(self, oracle, *, n_slots: int, proposer: Proposer | None = None,
                 prompt_cache: PromptCache | None = None, backend_sampling: bool = False,
                 draft=None, draft_top: int = 0) -> None:
        self.oracle, self.n_slots, self.proposer, self.prompt_cache = oracle, n_slots, proposer, prompt_cache
        self.backend_sampling = backend_sampling
        self.draft, self.draft_top = draft, draft_top
        self.pools = [""] * n_slots  # whose text each slot of the oracle's cache holds (`Seq.pool`)

    def admit(self, seq: Seq, free: Sequence[int] = (), busy: Sequence[int] = ()) -> int:
        """Ready the caches of `seq.slot` (the scheduler's choice) for `seq`, and return how many of
        its prompt's tokens the oracle still evaluates (its last one too, in the pass that ends the
        prompt). What the slot held beyond the shared prefix is moved to the emptiest of the `free`
        slots, or kept in the prompt cache; `busy`: the slots other sequences run in."""
        slot = seq.slot
        seq.backend_greedy = self.oracle.sample_greedy(slot, self.backend_sampling and _picks_suffice(seq))
        if self.draft is not None:  # (a chain set or cleared takes effect at the slot's next draft decode)
            seq.draft_picks = self.draft.sample_top(slot, self.draft_top if seq.speculative and draft_picks_suffice(
                seq.request.sampling, seq.walk is not None) else 0)
        target = seq.history[:-1]
        common = self.oracle.common_prefix(target, seq=slot) if self.pools[slot] == seq.pool else 0
        self._keep_aside(slot, common, free)
        if seq.request.prompt_logprobs is None:
            common = self._reuse(seq, target, common, busy)
        else:  # every prompt token's logits: nothing reused
            common = 0
        self.oracle.rollback(common, seq=slot)
        self.pools[slot] = seq.pool
        if seq.speculative:
            seq.proposer = self.proposer.fork(slot)
            if seq.request.draft_p_min is not None:
                set_draft_p_min(seq.proposer, seq.request.draft_p_min)
            # the draft is not run here: its first proposal catches up on what it has not seen (all of
            # the prompt while drafting pays, copied from the oracle's cache where their layouts match;
            # else a probe's window of it while the policy is idle; a window of what came after the
            # prompt without drafting)
            seq.proposer.start(catch_up=not seq.policy.idle, pool=seq.pool, prompt=len(seq.history))
        return len(target) - common + 1

    def filling_for(self, seq: Seq, active: Sequence[Seq]) -> bool:
        """Whether a sequence that came before `seq` (of its pool) is still filling its cache with a
        prefix of `seq`'s prompt COPY_MIN or more tokens longer than `seq`'s slot holds (requests with
        one system prompt that arrive together): `seq` then waits, and copies that prefix
        (`share`) rather than evaluating it too."""
        if seq.request.prompt_logprobs is not None:
            return False
        history, held = seq.history, len(self.oracle.seq_tokens(seq.slot))
        for other in active:
            if other.id < seq.id and other.status == Status.PREFILL and other.pool == seq.pool:
                # what both prompts share, their last tokens aside (each evaluates its own with its last chunk)
                shared = min(shared_prefix(history, other.history), len(history) - 1, len(other.history) - 1)
                if shared >= held + COPY_MIN and len(self.oracle.seq_tokens(other.slot)) < shared:
                    return True
        return False

    def share(self, seq: Seq, busy: Sequence[int] = ()) -> int:
        """Before `seq` fills more of its prompt: take a longer prefix of it that another slot (or
        the prompt cache) holds by now, as `admit` does (what `filling_for` waited for). Returns the
        prompt tokens that copy saved evaluating."""
        if seq.request.prompt_logprobs is not None:
            return 0
        held = len(self.oracle.seq_tokens(seq.slot))
        return max(0, self._reuse(seq, seq.history[:-1], held, busy) - held)

    def _keep_aside(self, slot: int, common: int, free: Sequence[int]) -> None:
        """What `slot` holds beyond the `common` prefix the next request keeps: moved to the
        emptiest of the `free` slots where that holds less (what it held goes to the prompt cache),
        else to the prompt cache (if it is on)."""
        held = len(self.oracle.seq_tokens(slot))
        if held - common < COPY_MIN:
            return
        parking = min((other for other in free if other != slot), key=lambda o: len(self.oracle.seq_tokens(o)),
                      default=None)
        if parking is not None and len(self.oracle.seq_tokens(parking)) < held:
            self._cache_slot(parking)
            if self.oracle.copy_seq(slot, parking, held):
                self.pools[parking] = self.pools[slot]
        else:
            self._cache_slot(slot)

    def _cache_slot(self, slot: int) -> None:
        if self.prompt_cache is not None and len(self.oracle.seq_tokens(slot)) >= COPY_MIN:
            state = self.oracle.save_seq(slot)
            if state is not None:
                self.prompt_cache.put(state, self.pools[slot])

    def _reuse(self, seq: Seq, target: Sequence[int], common: int, busy: Sequence[int]) -> int:
        """Fill `seq.slot` with the longest prefix of `target` its pool has anywhere (another slot,
        a running sequence's too, the latest finished one's first on a tie; or the prompt cache)
        where that is COPY_MIN tokens longer than the `common` prefix the slot holds. Returns the
        prefix the slot holds then."""
        slot, pool = seq.slot, seq.pool
        source, best = max(((other, self.oracle.common_prefix(target, seq=other)) for other in range(self.n_slots)
                            if other != slot and self.pools[other] == pool),
                           key=lambda t: (t[1], t[0] not in busy), default=(None, 0))
        kept, n = self.prompt_cache.match(target, pool) if self.prompt_cache is not None else (None, 0)
        if kept is not None and n > best and n >= common + COPY_MIN:
            if self.oracle.load_seq(kept, seq=slot):
                self.oracle.rollback(n, seq=slot)  # what the kept text went on with is not this prompt's
                self.prompt_cache.used(kept, pool, n - common)
                return n
            common = 0  # llama.cpp refused it: the slot is empty now
        if source is not None and best >= common + COPY_MIN:
            return best if self.oracle.copy_seq(source, slot, best) else 0
        return common


def _picks_suffice(seq: Seq) -> bool:
    """Whether the oracle's greedy picks are all `seq`'s verify passes need of its logits: a greedy
    request with no logprobs, no logit bias and no grammar (each of those reads whole rows)."""
    request = seq.request
    return (request.sampling.greedy and not request.sampling.logit_bias and seq.walk is None
            and request.logprobs is None and request.prompt_logprobs is None)
