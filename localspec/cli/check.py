"""`localspec check`: is this draft worth it for this oracle, on this machine?

Compatibility report, then measured acceptance and costs on a small workload, the speedup the
standard model predicts from them, the speedup measured, and a plain recommendation. The costs are
the pass-cost model fitted to every step the check ran (localspec/speculative/costs.py: an oracle pass of n
tokens and a draft of l tokens as functions of the context); it also times the oracle's passes with
each attention kernel and records the faster one, which `--flash-attn auto` uses from then on.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from localspec.bench.ceiling import acceptance_from_tokens_per_step, predicted_speedup
from localspec.speculative.compat import first_difference
from localspec.speculative.costs import fit_steps
from localspec.runtime.engine import Engine
from localspec.runtime.factory import kernel_identity
from localspec.llama.context import LlamaContext
from localspec.speculative.policy import FixedLength, learns

KERNEL_CONTEXTS = (256, 1024)  # where the attention kernels are compared
KERNEL_PASS = 9  # a verify pass of 8 drafted tokens
FIT_CONTEXTS = (256, 1024, 2048)  # where the report shows the fitted curve
FIT_SIZES = (1, 2, 5, 9, 17)

PROBE_K = 8  # fixed draft length used to measure acceptance per token


@dataclass
class CheckReport:
    oracle: str
    draft: str
    compatible: bool
    difference: str | None
    prompts: int
    acceptance_rate: float = 0.0  # per drafted token, at k = PROBE_K
    per_token_acceptance: float = 0.0  # a in E = (1 - a^(k+1)) / (1 - a)
    draft_cost_ms: float = 0.0  # per draft token, fitted, at the workload's typical context
    verify_cost_ms: dict[int, float] = field(default_factory=dict)  # oracle pass of n tokens, same context
    fitted: dict[int, dict[int, float]] = field(default_factory=dict)  # context -> {n: ms}, the fitted verify curve
    draft_fitted: dict[int, float] = field(default_factory=dict)  # context -> ms per draft token
    context: int = 0  # the workload's typical context length
    kernel: dict[str, Any] = field(default_factory=dict)  # attention kernels timed: {"on": ms, "off": ms, "chosen"}
    predicted_speedup: float = 0.0  # at the best k
    predicted_best_k: int = 0
    baseline_tokens_per_second: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)  # system -> speedup over the baseline
    adaptive_idle: dict[str, Any] = field(default_factory=dict)  # the adaptive run's idle steps and why
    regimes: list[dict[str, Any]] = field(default_factory=list)  # what the policy knows per sampling regime
    recommendation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _throughput(engine: Engine, prompts: list, **options) -> tuple[float, list]:
    tokens, seconds, results = 0, 0.0, []
    for p in prompts:
        r = engine.generate(p.request, max_tokens=p.max_tokens, **options)
        tokens += r.stats.completion_tokens
        seconds += r.stats.generation_time
        results.append(r)
    return (tokens / seconds if seconds > 0 else 0.0), results


def run_check(engine: Engine, prompts: list, *, oracle: str, draft: str,
              progress: Callable[[str], None] = lambda _: None, kernels: bool = True) -> CheckReport:
    """`engine` holds the pair (built with cross_tokenizer=True when the vocabularies differ).
    `kernels`: also time the oracle with each attention kernel and record the faster one."""
    difference = first_difference(engine.oracle_model, engine.draft_model) if engine.draft_model else None
    report = CheckReport(oracle=oracle, draft=draft, compatible=difference is None, difference=difference,
                         prompts=len(prompts))
    engine.generate(prompts[0].request, max_tokens=8)  # warm-up
    records: list = []

    progress("measuring the oracle alone ...")
    base_tps, results = _throughput(engine, prompts, speculative=False)
    records += [r for result in results for r in result.stats.records]
    report.baseline_tokens_per_second = base_tps
    for k in (4, PROBE_K):
        progress(f"measuring draft length {k} ...")
        with engine.using_policy(FixedLength(k)):
            tps, results = _throughput(engine, prompts)
        records += [r for result in results for r in result.stats.records]
        report.measured[f"k={k}"] = tps / base_tps if base_tps else 0.0
        if k == PROBE_K:
            _record_acceptance(report, results, k)
    if learns(engine.policy):  # the adaptive policy (a hybrid's or prompt lookup's too)
        progress("measuring adaptive drafting ...")
        tps, results = _throughput(engine, prompts)
        records += [r for result in results for r in result.stats.records]
        report.measured["adaptive"] = tps / base_tps if base_tps else 0.0
        idle = [r.stats for r in results if r.stats.idle_steps]
        report.adaptive_idle = {"idle_steps": sum(s.idle_steps for s in idle),
                                "steps": sum(r.stats.steps for r in results),
                                "reason": idle[-1].idle_reason if idle else None}
        report.regimes = engine.policy.known_regimes()

    _record_costs(report, records)
    if kernels:
        progress("timing the oracle's passes with each attention kernel ...")
        report.kernel = compare_kernels(engine)
        if engine.cost_store is not None:
            engine.cost_store.save("kernel", kernel_identity(engine.oracle_model.path, n_threads=engine.n_threads,
                                                              gpu_layers=engine.gpu_layers, rpc=engine.rpc),
                                   {"flash_attn": report.kernel["chosen"], "measured_ms": report.kernel["ms"]})
    report.recommendation = recommend(report)
    return report


def _record_acceptance(report: CheckReport, results: list, k: int) -> None:
    """The acceptance drafting `k` tokens a step measured (`results`), and the context it ran at."""
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    steps = sum(r.stats.steps for r in results)
    tokens = sum(r.stats.completion_tokens for r in results)
    report.acceptance_rate = accepted / drafted if drafted else 0.0
    report.per_token_acceptance = acceptance_from_tokens_per_step(tokens / steps if steps else 0.0, k)
    report.context = int(statistics.median(
        r.stats.prompt_tokens + r.stats.completion_tokens / 2 for r in results))


def _record_costs(report: CheckReport, records: list) -> None:
    """The pass costs fitted to every step measured (`records`), and the draft length and speedup
    they predict at the measured acceptance."""
    fit = fit_steps(records)
    if fit is None:
        return
    verify, draft_cost = fit
    c = report.context
    report.fitted = {ctx: {n: 1000 * verify(n, ctx) for n in FIT_SIZES} for ctx in FIT_CONTEXTS}
    report.verify_cost_ms = {n: 1000 * verify(n, c) for n in FIT_SIZES}
    if draft_cost.ready:  # per token, for a step that evaluates PROBE_K of them
        report.draft_fitted = {ctx: 1000 * draft_cost(PROBE_K, ctx) / PROBE_K for ctx in FIT_CONTEXTS}
        report.draft_cost_ms = 1000 * draft_cost(PROBE_K, c) / PROBE_K
        options = {k: predicted_speedup(report.per_token_acceptance, k, report.draft_cost_ms / 1000,
                                        lambda n: verify(max(1, round(n)), c)) for k in range(1, 17)}
        report.predicted_best_k = max(options, key=options.get)
        report.predicted_speedup = options[report.predicted_best_k]


def compare_kernels(engine: Engine, repeats: int = 5) -> dict[str, Any]:
    """Time the oracle's one-token pass and a KERNEL_PASS-token verify pass at each of
    KERNEL_CONTEXTS with flash attention on and off (interleaved, medians), and choose the kernel
    whose passes cost less in all: speculation's own workload (the one-token pass is what the
    first token and plain steps cost)."""
    model = engine.oracle_model
    n_ctx = max(KERNEL_CONTEXTS) + 2 * KERNEL_PASS
    filler = np.random.default_rng(0).integers(0, model.n_vocab, size=n_ctx).tolist()
    ctxs = {fa: LlamaContext(model, n_ctx=n_ctx, n_batch=512, n_threads=engine.n_threads, flash_attn=fa)
            for fa in ("on", "off")}
    try:
        times: dict[str, dict[str, list[float]]] = {fa: {} for fa in ctxs}
        for context in KERNEL_CONTEXTS:
            for fa, ctx in ctxs.items():
                ctx.sync(filler[:context], n_logits=0)
            for i in range(repeats):
                for fa, ctx in (ctxs.items() if i % 2 else reversed(list(ctxs.items()))):
                    for n in (1, KERNEL_PASS):
                        t0 = time.perf_counter()
                        ctx.decode(filler[context:context + n], n_logits=n)
                        times[fa].setdefault(f"{n}@{context}", []).append(time.perf_counter() - t0)
                        ctx.rollback(context)
    finally:
        for ctx in ctxs.values():
            ctx.close()
    ms = {fa: {key: 1000 * statistics.median(v) for key, v in t.items()} for fa, t in times.items()}
    total = {fa: sum(v.values()) for fa, v in ms.items()}
    return {"ms": ms, "total_ms": total, "chosen": min(total, key=total.get)}


def recommend(report: CheckReport) -> str:
    best_name, best = max(report.measured.items(), key=lambda kv: kv[1], default=("", 0.0))
    adaptive = report.measured.get("adaptive")
    if best >= 1.10:
        how = "the default (adaptive) drafting" if adaptive is not None and adaptive >= 0.95 * best else \
            f"--draft-length {best_name.removeprefix('k=')}"
        return f"use it: {best:.2f}x the oracle alone here, with {how}."
    if best >= 0.97:
        return (f"tune it: at best {best:.2f}x. Try --p-min 0.5 (stop drafting when the draft is unsure) or "
                "a smaller --draft-max; adaptive drafting falls back to the oracle alone when nothing pays.")
    return (f"don't: speculation is slower here ({best:.2f}x at best; draft agreement "
            f"{report.acceptance_rate:.0%}). Use a draft that agrees more often or costs less, or --no-draft.")


def format_report(r: CheckReport) -> str:
    lines = [f"oracle  {r.oracle}", f"draft   {r.draft}"]
    lines.append("vocabulary: compatible (token-for-token drafting)" if r.compatible else
                 f"vocabulary: differs ({r.difference}); drafting through text (cross-tokenizer)")
    lines.append(f"workload: {r.prompts} prompts; oracle alone {r.baseline_tokens_per_second:.1f} tokens/s")
    lines.append(f"acceptance: {r.acceptance_rate:.0%} of drafted tokens at k={PROBE_K} "
                 f"(per-token a = {r.per_token_acceptance:.2f})")
    if r.fitted:
        lines.append(f"costs fitted to every step (ms; typical context here {r.context} tokens):")
        lines.append("  context  " + "  ".join(f"{'n=' + str(n):>6}" for n in FIT_SIZES) + "   draft/token")
        for ctx, row in r.fitted.items():
            d = r.draft_fitted.get(ctx)
            lines.append(f"  {ctx:>7}  " + "  ".join(f"{ms:6.1f}" for ms in row.values())
                         + (f"   {d:6.1f}" if d is not None else ""))
    if r.predicted_speedup:
        lines.append(f"predicted: {r.predicted_speedup:.2f}x at k={r.predicted_best_k}")
    if r.kernel:
        timed = "; ".join(f"flash attention {fa}: " + ", ".join(f"{key} {ms:.1f}" for key, ms in v.items())
                          for fa, v in r.kernel["ms"].items())
        lines.append(f"attention kernel (ms, pass of n tokens @ context): {timed}")
        lines.append(f"  faster here: flash attention {r.kernel['chosen']} (--flash-attn auto uses it from now on)")
    lines.append("measured: " + ", ".join(f"{name} {x:.2f}x" for name, x in r.measured.items()))
    if r.adaptive_idle.get("idle_steps"):
        lines.append(f"  adaptive drafting was idle for {r.adaptive_idle['idle_steps']} of {r.adaptive_idle['steps']} "
                     f"steps: {r.adaptive_idle['reason']}")
    if r.regimes:
        lines.append("what the adaptive policy knows, per sampling regime (kept between runs):")
        for g in r.regimes:
            state = "drafts" if g["drafting"] else f"idle: {g['why_idle']}"
            lines.append(f"  {g['source']}, {g['regime']}: acceptance {g['acceptance']:.0%} "
                         f"({g['trials']} draft tokens judged); {state}")
    lines.append(f"recommendation: {r.recommendation}")
    return "\n".join(lines)


def load_prompts(path: str | None, max_prompts: int, max_tokens: int) -> list:
    from localspec.bench.workloads import BenchPrompt, load

    if path is None:
        return load(["chat", "grounded", "code"], max_prompts=max_prompts, max_tokens=max_tokens)
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per line)")
    return [BenchPrompt("custom", f"line-{i}", max_tokens, messages=({"role": "user", "content": text},))
            for i, text in enumerate(lines[:max_prompts * 3], 1)]

