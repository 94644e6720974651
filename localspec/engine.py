"""The engine: propose -> verify -> accept -> rollback, with stopping and streaming.

One speculative step, as in llama.cpp's speculative-simple:

    history = prompt + emitted tokens; the oracle's cache holds history[:-1], and the last token
              is kept out of it until the next step evaluates it
    draft   = proposer.propose(history, k)                 # k tokens, maybe fewer
    logits  = oracle.decode([last, d1..dk])                # ONE pass, logits at all k+1 positions
    out     = accepted draft tokens + a recovered or bonus token
    oracle cache trimmed to history + accepted (seq_rm); the draft's cache is synced lazily

With no draft (or k = 0) the same loop is plain oracle decoding: the baseline.

Under a JSON schema or a grammar (`constraints.ConstraintWalk`), the draft proposes only allowed
tokens (pushing them onto the walk), every verified row of the oracle's logits gets the mask of its
position before acceptance (so the target is the constrained oracle distribution, and recovered and
bonus tokens come from it), and the walk pops back to the accepted prefix.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import chat, constraints
from .acceptance import accept_draft, accept_greedy
from .constraints import Constraint, ConstraintWalk
from .costs import CostBook
from .factory import (DEFAULT_DRAFT_MAX, DEFAULT_P_MIN, LOOKUP_DRAFT_MAX, NGRAM, Parts, build,  # noqa: F401
                      default_policy, kernel_identity)
from .llama import Detokenizer, LlamaContext, LlamaModel
from .options import OPTIONS, GenerationOptions
from .outputs import Chunk, Result, Stats, StepRecord, TokenLogprob, TopLogprob
from .policy import LengthPolicy, Regime
from .proposers import EMPTY_DRAFT, Draft, Proposer, propose
from .sampling import (SamplingParams, coupled_choice, greedy_argmax, log_softmax, logits_to_probs, mask_logits,
                       seed_key, top_ids)
from .text import TextStream

log = logging.getLogger("localspec.engine")

Prompt = str | Sequence[Mapping[str, Any]]


class PromptTooLongError(ValueError):
    """The prompt does not fit in the context."""


@dataclass(frozen=True)
class Request:
    """One generation request as the loop runs it: the options of a `GenerationOptions`, with the
    sampling ones gathered and the schema or grammar compiled (`Request.of`)."""

    max_tokens: int = OPTIONS["max_tokens"].default
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; n >= 0: the emitted token's logprob and the top n
    speculative: bool = True
    draft_max: int | None = None  # per-request cap on the draft length
    constraint: Constraint | None = None  # a JSON schema or grammar the output must follow

    def __post_init__(self) -> None:
        for name in ("max_tokens", "logprobs", "draft_max"):  # the rules of options.py
            OPTIONS[name].check(getattr(self, name))

    @classmethod
    def of(cls, options: GenerationOptions) -> "Request":
        return cls(max_tokens=options.max_tokens,
                   sampling=SamplingParams(temperature=options.temperature, top_k=options.top_k,
                                           top_p=options.top_p, min_p=options.min_p, seed=options.seed),
                   stop=options.stop, logprobs=options.logprobs, speculative=options.speculative,
                   draft_max=options.draft_max, constraint=options.constraint)


class Engine:
    """An oracle model, optionally a proposer (a draft model, prompt lookup or both), a draft-length
    policy, and the loop that runs them.

    `Engine(oracle, draft, **options)` loads the models by name or path (`localspec.factory.build`
    says what the options are); `Engine.from_parts` runs parts built elsewhere.
    Not thread-safe: one generation at a time (the server runs a single worker).
    """

    def __init__(self, oracle: str | os.PathLike, draft: str | os.PathLike | None = None, **options) -> None:
        """`draft`: a model (name or path), "ngram" (prompt lookup, no model) or None (oracle
        alone); the options (n_ctx, n_threads, gpu_layers, flash_attn, draft_length, draft_max,
        p_min, lookup, cross_tokenizer, policy, cost_cache, progress, rpc, draft_rpc, ...) as for
        `localspec.factory.build`. The engine owns what it loads: `close()` frees it."""
        self._adopt(build(oracle, draft, **options), owned=True)

    @classmethod
    def from_parts(cls, *, oracle: LlamaContext, proposer: Proposer | None = None,
                   policy: LengthPolicy | None = None, draft: LlamaContext | None = None,
                   costs: CostBook | None = None) -> "Engine":
        """An engine over parts built elsewhere: the oracle's context (its `model` is the oracle
        model), an optional proposer (and the draft context it drafts on, if any), a length
        policy (default: none drafted without a proposer, else adaptive) and where the policy's
        learned state is kept (default: nowhere). The caller owns the parts: `close()` leaves them
        open. Tests plug scripted contexts in here."""
        engine = cls.__new__(cls)
        engine._adopt(Parts(oracle=oracle, proposer=proposer, policy=policy, draft=draft, costs=costs), owned=False)
        return engine

    def _adopt(self, parts: Parts, *, owned: bool) -> None:
        self._closers: list[Callable[[], None]] = parts.closers if owned else []
        self._warned_no_template = False
        self.oracle = parts.oracle
        self.oracle_model: LlamaModel = parts.oracle.model
        self.draft_ctx = parts.draft
        self.draft_model: LlamaModel | None = parts.draft.model if parts.draft is not None else None
        self.proposer = parts.proposer
        self.policy: LengthPolicy = parts.policy if parts.policy is not None else default_policy(parts.proposer)
        self.costs = parts.costs
        self.cost_store = parts.cost_store if parts.cost_store is not None else (
            parts.costs.store if parts.costs is not None else None)
        self.n_threads, self.gpu_layers = parts.n_threads, parts.gpu_layers
        self.rpc, self.draft_rpc = parts.rpc, parts.draft_rpc
        if self.costs is not None:
            self.costs.load(self.policy)

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
        if self.costs is not None:
            self.costs.save(self.policy if policy is None else policy)

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Engine":
        from .models import Registry

        pair = Registry.load().pair(name)
        kwargs.setdefault("cross_tokenizer", pair.cross_tokenizer)
        return cls(pair.oracle, pair.draft, **kwargs)

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        self._closers.clear()

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
        """A completion prompt (str) or chat messages (rendered with the model's template, with
        `tools` for a template that takes them)."""
        m = self.oracle_model
        if isinstance(prompt, str):
            return m.tokenize(prompt, add_special=True, parse_special=True)
        text = self.render(prompt, tools)
        bos_text = m.token_piece(m.bos, special=True).decode(errors="replace")
        has_bos = bool(bos_text) and text.startswith(bos_text)  # templates often write BOS themselves
        return m.tokenize(text, add_special=not has_bos, parse_special=True)

    # -- generation

    def generate(self, prompt: Prompt, options: GenerationOptions | None = None, *, tools: list | None = None,
                 **changes) -> Result:
        """Generate a completion; arguments as for `stream`."""
        options = GenerationOptions.build(options, **changes)
        text, tokens, logprobs = [], [], []
        final = None
        for final in self.stream(prompt, options, tools=tools):
            text.append(final.text)
            tokens.extend(final.tokens)
            if final.logprobs is not None:
                logprobs.extend(final.logprobs)
        assert final is not None and final.finish_reason is not None and final.stats is not None
        return Result(text="".join(text), tokens=tokens, finish_reason=final.finish_reason,
                      stats=final.stats, logprobs=logprobs if options.logprobs is not None else None,
                      structure=final.structure)

    def stream(self, prompt: Prompt, options: GenerationOptions | None = None, *, tools: list | None = None,
               **changes) -> Iterator[Chunk]:
        """Yield text chunks as speculative steps are accepted; the last chunk carries
        finish_reason ("stop" or "length") and the stats.

        `options`: a `GenerationOptions` (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
        logprobs, speculative, draft_max, schema, grammar); keyword arguments of those names build
        one, or change the given one: `stream(prompt, max_tokens=64, temperature=0.8)`.
        `schema`: a JSON schema (dict, JSON text or a pydantic model class) the output must follow;
        `grammar`: a Lark or GBNF grammar (text) it must follow; or a `constraints.Constraint`.
        Invalid options raise a ValueError (an invalid schema or grammar a `constraints.ConstraintError`)
        before anything is generated.
        `tools`: OpenAI function specs handed to a chat template that takes them (the server's tool calls)."""
        request = Request.of(GenerationOptions.build(options, **changes))
        tokens = self.tokenize_prompt(prompt, tools)
        return self.stream_tokens(tokens, request)

    def stream_tokens(self, prompt_tokens: list[int], request: Request) -> Iterator[Chunk]:
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_tokens)} tokens; the context holds {self.n_ctx}")
        walk = self.constraint_walk(request.constraint) if request.constraint is not None else None
        return self._run(list(prompt_tokens), request, self.policy, walk)

    def constraint_walk(self, constraint: Constraint) -> ConstraintWalk:
        """A matcher for one generation under `constraint` over the oracle's vocabulary. Raises
        ConstraintError when llguidance cannot compile it (the vocabulary is read on first use)."""
        return ConstraintWalk(constraints.tokenizer_for(self.oracle_model), constraint, self.oracle_model.n_vocab)

    def _run(self, history: list[int], request: Request, policy: LengthPolicy,
             walk: ConstraintWalk | None = None) -> Iterator[Chunk]:
        """`policy`: the length policy the request started with (it keeps it to its end)."""
        stats = Stats(prompt_tokens=len(history), flash_attn=self.oracle.flash_attn,
                      draft_flash_attn=self.draft_ctx.flash_attn if self.draft_ctx is not None else None)
        t_start = time.perf_counter()
        seed = request.sampling.seed
        rng = np.random.default_rng(None if seed is None else seed_key(seed))
        detok = Detokenizer(self.oracle_model)
        text = TextStream(detok.feed, detok.flush, request.stop)
        speculative = request.speculative and self.proposer is not None
        if speculative:
            regime = Regime.of(request.sampling, constrained=request.constraint is not None)
            stats.regime = regime.describe()
            policy.start_request(regime)
        self._prefill(history, stats, policy if speculative else None)
        stats.prompt_time = time.perf_counter() - t_start

        finish = None
        while finish is None:
            # the first token comes from a plain oracle step, as fast as the oracle alone gives it;
            # the draft catches up on the prompt in the next step
            limit = self._draft_limit(history, request, request.max_tokens - stats.completion_tokens) \
                if stats.steps else 0
            out, logprobs = self._step(history, limit, request, policy, rng, stats, walk)
            emitted, finish = self._emit(out, history, text, request, stats)
            structure = None
            if walk is not None:
                stats.constraint_time = walk.seconds
                if finish:
                    finish, structure = self._structure(walk, out, emitted, finish, stats)
            if stats.time_to_first_token == 0.0:
                stats.time_to_first_token = time.perf_counter() - t_start
            if logprobs is not None:
                logprobs = logprobs[:len(emitted)]
            if finish:
                piece = text.finish()
                stats.total_time = time.perf_counter() - t_start
                if speculative:
                    if stats.idle_steps:
                        stats.idle_reason = policy.explain()
                    self.save_costs(policy)
                yield Chunk(piece, emitted, logprobs, finish_reason=finish, stats=stats, structure=structure)
            elif emitted:
                yield Chunk(text.release(), emitted, logprobs, stats=stats)  # stats so far

    def _structure(self, walk: ConstraintWalk, out: list[int], emitted: list[int], finish: str,
                   stats: Stats) -> tuple[str, str]:
        """(finish_reason, "complete" | "incomplete") of a constrained generation that just ended.
        Complete: it ended with the end-of-generation token (allowed only once the text is a whole
        instance of the grammar), or it reached max_tokens where nothing but the end could follow
        (then it stopped as it would have: "stop"). Anything else, e.g. max_tokens in the middle
        of a JSON object or a stop string, is incomplete."""
        if len(emitted) < len(out) and self.oracle_model.is_eog(out[len(emitted)]):
            return finish, "complete"
        walk.pop(walk.depth - stats.completion_tokens)  # the step's tokens after the end
        if finish == "length" and walk.complete:
            return "stop", "complete"
        return finish, "incomplete"

    def _emit(self, out: list[int], history: list[int], text: TextStream, request: Request,
              stats: Stats) -> tuple[list[int], str | None]:
        """Append a step's tokens to the history until one of them ends the generation:
        end-of-generation token, stop string, max_tokens, or a full context."""
        emitted: list[int] = []
        for token in out:
            if self.oracle_model.is_eog(token):
                return emitted, "stop"
            emitted.append(token)
            history.append(token)
            stats.completion_tokens += 1
            if text.add(token):
                return emitted, "stop"
            if stats.completion_tokens >= request.max_tokens or len(history) > self.n_ctx:
                return emitted, "length"
        return emitted, None

    def _prefill(self, history: list[int], stats: Stats, policy: LengthPolicy | None) -> None:
        """Bring the oracle's cache to history[:-1], reusing what it already holds. The draft is
        not run here: its first proposal catches up on what it has not seen (all of the prompt while
        drafting pays, copied from the oracle's cache where their layouts match; else a probe's
        window of it while the policy is idle). `policy`: the request's
        length policy, None when it does not draft at all."""
        _, n_eval = self.oracle.sync(history[:-1], n_logits=0)
        stats.prompt_tokens_evaluated = n_eval + 1  # the last prompt token is evaluated in step one
        if policy is not None:
            self.proposer.start(catch_up=not policy.idle)

    def _draft_limit(self, history: list[int], request: Request, remaining: int) -> int:
        """Most draft tokens worth proposing now: each step emits up to k+1 tokens, and the oracle
        must hold history + k."""
        if self.proposer is None or not request.speculative:
            return 0
        limit = min(remaining - 1, self.n_ctx - len(history))
        if request.draft_max is not None:
            limit = min(limit, request.draft_max)
        return max(0, limit)

    def _step(self, history: list[int], limit: int, request: Request, policy: LengthPolicy,
              rng: np.random.Generator, stats: Stats, walk: ConstraintWalk | None = None) -> tuple[list[int], list[TokenLogprob] | None]:
        """One propose -> verify -> accept -> rollback step. Returns the tokens it yields (accepted
        draft tokens, then a recovered or bonus token) and, if asked, their oracle logprobs.
        `walk`: the grammar's matcher, holding every emitted token (the draft pushes its own)."""
        context = len(history) - 1  # the oracle holds all but the last token
        t0 = time.perf_counter()
        k = policy.draft_length(limit, context) if limit > 0 else 0
        if k > 0 and policy.consume_catch_up():  # a re-try: the draft sees all the text again
            self.proposer.resync()
        base = walk.depth if walk is not None else 0
        draft = propose(self.proposer, history, k, request.sampling, rng, walk) if k > 0 else EMPTY_DRAFT
        t1 = time.perf_counter()
        logits, _ = self.oracle.sync(history + draft.tokens.tolist(), n_logits=len(draft) + 1)  # [k+1, vocab]
        raw = logits
        if walk is not None:  # the constrained oracle: each row masked at its position (draft tokens included)
            logits = mask_logits(logits, walk.masks(base))  # [k+1, vocab]
        out, n_accepted = self._accept(draft, logits, request.sampling, rng, len(history))
        if walk is not None:
            walk.pop(len(draft) - n_accepted)
            walk.push(int(out[-1]))  # drawn from a masked row: allowed
            walk.settle()
        self.oracle.rollback(len(history) + n_accepted)  # keep last + accepted; the new last stays out
        t2 = time.perf_counter()
        # the logits stay valid until the next decode: logprobs are not part of the verify time
        logprobs = self._logprobs(raw[:len(out)], out, request.logprobs) if request.logprobs is not None else None

        step = StepRecord(k=k, drafted=len(draft), accepted=n_accepted, draft_time=t1 - t0, verify_time=t2 - t1,
                          context=context, draft_evaluated=draft.evaluated, draft_prompt_time=draft.prompt_time,
                          source=draft.source)
        if request.speculative:  # a request that does not draft teaches the policy nothing
            policy.update(step)
            stats.idle_steps += limit > 0 and not step.drafted
        stats.add_step(step)
        return out.tolist(), logprobs

    @staticmethod
    def _accept(draft: Draft, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
                position: int) -> tuple[np.ndarray, int]:
        """Accepted draft tokens + a recovered or bonus token. `position`: where the first verified
        token goes in the sequence (keys the noise of seeded sampling)."""
        if sampling.greedy:
            return accept_greedy(draft.tokens, greedy_argmax(logits))  # target argmax [k+1]
        target_probs = logits_to_probs(logits, sampling)  # [k+1, vocab]
        if sampling.coupled:
            picks = [coupled_choice(row, sampling.seed, position + i) for i, row in enumerate(target_probs)]
            return accept_greedy(draft.tokens, np.asarray(picks))  # the oracle's seeded picks [k+1]
        return accept_draft(draft.tokens, draft.probs, target_probs, rng)

    def _logprobs(self, logits: np.ndarray, tokens: np.ndarray, top_n: int) -> list[TokenLogprob]:
        """The oracle's own log-probabilities (raw model distribution) of `tokens` [n] from logits
        [n, vocab], with each token's real bytes; the top `top_n` most likely first, ties by token id."""
        logp = log_softmax(logits)  # [n, vocab]
        model = self.oracle_model

        def text_and_bytes(token: int) -> tuple[str, bytes]:
            piece = model.token_piece(token)
            return piece.decode(errors="replace"), piece

        out = []
        for row, token in zip(logp, tokens.tolist()):
            top = tuple(TopLogprob(t, *text_and_bytes(t), float(row[t])) for t in top_ids(row, top_n).tolist())
            out.append(TokenLogprob(token, *text_and_bytes(token), float(row[token]), top))
        return out
