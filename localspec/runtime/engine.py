"""The engine: plan -> execute for one sequence or many at once; the scheduler applies the outcome.

One speculative step, as in llama.cpp's speculative-simple:

    history = prompt + emitted tokens; the oracle's cache holds history[:-1], and the last token
              is kept out of it until the next step evaluates it
    offer   = proposer.offer(history, limit)                 # what it could draft, found without decoding
    plan    = policy.plan(offer, limit, context)             # which source drafts how many (DraftPlan)
    draft   = the proposer carries the plan out              # k tokens, maybe fewer
    logits  = oracle.decode([last, d1..dk])                  # ONE pass, logits at all k+1 positions
    out     = accepted draft tokens + a recovered or bonus token
    oracle cache trimmed to history + accepted (seq_rm); the draft's cache is synced lazily

With no draft (or k = 0) the same loop is plain oracle decoding: the baseline.

Many sequences (`Seq`, each in a slot: a sequence id of both contexts) step together, as
llama-server's slots do: `step(running, prefill)` plans every running sequence's draft (each with
its fork of the length policy, priced for the shared pass), drafts for all of them (one
draft-model decode per draft position: `proposers.drive_all`), builds ONE verify batch of every
sequence's [last, d1..dk] and chunks of prompts being filled, decodes it, accepts and rolls back
each sequence on its own rows, and returns each sequence's `StepOutcome`. What a step knows of a
sequence between its plan and its record (the offer, the plan, the draft) is the step's own
(`Proposal`), never kept on the `Seq`. The scheduler decides who runs and applies the outcomes (it
alone changes a sequence's status); `generate` and `stream` run one sequence through the same path.

Under a JSON schema or a grammar (`constraints.ConstraintWalk`), the draft proposes only allowed
tokens (pushing them onto the walk), every verified row of the oracle's logits gets the mask of its
position before acceptance (so the target is the constrained oracle distribution, and recovered and
bonus tokens come from it), and the walk pops back to the accepted prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import time
from contextlib import contextmanager
from itertools import accumulate
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from localspec.runtime import chat
from localspec import constraints
from localspec.speculative.acceptance import accept
from localspec.constraints import Constraint, ConstraintWalk
from localspec.runtime.learning import CostBook
from localspec.runtime.factory import (DEFAULT_DRAFT_MAX, DEFAULT_P_MIN, LOOKUP_DRAFT_MAX, NGRAM, Parts, build,  # noqa: F401
                      default_policy, kernel_identity)
from localspec.batch import Rows
from localspec.llama.context import Detokenizer, LlamaContext, LlamaModel, on_local_gpu, shared_prefix
from localspec.options import GenerationOptions, OptionError
from localspec.outputs import Chunk, DraftSource, Result, Stats, StepRecord, Structure, TokenLogprob, TopLogprob
from localspec.speculative.plan import NO_DRAFT, NO_OFFER, DraftPlan, Offer, SharedPass, unused_offers
from localspec.speculative.policy import LengthPolicy, Regime, learns
from localspec.speculative.proposers import EMPTY_DRAFT, Draft, Proposer, drive_all, set_draft_p_min
from localspec.runtime.calibrate import measure
from localspec.runtime.prompt_cache import PromptCache
from localspec.speculative.suffix import SuffixPools
from localspec.speculative.sampling import SamplingParams, log_softmax, seed_key, top_ids
from localspec.runtime.scheduler import Scheduler
from localspec.runtime.sequence import PromptTooLongError, Request, Seq, Status, StepOutcome  # noqa: F401 (callers import these from here too)
from localspec.runtime.text import TextStream

log = logging.getLogger("localspec.runtime.engine")

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]  # text, chat messages, or token ids


# a prefix another slot holds is copied (not evaluated) when it is this many tokens longer than
# the slot's own: a copy of a sequence's cache costs 0.01-0.03 ms a token here, an evaluation ~2 ms
COPY_MIN = 16
# a padded decode must be predicted this much cheaper than the ragged one: the pass-cost fit is off
# by about this much on one pass (costs.NOISE: a step here varies 10-20%), and a filler token that
# buys nothing must not be paid for on a guess (measured on the reference CPU, records answered a
# second time, big verify rows: taking savings of 2-5% made the passes slower)
EVEN_OUT_MARGIN = 0.1


class Engine:
    """An oracle model, optionally a proposer (a draft model, prompt lookup or both), a draft-length
    policy, and the loop that runs them.

    `Engine(oracle, draft, **options)` loads the models by name or path (`localspec.runtime.factory.build`
    says what the options are); `Engine.from_parts` runs parts built elsewhere.
    Not thread-safe: one thread drives it (the server runs a single worker). Its contexts hold
    `n_slots` sequences (`parallel=N`), which its `scheduler` generates together.
    """

    def __init__(self, oracle: str | os.PathLike, draft: str | os.PathLike | None = None, **options) -> None:
        """`draft`: a model (name or path), "ngram" (prompt lookup, no model) or None (oracle
        alone); the options (n_ctx, parallel, n_threads, gpu_layers, flash_attn, draft_length, draft_max,
        p_min, lookup, cross_tokenizer, policy, cost_cache, progress, rpc, draft_rpc, ...) as for
        `localspec.runtime.factory.build`. The engine owns what it loads: `close()` frees it."""
        self._adopt(build(oracle, draft, **options), owned=True)

    @classmethod
    def from_parts(cls, *, oracle: LlamaContext, proposer: Proposer | None = None,
                   policy: LengthPolicy | None = None, draft: LlamaContext | None = None,
                   costs: CostBook | None = None, suffix: SuffixPools | None = None,
                   prompt_cache: PromptCache | None = None, calibrate: bool = False) -> "Engine":
        """An engine over parts built elsewhere: the oracle's context (its `model` is the oracle
        model), an optional proposer (and the draft context it drafts on, if any), a length
        policy (default: none drafted without a proposer, else adaptive) and where the policy's
        learned state is kept (default: nowhere); `suffix`: the suffix cache's pools a
        `SuffixProposer` reads, which finished requests add to; `prompt_cache`: where finished
        sequences' oracle caches are kept for later prompts; `calibrate`: time the contexts' passes
        first (`runtime.calibrate`). The caller owns the parts: `close()`
        leaves them open. Tests plug scripted contexts in here."""
        engine = cls.__new__(cls)
        engine._adopt(Parts(oracle=oracle, proposer=proposer, policy=policy, draft=draft, costs=costs, suffix=suffix,
                            prompt_cache=prompt_cache, calibrate=calibrate), owned=False)
        return engine

    def _adopt(self, parts: Parts, *, owned: bool) -> None:
        self._closers: list[Callable[[], None]] = parts.closers if owned else []
        self._warned_no_template = False
        self.oracle = parts.oracle
        self.oracle_model: LlamaModel = parts.oracle.model
        self.draft_ctx = parts.draft
        self.draft_model: LlamaModel | None = parts.draft.model if parts.draft is not None else None
        self.proposer = parts.proposer
        self.suffix = parts.suffix  # the suffix cache's pools (None: off)
        self.prompt_cache = parts.prompt_cache  # finished sequences' oracle caches in host memory (None: off)
        self.policy: LengthPolicy = parts.policy if parts.policy is not None else default_policy(parts.proposer)
        self.costs = parts.costs
        self.cost_store = parts.cost_store if parts.cost_store is not None else (
            parts.costs.store if parts.costs is not None else None)
        self.n_threads, self.gpu_layers = parts.n_threads, parts.gpu_layers
        self.rpc, self.draft_rpc = parts.rpc, parts.draft_rpc
        if self.costs is not None and learns(self.policy):
            self.costs.load(self.policy)
        self.n_slots = min(ctx.n_seq for ctx in self.contexts)  # sequences generated at once
        self._slot_pools = [""] * self.n_slots  # whose text each slot of the oracle's cache holds (`Seq.pool`)
        self._drafting = 1.0  # sequences a batch's draft rounds are shared by, lately (for its prices)
        self.last_pass = (0, 0)  # the last oracle pass: sequences and tokens it carried
        # greedy requests that need nothing but the oracle's picks (no logprobs, bias or grammar)
        # have llama.cpp pick them inside its graph where the oracle's output layer runs on a GPU
        # (every layer offloaded): one id a verified row crosses to the host, not its logits
        # (LlamaContext.sample_greedy). Exact: the same argmax, taken on the device. Not on the
        # CPU, where the graph's argmax of every row made a verify pass 3-14% slower than the
        # host's (SmolLM2 and Gemma 3 270M, 5 and 17 rows).
        layers = self.gpu_layers or 0
        self.backend_sampling = on_local_gpu(layers) and (layers < 0 or layers > self.oracle_model.n_layer)
        self.scheduler = Scheduler(self)
        if parts.calibrate:  # (where a model runs on a GPU: see runtime.calibrate)
            measure(self.policy, self.oracle, self.draft_ctx, backend_sampling=self.backend_sampling)

    @property
    def contexts(self) -> list[LlamaContext]:
        """The oracle's context, then the draft's if there is one."""
        return [self.oracle] + ([self.draft_ctx] if self.draft_ctx is not None else [])

    @contextmanager
    def using_policy(self, policy: LengthPolicy) -> Iterator[LengthPolicy]:
        """Requests started inside the block choose their draft lengths with `policy` (e.g. a fixed
        length, to measure it); the engine's own policy is back after it. A request keeps the
        policy it started with to its end."""
        own, self.policy = self.policy, policy
        try:
            yield policy
        finally:
            self.policy = own

    def kernel_identity(self, oracle_path, gpu_layers: int) -> dict:
        """The key `localspec check` keeps the faster attention kernel for this oracle under."""
        return kernel_identity(oracle_path, n_threads=self.n_threads, gpu_layers=gpu_layers, rpc=self.rpc)

    def save_costs(self, policy: LengthPolicy | None = None) -> None:
        """Write what the policy (default: the engine's) learned to the cache (after each request)."""
        policy = self.policy if policy is None else policy
        if self.costs is not None and learns(policy):
            self.costs.save(policy)

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Engine":
        from localspec.models import Registry

        pair = Registry.load().pair(name)
        kwargs.setdefault("cross_tokenizer", pair.cross_tokenizer)
        return cls(pair.oracle, pair.draft, **kwargs)

    def close(self) -> None:
        while self._closers:  # last built first; one interrupted (Ctrl-C) leaves the rest to a later close
            self._closers.pop()()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def n_ctx(self) -> int:
        return self.oracle.n_ctx

    # -- prompts

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list | None = None) -> str:
        m = self.oracle_model
        template = m.chat_template
        if not template and not self._warned_no_template:
            self._warned_no_template = True  # once per engine, not on every request
            log.warning("%s has no chat template; using ChatML", m.name)
        return chat.render(template, messages, bos_token=m.token_piece(m.bos, special=True).decode(errors="replace"),
                           eos_token=m.token_piece(m.eos, special=True).decode(errors="replace"), tools=tools)

    def tokenize_prompt(self, prompt: Prompt, tools: list | None = None) -> list[int]:
        """A completion prompt (str), token ids (taken as they are), or chat messages (rendered with
        the model's template, with `tools` for a template that takes them)."""
        m = self.oracle_model
        if isinstance(prompt, str):
            return m.tokenize(prompt, add_special=True, parse_special=True)
        if prompt and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < m.n_vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is not in the vocabulary (ids 0 to {m.n_vocab - 1})")
            return [int(t) for t in prompt]
        text = self.render(prompt, tools)
        bos_text = m.token_piece(m.bos, special=True).decode(errors="replace")
        has_bos = bool(bos_text) and text.startswith(bos_text)  # templates often write BOS themselves
        return m.tokenize(text, add_special=not has_bos, parse_special=True)

    # -- generation

    def generate(self, prompt: Prompt, options: GenerationOptions | None = None, *, tools: list | None = None,
                 pool: str = "", **changes) -> Result:
        """Generate a completion; arguments as for `stream`."""
        options = GenerationOptions.build(options, **changes)
        text, tokens, logprobs = [], [], []
        final = None
        for final in self.stream(prompt, options, tools=tools, pool=pool):
            text.append(final.text)
            tokens.extend(final.tokens)
            if final.logprobs is not None:
                logprobs.extend(final.logprobs)
        assert final is not None and final.finish_reason is not None and final.stats is not None
        return Result(text="".join(text), tokens=tokens, finish_reason=final.finish_reason,
                      stats=final.stats, logprobs=logprobs if options.logprobs is not None else None,
                      structure=final.structure)

    def prepare(self, prompt: Prompt, options: GenerationOptions | None = None, *, tools: list | None = None,
                pool: str = "", **changes) -> Seq:
        """A sequence for `prompt` (arguments as for `stream`), checked and ready for the scheduler
        (`scheduler.add`): how the server's worker and a batch file's runner start requests.
        `pool`: whose earlier requests the suffix cache drafts from, and keeps this one's text for
        (e.g. an API key's)."""
        request = Request.of(GenerationOptions.build(options, **changes))
        return self.new_seq(self.tokenize_prompt(prompt, tools), request, pool=pool)

    def stream(self, prompt: Prompt, options: GenerationOptions | None = None, *, tools: list | None = None,
               pool: str = "", **changes) -> Iterator[Chunk]:
        """Yield text chunks as speculative steps are accepted; the last chunk carries
        finish_reason ("stop" or "length") and the stats.

        `options`: a `GenerationOptions` (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
        logprobs, speculative, draft_max, schema, grammar); keyword arguments of those names build
        one, or change the given one: `stream(prompt, max_tokens=64, temperature=0.8)`.
        `schema`: a JSON schema (dict, JSON text or a pydantic model class) the output must follow;
        `grammar`: a Lark or GBNF grammar (text) it must follow; or a `constraints.Constraint`.
        Invalid options raise a ValueError (an invalid schema or grammar a `constraints.ConstraintError`)
        before anything is generated.
        `tools`: OpenAI function specs handed to a chat template that takes them (the server's tool calls).
        `pool`: whose earlier requests the suffix cache drafts from, and keeps this one's text for."""
        return self.scheduler.run(self.prepare(prompt, options, tools=tools, pool=pool, **changes))

    def stream_tokens(self, prompt_tokens: list[int], request: Request) -> Iterator[Chunk]:
        """`stream` of a tokenized prompt. The request is checked (and its grammar compiled) at
        once; the generation runs as the returned iterator is read (closing it aborts it)."""
        return self.scheduler.run(self.new_seq(prompt_tokens, request))

    def remember(self, prompt: Prompt, text: str, *, pool: str = "") -> None:
        """Keep `prompt` and its answer `text` in the suffix cache of `pool` (if it is on), as a
        request that produced them would: a resumed batch's earlier answers."""
        if self.suffix is not None:
            answer = self.oracle_model.tokenize(text, add_special=False, parse_special=False)
            self.suffix.add(pool, [self.tokenize_prompt(prompt) + answer])

    def constraint_walk(self, constraint: Constraint) -> ConstraintWalk:
        """A matcher for one generation under `constraint` over the oracle's vocabulary. Raises
        ConstraintError when llguidance cannot compile it (the vocabulary is read on first use)."""
        return ConstraintWalk(constraints.tokenizer_for(self.oracle_model), constraint, self.oracle_model.n_vocab)

    # -- sequences

    def new_seq(self, prompt_tokens: Sequence[int], request: Request, *, pool: str = "") -> Seq:
        """A sequence for `request` on a tokenized prompt, ready for the scheduler. It runs with
        the policy the engine has now (`using_policy`), to its end. Raises ValueError (a prompt
        that is empty or too long: PromptTooLongError; a logit_bias token the vocabulary lacks:
        OptionError; a grammar llguidance cannot compile) before anything runs."""
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_tokens)} tokens; the context holds {self.n_ctx}")
        biased = [token for token, _ in request.sampling.logit_bias if token >= self.oracle_model.n_vocab]
        if biased:
            raise OptionError("logit_bias", f"logit_bias must hold token ids of the vocabulary (0 to "
                                            f"{self.oracle_model.n_vocab - 1})", biased[0], f"token id {biased[0]}")
        walk = self.constraint_walk(request.constraint) if request.constraint is not None else None
        stats = Stats(prompt_tokens=len(prompt_tokens), flash_attn=self.oracle.flash_attn,
                      draft_flash_attn=self.draft_ctx.flash_attn if self.draft_ctx is not None else None)
        seed = request.sampling.seed
        detok = Detokenizer(self.oracle_model)
        speculative = request.speculative and self.proposer is not None
        text = TextStream(detok.feed, detok.flush, request.stop, labelled=request.sources)
        regime = Regime.of(request.sampling, constrained=request.constraint is not None) if speculative else None
        stats.regime = regime.describe() if regime is not None else ""
        return Seq(list(prompt_tokens), request, rng=np.random.default_rng(None if seed is None else seed_key(seed)),
                   text=text, stats=stats, policy=self.policy.fork(regime), speculative=speculative, walk=walk,
                   pool=pool)

    def admit(self, seq: Seq, free: Sequence[int] = (), busy: Sequence[int] = ()) -> None:
        """Ready the caches of `seq.slot` (the scheduler's choice) for `seq`: the oracle's cache
        there keeps what it shares with the prompt, or takes a longer shared prefix another slot
        holds or the prompt cache kept (a copy of that cache, not an evaluation: the same system
        prompt, the next turn of a conversation, a request sent again). What the slot held that the
        prompt does not share is first moved to the emptiest of the `free` slots, for a request that
        comes back to it, or else kept in the prompt cache (if it is on). Only a prefix of the same
        pool is reused (`Seq.pool`: an API key's requests). `busy`: the slots other sequences run in."""
        slot = seq.slot
        seq.backend_greedy = self.oracle.sample_greedy(slot, self.backend_sampling and _picks_suffice(seq))
        target = seq.history[:-1]
        common = self.oracle.common_prefix(target, seq=slot) if self._slot_pools[slot] == seq.pool else 0
        self._keep_aside(slot, common, free)
        if seq.request.prompt_logprobs is None:
            common = self._reuse(seq, target, common, busy)
        else:  # every prompt token's logits: nothing reused
            common = 0
            seq.prompt_logprobs = [TokenLogprob(seq.history[0], *self._text_and_bytes(seq.history[0]), None)]
        self.oracle.rollback(common, seq=slot)
        self._slot_pools[slot] = seq.pool
        seq.stats.prompt_tokens_evaluated = len(target) - common + 1  # the last prompt token is evaluated in step one
        if seq.speculative:
            seq.proposer = self.proposer.fork(slot)
            if seq.request.draft_p_min is not None:
                set_draft_p_min(seq.proposer, seq.request.draft_p_min)
            # the draft is not run here: its first proposal catches up on what it has not seen (all of
            # the prompt while drafting pays, copied from the oracle's cache where their layouts match;
            # else a probe's window of it while the policy is idle)
            seq.proposer.start(catch_up=not seq.policy.idle, pool=seq.pool)

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
                # what both prompts share, their last tokens aside (each evaluates its own in step one)
                shared = min(shared_prefix(history, other.history), len(history) - 1, len(other.history) - 1)
                if shared >= held + COPY_MIN and len(self.oracle.seq_tokens(other.slot)) < shared:
                    return True
        return False

    def share(self, seq: Seq, busy: Sequence[int] = ()) -> None:
        """Before `seq` fills more of its prompt: take a longer prefix of it that another slot (or
        the prompt cache) holds by now, as `admit` does (what `filling_for` waited for)."""
        if seq.request.prompt_logprobs is not None:
            return
        held = len(self.oracle.seq_tokens(seq.slot))
        got = self._reuse(seq, seq.history[:-1], held, busy)
        if got > held:
            seq.stats.prompt_tokens_evaluated -= got - held

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
                self._slot_pools[parking] = self._slot_pools[slot]
        else:
            self._cache_slot(slot)

    def _cache_slot(self, slot: int) -> None:
        if self.prompt_cache is not None and len(self.oracle.seq_tokens(slot)) >= COPY_MIN:
            state = self.oracle.save_seq(slot)
            if state is not None:
                self.prompt_cache.put(state, self._slot_pools[slot])

    def _reuse(self, seq: Seq, target: Sequence[int], common: int, busy: Sequence[int]) -> int:
        """Fill `seq.slot` with the longest prefix of `target` its pool has anywhere (another slot,
        a running sequence's too, the latest finished one's first on a tie; or the prompt cache)
        where that is COPY_MIN tokens longer than the `common` prefix the slot holds. Returns the
        prefix the slot holds then."""
        slot, pool = seq.slot, seq.pool
        source, best = max(((other, self.oracle.common_prefix(target, seq=other)) for other in range(self.n_slots)
                            if other != slot and self._slot_pools[other] == pool),
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

    def step(self, running: Sequence[Seq], prefill: Mapping[Seq, int] | None = None, *,
             queued: bool = False) -> list[StepOutcome]:
        """ONE pass of the oracle: a speculative step of each running sequence and the next
        `prefill[seq]` prompt tokens of each sequence filling its cache. What the steps emit goes
        to each sequence's outbox; the returned outcomes say who finished and whose prompt is in
        (the scheduler applies them). `queued`: requests wait for a slot (one that finishes sooner
        lets the next one in)."""
        prefill = dict(prefill or {})
        running = sorted(running, key=lambda seq: seq.slot)  # rows in slot order: llama.cpp's fewest passes
        t0, l0 = time.perf_counter(), self._llama_seconds()
        closed = len(running) > 1 and not queued
        props = self._plan(running, n_seqs=len(running) + len(prefill), closed=closed)
        rounds = self._propose(running, props)
        if closed:
            self._all_or_none(running, props)
        t1, l1 = time.perf_counter(), self._llama_seconds()
        rows = self._rows(prefill, props)
        contexts = {r.seq: len(self.oracle.seq_tokens(r.seq)) for r in rows}
        rows = self._even_out(rows, contexts, {seq.slot for seq in running})
        logits = self.oracle.decode_rows(rows)  # [sum of n_logits, vocab], in slot order
        picked = self.oracle.last_sampled  # [sum of running's k+1] the backend's greedy ids, or None
        t_decoded = time.perf_counter()
        self.last_pass = (len(rows), sum(len(r.tokens) for r in rows))
        offsets = dict(zip((r.seq for r in rows), accumulate((r.n_logits for r in rows), initial=0)))
        self._prompt_logprobs(prefill, logits, offsets)
        outs = [self._verify(seq, props[seq], *self._rows_of(seq, props[seq], logits, picked, offsets[seq.slot]))
                for seq in running]
        t2, l2 = time.perf_counter(), self._llama_seconds()
        host = {"draft_host_time": (t1 - t0) - (l1 - l0), "verify_host_time": (t2 - t1) - (l2 - l1)}
        outcomes = [self._record(seq, props[seq], out, logprobs, n_accepted, draft_time=t1 - t0,
                                 verify_time=t2 - t1, batch_seqs=len(rows), batch_tokens=self.last_pass[1], **host)
                    for seq, (out, logprobs, n_accepted) in zip(running, outs)]
        outcomes += [StepOutcome(seq, prompt_done=len(self.oracle.seq_tokens(seq.slot)) >= len(seq.history) - 1)
                     for seq in prefill]
        self._observe_batch(rows, contexts, rounds, prefill, t_decoded - t1)
        other = (time.perf_counter() - t2) - (self._llama_seconds() - l2)  # emitting, the policies' updates
        for seq in running:
            seq.stats.host_other_time += other
        return outcomes

    def _rows(self, prefill: Mapping[Seq, int], props: Mapping[Seq, "Proposal"]) -> list[Rows]:
        """The verify pass's rows in slot order: each prompt chunk being filled, each running
        sequence's [last, d1..dk]."""
        rows = [Rows(seq.slot, seq.history[len(self.oracle.seq_tokens(seq.slot)):][:n],
                     n if seq.request.prompt_logprobs is not None else 0) for seq, n in prefill.items()]
        rows += [Rows(seq.slot, [seq.history[-1]] + p.draft.tokens.tolist(), len(p.draft) + 1) for seq, p in props.items()]
        return sorted(rows, key=lambda r: r.seq)

    def _even_out(self, rows: list[Rows], contexts: Mapping[int, int], verifying: set[int]) -> list[Rows]:
        """The verify rows (of the sequences in `verifying`), the short ones padded with filler up to
        the length that makes the decode cheapest as the policy learned the oracle's passes:
        llama.cpp runs consecutive sequences of one length as one pass and splits ragged rows into
        several (`LlamaContext.ubatches`), each reading the weights again. A pass that costs little
        per token (a GPU; a memory-bound CPU pass) is evened out; one that pays for every token
        seldom is: a saving under EVEN_OUT_MARGIN of the pass is within the fit's error and not
        taken. Unchanged before a pass was measured, and for a policy that does not learn."""
        sizes = [(r.seq, len(r.tokens)) for r in rows]
        lengths = sorted({n for seq, n in sizes if seq in verifying})
        if len(lengths) < 2 or not learns(self.policy):
            return rows
        least = self.policy.decode_time(self._passes(self.oracle, sizes, contexts))
        if least is None:
            return rows
        bar, best = least * (1.0 - EVEN_OUT_MARGIN), None
        for target in lengths[1:]:
            t = self.policy.decode_time(self._passes(self.oracle, [(seq, max(n, target) if seq in verifying else n)
                                                                   for seq, n in sizes], contexts))
            if t < min(least, bar):
                best, least = target, t
        if best is None:
            return rows
        return [dataclasses.replace(r, pad=best - len(r.tokens)) if r.seq in verifying and len(r.tokens) < best else r
                for r in rows]

    @staticmethod
    def _rows_of(seq: Seq, prop: "Proposal", logits: np.ndarray, picked: np.ndarray | None,
                 offset: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`seq`'s verified rows of the pass: logits [k+1, vocab] and, when llama.cpp picked its
        greedy tokens, those picks [k+1]."""
        n = len(prop.draft) + 1
        return logits[offset:offset + n], picked[offset:offset + n] if seq.backend_greedy else None

    def _prompt_logprobs(self, prefill: Mapping[Seq, int], logits: np.ndarray, offsets: Mapping[int, int]) -> None:
        """The logprobs of each prompt chunk's tokens, for the sequences that asked (row j of a
        chunk predicts the token after the j-th of it)."""
        for seq, n in prefill.items():
            if seq.request.prompt_logprobs is not None:
                start = len(seq.prompt_logprobs)
                targets = np.asarray(seq.history[start:start + n])  # [n]
                seq.prompt_logprobs += self._logprobs(logits[offsets[seq.slot]:offsets[seq.slot] + n], targets,
                                                      seq.request.prompt_logprobs)

    def _llama_seconds(self) -> float:
        """Seconds spent inside llama.cpp so far, on every context."""
        return sum(ctx.llama_seconds for ctx in self.contexts)

    def _plan(self, running: Sequence[Seq], *, n_seqs: int, closed: bool) -> dict[Seq, "Proposal"]:
        """Each running sequence's part of the step (in slot order): what its proposer offers and
        the plan its policy makes of it, priced for the shared pass when other sequences share it.
        `closed`: nobody waits for a slot (see `_all_or_none`)."""
        shared = SharedPass([len(seq.history) - 1 for seq in running], self._drafting) if n_seqs > 1 else None
        props = {}
        for seq in running:
            limit = self._draft_limit(seq) if seq.stats.steps else 0  # the first token: a plain oracle step
            if limit > 0:
                offer = seq.proposer.offer(seq.history, limit, seq.walk)
                props[seq] = Proposal(offer, seq.policy.plan(offer, limit, len(seq.history) - 1, shared))
            else:
                props[seq] = Proposal()
        if closed:
            eligible = self._may_draft(running)
            if not all(props[seq].plan.drafts for seq in eligible):  # one without a draft: the others' would be dropped
                for seq in eligible:
                    props[seq].plan = DraftPlan(resync=props[seq].plan.resync)
        return props

    def _propose(self, running: Sequence[Seq], props: Mapping[Seq, "Proposal"]) -> list:
        """Every running sequence's draft (`Proposal.draft`), each proposer carrying out its plan:
        the draft model drafts for all of them together, one decode per draft position. Returns the
        draft decodes (`proposers.Round`s)."""
        proposals, drafting = [], []
        for seq in running:
            prop = props[seq]
            prop.walk_base = seq.walk.depth if seq.walk is not None else 0
            if prop.plan.drafts or prop.plan.resync:
                proposals.append(seq.proposer.propose_steps(seq.history, prop.plan, prop.offer, seq.request.sampling,
                                                            seq.rng, seq.walk))
                drafting.append(seq)
        if not proposals:
            return []
        drafts, rounds = drive_all(proposals, self.draft_ctx)
        for seq, draft in zip(drafting, drafts):
            props[seq].draft = draft
            if len(draft) < (seq.request.draft_min or 0):  # too short to be worth verifying, as asked
                self._drop_draft(seq, props[seq])
        if len(running) > 1:  # how many share a draft's costs (rounds, a pass split off), as the next prices expect
            self._drafting = 0.7 * self._drafting + 0.3 * max(1, sum(1 for d in drafts if len(d)))
        return rounds

    def _may_draft(self, running: Sequence[Seq]) -> list[Seq]:
        """The running sequences past their first token with room to draft."""
        return [seq for seq in running if seq.stats.steps and self._draft_limit(seq) > 0]

    def _all_or_none(self, running: Sequence[Seq], props: Mapping[Seq, "Proposal"]) -> None:
        """With nobody waiting for a slot, the batch runs until its longest answer ends: a draft
        that speeds one sequence up and slows the pass for all of them shortens nothing (the others
        still need as many passes) unless every sequence drafts. So the step drafts for every
        sequence that may draft, or for none: every one of them plans a draft or none drafts
        (`_plan`), and the drafts are dropped when one of them came back empty.
        (Measured on the reference CPU, 8 clients of 256-token answers: a few prompt-lookup copies
        and short model drafts for some sequences, probes among them, left the passes as many and
        made them dearer, 0.85x plain batched decoding.)"""
        eligible = self._may_draft(running)
        if all(len(props[seq].draft) for seq in eligible) or not any(len(props[seq].draft) for seq in eligible):
            return
        for seq in eligible:
            self._drop_draft(seq, props[seq])

    @staticmethod
    def _drop_draft(seq: Seq, prop: "Proposal") -> None:
        """`seq`'s step runs without its draft (its tokens come off the grammar walk too)."""
        if seq.walk is not None:
            seq.walk.pop(len(prop.draft))
        prop.draft = EMPTY_DRAFT

    def _verify(self, seq: Seq, prop: "Proposal", logits: np.ndarray,
                picked: np.ndarray | None = None) -> tuple[list[int], list[TokenLogprob] | None, int]:
        """Accept `seq`'s draft against its rows of the verify pass (logits [k+1, vocab], or the
        oracle's greedy picks [k+1] made on the backend) and trim its caches: (the tokens it
        yields, their logprobs if asked, draft tokens accepted)."""
        draft, walk, request = prop.draft, seq.walk, seq.request
        # under a grammar the target is the constrained oracle: each row masked at its position
        masks = walk.masks(prop.walk_base) if walk is not None and picked is None else None  # [k+1, vocab]
        out, n_accepted = self._accept(draft, logits, request.sampling, seq.rng, len(seq.history), picked, masks=masks)
        if walk is not None:
            walk.pop(len(draft) - n_accepted)
            walk.push(int(out[-1]))  # drawn from a masked row: allowed
            walk.settle()
        self.oracle.rollback(len(seq.history) + n_accepted, seq=seq.slot)  # keep last + accepted; the new last stays out
        # the logits stay valid until the next decode: logprobs are not part of the verify time
        logprobs = self._logprobs(logits[:len(out)], out, request.logprobs) if request.logprobs is not None else None
        return out.tolist(), logprobs, n_accepted

    def _record(self, seq: Seq, prop: "Proposal", out: list[int], logprobs: list[TokenLogprob] | None,
                n_accepted: int, *, draft_time: float, verify_time: float, batch_seqs: int, batch_tokens: int,
                draft_host_time: float = 0.0, verify_host_time: float = 0.0) -> StepOutcome:
        """Emit what `seq`'s step yielded and count the step (its policy learns from it)."""
        draft, stats = prop.draft, seq.stats
        context = len(seq.history) - 1
        could_draft = seq.request.speculative and stats.steps > 0 and self._draft_limit(seq) > 0
        emitted, finish = self._emit(out, seq, _sources(draft, n_accepted, len(out)) if seq.request.sources else None)
        step = StepRecord(k=prop.plan.length, drafted=len(draft), accepted=n_accepted, draft_time=draft_time,
                          verify_time=verify_time, context=context, draft_evaluated=draft.evaluated,
                          draft_prompt_time=draft.prompt_time, source=draft.source, batch_seqs=batch_seqs,
                          batch_tokens=batch_tokens if batch_seqs > 1 else 0, draft_host_time=draft_host_time,
                          verify_host_time=verify_host_time,
                          unused=unused_offers(prop.offer, draft.source, emitted) if not finish else ())
        if seq.request.speculative:  # a request that does not draft teaches the policy nothing
            seq.policy.observe(step)
            stats.idle_steps += could_draft and not step.drafted
        stats.add_step(step)
        structure = None
        if seq.walk is not None:
            stats.constraint_time = seq.walk.seconds
            if finish:
                finish, structure = self._structure(seq.walk, out, emitted, finish, stats)
        if stats.time_to_first_token == 0.0:
            stats.time_to_first_token = time.perf_counter() - seq.t_start
        if logprobs is not None:
            logprobs = logprobs[:len(emitted)]
        if not finish:
            if emitted:
                seq.emit(seq.text.release(), emitted, logprobs)  # stats so far
            return StepOutcome(seq)
        piece = seq.text.finish()
        stats.total_time = time.perf_counter() - seq.t_start
        if seq.speculative:
            if stats.idle_steps:
                stats.idle_reason = seq.policy.explain()
            self.save_costs(seq.policy)
            if self.suffix is not None:  # later requests of its pool may draft from its text
                self.suffix.add(seq.pool, [seq.history])
        seq.emit(piece, emitted, logprobs, finish_reason=finish, structure=structure)
        return StepOutcome(seq, finish_reason=finish, structure=structure)

    def _observe_batch(self, rows: Sequence[Rows], contexts: Mapping[int, int], rounds, prefill,
                       seconds: float) -> None:
        """What the shared costs learn from a pass beside each step's record: every draft decode (a
        round of one sequence or several, a catch-up on a prompt too: what batched drafting costs
        is known before batches form), and a verify pass shared by several sequences, once (a step
        alone teaches its policy through its record, as it always did), unless it also filled a
        prompt (a chunk of hundreds of tokens runs at another rate per token)."""
        if not learns(self.policy):
            return
        for held, t in rounds:
            at = {seq: context for seq, _, context in held}
            self.policy.observe_draft_round(self._passes(self.draft_ctx, [(seq, n) for seq, n, _ in held], at), t)
        if len(rows) > 1 and not prefill:
            self.policy.observe_pass(self._passes(self.oracle, [(r.seq, len(r.tokens) + r.pad) for r in rows], contexts), seconds)

    @staticmethod
    def _passes(ctx, rows: Sequence[tuple[int, int]], contexts: Mapping[int, int]) -> list[tuple[list[int], list[int]]]:
        """The passes llama.cpp runs a decode of `rows` (sequence, tokens) as: each one's tokens per
        sequence and contexts, for the cost models."""
        out, consumed = [], dict.fromkeys(contexts, 0)
        for group in ctx.ubatches(rows):
            out.append(([n for _, n in group], [contexts[seq] + consumed[seq] for seq, _ in group]))
            for seq, n in group:
                consumed[seq] += n
        return out

    def _structure(self, walk: ConstraintWalk, out: list[int], emitted: list[int], finish: str,
                   stats: Stats) -> tuple[str, Structure]:
        """(finish_reason, structure) of a constrained generation that just ended.
        Complete: it ended with the end-of-generation token (allowed only once the text is a whole
        instance of the grammar), or it reached max_tokens where nothing but the end could follow
        (then it stopped as it would have: "stop"). Anything else, e.g. max_tokens in the middle
        of a JSON object or a stop string, is incomplete."""
        if len(emitted) < len(out) and self.oracle_model.is_eog(out[len(emitted)]):
            return finish, Structure.COMPLETE
        walk.pop(walk.depth - stats.completion_tokens)  # the step's tokens after the end
        if finish == "length" and walk.complete:
            return "stop", Structure.COMPLETE
        return finish, Structure.INCOMPLETE

    def _emit(self, out: list[int], seq: Seq, sources: list[str] | None = None) -> tuple[list[int], str | None]:
        """Append a step's tokens to the history until one of them ends the generation:
        end-of-generation token, stop string, max_tokens, or a full context. `sources`: where
        each token came from, for a request that asked (its text is labelled with them)."""
        emitted: list[int] = []
        stats, history = seq.stats, seq.history
        for i, token in enumerate(out):
            if self.oracle_model.is_eog(token):
                return emitted, "stop"
            emitted.append(token)
            history.append(token)
            stats.completion_tokens += 1
            if seq.text.add(token, sources[i] if sources else ""):
                return emitted, "stop"
            if stats.completion_tokens >= seq.request.max_tokens or len(history) > self.n_ctx:
                return emitted, "length"
        return emitted, None

    def _draft_limit(self, seq: Seq) -> int:
        """Most draft tokens worth proposing now: each step emits up to k+1 tokens, and the oracle
        must hold history + k."""
        request = seq.request
        if not seq.speculative:
            return 0
        limit = min(request.max_tokens - seq.stats.completion_tokens - 1, self.n_ctx - len(seq.history))
        if request.draft_max is not None:
            limit = min(limit, request.draft_max)
        return max(0, limit)

    @staticmethod
    def _accept(draft: Draft, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
                position: int, picked: np.ndarray | None = None, *,
                masks: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Accepted draft tokens + a recovered or bonus token (`acceptance.accept`: the target, the
        regime's rule). `position`: where the first verified token goes in the sequence (keys the
        noise of seeded sampling). `picked`: the oracle's greedy ids [k+1], picked by llama.cpp
        (then `logits` has no columns). `masks`: the grammar's [k+1, vocab]."""
        return accept(draft.tokens, draft.probs, logits, sampling, rng, position=position, masks=masks, picked=picked)

    def _logprobs(self, logits: np.ndarray, tokens: np.ndarray, top_n: int) -> list[TokenLogprob]:
        """The oracle's own log-probabilities (raw model distribution) of `tokens` [n] from logits
        [n, vocab], with each token's real bytes; the top `top_n` most likely first, ties by token id."""
        logp = log_softmax(logits)  # [n, vocab]
        out = []
        for row, token in zip(logp, tokens.tolist()):
            top = tuple(TopLogprob(t, *self._text_and_bytes(t), float(row[t])) for t in top_ids(row, top_n).tolist())
            out.append(TokenLogprob(token, *self._text_and_bytes(token), float(row[token]), top))
        return out

    def _text_and_bytes(self, token: int) -> tuple[str, bytes]:
        piece = self.oracle_model.token_piece(token)
        return piece.decode(errors="replace"), piece


@dataclasses.dataclass(eq=False)
class Proposal:
    """One running sequence's part of a step, from plan to record: what its proposer offered, the
    plan its policy made of that, the draft that came of it and the grammar walk's depth before the
    draft was pushed. It lives for one step (in `Engine.step`), not on the request's `Seq`."""

    offer: Offer = NO_OFFER
    plan: DraftPlan = NO_DRAFT
    draft: Draft = EMPTY_DRAFT
    walk_base: int = 0


def _picks_suffice(seq: Seq) -> bool:
    """Whether the oracle's greedy picks are all `seq`'s verify passes need of its logits: a greedy
    request with no logprobs, no logit bias and no grammar (each of those reads whole rows)."""
    request = seq.request
    return (request.sampling.greedy and not request.sampling.logit_bias and seq.walk is None
            and request.logprobs is None and request.prompt_logprobs is None)


_DRAFT_SOURCES = {DraftSource.MODEL: "draft", DraftSource.LOOKUP: "lookup", DraftSource.SUFFIX: "suffix"}  # a Draft's source -> a token's (Chunk.sources)


def _sources(draft: Draft, n_accepted: int, n: int) -> list[str]:
    """Where each of a step's `n` tokens came from: the accepted draft tokens from the draft's
    source, the last one (recovered or bonus) from the oracle."""
    return [_DRAFT_SOURCES.get(draft.source, "draft")] * n_accepted + ["oracle"] * (n - n_accepted)
