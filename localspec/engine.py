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
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import chat, constraints
from .acceptance import accept_draft, accept_greedy
from .compat import check_compatible, first_difference
from .constraints import Constraint, ConstraintWalk
from .costs import CostStore, file_fingerprint, machine_identity
from .llama import Detokenizer, LlamaContext, LlamaModel, default_threads, resolve_flash_attn
from .options import OPTIONS, GenerationOptions
from .outputs import Chunk, Result, Stats, StepRecord, TokenLogprob, TopLogprob
from .policy import AdaptiveLength, FixedLength, LengthPolicy
from .proposers import (EMPTY_DRAFT, CrossTokenizerProposer, Draft, DraftModelProposer, HybridProposer,
                        PromptLookupProposer, Proposer, propose)
from .sampling import (SamplingParams, coupled_choice, greedy_argmax, log_softmax, logits_to_probs, mask_logits,
                       seed_key, top_ids)
from .text import TextStream

log = logging.getLogger("localspec.engine")

Prompt = str | Sequence[Mapping[str, Any]]

DEFAULT_DRAFT_MAX = 16
LOOKUP_DRAFT_MAX = 64  # prompt lookup drafts for free: a copied passage may be accepted 30+ tokens at a time
DEFAULT_P_MIN = 0.3  # measured on the default pair: acceptance 0.80 -> 0.91 at k=8, fewer wasted drafts
NGRAM = "ngram"  # draft=NGRAM: prompt lookup instead of a draft model


