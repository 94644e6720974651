"""Building an engine's parts from names: the models resolved (registry names fetched on first use)
and loaded, their contexts, the proposer, the length policy and where its learned costs are kept.

The engine runs whatever parts it is given (`Engine.from_parts`); `Engine(oracle, draft, ...)` is
`build(oracle, draft, ...)` handed to it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

from localspec.speculative.compat import check_compatible, first_difference
from localspec.options import DEFAULT_CTX
from localspec.runtime.learning import CostBook, CostStore, file_fingerprint, machine_identity
from localspec.llama.backend import default_threads
from localspec.llama.context import LlamaContext, LlamaModel, on_local_gpu, resolve_flash_attn
from localspec.speculative.policy import (LOOKUP_PRIORS, LOOKUP_RUNS, AdaptiveLength, FixedLength, HybridLength,
                                         LengthPolicy, LookupLength, learns)
from localspec.speculative.cross_tokenizer import CrossTokenizerProposer
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import DraftModelProposer, HybridProposer, Proposer
from localspec.runtime.prompt_cache import PromptCache
from localspec.speculative.suffix import SuffixPools, SuffixProposer

log = logging.getLogger("localspec.runtime.engine")

DEFAULT_DRAFT_MAX = 16
LOOKUP_TEXT_WEIGHT = 4.0  # tokens of the text at hand a lookup's estimates weigh (`Outlook.text_weight`, the `text_weight` of AdaptiveLength)
LOOKUP_DRAFT_MAX = 64  # prompt lookup drafts for free: a copied passage may be accepted 30+ tokens at a time
DEFAULT_P_MIN = 0.3  # measured on the default pair: acceptance 0.80 -> 0.91 at k=8, fewer wasted drafts
NGRAM = "ngram"  # draft=NGRAM: prompt lookup instead of a draft model


@dataclass
class Parts:
    """What an engine runs. `oracle`: the oracle's context (its `model` is the oracle model);
    `proposer` (None: the oracle alone) and `draft`, the draft context it drafts on, if any;
    `policy` (None: a default); `costs`: where the policy's learned state is kept between
    processes (None: nowhere). `closers` close what was built here, last built first."""

    oracle: LlamaContext
    proposer: Proposer | None = None
    policy: LengthPolicy | None = None
    draft: LlamaContext | None = None
    costs: CostBook | None = None
    cost_store: CostStore | None = None
    suffix: SuffixPools | None = None  # the suffix cache's pools, which every finished request adds to
    prompt_cache: PromptCache | None = None  # finished sequences' oracle caches, kept in host memory
    calibrate: bool = False  # time both models' passes before the first request (runtime.calibrate)
    closers: list[Callable[[], None]] = field(default_factory=list)
    n_threads: int = 0
    gpu_layers: int = 0
    draft_gpu_layers: int = 0
    rpc: tuple[str, ...] = ()
    draft_rpc: tuple[str, ...] = ()


def default_policy(proposer: Proposer | None, draft_max: int = DEFAULT_DRAFT_MAX, *,
                   lookup_max: int = LOOKUP_DRAFT_MAX, model_draft: bool = True,
                   cost_ratio: float = 0.5) -> LengthPolicy:
    """None drafted without a proposer, else the cost-aware adaptive length (up to `draft_max`; a
    hybrid proposer's lookup up to `lookup_max`). `model_draft` / `cost_ratio`: see AdaptiveLength
    (whether proposing runs a draft model; its first guess at a draft token's cost)."""
    if proposer is None:
        return FixedLength(0)
    suffix = isinstance(proposer, SuffixProposer)
    base = proposer.inner if suffix else proposer
    if base is None or isinstance(base, PromptLookupProposer):
        return lookup_policy(k_max=draft_max, lookup=base is not None, suffix=suffix)
    policy = AdaptiveLength(k_max=draft_max, model_draft=model_draft, draft_cost_ratio=cost_ratio)
    if isinstance(base, HybridProposer) or suffix:
        return hybrid_policy(policy, lookup_max=lookup_max, lookup=isinstance(base, HybridProposer), suffix=suffix)
    return policy


def lookup_adaptive(k_max: int, name: str = "prompt lookup") -> AdaptiveLength:
    """A model-free source's adaptive length (prompt lookup's, the suffix cache's): drafts that
    cost nothing to make, sized by their match."""
    return AdaptiveLength(k_max=k_max, model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS,
                          draft_cost_ratio=draft_cost_ratio(None, None), text_weight=LOOKUP_TEXT_WEIGHT, name=name)


def lookup_policy(*, k_max: int = LOOKUP_DRAFT_MAX, lookup: bool = True, suffix: bool = False) -> LookupLength:
    """The adaptive policy of model-free drafting alone: prompt lookup's and/or the suffix cache's
    (it sizes each draft once the match is known)."""
    return LookupLength(lookup_adaptive(k_max) if lookup else None,
                        lookup_adaptive(k_max, "suffix cache") if suffix else None)


def hybrid_policy(model: AdaptiveLength, *, lookup_max: int = LOOKUP_DRAFT_MAX, lookup: bool = True,
                  suffix: bool = False) -> HybridLength:
    """The adaptive policy of a draft model beside model-free sources (it chooses each step's
    source and length)."""
    return HybridLength(model, lookup_adaptive(lookup_max) if lookup else None,
                        lookup_adaptive(lookup_max, "suffix cache") if suffix else None)


def rpc_servers(value: str | Sequence[str] | None) -> tuple[str, ...]:
    from localspec.llama.rpc import parse_servers  # keeps the RPC module out of runs that do not use it

    return parse_servers(value) if value else ()


def kernel_identity(oracle_path, *, n_threads: int, gpu_layers: int, rpc: Sequence[str] = ()) -> dict:
    """The key of the attention kernel `localspec check` measured faster for an oracle here."""
    return {"model": file_fingerprint(oracle_path), "threads": n_threads, "gpu_layers": gpu_layers,
            **machine_identity(), **({"rpc": list(rpc)} if rpc else {})}


def draft_cost_ratio(oracle: LlamaModel | None, draft: LlamaModel | None) -> float:
    """A first guess at a draft token's cost in one-token oracle passes, until one is measured:
    between the ratio of the models' sizes (a pass that streams its weights from memory) and of
    their parameters (one that is compute-bound); prompt lookup (no draft model) costs next to nothing."""
    if draft is None or oracle is None:
        return 0.01
    ratio = ((draft.size_bytes / max(oracle.size_bytes, 1)) * (draft.n_params / max(oracle.n_params, 1))) ** 0.5
    return float(min(1.0, max(0.02, ratio)))


def build(oracle: str | os.PathLike, draft: str | os.PathLike | None = None, *,
          n_ctx: int = DEFAULT_CTX, n_batch: int = 512, n_threads: int | None = None, parallel: int = 1,
          gpu_layers: int = -1, draft_gpu_layers: int = -1, flash_attn: str = "auto",
          draft_length: int | None = None, draft_max: int | None = None,
          p_min: float = DEFAULT_P_MIN, lookup: bool = True, cross_tokenizer: bool = False,
          policy: LengthPolicy | None = None, cost_cache: bool = True,
          progress: Callable[[str], None] | None = None,
          rpc: str | Sequence[str] | None = None, draft_rpc: str | Sequence[str] | None = None,
          suffix_cache: int = 0, prompt_cache_mib: int = 0, calibrate: bool | None = None) -> Parts:
    """`oracle` / `draft`: a GGUF path or a model name from models.toml (fetched on first use);
    `draft` may also be "ngram" (prompt lookup, no model) or None (the oracle alone).
    `n_ctx`: the tokens each sequence may hold; `parallel`: sequences the contexts hold at once
    (requests generated together in one batch: the server's slots, a batch file's `--parallel`).
    `draft_length`: a fixed k; None chooses k per step from measured costs and acceptance
    (capped by `draft_max`: default 16 for a draft model, 64 for prompt lookup, whose drafts cost
    nothing to make). `p_min`: the draft stops when its top probability falls below it.
    `lookup` (with a draft model): prompt lookup beside it, each step drafting from whichever
    promises more tokens per second (`policy.HybridLength`); False: the draft model alone.
    `cross_tokenizer`: allow a draft whose vocabulary differs (re-tokenizes text between them).
    `flash_attn`: "auto" (see `llama.resolve_flash_attn`: off on a CPU, on with GPU offload,
    unless `localspec check` measured otherwise here), "on" or "off"; for both models.
    `policy`: the length policy (default: as `draft_length` says). `cost_cache`: keep the
    adaptive policy's fitted costs and acceptance in the cache, so the next process starts from them.
    `rpc`: llama.cpp rpc-servers ("HOST:PORT,..." or a list) the oracle's layers are split over,
    with this machine (see `localspec.llama.rpc`); `draft_rpc`: the same for the draft (default: local).
    Each server is checked before anything loads.
    `suffix_cache`: tokens of earlier requests' text kept per pool to draft from (see
    `localspec.speculative.suffix`; the command line's default is DEFAULT_SUFFIX_CACHE); 0, the
    default here: none, so an engine's drafts depend on the request alone.
    `prompt_cache_mib`: MiB of host memory that keep the oracle's cache of finished sequences a
    new request overwrites, for later prompts that start the same way (see
    `localspec.runtime.prompt_cache`; the command line's default is DEFAULT_PROMPT_CACHE_MIB); 0,
    the default here: none.
    `calibrate`: time both models' passes at load, for the costs the policy has not learned yet
    (`localspec.runtime.calibrate`); None: where a model runs on a local GPU (passes of a few ms,
    whose shape is not a CPU's), not on a CPU (its first steps teach the costs)."""
    loader = _Loader(n_threads or default_threads(), rpc_servers(rpc), rpc_servers(draft_rpc), progress,
                     CostStore() if cost_cache else None)
    try:
        parts = loader.load(oracle, draft, n_ctx=n_ctx, n_batch=n_batch, n_seq=parallel, gpu_layers=gpu_layers,
                            draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn, p_min=p_min, lookup=lookup,
                            cross_tokenizer=cross_tokenizer)
    except BaseException:
        loader.close()
        raise
    _add_caches(parts, suffix_cache=suffix_cache, prompt_cache_mib=prompt_cache_mib)
    parts.policy = policy if policy is not None else _length_policy(parts, draft, draft_length, draft_max)
    parts.calibrate = (on_local_gpu(gpu_layers) or parts.draft is not None and on_local_gpu(draft_gpu_layers)
                       if calibrate is None else calibrate)
    if loader.cost_store is not None and learns(parts.policy):
        parts.costs = CostBook(loader.cost_store, loader.cost_identities(parts, gpu_layers=gpu_layers,
                                                                         draft_gpu_layers=draft_gpu_layers,
                                                                         p_min=p_min))
    return parts


def _add_caches(parts: Parts, *, suffix_cache: int, prompt_cache_mib: int) -> None:
    """The prompt cache and the suffix cache `build` was asked for (0: none); the suffix cache's
    proposer wraps the one built."""
    if prompt_cache_mib > 0:
        parts.prompt_cache = PromptCache(prompt_cache_mib << 20)
    if parts.proposer is not None and suffix_cache > 0:
        parts.suffix = SuffixPools(suffix_cache)
        parts.proposer = SuffixProposer(parts.proposer, parts.suffix, is_end=parts.oracle.model.is_eog)


def _length_policy(parts: Parts, draft: str | os.PathLike | None, draft_length: int | None,
                   draft_max: int | None) -> LengthPolicy:
    """The length policy `build`'s arguments ask for: `draft_length` tokens a step, else the default
    adaptive policy, capped by `draft_max` (None: 64 for prompt lookup, 16 for a draft model)."""
    lookup_max = LOOKUP_DRAFT_MAX if draft_max is None else draft_max
    if draft_max is None:
        draft_max = LOOKUP_DRAFT_MAX if draft == NGRAM else DEFAULT_DRAFT_MAX
    if parts.proposer is not None and draft_length is not None:
        return FixedLength(min(draft_length, draft_max))
    return default_policy(parts.proposer, draft_max, lookup_max=lookup_max, model_draft=parts.draft is not None,
                          cost_ratio=draft_cost_ratio(parts.oracle.model, parts.draft.model if parts.draft else None))


class _Loader:
    """Loads the models and contexts of one engine, keeping what it built to close it."""

    def __init__(self, n_threads: int, rpc: tuple[str, ...], draft_rpc: tuple[str, ...],
                 progress: Callable[[str], None] | None, cost_store: CostStore | None) -> None:
        self.n_threads, self.rpc, self.draft_rpc = n_threads, rpc, draft_rpc
        self.progress = progress
        self.cost_store = cost_store
        self.closers: list[Callable[[], None]] = []

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()

    def _own(self, obj):
        self.closers.append(obj.close)
        return obj

    def load(self, oracle, draft, *, n_ctx: int, n_batch: int, n_seq: int, gpu_layers: int, draft_gpu_layers: int,
             flash_attn: str, p_min: float, lookup: bool, cross_tokenizer: bool) -> Parts:
        from localspec.models import Registry  # models pulls in the registry file; keep it lazy

        if self.rpc or self.draft_rpc:
            from localspec.llama.rpc import check_servers

            check_servers(self.rpc + tuple(s for s in self.draft_rpc if s not in self.rpc))
        registry = Registry.load()
        oracle_path = registry.resolve(str(oracle), progress=self.progress)
        draft_path = registry.resolve(str(draft), progress=self.progress) if draft not in (None, NGRAM) else None
        # the two models load at once (llama.cpp releases the GIL): a one-shot run starts sooner
        with ThreadPoolExecutor(max_workers=1) as pool:
            loading = pool.submit(self._load_draft, draft_path, gpu_layers=draft_gpu_layers, flash_attn=flash_attn,
                                  n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq) if draft_path is not None else None
            try:
                oracle_model = self._own(self._load_model(oracle_path, gpu_layers, self.rpc, "oracle"))
                oracle_fa = resolve_flash_attn(flash_attn, n_gpu_layers=gpu_layers,
                                               measured=self._measured_kernel(oracle_path, gpu_layers))
                oracle_ctx = self._own(LlamaContext(oracle_model, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq,
                                                    n_threads=self.n_threads, flash_attn=oracle_fa))
            finally:
                if loading is not None:
                    wait([loading])  # its own failure is raised below, after the oracle's
        parts = Parts(oracle=oracle_ctx, cost_store=self.cost_store, closers=self.closers, n_threads=self.n_threads,
                      gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, rpc=self.rpc,
                      draft_rpc=self.draft_rpc)
        if draft == NGRAM:
            parts.proposer = PromptLookupProposer(is_end=parts.oracle.model.is_eog)
        elif loading is not None:
            parts.draft = loading.result()
            parts.proposer = self._draft_model_proposer(oracle_ctx, parts.draft, p_min=p_min,
                                                        cross_tokenizer=cross_tokenizer,
                                                        local_cpu=not (self.rpc or self.draft_rpc
                                                                       or on_local_gpu(draft_gpu_layers)))
            if lookup:
                parts.proposer = HybridProposer(PromptLookupProposer(is_end=parts.oracle.model.is_eog), parts.proposer)
        return parts

    def _load_draft(self, path, *, gpu_layers: int, flash_attn: str, n_ctx: int, n_batch: int,
                    n_seq: int) -> LlamaContext:
        model = self._own(self._load_model(path, gpu_layers, self.draft_rpc, "draft"))
        return self._own(LlamaContext(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=self.n_threads, n_seq=n_seq,
                                      flash_attn=resolve_flash_attn(flash_attn, n_gpu_layers=gpu_layers)))

    def _load_model(self, path, gpu_layers: int, rpc: tuple[str, ...], role: str) -> LlamaModel:
        if not rpc:
            return LlamaModel(path, n_gpu_layers=gpu_layers)
        from localspec.llama.rpc import place

        placement = place(path, rpc, n_gpu_layers=gpu_layers)
        if self.progress is not None:
            self.progress(f"{role} layers: {placement.summary}")
        model = LlamaModel(path, n_gpu_layers=placement.n_gpu_layers, devices=placement.devices,
                           tensor_split=placement.tensor_split)
        model.placement = placement
        return model

    def _draft_model_proposer(self, oracle: LlamaContext, draft: LlamaContext, *, p_min: float,
                              cross_tokenizer: bool, local_cpu: bool = True) -> Proposer:
        o, d = oracle.model, draft.model
        difference = first_difference(o, d)
        if difference is not None and not cross_tokenizer:
            check_compatible(o, d)  # raises, naming the difference
        # a same-vocabulary draft drafts over the oracle's vocabulary (their sizes may differ a little);
        # a cross-tokenizer one over its own
        # on a CPU a draft evaluates a prompt slowly (~3 ms a token for a small Q4_1 one): one laid
        # out like the oracle copies the oracle's cache instead. Not where a GPU evaluates it quicker
        # than a copy, nor over RPC (an oracle's or a draft's cache on a server is read or written a row
        # at a time, a round trip each: measured, seconds a copy through a 5 ms link, speculation at 0.2x)
        proposer = DraftModelProposer(draft, p_min=p_min, n_vocab=o.n_vocab if difference is None else None,
                                      cache_source=oracle if difference is None and local_cpu else None)
        if d.size_bytes >= o.size_bytes or d.n_params > o.n_params:
            log.warning("the draft %s (%.0f MB, %.0fM params) is not smaller than the oracle %s (%.0f MB, %.0fM "
                        "params): speculation will likely be slower than the oracle alone",
                        d.path.name, d.size_bytes / 1e6, d.n_params / 1e6, o.path.name, o.size_bytes / 1e6,
                        o.n_params / 1e6)
        if difference is None:
            return proposer
        log.info("draft and oracle vocabularies differ (%s): drafting through text", difference)
        return CrossTokenizerProposer(proposer, oracle=o, draft=d)

    # -- costs kept between processes

    def _measured_kernel(self, oracle_path, gpu_layers: int) -> str | None:
        """The attention kernel `localspec check` measured faster for this oracle here, if any."""
        if self.cost_store is None:
            return None
        identity = kernel_identity(oracle_path, n_threads=self.n_threads, gpu_layers=gpu_layers, rpc=self.rpc)
        state = self.cost_store.load("kernel", identity)
        return state.get("flash_attn") if state else None

    def cost_identities(self, parts: Parts, *, gpu_layers: int, draft_gpu_layers: int,
                        p_min: float) -> dict[str, dict]:
        """What each kind of learned state depends on (its key in the cost store)."""
        machine = machine_identity()
        oracle = file_fingerprint(parts.oracle.model.path)
        draft = file_fingerprint(parts.draft.model.path) if parts.draft is not None else None
        suffix = isinstance(parts.proposer, SuffixProposer)
        base = parts.proposer.inner if suffix else parts.proposer
        kind = base.describe() if base is not None else "model"
        hybrid = kind == "hybrid"
        if hybrid:  # its draft model costs and is judged as it would be alone; its lookup apart
            kind = base.model.describe()
        draft_identity = {"proposer": kind, "model": draft, "oracle": oracle if kind != "model" else None,
                          "threads": self.n_threads, "gpu_layers": draft_gpu_layers, "p_min": p_min,
                          "flash_attn": parts.draft.flash_attn if parts.draft is not None else None, **machine,
                          **({"rpc": list(self.draft_rpc)} if self.draft_rpc else {})}
        return {
            # not the context's size: a pass costs what the tokens it attends to cost (the fit's context
            # term), and `generate` sizes the context to each prompt, so a key with it kept no costs
            # from one run to the next
            "verify": {"model": oracle, "threads": self.n_threads, "gpu_layers": gpu_layers,
                       "flash_attn": parts.oracle.flash_attn, **machine,
                       **({"rpc": list(self.rpc)} if self.rpc else {})},
            "draft": draft_identity,
            "draft_round": draft_identity,
            "acceptance": {"proposer": kind, "oracle": oracle, "draft": draft, "p_min": p_min},
            # drafting against plain batched decoding (`batch_judge`): both models' costs, and the drafts'
            "batch": {"verify": {"model": oracle, "threads": self.n_threads, "gpu_layers": gpu_layers,
                                 "flash_attn": parts.oracle.flash_attn, **machine}, "draft": draft_identity},
            **({"lookup_acceptance": {"proposer": "hybrid-lookup", "oracle": oracle}} if hybrid else {}),
            **({"suffix_acceptance": {"proposer": "suffix", "oracle": oracle}} if suffix else {}),
        }
