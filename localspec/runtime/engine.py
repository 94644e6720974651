"""The engine: the API a caller generates through (`generate`, `stream`, `prepare`), over four rooms.

- `runtime.slots.Slots`: the slots of both contexts, and the prefix cache that fills them
- `runtime.step.Step`: one pass, plan -> execute, which returns what happened
- `runtime.apply.Apply`: where that lands on the requests (history, outbox, stats, learning)
- `runtime.learning.Learner`: the length policy, its stores, and what the shared costs learn

and the `runtime.scheduler.Scheduler`, which decides who runs and changes a request's status. The
CLI, the server and a batch file's runner are thin layers over this API.
"""

from __future__ import annotations

import logging
import numbers
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from localspec.runtime import chat
from localspec.constraints import ConstraintWalk
from localspec.runtime.learning import CostBook, Learner
from localspec.runtime.factory import (DEFAULT_DRAFT_MAX, DEFAULT_P_MIN, LOOKUP_DRAFT_MAX, NGRAM, Parts, build,  # noqa: F401
                      default_policy)
from localspec.llama.context import Detokenizer, LlamaContext, LlamaModel, on_local_gpu
from localspec.options import GenerationOptions, OptionError
from localspec.outputs import Chunk, Result, Stats, TokenLogprob
from localspec.speculative.policy import LengthPolicy, Regime
from localspec.speculative.proposers import DEVICE_TOP_K, Proposer, draft_model_of
from localspec.runtime.apply import Apply
from localspec.runtime.calibrate import PICKS_LENGTH, draft_picks_faster, measure, on_a_passing_thread
from localspec.runtime.prompt_cache import PromptCache
from localspec.runtime.slots import Slots
from localspec.runtime.step import Step, text_and_bytes
from localspec.speculative.suffix import SuffixPools
from localspec.speculative.sampling import seed_key
from localspec.runtime.scheduler import Scheduler
from localspec.runtime.sequence import PromptTooLongError, Request, Seq, Status, StepOutcome  # noqa: F401 (callers import these from here too)
from localspec.runtime.text import TextStream

