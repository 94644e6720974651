"""Turn a bench run into figures: per system and workload aggregates, a markdown table and the
summary `localspec bench` prints (the results document is localspec.bench.results_document's, the
PNG charts localspec.bench.charts').

Aggregates (one row per system and workload, plus an "all" row per system):

    tokens_per_second     generated tokens / generation time (the oracle's prompt evaluation excluded, the
                          draft's included), per prompt
                          the median over repetitions, summed over prompts
    speedup               tokens/s over the baseline's on the same prompt in the same repetition; the
                          median over repetitions per prompt, then the geometric mean over prompts
    paired_speedup        with `--paired`: tokens/s over the same system's run of the same prompt with
                          drafting off, in the same process and repetition (same aggregation);
                          paired_interval: a 95% confidence interval for it (every run one sample)
    acceptance_rate       accepted / drafted draft tokens
    mean_accepted_length  accepted draft tokens per verify step (tokens_per_step = 1 + that)
    per_token_acceptance  a with E(a, K) = tokens_per_step, K = mean draft length (see ceiling.py)
    ceiling               the speedup predicted for the steps the system took (their draft lengths,
                          accepted tokens and context lengths) by the pass-cost model fitted to all of
                          its steps (see ceiling.py); for the C++ anchor, from its acceptance and the
                          costs fitted to localspec's run of the same K; efficiency = speedup / ceiling
    one_shot_wall         with `--one-shot`: a fresh process's wall time per prompt (the median of the
                          repetitions), summed over prompts; one_shot_speedup: the baseline's over it, geometric mean
    ttft                  time to first token (prompt evaluation included), median over runs
    ttft_ratio            TTFT over the baseline's in the same prompt and repetition: median per prompt,
                          geometric mean over prompts (the median over runs of a row mixes short and long
                          prompts, so it moves with which prompts' runs land in the middle)
    latency_p50/p95       per-token latency: chunk inter-arrival time / tokens in the chunk
    peak_rss              per system (see the systems' peak_rss_scope)
    greedy_match          output agreement with the baseline's in the same repetition (1.0 = identical)
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from localspec.bench.ceiling import (acceptance_from_tokens_per_step, fit_costs, geomean, median, percentile, predicted_speedup,
                      ratio_interval, record_ceiling)
from localspec.bench.systems import LLAMA_CPP, uses_draft_model

ALL = "all"
RESULT_FIELDS = (
    "system", "workload", "n_prompts", "n_runs", "tokens_per_second", "speedup", "speedup_per_prompt",
    "paired_speedup", "paired_interval",
    "acceptance_rate", "per_token_acceptance", "mean_accepted_length", "tokens_per_step", "mean_draft_length",
    "ceiling", "efficiency", "one_shot_wall", "one_shot_speedup",
    "ttft", "ttft_ratio", "latency_p50", "latency_p95", "peak_rss", "greedy_match", "mismatched_runs", "costs",
    "host_ms_per_token",
)
COST_SIZES = (1, 2, 5, 9, 17)  # pass sizes the report shows the fitted verify cost at


def _fits(report: dict) -> dict[str, tuple]:
    """Per localspec system: (verify, draft) pass-cost models fitted to all its steps (drafting-off
    runs of --paired included: same process, more one-token passes)."""
    fits = {}
    for system in report["systems"]:
        records = [x for r in report["runs"] if r["system"] == system["name"]
                   for x in (r.get("records") or []) + (r.get("paired_records") or [])]
        fit = fit_costs(records) if records else None
        if fit is not None:
            fits[system["name"]] = fit
    return fits


def repriced(reports: Mapping[str, dict]) -> dict[tuple[str, str, str], float]:
    """(label, workload, system) -> the speedup of the steps each localspec system took, all of
    them priced with ONE pass-cost fit made over every report's steps (the baseline's one-token
    cost from every report's baseline steps). A shared VM's speed drifts by 5-15% between runs and
    minutes, more than most changes of policy move a run: priced alike, two runs of two versions
    differ only by the steps their policies chose (draft lengths, sources, acceptance), which is
    what a change of policy changes. `reports`: bench reports (`--json`) by label."""
    steps = [x for rep in reports.values() for r in rep["runs"] for x in (r.get("records") or [])]
    fit = fit_costs(steps)
    if fit is None:
        return {}
    verify, draft = fit
    base = fit_costs([x for rep in reports.values() for r in rep["runs"] if r["system"] == "baseline"
                      for x in (r.get("records") or [])])
    alone = base[0] if base is not None else None
    out = {}
    for label, rep in reports.items():
        rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for r in rep["runs"]:
            if r.get("records"):
                rows[(r["workload"], r["system"])].append(r)
        for system in rep["systems"]:
            if system.get("kind") == LLAMA_CPP:
                continue
            model_draft = draft if _drafts_with_model(system) else None
            for workload in sorted({w for w, name in rows if name == system["name"]}):
                x = pooled_ceiling(rows[(workload, system["name"])], verify, model_draft, alone)
                if x is not None:
                    out[(label, workload, system["name"])] = x
    return out


def pooled_ceiling(runs: list[dict], verify, model_draft, alone) -> float | None:
    """The speedup predicted for a row's runs: the oracle alone's time for all their tokens over
    their steps' predicted times, pooled (a sum, not a mean of ratios)."""
    base_time = spec_time = 0.0
    for r in runs:
        x = record_ceiling(r.get("records") or [], verify, model_draft, alone)
        if x is not None:
            spec_time += r["completion_tokens"] / x
            base_time += r["completion_tokens"]
    return base_time / spec_time if spec_time > 0 else None


