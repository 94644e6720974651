"""`localspec check`: is this draft worth it for this oracle, on this machine?

Compatibility report, then measured acceptance and costs on a small workload, the speedup the
standard model predicts from them, the speedup measured, and a plain recommendation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .bench.ceiling import acceptance_from_tokens_per_step, cost_curve, predicted_speedup
from .compat import first_difference
from .engine import Engine
from .policy import AdaptiveLength, FixedLength

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
    draft_cost_ms: float = 0.0  # per draft token
    verify_cost_ms: dict[int, float] = field(default_factory=dict)  # oracle pass of n tokens
    predicted_speedup: float = 0.0  # at the best k
    predicted_best_k: int = 0
    baseline_tokens_per_second: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)  # system -> speedup over the baseline
    recommendation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _throughput(engine: Engine, prompts: list, **options) -> tuple[float, list]:
    tokens, seconds, results = 0, 0.0, []
    for p in prompts:
        r = engine.generate(p.request, max_tokens=p.max_tokens, **options)
        tokens += r.stats.completion_tokens
        seconds += r.stats.total_time - r.stats.prompt_time
        results.append(r)
    return (tokens / seconds if seconds > 0 else 0.0), results


def run_check(engine: Engine, prompts: list, *, oracle: str, draft: str,
              progress: Callable[[str], None] = lambda _: None) -> CheckReport:
    """`engine` holds the pair (built with cross_tokenizer=True when the vocabularies differ)."""
    difference = first_difference(engine.oracle_model, engine.draft_model) if engine.draft_model else None
    report = CheckReport(oracle=oracle, draft=draft, compatible=difference is None, difference=difference,
                         prompts=len(prompts))
    adaptive = engine.policy
    engine.generate(prompts[0].request, max_tokens=8)  # warm-up

    progress("measuring the oracle alone ...")
    base_tps, _ = _throughput(engine, prompts, speculative=False)
    report.baseline_tokens_per_second = base_tps
    for k in (4, PROBE_K):
        progress(f"measuring draft length {k} ...")
        engine.policy = FixedLength(k)
        tps, results = _throughput(engine, prompts)
        report.measured[f"k={k}"] = tps / base_tps if base_tps else 0.0
        if k == PROBE_K:
            drafted = sum(r.stats.drafted for r in results)
            accepted = sum(r.stats.accepted for r in results)
            steps = sum(r.stats.steps for r in results)
            tokens = sum(r.stats.completion_tokens for r in results)
            report.acceptance_rate = accepted / drafted if drafted else 0.0
            report.per_token_acceptance = acceptance_from_tokens_per_step(tokens / steps if steps else 0.0, k)
            draft_time = sum(r.stats.draft_time for r in results)
            report.draft_cost_ms = 1000 * draft_time / drafted if drafted else 0.0
    engine.policy = adaptive
    if isinstance(adaptive, AdaptiveLength):
        progress("measuring adaptive drafting ...")
        tps, _ = _throughput(engine, prompts)
        report.measured["adaptive"] = tps / base_tps if base_tps else 0.0
        if adaptive.verify_cost.ready:
            report.verify_cost_ms = {n: 1000 * adaptive.verify_cost(n, adaptive.context) for n in (1, 2, 4, 8, 16)}

    if report.verify_cost_ms:
        curve = cost_curve(report.verify_cost_ms)
        options = {k: predicted_speedup(report.per_token_acceptance, k, report.draft_cost_ms, curve)
                   for k in range(1, 17)}
        report.predicted_best_k = max(options, key=options.get)
        report.predicted_speedup = options[report.predicted_best_k]
    report.recommendation = recommend(report)
    return report


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
    if r.verify_cost_ms:
        costs = ", ".join(f"{n}: {ms:.1f}" for n, ms in r.verify_cost_ms.items())
        lines.append(f"costs: draft {r.draft_cost_ms:.1f} ms/token; oracle pass of n tokens (ms) {costs}")
        lines.append(f"predicted: {r.predicted_speedup:.2f}x at k={r.predicted_best_k}")
    lines.append("measured: " + ", ".join(f"{name} {x:.2f}x" for name, x in r.measured.items()))
    lines.append(f"recommendation: {r.recommendation}")
    return "\n".join(lines)


def load_prompts(path: str | None, max_prompts: int, max_tokens: int) -> list:
    from .bench.workloads import BenchPrompt, load

    if path is None:
        return load(["chat", "grounded", "code"], max_prompts=max_prompts, max_tokens=max_tokens)
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per line)")
    return [BenchPrompt("custom", f"line-{i}", max_tokens, messages=({"role": "user", "content": text},))
            for i, text in enumerate(lines[:max_prompts * 3], 1)]

