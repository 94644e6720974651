"""The systems a bench run compares, by name.

    baseline        the oracle alone through localspec (Engine(oracle, None)): the reference
    kN              localspec, the draft model alone, fixed draft length N (k2, k4, k8, ...)
    kN+lookup       localspec, the draft model and prompt lookup, fixed draft length N (the lookup's
                    tokens when it finds some, the draft model's otherwise)
    adaptive        localspec's default: the draft model and prompt lookup, each step's source and
                    length chosen from measured costs and acceptance (`hybrid` is another name for it)
    model           localspec, the draft model alone (--no-lookup), adaptive draft length
    lookup          localspec, prompt lookup (n-gram) drafting, no draft model (adaptive length)
    lookup-kN       localspec, prompt lookup, fixed draft length N
    llama.cpp       llama.cpp's C++ llama-speculative-simple with the same models, K = 8 (the anchor)
    llama.cpp-kN    the same with K = N
    llama.cpp-spec  llama.cpp's C++ llama-speculative (K = 8; llama.cpp-spec-kN for another K)
    llama.cpp-ngram llama.cpp's C++ prompt lookup: llama-speculative-simple --spec-type ngram-simple, no
                    draft model, its defaults (a 12-token match, up to 48 drafted); llama.cpp-ngram-kN
                    drafts up to N
    llama.cpp-grid  shorthand for the anchor at each of its plausible best flags: K = 4, 8, 16, each with
                    flash attention auto (llama.cpp's default: on for the CPU) and off; the report names
                    the best of them

Any name takes a suffix `-fa-auto`, `-fa-on` or `-fa-off`: the attention kernel (localspec: its
--flash-attn, whose auto is off on a CPU; the anchor: its -fa, whose auto is llama.cpp's own).
Without one, each system runs its own default.
    lcp-lookup      llama-cpp-python's own prompt lookup (Llama(draft_model=LlamaPromptLookupDecoding)),
                    num_pred_tokens as its README recommends (2 on CPU, 10 with GPU offload);
                    lcp-lookup-kN for num_pred_tokens = N
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SYSTEMS = ("baseline", "k4", "k8", "k16", "k4+lookup", "k8+lookup", "k16+lookup", "adaptive", "model", "lookup", "llama.cpp-grid", "llama.cpp-ngram",
                   "llama.cpp-ngram-fa-off", "lcp-lookup")
ANCHOR_K = 8
ANCHOR_GRID = tuple(f"llama.cpp-k{k}{fa}" for k in (4, 8, 16) for fa in ("", "-fa-off"))
GROUPS = {"llama.cpp-grid": ANCHOR_GRID}
NGRAM_SIMPLE_M = 48  # llama.cpp's default --spec-ngram-simple-size-m

LOCALSPEC = "localspec"
LLAMA_CPP = "llama.cpp"
LLAMA_CPP_PYTHON = "llama-cpp-python"


@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str  # LOCALSPEC | LLAMA_CPP | LLAMA_CPP_PYTHON
    description: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def uses_draft_model(self) -> bool:
        return uses_draft_model(self.kind, self.params)

    @property
    def is_baseline(self) -> bool:
        return self.name == "baseline"

    @property
    def is_anchor(self) -> bool:
        """llama.cpp's own speculative decoding with a draft model (not its prompt lookup)."""
        return self.kind == LLAMA_CPP and not self.params.get("spec_type")

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description, "params": dict(self.params)}


def uses_draft_model(kind: str, params: dict[str, Any]) -> bool:
    """Whether a system runs a draft model (the anchor does, unless it drafts by n-gram lookup)."""
    return params.get("draft") == "model" or (kind == LLAMA_CPP and not params.get("spec_type"))


def parse_system(name: str) -> SystemSpec:
    n = name.strip()
    if m := re.fullmatch(r"(.+)-fa-(auto|on|off)", n):
        spec = _parse(m.group(1))
        if spec.kind == LLAMA_CPP_PYTHON:
            raise ValueError(f"{name}: llama-cpp-python's lookup runs with its own settings (no -fa suffix)")
        if spec.is_baseline:
            raise ValueError(f"{name}: the baseline runs localspec's default kernel (the same rule as every "
                             "localspec system); compare kernels with e.g. adaptive-fa-on")
        who = "llama.cpp's -fa" if spec.kind == LLAMA_CPP else "--flash-attn"
        return SystemSpec(n, spec.kind, f"{spec.description}, flash attention {m.group(2)} ({who})",
                          {**spec.params, "flash_attn": m.group(2)})
    return _parse(n)