def one_shot_walls(runs) -> dict[str, float]:
    """Per prompt id, the median one-shot wall time over its runs' repetitions (a fresh process's
    speed varies), from (prompt id, run) pairs; prompts without one are left out."""
    walls: dict[str, list[float]] = defaultdict(list)
    for pid, r in runs:
        if r.get("one_shot_wall"):
            walls[pid].append(r["one_shot_wall"])
    return {pid: median(w) for pid, w in walls.items()}


def _anchor_fit(system: dict, fits: dict[str, tuple]) -> tuple | None:
    """The cost model for an anchor run's ceiling: localspec's with the same K, else adaptive's."""
    for name in (f"k{system.get('params', {}).get('k')}", "model", "adaptive"):
        if name in fits and fits[name][1].ready:
            return fits[name]
    return next((f for n, f in fits.items() if n != "baseline" and f[1].ready), None)


def _row(system: dict, workload: str, runs: list[dict], base: dict[tuple[str, int], dict], fits: dict[str, tuple],
         one_shot_base: dict[str, float]) -> dict:
    """One result row (RESULT_FIELDS, in that order): a system's runs on one workload (or on all of
    them), set against the baseline's runs of the same prompt and repetition (`base`, by (prompt id,
    rep)) and the baseline's one-shot wall times (`one_shot_base`, by prompt id)."""
    by_prompt = _by_prompt(runs)
    drafting = _Drafting.of(runs)
    ceiling, costs = _ceiling_and_costs(system, runs, fits, drafting)
    fields = {"system": system["name"], "workload": workload, "n_prompts": len(by_prompt), "n_runs": len(runs),
              "tokens_per_second": _tokens_per_second(by_prompt), "ceiling": ceiling, "costs": costs,
              "peak_rss": system.get("peak_rss"), **_against_baseline(by_prompt, base), **drafting.fields(),
              **_one_shot(by_prompt, one_shot_base), **_per_run_figures(runs)}
    fields["efficiency"] = fields["speedup"] / ceiling if fields["speedup"] and ceiling else None
    return {name: fields[name] for name in RESULT_FIELDS}


