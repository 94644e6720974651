"""Proposers: where draft tokens come from. Each is a small class that carries out a plan.

A step asks a proposer twice. `offer(history, limit, constraint)` says what it could draft now
without decoding anything (prompt lookup's match, whether a draft model is there): an `Offer`,
which changes nothing. The length policy turns it into a `DraftPlan` (which source, how many
tokens). `propose_steps(history, plan, offer, sampling, rng, constraint)` carries the plan out as a
generator: each draft-model decode it needs is yielded as `batch.Rows` (its sequence's tokens,
logits for the last) and the logits are sent back; it returns the `Draft`. The engine drives every
drafting sequence's proposal together, one decode per draft position for all of them
(`drive_all`); `propose` runs one alone with the plain plan (`plan.plain_plan`). A proposer knows
no policy. `fork(seq)` is the same proposer for another sequence of the same contexts;
`start(catch_up=...)` says a new request begins (nothing is evaluated then, so the oracle's first
token comes first).

Under a grammar (`constraint`, a `constraints.ConstraintWalk` holding `history`'s generated tokens)
a proposer proposes only tokens the grammar allows and pushes each one onto the walk: the draft
model picks from its logits with the grammar's mask applied (its distribution, handed to the
verifier, is the constrained one); a model-free draft is cut at the first token the grammar refuses.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterator, Protocol, Sequence

import numpy as np

from localspec.batch import DecodeContext, Rows, TopRow
from localspec.outputs import DraftSource
from localspec.speculative.plan import MODEL_ONLY, NO_OFFER, DraftPlan, Offer, plain_plan
from localspec.speculative.proposal import SparseRows, proposal_probs, top_row_proposal
from localspec.speculative.sampling import (SamplingParams, bias_logits, coupled_choice, greedy_argmax, logits_to_probs,
                                            mask_logits, sample, scratch, top_probability_at_least, top_row_greedy)

if TYPE_CHECKING:
    from localspec.speculative.lookup import PromptLookupProposer


@dataclass(frozen=True)
class Draft:
    """Draft tokens in the oracle's vocabulary, and the distributions over the oracle's vocabulary
    they were drawn from (the verifier compares them with the oracle's own, id for id)."""

    tokens: np.ndarray  # [k] int32
    # [k, oracle vocab] the distributions the tokens were drawn from (a sampled draft model's: each
    # row's support, `SparseRows`); None: point masses
    probs: SparseRows | np.ndarray | None
    evaluated: int = 0  # tokens a draft model evaluated to propose these (its catch-up included)
    prompt_time: float = 0.0  # seconds of the proposing spent evaluating a new request's prompt
    source: DraftSource = DraftSource.MODEL  # where the tokens came from
    match_length: int = 0  # a lookup draft: the tokens before it that agree with the text before its source (up to MATCH_CAP)
    stop: str = ""  # why it is shorter than its plan, if it is: one of STOPS

    def __len__(self) -> int:
        return len(self.tokens)


log = logging.getLogger("localspec.speculative.proposers")

EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32), None, source=DraftSource.NONE)
# why a proposer drafted fewer tokens than its plan (`Draft.stop`): the draft model's confidence
# fell under p_min, it proposed the end of generation, its context (or the oracle's) had no room,
# it proposed ids the other model lacks, a model-free source found fewer, the grammar refused one
STOPS = ("p_min", "end", "context", "vocab", "match", "grammar")
MODEL_OFFER = Offer(model=True)  # a draft model's offer: it can draft, whatever the text


# a proposal as a generator: yields the draft-model decodes it needs, receives their logits
# [n_logits, vocab], returns the Draft
ProposeSteps = Generator[Rows, np.ndarray, Draft]