log = logging.getLogger("localspec.runtime.engine")

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]  # text, chat messages, or token ids


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
                   prompt_cache: PromptCache | None = None, calibrate: bool = False,
                   clock: Callable[[], float] | None = None) -> "Engine":
        """An engine over parts built elsewhere: the oracle's context (its `model` is the oracle
        model), an optional proposer (and the draft context it drafts on, if any), a length
        policy (default: none drafted without a proposer, else adaptive) and where the policy's
        learned state is kept (default: nowhere); `suffix`: the suffix cache's pools a
        `SuffixProposer` reads, which finished requests add to; `prompt_cache`: where finished
        sequences' oracle caches are kept for later prompts; `calibrate`: time the contexts' passes
        first (`runtime.calibrate`); `clock`: seconds for the step's timings (default
        time.perf_counter; a replay's passes only when it charges one). The caller owns the parts:
        `close()` leaves them open. Tests and the replay plug scripted contexts in here."""
        engine = cls.__new__(cls)
        engine._adopt(Parts(oracle=oracle, proposer=proposer, policy=policy, draft=draft, costs=costs, suffix=suffix,
                            prompt_cache=prompt_cache, calibrate=calibrate), owned=False, clock=clock)
        return engine

    def _adopt(self, parts: Parts, *, owned: bool, clock: Callable[[], float] | None = None) -> None:
        self._closers: list[Callable[[], None]] = parts.closers if owned else []
        self._warned_no_template = False
        self.oracle = parts.oracle
        self.oracle_model: LlamaModel = parts.oracle.model
        self.draft_ctx = parts.draft
        self.draft_model: LlamaModel | None = parts.draft.model if parts.draft is not None else None
        self.proposer = parts.proposer
        self.suffix = parts.suffix  # the suffix cache's pools (None: off)
        self.cost_store = parts.cost_store if parts.cost_store is not None else (
            parts.costs.store if parts.costs is not None else None)
        self.n_threads, self.gpu_layers = parts.n_threads, parts.gpu_layers
        self.rpc, self.draft_rpc = parts.rpc, parts.draft_rpc
        self.learner = Learner(parts.policy if parts.policy is not None else default_policy(parts.proposer), parts.costs)
        # greedy requests that need nothing but the oracle's picks (no logprobs, bias or grammar)
        # have llama.cpp pick them inside its graph where the oracle's output layer runs on a GPU
        # (every layer offloaded): one id a verified row crosses to the host, not its logits
        # (LlamaContext.sample_greedy). Exact: the same argmax, taken on the device. Not on the
        # CPU, where the graph's argmax of every row made a verify pass 3-14% slower than the
        # host's (SmolLM2 and Gemma 3 270M, 5 and 17 rows).
        backend_sampling = _offloaded(self.gpu_layers, self.oracle_model)
        # likewise a draft model's rows, where its output layer runs on a GPU: the device keeps each
        # row's top DEVICE_TOP_K logits, and the host picks from those (LlamaContext.sample_top), not
        # from the vocabulary's (on an H200 a drafted token had cost the host ~0.4 ms): where the
        # draft's proposals, timed both ways at load (tens of ms), run faster so
        draft_top = 0
        self.draft_picks_seconds: dict[str, float] = {}  # a draft proposal's seconds each way, if timed
        if (self.draft_ctx is not None and draft_model_of(self.proposer) is not None
                and _offloaded(parts.draft_gpu_layers, self.draft_model)):
            faster, self.draft_picks_seconds = on_a_passing_thread(  # (not this thread: see there)
                lambda: draft_picks_faster(self.draft_ctx, DEVICE_TOP_K))
            draft_top = DEVICE_TOP_K if faster else 0
            log.info("the draft picks from %s (a %d-token proposal: %s)",
                     f"its rows' top {DEVICE_TOP_K}, kept on the device" if faster else "whole rows", PICKS_LENGTH,
                     ", ".join(f"{name} {1000 * t:.2f} ms" for name, t in self.draft_picks_seconds.items()))
        self.n_slots = min(ctx.n_seq for ctx in self.contexts)  # sequences generated at once (`parallel`)
        self.slots = Slots(self.oracle, n_slots=self.n_slots, proposer=self.proposer,
                           prompt_cache=parts.prompt_cache, backend_sampling=backend_sampling,
                           draft=self.draft_ctx, draft_top=draft_top)
        self.stepper = Step(oracle=self.oracle, draft=self.draft_ctx, learner=self.learner, clock=clock)
        self.apply = Apply(model=self.oracle_model, oracle=self.oracle, draft=self.draft_ctx, learner=self.learner,
                           suffix=self.suffix, clock=clock)
        self.scheduler = Scheduler(self.slots, self.stepper, self.apply)
        if parts.calibrate:  # (where a model runs on a GPU: see runtime.calibrate)
            on_a_passing_thread(lambda: measure(self.policy, self.oracle, self.draft_ctx,
                                                backend_sampling=backend_sampling, draft_top=draft_top))

    @property
    def policy(self) -> LengthPolicy:
        """The length policy requests started now fork (`using_policy` swaps it for a while)."""
        return self.learner.policy

    @policy.setter
    def policy(self, policy: LengthPolicy) -> None:
        self.learner.policy = policy

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

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Engine":
        from localspec.models import Registry

        pair = Registry.load().pair(name)
        kwargs.setdefault("cross_tokenizer", pair.cross_tokenizer)
        return cls(pair.oracle, pair.draft, **kwargs)

    def close(self) -> None:
        if self.learner.costs is not None:
            self.learner.costs.flush()  # what the last request learned is on disk once this returns
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
        walk = ConstraintWalk.of(self.oracle_model, request.constraint) if request.constraint is not None else None
        speculative = request.speculative and self.proposer is not None
        regime = Regime.of(request.sampling, constrained=request.constraint is not None) if speculative else None
        stats = Stats(prompt_tokens=len(prompt_tokens), flash_attn=self.oracle.flash_attn,
                      draft_flash_attn=self.draft_ctx.flash_attn if self.draft_ctx is not None else None,
                      regime=regime.describe() if regime is not None else "")
        seed = request.sampling.seed
        detok = Detokenizer(self.oracle_model)
        text = TextStream(detok.feed, detok.flush, request.stop, labelled=request.sources)
        first = prompt_tokens[0]  # it has no logprob; the prompt's chunks' rows give the rest's
        return Seq(list(prompt_tokens), request, rng=np.random.default_rng(None if seed is None else seed_key(seed)),
                   text=text, stats=stats, policy=self.policy.fork(regime), speculative=speculative, walk=walk,
                   pool=pool, prompt_logprobs=None if request.prompt_logprobs is None else
                   [TokenLogprob(first, *text_and_bytes(self.oracle_model, first), None)])


def _offloaded(gpu_layers: int | None, model: LlamaModel | None) -> bool:
    """Whether `model` runs every layer, its output layer included, on a GPU of this machine."""
    layers = gpu_layers or 0
    return model is not None and on_local_gpu(layers) and (layers < 0 or layers > model.n_layer)