def _parse(n: str) -> SystemSpec:
    if n == "baseline":
        return SystemSpec(n, LOCALSPEC, "the oracle alone (localspec, no draft)", {"draft": None})
    if m := re.fullmatch(r"k(\d+)", n):
        k = _k(m, n)
        return SystemSpec(n, LOCALSPEC, f"localspec, draft model alone, fixed K={k}",
                          {"draft": "model", "draft_length": k, "lookup": False})
    if m := re.fullmatch(r"k(\d+)\+lookup", n):
        k = _k(m, n)
        return SystemSpec(n, LOCALSPEC, f"localspec, draft model and prompt lookup, fixed K={k}",
                          {"draft": "model", "draft_length": k, "lookup": True})
    if n in ("adaptive", "hybrid"):  # what a user gets by default
        return SystemSpec(n, LOCALSPEC, "localspec's default: draft model and prompt lookup, adaptive K and source",
                          {"draft": "model", "draft_length": None, "lookup": True})
    if n == "model":
        return SystemSpec(n, LOCALSPEC, "localspec, draft model alone (--no-lookup), adaptive K",
                          {"draft": "model", "draft_length": None, "lookup": False})
    if n == "lookup":
        return SystemSpec(n, LOCALSPEC, "localspec, prompt lookup (no draft model), adaptive K",
                          {"draft": "ngram", "draft_length": None})
    if m := re.fullmatch(r"lookup-k(\d+)", n):
        k = _k(m, n)
        return SystemSpec(n, LOCALSPEC, f"localspec, prompt lookup, fixed K={k}", {"draft": "ngram", "draft_length": k})
    if m := re.fullmatch(r"llama\.cpp(-spec)?(?:-k(\d+))?", n):
        k = _k(m, n, 2) if m.group(2) else ANCHOR_K
        binary = "llama-speculative" if m.group(1) else "llama-speculative-simple"
        return SystemSpec(n, LLAMA_CPP, f"llama.cpp C++ {binary}, K={k}", {"binary": binary, "k": k})
    if m := re.fullmatch(r"llama\.cpp-ngram(?:-k(\d+))?", n):
        k = _k(m, n) if m.group(1) else None
        return SystemSpec(n, LLAMA_CPP, f"llama.cpp C++ llama-speculative-simple, ngram-simple lookup, "
                          f"up to {k or NGRAM_SIMPLE_M} drafted",
                          {"binary": "llama-speculative-simple", "k": k, "spec_type": "ngram-simple"})
    if m := re.fullmatch(r"lcp-lookup(?:-k(\d+))?", n):
        k = _k(m, n) if m.group(1) else None
        desc = f"llama-cpp-python LlamaPromptLookupDecoding, num_pred_tokens={k if k else '2 (CPU) / 10 (GPU)'}"
        return SystemSpec(n, LLAMA_CPP_PYTHON, desc, {"num_pred_tokens": k, "max_ngram_size": 2})
    raise ValueError(f"unknown system {n!r} (known: baseline, kN, kN+lookup, adaptive (hybrid), model, lookup, lookup-kN, "
                     f"llama.cpp, llama.cpp-kN, llama.cpp-spec[-kN], llama.cpp-ngram[-kN], lcp-lookup[-kN])")


def _k(m: re.Match, name: str, group: int = 1) -> int:
    k = int(m.group(group))
    if not 1 <= k <= 64:
        raise ValueError(f"{name}: the draft length must be between 1 and 64")
    return k


def parse_systems(names: str | list[str] | tuple[str, ...] | None) -> list[SystemSpec]:
    """Parse a comma-separated list (or a list); the baseline is always included, first."""
    if names is None:
        names = list(DEFAULT_SYSTEMS)
    elif isinstance(names, str):
        names = [s for s in names.split(",") if s.strip()]
    names = [n for name in names for n in GROUPS.get(name.strip(), (name,))]
    specs, seen = [], set()
    for s in ["baseline", *names]:
        spec = parse_system(s)
        if spec.name not in seen:
            seen.add(spec.name)
            specs.append(spec)
    return specs