def rpc_servers(value: str | Sequence[str] | None) -> tuple[str, ...]:
    from .rpc import parse_servers  # keeps the RPC module out of runs that do not use it

    return parse_servers(value) if value else ()


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
    """An oracle model, optionally a draft model, and the loop that runs them.

    `oracle` / `draft`: a GGUF path or a model name from models.toml (fetched on first use).
    Not thread-safe: one generation at a time (the server runs a single worker).
    """

    def __init__(self, oracle: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                 n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 gpu_layers: int = -1, draft_gpu_layers: int = -1, flash_attn: str = "auto",
                 draft_length: int | None = None, draft_max: int | None = None,
                 p_min: float = DEFAULT_P_MIN, lookup: bool = False, cross_tokenizer: bool = False,
                 policy: LengthPolicy | None = None, cost_cache: bool = True,
                 progress: Callable[[str], None] | None = None,
                 rpc: str | Sequence[str] | None = None, draft_rpc: str | Sequence[str] | None = None) -> None:
        """`draft`: a model (name or path), "ngram" (prompt lookup, no model) or None (oracle alone).
        `draft_length`: a fixed k; None chooses k per step from measured costs and acceptance
        (capped by `draft_max`: default 16 for a draft model, 64 for prompt lookup, whose drafts cost
        nothing to make). `p_min`: the draft stops when its top probability falls below it.
        `lookup`: try prompt lookup first and the draft model when it finds nothing.
        `cross_tokenizer`: allow a draft whose vocabulary differs (re-tokenizes text between them).
        `flash_attn`: "auto" (see `llama.resolve_flash_attn`: off on a CPU, on with GPU offload,
        unless `localspec check` measured otherwise here), "on" or "off"; for both models.
        `cost_cache`: keep the adaptive policy's fitted costs and acceptance in the cache, so the
        next process starts from them.
        `rpc`: llama.cpp rpc-servers ("HOST:PORT,..." or a list) the oracle's layers are split over,
        with this machine (see `localspec.rpc`); `draft_rpc`: the same for the draft (default: local).
        Each server is checked before anything loads."""
        from .models import Registry  # models pulls in the registry file; keep it lazy

        self._closers: list[Callable[[], None]] = []
        self._warned_no_template = False
        self.n_threads = n_threads or default_threads()
        self.gpu_layers = gpu_layers
        self._cost_keys: dict[str, dict] = {}
        self.cost_store = CostStore() if cost_cache else None
        self.rpc, self.draft_rpc = rpc_servers(rpc), rpc_servers(draft_rpc)
        self._progress = progress
        try:
            if self.rpc or self.draft_rpc:
                from .rpc import check_servers

                check_servers(self.rpc + tuple(s for s in self.draft_rpc if s not in self.rpc))
            registry = Registry.load()
            oracle_path = registry.resolve(str(oracle), progress=progress)
            draft_path = registry.resolve(str(draft), progress=progress) if draft not in (None, NGRAM) else None
            self.draft_model: LlamaModel | None = None
            self.draft_ctx: LlamaContext | None = None
            # the two models load at once (llama.cpp releases the GIL): a one-shot run starts sooner
            with ThreadPoolExecutor(max_workers=1) as pool:
                loading = pool.submit(self._load_draft, draft_path, gpu_layers=draft_gpu_layers, flash_attn=flash_attn,
                                      n_ctx=n_ctx, n_batch=n_batch) if draft_path is not None else None
                try:
                    self.oracle_model = self._own(self._load_model(oracle_path, gpu_layers, self.rpc, "oracle"))
                    oracle_fa = resolve_flash_attn(flash_attn, n_gpu_layers=gpu_layers,
                                                   measured=self._measured_kernel(oracle_path, gpu_layers))
                    self.oracle = self._own(LlamaContext(self.oracle_model, n_ctx=n_ctx, n_batch=n_batch,
                                                         n_threads=self.n_threads, flash_attn=oracle_fa))
                finally:
                    if loading is not None:
                        wait([loading])  # its own failure is raised below, after the oracle's
            self.proposer: Proposer | None = None
            if draft == NGRAM:
                self.proposer = PromptLookupProposer()
            elif loading is not None:
                self.draft_model, self.draft_ctx = loading.result()
                self.proposer = self._draft_model_proposer(p_min=p_min, cross_tokenizer=cross_tokenizer)
                if lookup:
                    self.proposer = HybridProposer(PromptLookupProposer(), self.proposer)
        except BaseException:
            self.close()
            raise
        if draft_max is None:
            draft_max = LOOKUP_DRAFT_MAX if draft == NGRAM else DEFAULT_DRAFT_MAX
        if policy is None:
            if self.proposer is None:
                policy = FixedLength(0)
            elif draft_length is not None:
                policy = FixedLength(min(draft_length, draft_max))
            else:
                policy = AdaptiveLength(k_max=draft_max, draft_cost_ratio=self._draft_cost_ratio(),
                                        model_draft=self.draft_model is not None)
        self.policy: LengthPolicy = policy
        if self.cost_store is not None and isinstance(policy, AdaptiveLength):
            self._cost_keys = self._cost_identities(gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers,
                                                    p_min=p_min)
            self._load_costs(policy)

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
        engine.n_threads = 0
        engine.gpu_layers = 0
        engine.cost_store = None
        engine._cost_keys = {}
        engine.rpc = engine.draft_rpc = ()
        engine.oracle = oracle
        engine.oracle_model = oracle.model
        engine.draft_ctx = draft
        engine.draft_model = draft.model if draft is not None else None
        engine.proposer = proposer
        engine.policy = policy if policy is not None else (
            FixedLength(0) if proposer is None else AdaptiveLength(k_max=DEFAULT_DRAFT_MAX))
        return engine

    def _load_draft(self, path, *, gpu_layers: int, flash_attn: str, n_ctx: int,
                    n_batch: int) -> tuple[LlamaModel, LlamaContext]:
        model = self._own(self._load_model(path, gpu_layers, self.draft_rpc, "draft"))
        ctx = self._own(LlamaContext(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=self.n_threads,
                                     flash_attn=resolve_flash_attn(flash_attn, n_gpu_layers=gpu_layers)))
        return model, ctx

    def _load_model(self, path, gpu_layers: int, rpc: tuple[str, ...], role: str) -> LlamaModel:
        if not rpc:
            return LlamaModel(path, n_gpu_layers=gpu_layers)
        from .rpc import place

        placement = place(path, rpc, n_gpu_layers=gpu_layers)
        if self._progress is not None:
            self._progress(f"{role} layers: {placement.summary}")
        model = LlamaModel(path, n_gpu_layers=placement.n_gpu_layers, devices=placement.devices,
                           tensor_split=placement.tensor_split)
        model.placement = placement
        return model

    def _draft_model_proposer(self, *, p_min: float, cross_tokenizer: bool) -> Proposer:
        assert self.draft_model is not None and self.draft_ctx is not None
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

    # -- costs kept between processes

    def _draft_cost_ratio(self) -> float:
        """A first guess at a draft token's cost in one-token oracle passes, until one is measured:
        between the ratio of the models' sizes (a pass that streams its weights from memory) and of
        their parameters (one that is compute-bound); prompt lookup costs next to nothing."""
        if self.draft_model is None:
            return 0.01
        o, d = self.oracle_model, self.draft_model
        ratio = ((d.size_bytes / max(o.size_bytes, 1)) * (d.n_params / max(o.n_params, 1))) ** 0.5
        return float(min(1.0, max(0.02, ratio)))

    def _proposer_kind(self) -> str:
        p = self.proposer
        if isinstance(p, HybridProposer):
            return "hybrid"
        if isinstance(p, CrossTokenizerProposer):
            return "cross-tokenizer"
        return "lookup" if isinstance(p, PromptLookupProposer) else "model"

    def _measured_kernel(self, oracle_path, gpu_layers: int) -> str | None:
        """The attention kernel `localspec check` measured faster for this oracle here, if any."""
        if self.cost_store is None:
            return None
        state = self.cost_store.load("kernel", self.kernel_identity(oracle_path, gpu_layers))
        return state.get("flash_attn") if state else None

    def kernel_identity(self, oracle_path, gpu_layers: int) -> dict:
        return {"model": file_fingerprint(oracle_path), "threads": self.n_threads, "gpu_layers": gpu_layers,
                **machine_identity(), **({"rpc": list(self.rpc)} if self.rpc else {})}

    def _cost_identities(self, *, gpu_layers: int, draft_gpu_layers: int, p_min: float) -> dict[str, dict]:
        machine = machine_identity()
        oracle = file_fingerprint(self.oracle_model.path)
        draft = file_fingerprint(self.draft_model.path) if self.draft_model is not None else None
        kind = self._proposer_kind()
        return {
            "verify": {"model": oracle, "threads": self.n_threads, "gpu_layers": gpu_layers, "n_ctx": self.n_ctx,
                       "flash_attn": self.oracle.flash_attn, **machine,
                       **({"rpc": list(self.rpc)} if self.rpc else {})},
            "draft": {"proposer": kind, "model": draft, "oracle": oracle if kind != "model" else None,
                      "threads": self.n_threads, "gpu_layers": draft_gpu_layers, "p_min": p_min,
                      "flash_attn": self.draft_ctx.flash_attn if self.draft_ctx is not None else None, **machine,
                      **({"rpc": list(self.draft_rpc)} if self.draft_rpc else {})},
            "acceptance": {"proposer": kind, "oracle": oracle, "draft": draft, "p_min": p_min},
        }

    def _load_costs(self, policy: AdaptiveLength) -> None:
        assert self.cost_store is not None
        for kind, target in (("verify", policy.verify_cost), ("draft", policy.draft_cost)):
            state = self.cost_store.load(kind, self._cost_keys[kind])
            try:
                if state:
                    target.load(state)
            except (KeyError, TypeError, ValueError) as e:
                log.debug("ignoring the saved %s costs: %s", kind, e)
        state = self.cost_store.load("acceptance", self._cost_keys["acceptance"])
        try:
            if state:
                policy.load_acceptance_state(state)
        except (KeyError, TypeError, ValueError) as e:
            log.debug("ignoring the saved acceptance: %s", e)

    def save_costs(self) -> None:
        """Write the adaptive policy's fitted costs and acceptance to the cache (after each request)."""
        policy = self.policy
        if self.cost_store is None or not self._cost_keys or not isinstance(policy, AdaptiveLength):
            return
        if policy.verify_cost.ready:
            self.cost_store.save("verify", self._cost_keys["verify"], policy.verify_cost.state())
        if policy.draft_cost.ready:
            self.cost_store.save("draft", self._cost_keys["draft"], policy.draft_cost.state())
        if policy.trials:
            self.cost_store.save("acceptance", self._cost_keys["acceptance"], policy.acceptance_state())

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
        return self._run(list(prompt_tokens), request, walk)

    def constraint_walk(self, constraint: Constraint) -> ConstraintWalk:
        """A matcher for one generation under `constraint` over the oracle's vocabulary. Raises
        ConstraintError when llguidance cannot compile it (the vocabulary is read on first use)."""
        return ConstraintWalk(constraints.tokenizer_for(self.oracle_model), constraint, self.oracle_model.n_vocab)

    def _run(self, history: list[int], request: Request, walk: ConstraintWalk | None = None) -> Iterator[Chunk]:
        stats = Stats(prompt_tokens=len(history), flash_attn=self.oracle.flash_attn,
                      draft_flash_attn=self.draft_ctx.flash_attn if self.draft_ctx is not None else None)
        t_start = time.perf_counter()
        seed = request.sampling.seed
        rng = np.random.default_rng(None if seed is None else seed_key(seed))
        detok = Detokenizer(self.oracle_model)
        text = TextStream(detok.feed, detok.flush, request.stop)
        speculative = request.speculative and self.proposer is not None
        if speculative:
            self.policy.start_request()
        self._prefill(history, stats, speculative=speculative)
        stats.prompt_time = time.perf_counter() - t_start

        finish = None
        while finish is None:
            # the first token comes from a plain oracle step, as fast as the oracle alone gives it;
            # the draft evaluates the prompt in the next step
            limit = self._draft_limit(history, request, request.max_tokens - stats.completion_tokens) \
                if stats.steps else 0
            out, logprobs = self._step(history, limit, request, rng, stats, walk)
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
                    self.save_costs()
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

    def _prefill(self, history: list[int], stats: Stats, *, speculative: bool) -> None:
        """Bring the oracle's cache to history[:-1], reusing what it already holds. The draft is
        not run here: its first proposal evaluates what it has not seen (all of the prompt while
        drafting pays; a probe's window of it while the policy is idle). `speculative`: whether
        this request drafts at all."""
        _, n_eval = self.oracle.sync(history[:-1], n_logits=0)
        stats.prompt_tokens_evaluated = n_eval + 1  # the last prompt token is evaluated in step one
        if speculative:
            self.proposer.start(catch_up=not self.policy.idle)

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
              stats: Stats, walk: ConstraintWalk | None = None) -> tuple[list[int], list[TokenLogprob] | None]:
        """One propose -> verify -> accept -> rollback step. Returns the tokens it yields (accepted
        draft tokens, then a recovered or bonus token) and, if asked, their oracle logprobs.
        `walk`: the grammar's matcher, holding every emitted token (the draft pushes its own)."""
        context = len(history) - 1  # the oracle holds all but the last token
        t0 = time.perf_counter()
        k = self.policy.draft_length(limit, context) if limit > 0 else 0
        if k > 0 and self.policy.consume_catch_up():  # a re-try: the draft sees all the text again
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
                          context=context, draft_evaluated=draft.evaluated, draft_prompt_time=draft.prompt_time)
        if request.speculative:  # a request that does not draft teaches the policy nothing
            self.policy.update(step)
        stats.records.append(step)
        stats.steps += 1
        stats.drafted += step.drafted
        stats.accepted += step.accepted
        stats.draft_time += step.draft_time
        stats.draft_prompt_time += step.draft_prompt_time
        stats.verify_time += step.verify_time
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
