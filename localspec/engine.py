"""The engine: propose -> verify -> accept -> rollback, with stopping and streaming.

One speculative step, as in llama.cpp's speculative-simple:

    history = prompt + emitted tokens; the oracle's cache holds history[:-1], and the last token
              is kept out of it until the next step evaluates it
    draft   = proposer.propose(history, k)                 # k tokens, maybe fewer
    logits  = oracle.decode([last, d1..dk])                # ONE pass, logits at all k+1 positions
    out     = accepted draft tokens + a recovered or bonus token
    oracle cache trimmed to history + accepted (seq_rm); the draft's cache is synced lazily

With no draft (or k = 0) the same loop is plain oracle decoding: the baseline.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import chat
from .acceptance import accept_draft, accept_greedy
from .compat import check_compatible, first_difference
from .llama import Detokenizer, LlamaContext, LlamaModel
from .outputs import Chunk, Result, Stats, TokenLogprob, TopLogprob
from .policy import AdaptiveLength, FixedLength, LengthPolicy
from .proposers import (EMPTY_DRAFT, CrossTokenizerProposer, Draft, DraftModelProposer, HybridProposer,
                        PromptLookupProposer, Proposer)
from .sampling import (SamplingParams, coupled_choice, greedy_argmax, log_softmax, logits_to_probs, seed_key,
                       top_ids)
from .text import TextStream

log = logging.getLogger("localspec.engine")

Prompt = str | Sequence[Mapping[str, Any]]

DEFAULT_DRAFT_MAX = 16
DEFAULT_P_MIN = 0.3  # measured on the default pair: acceptance 0.80 -> 0.91 at k=8, fewer wasted drafts
NGRAM = "ngram"  # draft=NGRAM: prompt lookup instead of a draft model


class PromptTooLongError(ValueError):
    """The prompt does not fit in the context."""


@dataclass(frozen=True)
class Request:
    """One generation request, validated."""

    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; n >= 0: the emitted token's logprob and the top n
    speculative: bool = True
    draft_max: int | None = None  # per-request cap on the draft length

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.draft_max is not None and self.draft_max < 0:
            raise ValueError("draft_max must be >= 0")


class Engine:
    """An oracle model, optionally a draft model, and the loop that runs them.

    `oracle` / `draft`: a GGUF path or a model name from models.toml (fetched on first use).
    Not thread-safe: one generation at a time (the server runs a single worker).
    """

    def __init__(self, oracle: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                 n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 gpu_layers: int = -1, draft_gpu_layers: int = -1,
                 draft_length: int | None = None, draft_max: int = DEFAULT_DRAFT_MAX,
                 p_min: float = DEFAULT_P_MIN, lookup: bool = False, cross_tokenizer: bool = False,
                 policy: LengthPolicy | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        """`draft`: a model (name or path), "ngram" (prompt lookup, no model) or None (oracle alone).
        `draft_length`: a fixed k; None chooses k per step from measured costs and acceptance
        (capped by `draft_max`). `p_min`: the draft stops when its top probability falls below it.
        `lookup`: try prompt lookup first and the draft model when it finds nothing.
        `cross_tokenizer`: allow a draft whose vocabulary differs (re-tokenizes text between them)."""
        from .models import Registry  # models pulls in the registry file; keep it lazy

        self._closers: list[Callable[[], None]] = []
        self._warned_no_template = False
        try:
            registry = Registry.load()
            oracle_path = registry.resolve(str(oracle), progress=progress)
            self.oracle_model = self._own(LlamaModel(oracle_path, n_gpu_layers=gpu_layers))
            self.oracle = self._own(LlamaContext(self.oracle_model, n_ctx=n_ctx, n_batch=n_batch,
                                                 n_threads=n_threads))
            self.draft_model: LlamaModel | None = None
            self.draft_ctx: LlamaContext | None = None
            self.proposer: Proposer | None = None
            if draft == NGRAM:
                self.proposer = PromptLookupProposer()
            elif draft is not None:
                self.proposer = self._draft_model_proposer(
                    registry.resolve(str(draft), progress=progress), gpu_layers=draft_gpu_layers,
                    n_batch=n_batch, n_threads=n_threads, p_min=p_min, cross_tokenizer=cross_tokenizer)
                if lookup:
                    self.proposer = HybridProposer(PromptLookupProposer(), self.proposer)
        except BaseException:
            self.close()
            raise
        if policy is None:
            if self.proposer is None:
                policy = FixedLength(0)
            elif draft_length is not None:
                policy = FixedLength(min(draft_length, draft_max))
            else:
                policy = AdaptiveLength(k_max=draft_max)
        self.policy: LengthPolicy = policy

    @classmethod
    def from_parts(cls, *, oracle: LlamaContext, proposer: Proposer | None = None,
                   policy: LengthPolicy | None = None, draft: LlamaContext | None = None) -> "Engine":
        """An engine over parts built elsewhere: the oracle's context (its `model` is the oracle
        model), an optional proposer (and the draft context it drafts on, if any) and a length
        policy (default: none drafted without a proposer, else adaptive). The caller owns the parts:
        `close()` leaves them open. Tests plug scripted contexts in here."""
        engine = cls.__new__(cls)
        engine._closers = []
        engine._warned_no_template = False
        engine.oracle = oracle
        engine.oracle_model = oracle.model
        engine.draft_ctx = draft
        engine.draft_model = draft.model if draft is not None else None
        engine.proposer = proposer
        engine.policy = policy if policy is not None else (
            FixedLength(0) if proposer is None else AdaptiveLength(k_max=DEFAULT_DRAFT_MAX))
        return engine

    def _draft_model_proposer(self, path, *, gpu_layers: int, n_batch: int, n_threads: int | None,
                              p_min: float, cross_tokenizer: bool) -> Proposer:
        self.draft_model = self._own(LlamaModel(path, n_gpu_layers=gpu_layers))
        self.draft_ctx = self._own(LlamaContext(self.draft_model, n_ctx=self.oracle.n_ctx, n_batch=n_batch,
                                                n_threads=n_threads))
        difference = first_difference(self.oracle_model, self.draft_model)
        if difference is not None and not cross_tokenizer:
            check_compatible(self.oracle_model, self.draft_model)  # raises, naming the difference
        # a same-vocabulary draft drafts over the oracle's vocabulary (their sizes may differ a little);
        # a cross-tokenizer one over its own
        proposer = DraftModelProposer(self.draft_ctx, p_min=p_min,
                                      n_vocab=self.oracle_model.n_vocab if difference is None else None)
        o, d = self.oracle_model, self.draft_model
        if d.size_bytes >= o.size_bytes or d.n_params > o.n_params:
            log.warning("the draft %s (%.0f MB, %.0fM params) is not smaller than the oracle %s (%.0f MB, %.0fM "
                        "params): speculation will likely be slower than the oracle alone",
                        d.path.name, d.size_bytes / 1e6, d.n_params / 1e6, o.path.name, o.size_bytes / 1e6,
                        o.n_params / 1e6)
        if difference is None:
            return proposer
        log.info("draft and oracle vocabularies differ (%s): drafting through text", difference)
        return CrossTokenizerProposer(proposer, oracle=self.oracle_model, draft=self.draft_model)

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Engine":
        from .models import Registry

        pair = Registry.load().pair(name)
        kwargs.setdefault("cross_tokenizer", pair.cross_tokenizer)
        return cls(pair.oracle, pair.draft, **kwargs)

    def _own(self, obj):
        self._closers.append(obj.close)
        return obj

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

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        m = self.oracle_model
        template = m.chat_template
        if not template and not self._warned_no_template:
            self._warned_no_template = True  # once per engine, not on every request
            log.warning("%s has no chat template; using ChatML", m.name)
        return chat.render(template, messages, bos_token=m.token_piece(m.bos, special=True).decode(errors="replace"),
                           eos_token=m.token_piece(m.eos, special=True).decode(errors="replace"))

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """A completion prompt (str) or chat messages (rendered with the model's template)."""
        m = self.oracle_model
        if isinstance(prompt, str):
            return m.tokenize(prompt, add_special=True, parse_special=True)
        text = self.render(prompt)
        bos_text = m.token_piece(m.bos, special=True).decode(errors="replace")
        has_bos = bool(bos_text) and text.startswith(bos_text)  # templates often write BOS themselves
        return m.tokenize(text, add_special=not has_bos, parse_special=True)

    # -- generation

    def generate(self, prompt: Prompt, **options) -> Result:
        """Generate a completion; options as for `stream`."""
        text, tokens, logprobs = [], [], []
        final = None
        for final in self.stream(prompt, **options):
            text.append(final.text)
            tokens.extend(final.tokens)
            if final.logprobs is not None:
                logprobs.extend(final.logprobs)
        assert final is not None and final.finish_reason is not None and final.stats is not None
        return Result(text="".join(text), tokens=tokens, finish_reason=final.finish_reason,
                      stats=final.stats, logprobs=logprobs if options.get("logprobs") is not None else None)

    def stream(self, prompt: Prompt, *, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None, logprobs: int | None = None,
               speculative: bool = True, draft_max: int | None = None) -> Iterator[Chunk]:
        """Yield text chunks as speculative steps are accepted; the last chunk carries
        finish_reason ("stop" or "length") and the stats."""
        request = Request(
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logprobs=logprobs, speculative=speculative, draft_max=draft_max)
        tokens = self.tokenize_prompt(prompt)
        return self.stream_tokens(tokens, request)

    def stream_tokens(self, prompt_tokens: list[int], request: Request) -> Iterator[Chunk]:
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_tokens)} tokens; the context holds {self.n_ctx}")
        return self._run(list(prompt_tokens), request)

    def _run(self, history: list[int], request: Request) -> Iterator[Chunk]:
        stats = Stats(prompt_tokens=len(history))
        t_start = time.perf_counter()
        seed = request.sampling.seed
        rng = np.random.default_rng(None if seed is None else seed_key(seed))
        detok = Detokenizer(self.oracle_model)
        text = TextStream(detok.feed, detok.flush, request.stop)
        start_request = getattr(self.policy, "start_request", None)  # optional for a custom policy
        if request.speculative and start_request is not None:
            start_request()
        self._prefill(history, stats, speculative=request.speculative and self.proposer is not None)
        stats.prompt_time = time.perf_counter() - t_start

        finish = None
        while finish is None:
            limit = self._draft_limit(history, request, request.max_tokens - stats.completion_tokens)
            out, logprobs = self._step(history, limit, request, rng, stats)
            emitted, finish = self._emit(out, history, text, request, stats)
            if stats.time_to_first_token == 0.0:
                stats.time_to_first_token = time.perf_counter() - t_start
            if logprobs is not None:
                logprobs = logprobs[:len(emitted)]
            if finish:
                piece = text.finish()
                stats.total_time = time.perf_counter() - t_start
                yield Chunk(piece, emitted, logprobs, finish_reason=finish, stats=stats)
            elif emitted:
                yield Chunk(text.release(), emitted, logprobs, stats=stats)  # stats so far

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

    def _prefill(self, history: list[int], stats: Stats, *, speculative: bool) -> None:
        """Bring the oracle's cache (and a same-vocabulary draft's) to history[:-1], reusing what
        they already hold. `speculative`: whether this request drafts at all."""
        _, n_eval = self.oracle.sync(history[:-1], n_logits=0)
        stats.prompt_tokens_evaluated = n_eval + 1  # the last prompt token is evaluated in step one
        drafter = self.proposer.model if isinstance(self.proposer, HybridProposer) else self.proposer
        if isinstance(drafter, DraftModelProposer):
            # not evaluated while drafting does not pay (or the request does not draft): TTFT is then
            # the oracle's alone
            drafter.prefill(history[:-1], evaluate=speculative and not getattr(self.policy, "idle", False))
        if speculative and isinstance(self.policy, AdaptiveLength) and not self.policy.calibrated:
            self._calibrate(history)

    def _calibrate(self, history: list[int]) -> None:
        """Time oracle passes of a few sizes and one draft token, at the current position; the
        caches are rolled back afterwards. Runs once per engine."""
        def timed(ctx: LlamaContext, n: int) -> float:
            base = ctx.n_past
            vocab_safe = [t % ctx.n_vocab for t in history]  # a cross-tokenizer draft has another vocabulary
            tokens = (vocab_safe * (n // len(vocab_safe) + 1))[:n]
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                ctx.decode(tokens, n_logits=n)
                best = min(best, time.perf_counter() - t0)
                ctx.rollback(base)
            return best

        sizes = tuple(n for n in (1, 2, 4, 8, 16) if self.oracle.n_past + n <= self.n_ctx)
        if len(sizes) < 2:
            return
        draft_ctx = self.draft_ctx
        if draft_ctx is None or draft_ctx.n_past + 2 > draft_ctx.n_ctx:
            time_draft = lambda n: 0.0  # noqa: E731  (prompt lookup costs next to nothing)
        else:
            time_draft = lambda n: timed(draft_ctx, n)  # noqa: E731
        timed(self.oracle, 1)  # warm-up
        self.policy.calibrate(lambda n: timed(self.oracle, n), time_draft, sizes)

    def _draft_limit(self, history: list[int], request: Request, remaining: int) -> int:
        """Most draft tokens worth proposing now: each step emits up to k+1 tokens, and the oracle
        must hold history + k."""
        if self.proposer is None or not request.speculative:
            return 0
        limit = min(remaining - 1, self.n_ctx - len(history))
        if request.draft_max is not None:
            limit = min(limit, request.draft_max)
        return max(0, limit)

    def _step(self, history: list[int], limit: int, request: Request, rng: np.random.Generator,
              stats: Stats) -> tuple[list[int], list[TokenLogprob] | None]:
        """One propose -> verify -> accept -> rollback step. Returns the tokens it yields (accepted
        draft tokens, then a recovered or bonus token) and, if asked, their oracle logprobs."""
        t0 = time.perf_counter()
        k = self.policy.draft_length(limit) if limit > 0 else 0
        draft = self.proposer.propose(history, k, request.sampling, rng) if k > 0 else EMPTY_DRAFT
        t1 = time.perf_counter()
        logits, _ = self.oracle.sync(history + draft.tokens.tolist(), n_logits=len(draft) + 1)  # [k+1, vocab]
        out, n_accepted = self._accept(draft, logits, request.sampling, rng, len(history))
        logprobs = self._logprobs(logits[:len(out)], out, request.logprobs) if request.logprobs is not None else None
        self.oracle.rollback(len(history) + n_accepted)  # keep last + accepted; the new last stays out
        t2 = time.perf_counter()

        if request.speculative:  # a request that does not draft teaches the policy nothing
            if self.proposer is not None:
                self.proposer.observe(len(draft), n_accepted)
            self.policy.update(n_drafted=len(draft), n_accepted=n_accepted, draft_time=t1 - t0,
                               verify_time=t2 - t1)
        stats.steps += 1
        stats.drafted += len(draft)
        stats.accepted += n_accepted
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
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