def _by_prompt(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs grouped by prompt id, in the order the prompts first appear."""
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_prompt[r["prompt_id"]].append(r)
    return by_prompt


def _tokens_per_second(by_prompt: dict[str, list[dict]]) -> float | None:
    """Tokens over generation time, each the median over a prompt's repetitions, summed over prompts."""
    tokens = time = 0.0
    for rs in by_prompt.values():
        tokens += median([r["completion_tokens"] for r in rs])
        time += median([r["completion_tokens"] / r["tokens_per_second"] for r in rs if r["tokens_per_second"] > 0]
                       or [math.inf])
    return tokens / time if time > 0 else None


def _per_prompt(by_prompt: dict[str, list[dict]],
                ratios: Callable[[str, list[dict]], list[float]]) -> dict[str, list[float]]:
    """Per prompt id, `ratios(prompt id, its runs)`; prompts with none are left out."""
    out = {}
    for pid, rs in by_prompt.items():
        if xs := ratios(pid, rs):
            out[pid] = xs
    return out


def _against_baseline(by_prompt: dict[str, list[dict]], base: dict[tuple[str, int], dict]) -> dict:
    """speedup (with speedup_per_prompt), ttft_ratio and the paired figures: per prompt the median of
    its runs' ratios, then the geometric mean over prompts (the paired interval from every run's)."""
    speedups = _medians(_per_prompt(by_prompt, lambda pid, rs: _speed_ratios(pid, rs, base)))
    ttft_ratios = _medians(_per_prompt(by_prompt, lambda pid, rs: _ttft_ratios(pid, rs, base)))
    paired = _per_prompt(by_prompt, lambda _pid, rs: _paired_ratios(rs))
    return {"speedup": _geomean_or_none(speedups), "speedup_per_prompt": speedups,
            "paired_speedup": _geomean_or_none(_medians(paired)),
            "paired_interval": ratio_interval([x for xs in paired.values() for x in xs]),
            "ttft_ratio": _geomean_or_none(ttft_ratios)}


def _speed_ratios(pid: str, runs: list[dict], base: dict[tuple[str, int], dict]) -> list[float]:
    """Each run's tokens/s over the baseline's on the same prompt in the same repetition."""
    return [r["tokens_per_second"] / b["tokens_per_second"] for r in runs
            if (b := base.get((pid, r["rep"]))) and b["tokens_per_second"] > 0]


def _ttft_ratios(pid: str, runs: list[dict], base: dict[tuple[str, int], dict]) -> list[float]:
    """Each run's time to first token over the baseline's on the same prompt in the same repetition."""
    return [r["ttft"] / b["ttft"] for r in runs if r.get("ttft") and (b := base.get((pid, r["rep"]))) and b.get("ttft")]


def _paired_ratios(runs: list[dict]) -> list[float]:
    """Each run's tokens/s over its own process's run with drafting off (`--paired`)."""
    return [r["tokens_per_second"] / r["paired_tokens_per_second"] for r in runs
            if (r.get("paired_tokens_per_second") or 0) > 0]


def _medians(per_prompt: dict[str, list[float]]) -> dict[str, float]:
    return {pid: median(xs) for pid, xs in per_prompt.items()}


def _geomean_or_none(per_prompt: dict[str, float]) -> float | None:
    return geomean(list(per_prompt.values())) if per_prompt else None


@dataclass(frozen=True)
class _Drafting:
    """A row's drafting totals over its runs, and the figures they give."""

    drafted: int
    accepted: int
    steps: int

    @classmethod
    def of(cls, runs: list[dict]) -> _Drafting:
        return cls(sum(r["drafted"] or 0 for r in runs), sum(r["accepted"] or 0 for r in runs),
                   sum(r["steps"] or 0 for r in runs))

    @property
    def tokens_per_step(self) -> float | None:
        return 1.0 + self.accepted / self.steps if self.steps else None

    @property
    def mean_length(self) -> float:
        """Draft tokens per step (0.0 without steps)."""
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def per_token_acceptance(self) -> float | None:
        tokens_per_step, k = self.tokens_per_step, self.mean_length
        return acceptance_from_tokens_per_step(tokens_per_step, k) if tokens_per_step and k > 0 else None

    def fields(self) -> dict:
        return {"acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "per_token_acceptance": self.per_token_acceptance,
                "mean_accepted_length": self.accepted / self.steps if self.steps else None,
                "tokens_per_step": self.tokens_per_step,
                "mean_draft_length": self.mean_length if self.steps else None}


def _drafts_with_model(system: dict) -> bool:
    return uses_draft_model(system.get("kind", ""), system.get("params", {}))


def _typical_context(runs: list[dict]) -> float:
    """The context a row's passes typically see: the median of prompt + half the completion."""
    return median([r["prompt_tokens"] + r["completion_tokens"] / 2 for r in runs])


def _ceiling_and_costs(system: dict, runs: list[dict], fits: dict[str, tuple],
                       drafting: _Drafting) -> tuple[float | None, dict | None]:
    """The row's ceiling, from the system's own fitted costs (then also those costs, for the report),
    or for the C++ anchor from localspec's (see _anchor_fit); (None, None) when neither applies."""
    alone = fits["baseline"][0] if "baseline" in fits else None  # the oracle's one-token cost, from its own run
    own = fits.get(system["name"])
    if own is not None:
        verify, draft = own
        model_draft = draft if _drafts_with_model(system) else None
        ceiling = 1.0 if system["name"] == "baseline" else pooled_ceiling(runs, verify, model_draft, alone)
        return ceiling, _costs(runs, verify, model_draft, drafting.mean_length)
    a = drafting.per_token_acceptance
    if system.get("kind") == LLAMA_CPP and a is not None and drafting.mean_length > 0:
        return _anchor_ceiling(system, runs, fits, alone, a, drafting.mean_length), None
    return None, None


def _costs(runs: list[dict], verify, model_draft, k_mean: float) -> dict:
    """The fitted costs at the row's typical context: a verify pass of each of COST_SIZES tokens, and
    the draft model's cost per token at its typical length in this run (None without one)."""
    context = _typical_context(runs)
    length = max(1, round(k_mean))
    return {"context": context, "verify": {str(n): verify(n, int(context)) for n in COST_SIZES},
            "draft_per_token": (model_draft(length, int(context)) / length
                                if model_draft is not None and model_draft.ready else None)}


def _anchor_ceiling(system: dict, runs: list[dict], fits: dict[str, tuple], alone, a: float,
                    k_mean: float) -> float | None:
    """The standard model's speedup at the anchor's acceptance `a` and mean draft length, priced with
    localspec's costs for the same K (None when no fit is ready)."""
    fit = _anchor_fit(system, fits)
    if fit is None or not fit[1].ready:
        return None
    verify, draft = fit
    context = int(_typical_context(runs))
    c_draft = draft(8, context) / 8 if _drafts_with_model(system) else 0.0
    one_token = alone or verify
    return predicted_speedup(a, k_mean, c_draft,
                             lambda n: (one_token if round(n) <= 1 else verify)(max(1, round(n)), context))


def _one_shot(by_prompt: dict[str, list[dict]], one_shot_base: dict[str, float]) -> dict:
    """one_shot_wall (summed over prompts) and one_shot_speedup (the baseline's over it, geometric mean)."""
    shots = one_shot_walls((pid, r) for pid, rs in by_prompt.items() for r in rs)
    ratios = [one_shot_base[pid] / t for pid, t in shots.items() if one_shot_base.get(pid)]
    return {"one_shot_wall": sum(shots.values()) if shots else None,
            "one_shot_speedup": geomean(ratios) if ratios else None}


def _per_run_figures(runs: list[dict]) -> dict:
    """The figures pooled over runs: TTFT, per-token latency, greedy match, host time per token."""
    latencies = [x for r in runs for x in (r.get("latencies") or [])]
    ttfts = [r["ttft"] for r in runs if r.get("ttft") is not None]
    matches = [r["match"] for r in runs if r.get("match") is not None]
    host = [(r["host_ms_per_token"], r["completion_tokens"]) for r in runs
            if r.get("host_ms_per_token") is not None and r.get("completion_tokens")]
    return {
        "ttft": median(ttfts) if ttfts else None,
        "latency_p50": percentile(latencies, 50) if latencies else None,
        "latency_p95": percentile(latencies, 95) if latencies else None,
        "greedy_match": sum(matches) / len(matches) if matches else None,
        "mismatched_runs": sum(1 for m in matches if m < 1.0),
        # the controller's own time per token, outside llama.cpp (localspec's runs only)
        "host_ms_per_token": sum(h * n for h, n in host) / sum(n for _, n in host) if host else None,
    }


def aggregate(report: dict) -> list[dict]:
    runs = report["runs"]
    workloads = [w for w in workload_order(report)]
    base = {(r["workload"], r["prompt_id"], r["rep"]): r for r in runs if r["system"] == "baseline"}
    fits = _fits(report)
    rows = []
    for system in report["systems"]:
        mine = [r for r in runs if r["system"] == system["name"]]
        if not mine:
            continue
        for workload in workloads + ([ALL] if len(workloads) > 1 else []):
            rs = [r for r in mine if workload == ALL or r["workload"] == workload]
            if not rs:
                continue
            wbase = {(pid, rep): b for (w, pid, rep), b in base.items() if workload == ALL or w == workload}
            if workload == ALL:  # prompt ids are unique per workload only
                rs = [dict(r, prompt_id=f"{r['workload']}/{r['prompt_id']}") for r in rs]
                wbase = {(f"{w}/{pid}", rep): b for (w, pid, rep), b in base.items()}
            shot_base = one_shot_walls((pid, b) for (pid, _), b in wbase.items())
            rows.append(_row(system, workload, rs, wbase, fits, shot_base))
    return rows


def workload_order(report: dict) -> list[str]:
    seen: list[str] = []
    for p in report["config"]["prompts"]:
        if p["workload"] not in seen:
            seen.append(p["workload"])
    return seen


# ------------------------------------------------------------------------------------ text


def _f(x: Any, fmt: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–"
    return format(x * scale, fmt)


def has_paired(report: dict) -> bool:
    return any(r.get("paired_speedup") is not None for r in report["results"])


def has_one_shot(report: dict) -> bool:
    return any(r.get("one_shot_wall") is not None for r in report["results"])


def markdown_table(report: dict) -> str:
    paired, shot = has_paired(report), has_one_shot(report)
    head = ("| workload | system | tok/s | speedup | " + ("paired speedup | " if paired else "")
            + "ceiling | efficiency | " + ("one-shot s | one-shot speedup | " if shot else "")
            + "acceptance | accepted/step | TTFT ms | TTFT vs alone | p50 ms/tok | p95 ms/tok | host ms/tok | peak RSS MB "
              "| greedy match |")
    lines = [head, "|---|---|" + "---:|" * (13 + paired + 2 * shot)]
    order = {s["name"]: i for i, s in enumerate(report["systems"])}
    wl = workload_order(report) + [ALL]
    for r in sorted(report["results"], key=lambda r: (wl.index(r["workload"]), order.get(r["system"], 99))):
        match = _f(r["greedy_match"], ".1%")
        if r["mismatched_runs"]:
            match += f" ({r['mismatched_runs']} differ)"
        speedups = [_f(r["speedup"], ".2f") + "×"]
        if paired:
            interval = r.get("paired_interval")
            speedups.append(_f(r.get("paired_speedup"), ".2f") + ("×" if r.get("paired_speedup") is not None else "")
                            + (f" ({interval[0]:.2f}–{interval[1]:.2f})" if interval else ""))
        shots = [_f(r.get("one_shot_wall"), ".2f"),
                 _f(r.get("one_shot_speedup"), ".2f") + ("×" if r.get("one_shot_speedup") is not None else "")]
        lines.append("| " + " | ".join([
            r["workload"], r["system"], _f(r["tokens_per_second"], ".1f"), *speedups,
            _f(r["ceiling"], ".2f") + ("×" if r["ceiling"] is not None else ""), _f(r["efficiency"], ".0%"),
            *(shots if shot else []), _f(r["acceptance_rate"], ".0%"), _f(r["mean_accepted_length"], ".2f"), _f(r["ttft"], ".0f", 1e3),
            _f(r.get("ttft_ratio"), ".2f") + ("×" if r.get("ttft_ratio") is not None else ""),
            _f(r["latency_p50"], ".1f", 1e3), _f(r["latency_p95"], ".1f", 1e3), _f(r.get("host_ms_per_token"), ".2f"),
            _f(r["peak_rss"], ".0f", 1 / 2**20), match]) + " |")
    return "\n".join(lines)


def skipped_lines(report: dict) -> list[str]:
    return [f"- `{s['name']}` skipped: {s['reason']}" for s in report["systems"] if s.get("status") == "skipped"]


def best_anchor(report: dict) -> dict | None:
    """The C++ anchor's (llama.cpp's own speculative decoding with a draft model) fastest flags in
    this run: its result row over all workloads."""
    anchors = {s["name"] for s in report["systems"]
               if s.get("kind") == LLAMA_CPP and not s.get("params", {}).get("spec_type")}
    workloads = workload_order(report)
    scope = ALL if len(workloads) > 1 else workloads[0]
    rows = [r for r in report["results"] if r["system"] in anchors and r["workload"] == scope and r["speedup"]]
    return max(rows, key=lambda r: r["speedup"], default=None)


def headline(report: dict) -> list[str]:
    """One line per comparison a reader looks for first: adaptive against the oracle alone, against
    the best fixed K, and against llama.cpp at its best flags."""
    workloads = workload_order(report)
    scope = ALL if len(workloads) > 1 else workloads[0]
    rows = {r["system"]: r for r in report["results"] if r["workload"] == scope}
    lines = []
    adaptive = rows.get("adaptive")
    if adaptive and adaptive["speedup"]:
        fixed = [r for n, r in rows.items() if re.fullmatch(r"k\d+(\+lookup)?", n) and r["speedup"]]
        best_k = max(fixed, key=lambda r: r["speedup"], default=None)
        line = f"adaptive (the default): {adaptive['speedup']:.2f}x the oracle alone"
        if best_k:  # what the policy is for: faster than any fixed setting (a regression shows here)
            line += f", {adaptive['speedup'] / best_k['speedup']:.2f}x the best fixed K"
        others = ([f"best fixed K: {best_k['system']} {best_k['speedup']:.2f}x"] if best_k else []) + \
            [f"{n} {rows[n]['speedup']:.2f}x" for n in ("model", "lookup") if rows.get(n) and rows[n]["speedup"]]
        if others:
            line += f" ({'; '.join(others)})"
        if adaptive.get("one_shot_speedup"):
            line += f"; one-shot {adaptive['one_shot_speedup']:.2f}x"
        if adaptive.get("ttft_ratio"):
            line += f"; time to first token {adaptive['ttft_ratio']:.2f}x the oracle alone's"
        lines.append(line)
    anchor = best_anchor(report)
    if anchor:
        line = f"llama.cpp at its best flags here: {anchor['system']}, {anchor['tokens_per_second']:.1f} tok/s " \
               f"({anchor['speedup']:.2f}x the oracle alone)"
        if adaptive and adaptive["tokens_per_second"] and anchor["tokens_per_second"]:
            line += f"; localspec adaptive is {adaptive['tokens_per_second'] / anchor['tokens_per_second']:.2f}x that"
        lines.append(line)
    return lines


def summary(report: dict) -> str:
    """What `localspec bench` prints: the table, the headline comparisons, skipped systems and notes."""
    parts = [markdown_table(report)]
    if headline(report):
        parts.append("\n".join(f"- {line}" for line in headline(report)))
    extra = skipped_lines(report) + [f"- {n}" for n in report.get("notes", [])]
    if extra:
        parts.append("\n".join(extra))
    return "\n\n".join(parts) + "\n"


def clean(x: Any) -> Any:
    """The report as strict JSON: NaN and infinities become null."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(clean(report), indent=1, ensure_ascii=False, allow_nan=False) + "\n", "utf-8")


__all__ = ["aggregate", "markdown_table", "summary", "write_json", "clean", "RESULT_FIELDS", "ALL"]