class Proposer(Protocol):
    draft_context: DecodeContext | None  # the context its decodes run on (None: it never decodes)

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        """What it could draft after `history` (at most `limit` tokens), found without decoding;
        changes nothing (a grammar walk is left as it was)."""

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        """Carry out `plan` (made from `offer`, this step's): the Draft, its decodes yielded."""

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        """A new request begins. `catch_up`: the first proposal conditions on the whole prompt
        (drafting is expected to pay); otherwise a later probe may condition on part of it.
        `pool`: whose earlier requests it may draft from (the suffix cache's pool, e.g. an API key).
        `prompt`: the prompt's length in tokens. Text generated after it while nothing was drafted
        (the policy idled, or plain batching ran) is caught up on as after any pause in drafting: the
        latest tokens only. None: a catch-up covers all the text there is."""

    def describe(self) -> str:
        """What kind of proposer this is ("model", "lookup", "hybrid", "cross-tokenizer"): the key
        its learned costs are kept under, and what reports call it."""

    def fork(self, seq: int) -> "Proposer":
        """The same proposer for sequence `seq` of its contexts, with a request state of its own."""


def propose(proposer: Proposer, history: Sequence[int], max_len: int, sampling: SamplingParams | None = None,
            rng: np.random.Generator | None = None, constraint=None) -> Draft:
    """One proposal of at most `max_len` tokens by the plain plan (prompt lookup's tokens where it
    found some, else the draft model's), its decodes run one at a time on the proposer's context."""
    offer = proposer.offer(history, max_len, constraint)
    steps = proposer.propose_steps(history, plain_plan(offer, max_len), offer, sampling or SamplingParams(),
                                   rng if rng is not None else np.random.default_rng(), constraint)
    return drive(steps, proposer.draft_context)


def drive(steps: ProposeSteps, ctx: DecodeContext | None) -> Draft:
    """Run a proposal's decodes one at a time on `ctx`."""
    try:
        rows = next(steps)
        while True:
            rows = steps.send(ctx.decode_rows([rows]))
    except StopIteration as done:
        return done.value


Round = tuple[list[tuple[int, int, int]], float]  # a draft decode: (sequence, tokens, context) of each row, seconds


def drive_all(proposals: Sequence[ProposeSteps], ctx: DecodeContext | None) -> tuple[list[Draft], list[Round]]:
    """Run several sequences' proposals together on `ctx`: each round, ONE decode holds every
    unfinished proposal's next tokens (a draft model proposing for all drafting sequences at once).
    Returns the drafts, in order, and the rounds (each row's sequence, tokens and context, and the
    seconds from the decode until every proposal had picked its next token)."""
    drafts: list[Draft | None] = [None] * len(proposals)
    pending: dict[int, Rows] = {}
    for i, steps in enumerate(proposals):
        try:
            pending[i] = next(steps)
        except StopIteration as done:
            drafts[i] = done.value
    rounds: list[Round] = []
    while pending:
        order = list(pending)
        rows = [pending[i] for i in order]
        held = [(r.seq, len(r.tokens), len(ctx.seq_tokens(r.seq))) for r in rows]
        t0 = time.perf_counter()
        logits = ctx.decode_rows(rows)  # [sum of n_logits, vocab]
        offset = 0
        for i, r in zip(order, rows):
            mine = logits[offset:offset + min(r.n_logits, len(r.tokens))]
            offset += len(mine)
            try:
                pending[i] = proposals[i].send(mine)
            except StopIteration as done:
                drafts[i] = done.value
                del pending[i]
        rounds.append((held, time.perf_counter() - t0))
    return drafts, rounds  # type: ignore[return-value]


class _Drives:
    """`propose`: one proposal by the plain plan, its decodes run one at a time on the proposer's own
    draft context (see the module function)."""

    def propose(self, history: Sequence[int], max_len: int, sampling: SamplingParams | None = None,
                rng: np.random.Generator | None = None, constraint=None) -> Draft:
        return propose(self, history, max_len, sampling, rng, constraint)


