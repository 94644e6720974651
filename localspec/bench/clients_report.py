"""`localspec bench --clients`'s summary and Markdown table (the runs come from localspec.bench.clients).

The summary has one entry per workload, client count, pass and system: medians over repetitions,
the pass's tokens/s against pass 1's (the same requests again, on the same server), against
llama-server's best and against localspec as it was before its caches across requests
(localspec-no-caches: no suffix cache, no prompt cache; else localspec-no-suffix) at the same point, the draft tokens accepted (localspec: those from the suffix cache apart), and
how many answers are the same text as the first system's (greedy decoding: all of them, where
every system computes the same) and as the same request's in pass 1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

BEFORE_CACHES = ("localspec-no-caches", "localspec-no-suffix")  # the reference: the first of these that ran
BASE = "localspec-base"  # localspec served from another checkout (bench --base-tree): an earlier commit


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _texts(row: dict) -> dict[tuple[str, int], str]:
    return {(r["conversation"], r["turn"]): r["text"] for r in row["requests"]}


def _same_share(rows: list[dict], others: list[dict | None]) -> float | None:
    """Of `rows`' requests, the share whose text is the same as the matching row's of `others`."""
    same = total = 0
    for row, other in zip(rows, others):
        if other is None:
            continue
        theirs = _texts(other)
        for key, text in _texts(row).items():
            total += 1
            same += theirs.get(key) == text
    return same / total if total else None


def _suffix_accepted(row: dict) -> float | None:
    """Draft tokens from the suffix cache accepted (None: a server that does not count by source)."""
    if row["by_source"] is None:
        return None
    return row["by_source"].get("suffix", {}).get("accepted", 0.0)


def _system_entry(mine: list[dict], find) -> dict:
    """One system's medians over its repetitions at one (workload, clients, pass); `find(row, system,
    number)`: the row of the same repetition for another system or pass."""
    first = mine[0]
    turns = max(len(r["ttft_p50_by_turn"]) for r in mine)
    return {"workload": first["workload"], "clients": first["clients"], "pass": first["pass"],
            "system": first["system"],
            "aggregate_tokens_per_second": _median(r["aggregate_tokens_per_second"] for r in mine),
            "vs_pass_1": _median(r["aggregate_tokens_per_second"] / p["aggregate_tokens_per_second"]
                                 for r in mine if (p := find(r, r["system"], 1)) and p["aggregate_tokens_per_second"])
            if first["pass"] > 1 else None,
            "ttft_p50": _median(r["ttft_p50"] for r in mine),
            "ttft_p95": max((r["ttft_p95"] for r in mine if r["ttft_p95"] is not None), default=None),
            "ttft_p50_by_turn": [_median(r["ttft_p50_by_turn"][t] for r in mine if t < len(r["ttft_p50_by_turn"]))
                                 for t in range(turns)],
            "client_tokens_per_second": _median([x for r in mine for x in r["client_tokens_per_second"]]) or 0.0,
            "accepted": _median(r["accepted"] for r in mine),
            "suffix_accepted": _median(_suffix_accepted(r) for r in mine),
            "same_text_as_pass_1": _same_share(mine, [find(r, r["system"], 1) for r in mine])
            if first["pass"] > 1 else None,
            "errors": sum(len(r["errors"]) for r in mine)}


def _compare(entries: list[dict], rows: list[dict], first_system: str, find) -> None:
    """Each entry against llama-server's best, localspec before its caches (BEFORE_CACHES) and the
    earlier checkout (BASE, where it ran) at the same point, and its texts against the first system's."""
    servers = [e["aggregate_tokens_per_second"] for e in entries if e["system"].startswith("llama-server")]
    best = max(servers) if servers else None
    before = next((e["aggregate_tokens_per_second"] for name in BEFORE_CACHES for e in entries
                   if e["system"] == name), None)
    base = next((e["aggregate_tokens_per_second"] for e in entries if e["system"] == BASE), None)
    for e in entries:
        agg = e["aggregate_tokens_per_second"]
        e["vs_llama_server_best"] = agg / best if best else None
        e["vs_localspec_before"] = agg / before if before else None
        e["vs_localspec_base"] = agg / base if base else None
        mine = [r for r in rows if r["system"] == e["system"]]
        e["same_text_as_first_system"] = _same_share(mine, [find(r, first_system, r["pass"]) for r in mine])


def summarize(rows: list[dict], reference: dict) -> list[dict]:
    """Per (workload, clients, pass, system), in the order the rows came."""
    index = {(r["workload"], r["clients"], r["rep"], r["pass"], r["system"]): r for r in rows}

    def find(row: dict, system: str, number: int) -> dict | None:
        return index.get((row["workload"], row["clients"], row["rep"], number, system))

    out = []
    for point in dict.fromkeys((r["workload"], r["clients"], r["pass"]) for r in rows):
        at = [r for r in rows if (r["workload"], r["clients"], r["pass"]) == point]
        systems = list(dict.fromkeys(r["system"] for r in at))
        entries = [_system_entry([r for r in at if r["system"] == s], find) for s in systems]
        _compare(entries, at, systems[0], find)
        for e in entries:
            e["batched_bench"] = reference.get(point[1], reference.get(str(point[1])))
        out += entries
    return out


def _fmt(x, spec: str, suffix: str = "") -> str:
    return format(x, spec) + suffix if x is not None else "–"


def _percent(share: float | None) -> str:
    return f"{100 * share:.0f}%" if share is not None else "–"


def _header(report: dict) -> list[str]:
    m, c = report["machine"], report["config"]
    workloads = "; ".join(f"{name}: {len(w['conversations'])} conversations (at {max(c['clients'])} clients) of "
                          f"{1 + max((len(x['followups']) for x in w['conversations']), default=0)} requests, up to "
                          f"{w['max_tokens']} tokens each, {w['passes']} pass{'es' if w['passes'] > 1 else ''}, "
                          f"{w['ctx_per_slot']} tokens of context per slot" for name, w in c["workloads"].items())
    return ["# Serving several clients at once", "",
            f"Machine: {m.get('cpu')} ({', '.join(m.get('cpu_flags') or [])}), {m.get('threads')} threads; "
            f"llama-cpp-python {m.get('llama_cpp_python')}; localspec commit {m.get('git_commit')}.", "",
            f"Oracle `{Path(c['oracle']).name}`, draft `{Path(c['draft']).name if c['draft'] else '-'}`; greedy; "
            f"streamed answers through /v1/chat/completions; {c['reps']} repetitions (medians), each on a fresh "
            "server with one slot per client, flash attention as localspec's auto, no weight repacking, one warm-up "
            f"round first. Workloads: {workloads}. Pass 2 of records: the same requests again on the same server.", ""]


def _table(summary: list[dict]) -> list[str]:
    based = any(s.get("vs_localspec_base") is not None for s in summary)  # a column only where BASE ran
    lines = ["| workload | clients | system | pass | aggregate tok/s | vs pass 1 | vs llama-server's best "
             "| vs localspec before its caches |" + (f" vs {BASE} |" if based else "") + " first token p50 | p95 "
             "| tok/s per request | accepted draft tokens (suffix cache) | same text as first system "
             "| llama-batched-bench (oracle alone) |",
             "|---|---:|---|---:|---:|---:|---:|---:|" + ("---:|" if based else "") + "---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        accepted = _fmt(s["accepted"], ".0f") + (f" ({s['suffix_accepted']:.0f})" if s["suffix_accepted"] is not None
                                                 else "")
        lines.append(f"| {s['workload']} | {s['clients']} | {s['system']} | {s['pass']} | "
                     f"{_fmt(s['aggregate_tokens_per_second'], '.1f')} | {_fmt(s['vs_pass_1'], '.2f', 'x')} | "
                     f"{_fmt(s['vs_llama_server_best'], '.2f', 'x')} | {_fmt(s['vs_localspec_before'], '.2f', 'x')} | "
                     + (f"{_fmt(s.get('vs_localspec_base'), '.2f', 'x')} | " if based else "") +
                     f"{_fmt(s['ttft_p50'], '.2f', ' s')} | {_fmt(s['ttft_p95'], '.2f', ' s')} | "
                     f"{s['client_tokens_per_second']:.1f} | {accepted} | "
                     f"{_percent(s['same_text_as_first_system'])} | "
                     f"{_fmt(s['batched_bench'], '.1f')} |" + (f" {s['errors']} errors" if s["errors"] else ""))
    return lines


def _turns_table(summary: list[dict]) -> list[str]:
    """First token p50 by turn, for workloads of several turns."""
    several = [s for s in summary if len(s["ttft_p50_by_turn"]) > 1]
    if not several:
        return []
    turns = max(len(s["ttft_p50_by_turn"]) for s in several)
    lines = ["", "First token p50 by turn (seconds):", "",
             "| workload | clients | system | " + " | ".join(f"turn {t + 1}" for t in range(turns)) + " |",
             "|---|---:|---|" + "---:|" * turns]
    for s in several:
        cells = [_fmt(x, ".2f") for x in s["ttft_p50_by_turn"]] + ["–"] * (turns - len(s["ttft_p50_by_turn"]))
        lines.append(f"| {s['workload']} | {s['clients']} | {s['system']} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    lines = _header(report) + _table(report["summary"]) + _turns_table(report["summary"])
    if report["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines) + "\n"
