"""What `localspec bench` does once click has parsed its options (the command itself is in cli.py)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Callable

from localspec.bench import report as rep
from localspec.bench.charts import write_charts
from localspec.bench.results_document import results_document
from localspec.bench import workloads as wl
from localspec.bench.runner import BenchConfig, run_bench
from localspec.bench.systems import parse_systems


def run(*, pair: str | None, oracle: str | None, draft: str | None, workload: str | None, systems: str | None,
        reps: int, max_prompts: int | None, max_tokens: int | None, threads: int | None, n_ctx: int,
        json_path: str | None, charts_dir: str | None, markdown_path: str | None, anchor_bin: str | None,
        cross_tokenizer: bool, paired: bool, one_shot: bool, mixed_warmup: int, clients: str | None,
        progress: Callable[[str], None], echo: Callable[[str], None], base_tree: str | None = None,
        temperature: float = 0.0) -> dict:
    from localspec.models import Registry

    choice = Registry.load().choose(pair, oracle, draft)
    oracle, draft, chosen = choice.oracle, choice.draft, choice.pair
    if base_tree and not clients:
        raise ValueError("--base-tree goes with --clients (the serving benchmark)")
    if temperature and clients:
        raise ValueError("--temperature is for the single-stream runs; --clients streams greedy answers")
    if clients:
        return _run_clients(oracle, draft, clients, systems, workload, reps, max_prompts, max_tokens, threads,
                            anchor_bin, json_path, markdown_path, progress, echo, base_tree=base_tree)
    if draft is None:
        progress("no --draft for this oracle: systems that need a draft model are skipped")
    names = [w.strip() for w in workload.split(",") if w.strip()] if workload else None
    prompts = wl.load(names, max_prompts=max_prompts, max_tokens=max_tokens)
    config = BenchConfig(oracle=oracle, draft=draft, prompts=prompts, systems=parse_systems(systems), reps=reps,
                         threads=threads, n_ctx=n_ctx, pair=chosen.name if oracle == chosen.oracle else None,
                         anchor_bin=anchor_bin, progress=progress, paired=paired, one_shot=one_shot, mixed_warmup=mixed_warmup,
                         cross_tokenizer=cross_tokenizer or choice.cross_tokenizer, temperature=temperature)
    report = run_bench(config)

    charts: dict[str, str] = {}
    if charts_dir:
        charts, why_not = write_charts(report, charts_dir)
        if why_not:
            report["notes"].append(why_not)
            progress(why_not)
    if json_path:
        rep.write_json(report, json_path)
        progress(f"wrote {json_path}")
    if markdown_path:
        base = Path(markdown_path).resolve().parent
        rel = {title: os.path.relpath(Path(p).resolve(), base) for title, p in charts.items()}
        command = "localspec bench " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
        Path(markdown_path).write_text(results_document(rep.clean(report), rel, command=command), "utf-8")
        progress(f"wrote {markdown_path}")
    echo(rep.summary(rep.clean(report)))
    return report


def _run_clients(oracle, draft, clients: str, systems: str | None, workload: str | None, reps: int,
                 max_prompts: int | None, max_tokens: int | None, threads: int | None, anchor_bin: str | None,
                 json_path: str | None, markdown_path: str | None, progress: Callable[[str], None],
                 echo: Callable[[str], None], base_tree: str | None = None) -> dict:
    """`--clients 1,4,8`: the serving benchmark (localspec.bench.clients); `base_tree`: a checkout
    served as "localspec-base" (first, where --systems does not choose)."""
    from localspec.llama.backend import default_threads
    from localspec.models import Registry

    from localspec.bench import clients as cl
    from localspec.bench import clients_report as cr

    registry = Registry.load()
    config = cl.ClientsConfig(
        oracle=str(registry.resolve(oracle, progress=progress)),
        draft=str(registry.resolve(draft, progress=progress)) if draft else None,
        clients=_client_counts(clients), systems=_client_systems(systems, base_tree),
        workloads=_names(workload or "open", cl.cw.CLIENT_WORKLOADS, "workloads"), reps=reps,
        threads=threads or default_threads(), anchor_bin=anchor_bin, base_tree=base_tree, max_tokens=max_tokens,
        max_prompts=max_prompts)
    report = cl.run_clients_bench(config, progress=progress)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1), "utf-8")
        progress(f"wrote {json_path}")
    text = cr.markdown(report)
    if markdown_path:
        Path(markdown_path).write_text(text, "utf-8")
        progress(f"wrote {markdown_path}")
    echo(text)
    return report


def _client_counts(clients: str) -> list[int]:
    try:
        counts = sorted({int(n) for n in clients.split(",") if n.strip()})
    except ValueError:
        raise ValueError(f"--clients: give client counts such as 1,4,8 (got {clients!r})") from None
    if not counts or min(counts) < 1:
        raise ValueError("--clients: counts of at least 1")
    return counts


def _client_systems(given: str | None, base_tree: str | None) -> list[str]:
    """--systems of the serving benchmark: all but `clients.ASKED_ONLY` by default; localspec-base
    runs only from a --base-tree (then it is among the defaults, and either way asked for it needs one)."""
    from localspec.bench import clients as cl

    if given is None:
        return [s for s in cl.SYSTEMS if s not in cl.ASKED_ONLY or s == "localspec-base" and base_tree]
    names = _names(given, cl.SYSTEMS, "systems")
    if "localspec-base" in names and not base_tree:
        raise ValueError("localspec-base is localspec served from another checkout: give it with --base-tree DIR")
    return names


def _names(given: str | None, known: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated choice among `known` (all of them when none is given)."""
    names = list(dict.fromkeys(s.strip() for s in given.split(",") if s.strip())) if given else list(known)
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise ValueError(f"--clients runs these {what}: {', '.join(known)} (not {', '.join(unknown) or 'none'})")
    return names