class DraftModelProposer(_Drives):
    """A small model drafting autoregressively on its own context.

    The draft context's cache is synced lazily: each `propose` reuses the longest prefix it already
    holds and evaluates only what is new (the accepted tokens and the last emitted one), in one batch.
    A new prompt is evaluated by the first proposal after it, not before the oracle's first token.

    Greedy decoding drafts the argmax and hands the verifier point masses (probs=None). Sampled
    decoding draws each token from the draft's filtered distribution less its far tail
    (`proposal.proposal_probs`) and hands that distribution on (its support: `SparseRows`), so the
    acceptance test uses exactly the probabilities the token was drawn from.

    `p_min`: stop drafting once the draft's own top probability falls below it (0 disables).

    `n_vocab`: the oracle's vocabulary size (default: the draft's own). A same-family draft may have
    a few more or fewer tokens than its oracle (llama.cpp allows 128 either way; Qwen2.5-0.5B has 151936
    against Qwen2.5-7B's 152064), the shared ids meaning the same text. Each row of the draft's logits is
    brought to the oracle's size before the draft picks, in every mode: ids the oracle does not have
    are cut off (masked: the draft never proposes them, and its distribution is renormalised over the
    rest), ids the draft does not have get logit -inf (probability 0). Drafted tokens, `Draft.probs`
    and the seeded noise are then all over the oracle's vocabulary. The oracle may emit an id the
    smaller draft lacks (llama_decode would refuse it): the draft reads the text as if it were not
    there.
    """

    def __init__(self, ctx: DecodeContext, *, p_min: float = 0.0, max_catch_up: int = 16,
                 n_vocab: int | None = None, cache_source: DecodeContext | None = None, seq: int = 0) -> None:
        self.ctx = self.draft_context = ctx
        self.seq = seq  # the sequence it drafts on (in `ctx`, and in `cache_source`)
        # the oracle's context, for a draft with the same vocabulary: a catch-up on text the oracle
        # holds (a new prompt, a re-try) first tries to copy the oracle's cache of it (see _adopt)
        self.cache_source = cache_source
        self.p_min = p_min
        self.max_catch_up = max_catch_up
        self.n_vocab = ctx.n_vocab if n_vocab is None else n_vocab
        # the draft's cache holds history[:keep] + history[start:]: all of it (keep == start), or after
        # a long pause in drafting, the start it still held and the recent text, with a gap between
        self.keep = self.gap_start = 0
        self.catch_up = False  # the next proposal evaluates all it has not seen (up to the prompt's end and a window)
        self.prompt: int | None = None  # the request's prompt length, which a catch-up covers whole (None: all)
        self.prompt_pending = False  # ... and that is a new request's prompt
        self.tokens_evaluated = 0  # draft-side tokens decoded, prompt included
        self._probs = SparseRows(self.n_vocab)  # a sampled draft's distributions (`Draft.probs`: a snapshot)

    def fork(self, seq: int) -> "DraftModelProposer":
        twin = DraftModelProposer(self.ctx, p_min=self.p_min, max_catch_up=self.max_catch_up, n_vocab=self.n_vocab,
                                  cache_source=self.cache_source, seq=seq)
        twin._shared = self  # a copy that failed for this pair fails for every sequence: see _adopt
        return twin

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.keep = self.gap_start = 0
        self.catch_up = self.prompt_pending = catch_up
        self.prompt = prompt

    def resync(self) -> None:
        self.keep = self.gap_start = 0
        self.catch_up, self.prompt_pending, self.prompt = True, False, None

    def describe(self) -> str:
        return "model"

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        return MODEL_OFFER

    def _held(self) -> list[int]:
        return self.ctx.seq_tokens(self.seq)

    def _view(self, history: Sequence[int], *, adopting: bool = False) -> list[int]:
        """The tokens the draft conditions on. After many steps without drafting, catching up on all
        of them would cost more than a probe is worth: the draft keeps the start of the text it
        already holds (the prompt says what the text is about) and evaluates only the latest
        `max_catch_up` tokens after it, as if the text in between were not there (unless it is
        `adopting` the oracle's cache of all of it). A catch-up (`start(catch_up=True)`) covers the
        whole prompt, then the same window of what was generated after it without drafting: four
        sequences of the 1.45B-wide oracle on a CPU had drafted nothing for 120 steps of plain
        batching, and the first draft after it cost the batch 3.2 s of catch-up (0.2 s a plain step)."""
        if adopting:
            self.catch_up = False
            self.keep = self.gap_start = 0
            return list(history)
        view = self._readable(list(history[:self.keep]) + list(history[self.gap_start:]))
        held = self.ctx.common_prefix(view, seq=self.seq)
        if self.catch_up:
            self.catch_up = False
            whole = len(history) if self.prompt is None else self.prompt  # what it evaluates, however much
            if len(history) - max(whole, held) <= self.max_catch_up:
                return view
            self.keep = max(whole, self.ctx.common_prefix(history, seq=self.seq))
        elif len(view) - held <= self.max_catch_up:
            return view
        else:
            self.keep = self.ctx.common_prefix(history, seq=self.seq)
        self.gap_start = max(self.keep, len(history) - self.max_catch_up)
        return self._readable(list(history[:self.keep]) + list(history[self.gap_start:]))

    # fewer tokens to catch up on than this, or than a 32nd of the text, are decoded: cheaper than
    # copying the whole cache (~33 us a token of it here, against ~3 ms a token evaluated)
    ADOPT_MIN = 8

    def _adoptable(self, history: Sequence[int]) -> bool:
        """Whether the oracle's cache holds text the draft would otherwise evaluate (at least
        ADOPT_MIN tokens of it) and copying it has not failed for this pair."""
        source = self.cache_source
        if source is None or getattr(self, "_shared", self).cache_source is None or self.ctx.n_vocab < self.n_vocab:
            return False
        held = source.seq_tokens(self.seq)
        return (len(held) - self.ctx.common_prefix(history, seq=self.seq) >= max(self.ADOPT_MIN, len(held) // 32)
                and len(held) <= len(history) and held == list(history[:len(held)]))

    def _adopt(self) -> None:
        """Take the oracle's cache of the text (a copy of its KV cache: milliseconds where
        evaluating a long prompt costs the draft ~3 ms a token on a small CPU); a pair whose caches
        differ in layout falls back to evaluating, for good."""
        if not self.ctx.copy_cache_from(self.cache_source, seq=self.seq, other_seq=self.seq):
            log.info("the draft cannot take the oracle's cache (another layout): it evaluates the text itself")
            self.cache_source = getattr(self, "_shared", self).cache_source = None

    def _readable(self, tokens: list[int]) -> list[int]:
        """`tokens` without the ids the draft's vocabulary lacks (none unless it is the smaller one)."""
        n_draft = self.ctx.n_vocab
        return tokens if n_draft >= self.n_vocab else [t for t in tokens if t < n_draft]

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        if plan.resync:
            self.resync()
        if plan.source != DraftSource.MODEL or plan.length <= 0:
            return EMPTY_DRAFT
        max_len = plan.length
        prompt, self.prompt_pending = self.prompt_pending, False
        adopting = self._adoptable(history)  # judged once: it compares the caches with the text
        view = self._view(history, adopting=adopting)
        max_len = min(max_len, self.ctx.n_ctx - len(view) + 1)
        if max_len <= 0 or not view:
            return dataclasses.replace(EMPTY_DRAFT, stop="context")
        t0 = time.perf_counter()
        if adopting:
            self._adopt()
        n_keep = min(self.ctx.common_prefix(view, seq=self.seq), len(view) - 1)
        self.ctx.rollback(n_keep, seq=self.seq)
        todo = view[len(self._held()):]  # rollback may have cleared more (recurrent caches)
        logits = yield Rows(self.seq, todo, 1)  # [1, vocab]
        prompt_time = time.perf_counter() - t0 if prompt else 0.0
        self.tokens_evaluated += len(todo)
        evaluated = len(todo)
        tokens: list[int] = []
        probs = self._probs  # the distributions the tokens are drawn from
        probs.clear()
        keeps_probs = not sampling.greedy and not sampling.coupled  # _pick hands its distributions on
        stop = ""
        while True:
            position = len(history) + len(tokens)
            if isinstance(logits[0], TopRow):  # the device kept the row's top k (`draft_picks_suffice`)
                token, confident = self._pick_top(logits[0], sampling, rng, probs, constraint)
            else:
                # [oracle vocab], as the target
                row = bias_logits(self._in_oracle_vocab(logits[0]), sampling.logit_bias)
                if constraint is not None:
                    row = mask_logits(row, constraint.allowed())
                token, confident = self._pick(row, sampling, rng, probs, position)
            if constraint is not None:
                constraint.push(token)
            tokens.append(token)
            batch = [token]
            if constraint is not None and confident:
                batch += self._forced(constraint, tokens, max_len, probs if keeps_probs else None)
            if len(tokens) >= max_len:
                stop = "context" if max_len < plan.length else ""
                break
            if not confident or self.ctx.model.is_eog(tokens[-1]):
                stop = "p_min" if not confident else "end"
                break  # nothing worth drafting past the end of the generation
            readable = self._readable(batch)
            if not readable or len(self._held()) + len(readable) > self.ctx.n_ctx:
                stop = "vocab" if not readable else "context"
                break
            logits = yield Rows(self.seq, readable, 1)
            self.tokens_evaluated += len(readable)
            evaluated += len(readable)
        return Draft(np.asarray(tokens, dtype=np.int32), probs.snapshot(), evaluated, prompt_time, stop=stop)

    def _forced(self, constraint, tokens: list[int], max_len: int, probs: SparseRows | None) -> list[int]:
        """The run of tokens the grammar forces after `tokens` (keys, punctuation), drafted without
        the model: its masked distribution there is a point mass whatever its logits, so the model
        reads the run in one batch with the token before it. Appended to `tokens` (and their
        one-hot distributions to `probs`, when kept) and pushed onto the walk."""
        run = []
        while len(tokens) < max_len and not self.ctx.model.is_eog(tokens[-1]):
            forced = constraint.forced()
            if forced is None:
                break
            constraint.push(forced)
            tokens.append(forced)
            run.append(forced)
            if probs is not None:
                probs.add(np.array([forced]), np.ones(1))  # a one-hot
        return run

    def _in_oracle_vocab(self, row: np.ndarray) -> np.ndarray:
        """The draft's logits [draft vocab] as logits over the oracle's vocabulary [n_vocab]."""
        n_draft = row.shape[-1]
        if n_draft >= self.n_vocab:
            return row[:self.n_vocab]  # a view; the ids the oracle lacks are masked by leaving them out
        padded = np.full(self.n_vocab, -np.inf, dtype=row.dtype)  # [n_vocab]
        padded[:n_draft] = row
        return padded

    def _pick(self, row: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
              probs: SparseRows, position: int) -> tuple[int, bool]:
        """Choose the next draft token from logits `row` [oracle vocab]; say whether to keep drafting."""
        if sampling.greedy:
            token = int(greedy_argmax(row))
            if self.p_min <= 0:
                return token, True
            return token, top_probability_at_least(row, token, self.p_min)
        if sampling.coupled:  # the oracle will check a seeded pick with its own noise: its distribution is not kept
            dist = logits_to_probs(row, sampling, out=scratch(self.n_vocab, slot="draft"))  # [vocab]
            return coupled_choice(dist, sampling.seed, position), self.p_min <= 0 or dist.max() >= self.p_min
        # speculative sampling: a distribution without the far tail (`proposal_probs`), kept for acceptance
        return self._draw(*proposal_probs(row, sampling), probs, rng)

    def _pick_top(self, row: TopRow, sampling: SamplingParams, rng: np.random.Generator, probs: SparseRows,
                  constraint) -> tuple[int, bool]:
        """`_pick` from the row's top k as the device kept them: a request whose draft needs no
        more of its rows (`draft_picks_suffice`)."""
        if constraint is not None or sampling.logit_bias or sampling.coupled:
            raise RuntimeError("a draft row's top k came back for a request that needs the whole row")
        ids, values = row.ids, row.logits
        if self.ctx.n_vocab > self.n_vocab:  # ids the oracle does not have are left out, as `_in_oracle_vocab` does
            keep = ids < self.n_vocab
            ids, values = ids[keep], values[keep]
        if sampling.greedy:
            return top_row_greedy(ids, values, self.p_min)
        return self._draw(*top_row_proposal(ids, values, sampling), probs, rng)

    def _draw(self, ids: np.ndarray, kept: np.ndarray, probs: SparseRows, rng: np.random.Generator) -> tuple[int, bool]:
        """A sampled draft's token from its distribution over `ids` [m] (`kept` [m]), which goes on to
        acceptance (`probs`); and whether the draft goes on (its top probability clears p_min)."""
        probs.add(ids, kept)
        return int(ids[sample(kept, rng)]), self.p_min <= 0 or kept.max() >= self.p_min


# the top of a draft row a device keeps where it picks the draft's tokens (`LlamaContext.sample_top`):
# enough for a greedy draft's confidence floor to decide as the whole row does on 99.4% of the
# default draft's rows (`top_row_greedy`), and for a sampled draft's distribution at T <= 1 to keep
# nearly all of its weight, while the host reads 2 KB a row, not the vocabulary's logits
DEVICE_TOP_K = 256


def _draft_models(proposer) -> Iterator["DraftModelProposer"]:
    """Every draft model proposer in `proposer`: itself, or a hybrid's, a suffix cache's or a
    cross-tokenizer draft's part."""
    if isinstance(proposer, DraftModelProposer):
        yield proposer
    for part in (getattr(proposer, "model", None), getattr(proposer, "inner", None)):
        if part is not None and part is not proposer:
            yield from _draft_models(part)


def draft_model_of(proposer) -> "DraftModelProposer | None":
    """The (first) draft model proposer inside `proposer`, if there is one: the proposer whose rows a
    device may pick from."""
    return next(_draft_models(proposer), None)


def draft_picks_suffice(sampling: SamplingParams, constrained: bool) -> bool:
    """Whether a draft model's picks for a request need no more of each of its rows than the top
    k a device keeps (`LlamaContext.sample_top`): no logit bias, no grammar, and no seeded noise
    (a seeded draft draws by the whole row's noise, `coupled_choice`)."""
    return not sampling.logit_bias and not constrained and not sampling.coupled


def set_draft_p_min(proposer, p_min: float) -> None:
    """Set the confidence floor of every draft model in `proposer` (a request's own, on its fork)."""
    for draft in _draft_models(proposer):
        draft.p_min = p_min


class _Wrapper(_Drives):
    """A proposer around a draft-model proposer (`drafter`): a new request is its business."""

    drafter: Proposer

    @property
    def draft_context(self) -> DecodeContext | None:
        return self.drafter.draft_context

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.drafter.start(catch_up=catch_up, pool=pool, prompt=prompt)

    def resync(self) -> None:
        """The next draft conditions on all of the text again."""
        self.drafter.resync()


class HybridProposer(_Wrapper):
    """Prompt lookup (free) and a draft model. Its offer is the lookup's match, with the model
    beside it; the plan says which of them drafts (`policy.HybridLength` decides from what each has
    been worth).

    After a stretch of lookup drafts the draft model has not seen the tokens they added: when it
    drafts again it catches up on all of them (a copy of the oracle's cache where it can), not on
    a window as after a pause in drafting, unless its draft is a probe."""

    def __init__(self, lookup: "PromptLookupProposer", model: "DraftModelProposer | _Wrapper") -> None:
        """`model`: a draft model's proposer (`cross_tokenizer.CrossTokenizerProposer` too)."""
        self.lookup = lookup
        self.model = self.drafter = model
        self._last = DraftSource.MODEL  # the source of the last draft

    def fork(self, seq: int) -> "HybridProposer":
        return HybridProposer(self.lookup.fork(seq), self.model.fork(seq))

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        found = self.lookup.offer(history, limit, constraint)
        return MODEL_ONLY if found is NO_OFFER else Offer(lookup=found.lookup, model=True)

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        if plan.resync:  # a re-try: the model's next draft, whenever it comes, sees all of the text
            self.model.resync()
        if plan.source == DraftSource.LOOKUP:
            self._last = DraftSource.LOOKUP
            return (yield from self.lookup.propose_steps(history, plan, offer, sampling, rng, constraint))
        if plan.source != DraftSource.MODEL or plan.length <= 0:
            return EMPTY_DRAFT
        if self._last == DraftSource.LOOKUP and not plan.probe:
            self.model.resync()
        self._last = DraftSource.MODEL
        return (yield from self.model.propose_steps(history, plan, offer, sampling, rng, constraint))

    def describe(self) -> str:
        return "hybrid"
