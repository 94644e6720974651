"""Run a benchmark: every system on the same prompts, models and thread count, in one run.

- Each localspec / llama-cpp-python system is loaded once, in its own worker process (so its peak
  RSS is its own), and warmed up once; model loading is not measured.
- The C++ anchor is one process per generation (it reports its decode time itself).
- Repetitions are interleaved: rep 1 of every system on every prompt, then rep 2, ...; within a
  prompt the system order rotates, so slow drifts in machine load hit every system alike.
- Speedups are ratios to the baseline's run of the same prompt in the same repetition, medianed
  over repetitions per prompt, then a geometric mean over prompts.
- With `paired`, every localspec system with drafting also runs each prompt with drafting switched
  off, in its own process, right before or after (alternating) its own run: the paired speedup is the
  ratio of the two. It removes process-to-process speed differences (several percent on a shared VM)
  from the comparison, at the cost of running those prompts twice.
- With `one_shot`, every localspec system also runs each prompt (in every repetition) the way a
  user's script does: a fresh `localspec generate --json` process, timed from its start to its exit
  (model files already in the cache; the costs a previous process kept are used, as a user's would
  be). The C++ anchor's figure is its own process's wall time, the same measure.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from localspec.llama.backend import default_threads
from localspec.options import DEFAULT_CTX

from localspec.bench import anchor
from localspec.bench.ceiling import percentile
from localspec.bench.machine import load_average, machine_info
from localspec.bench.report import aggregate
from localspec.bench.systems import LLAMA_CPP, LLAMA_CPP_PYTHON, LOCALSPEC, SystemSpec, parse_systems
from localspec.bench.workloads import BenchPrompt

SCHEMA = "localspec-bench/1"
WARMUP_TOKENS = 16
# the warm-up's sampled requests (each drafting localspec system's, in its own process): what a
# server that answers OpenAI clients sees between greedy requests (temperature 1 when they set none)
MIXED_WARMUP = 12
MIXED_WARMUP_TOKENS = 48
MIXED_WARMUP_TEMPERATURES = (1.0, 0.7)


class BenchError(RuntimeError):
    """The benchmark cannot run (e.g. the baseline does not load)."""


@dataclass
class BenchConfig:
    oracle: str  # model name or GGUF path
    draft: str | None  # model name or path; None: systems that need a draft model are skipped
    prompts: Sequence[BenchPrompt]
    systems: Sequence[SystemSpec] = field(default_factory=lambda: parse_systems(None))
    reps: int = 3
    threads: int | None = None  # None: every core this process may use
    n_ctx: int = 4096
    pair: str | None = None
    anchor_bin: str | None = None  # directory of the anchor binaries (default: the cache)
    cross_tokenizer: bool = False  # the draft's vocabulary differs from the oracle's (drafting through text)
    paired: bool = False  # also time each localspec system with drafting off, in its own process
    one_shot: bool = False  # also time each localspec system as a fresh `localspec generate` process
    warmup: bool = True
    mixed_warmup: int = MIXED_WARMUP  # sampled requests each drafting localspec system answers before the runs
    temperature: float = 0.0  # every timed run's: 0 greedy; above it sampled, unseeded (no greedy match then)
    progress: Callable[[str], None] | None = None


# ------------------------------------------------------------------------------------ workers


class Worker:
    """A `python -m localspec.bench.worker` process serving one system."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.info: dict = {}
        self.log = tempfile.NamedTemporaryFile(prefix=f"localspec-bench-{_safe(name)}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "localspec.bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, encoding="utf-8",
                                     bufsize=1)

    def call(self, **msg) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise RuntimeError(f"the {self.name} worker died; its log: {self.log.name}\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "worker error"))
        return reply

    def log_tail(self, n: int = 10) -> str:
        return anchor.file_tail(self.log.name, n)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="quit")
            except Exception:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        anchor.discard_log(self.log)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


# ------------------------------------------------------------------------------------ the run


def run_bench(config: BenchConfig) -> dict:
    """Run the benchmark and return the report (a JSON-able dict; see report.py for its fields)."""
    say = config.progress or (lambda _msg: None)
    if config.reps < 1:
        raise ValueError("reps must be >= 1")
    if not config.prompts:
        raise ValueError("no prompts to run")
    threads = config.threads or default_threads()
    models = _resolve_models(config, say)
    started = _dt.datetime.now(_dt.timezone.utc)
    machine = machine_info(threads)
    bench = _Bench(config, say, threads, models, _with_baseline(config.systems))
    try:
        bench.load_systems()
        bench.prepare_prompts()
        if config.warmup:
            bench.warm_up()
        runs, outputs, elapsed = bench.timed_runs()
        bench.record_workers_rss()
    finally:
        bench.close()
    bench.record_anchor_rss(runs)
    if not config.temperature:  # sampled texts part wherever the draws do
        _add_matches(runs, outputs)
    machine["load_average_end"] = load_average()
    report = {
        "schema": SCHEMA,
        "created": started.isoformat(timespec="seconds"),
        "elapsed_seconds": round(elapsed, 1),
        "machine": machine,
        "config": _config_section(config, models, threads, bench.prepared),
        "systems": [{**spec.to_dict(), **bench.status[spec.name]} for spec in bench.systems],
        "runs": runs,
        "notes": bench.notes,
    }
    report["results"] = aggregate(report)
    _keep_latency_percentiles(runs)
    return report


def _resolve_models(config: BenchConfig, say: Callable[[str], None]) -> dict:
    """The oracle's and the draft's GGUF paths (fetched if need be), as the workers take them."""
    from localspec.models import Registry

    registry = Registry.load()
    oracle_path = str(registry.resolve(config.oracle, progress=say))
    draft_path = str(registry.resolve(config.draft, progress=say)) if config.draft else None
    return {"oracle": oracle_path, "draft": draft_path, "oracle_path": oracle_path,
            "cross_tokenizer": config.cross_tokenizer}


def _with_baseline(systems: Sequence[SystemSpec]) -> list[SystemSpec]:
    """The systems to run, the baseline first unless they name it."""
    systems = list(systems)
    if not any(s.is_baseline for s in systems):
        systems.insert(0, parse_systems([])[0])
    return systems


def _config_section(config: BenchConfig, models: dict, threads: int, prepared: dict) -> dict:
    """The report's "config": what was run, on which models, how often, with which prompts."""
    return {
        "pair": config.pair, "oracle": config.oracle, "draft": config.draft,
        "cross_tokenizer": config.cross_tokenizer,
        "oracle_path": models["oracle"], "draft_path": models["draft"], "threads": threads, "n_ctx": config.n_ctx,
        "reps": config.reps, "temperature": config.temperature, "paired": config.paired, "one_shot": config.one_shot,
        "mixed_warmup": {"requests": config.mixed_warmup if config.warmup else 0, "max_tokens": MIXED_WARMUP_TOKENS,
                         "temperatures": list(MIXED_WARMUP_TEMPERATURES)},
        "workloads": sorted({p.workload for p in config.prompts}),
        "prompts": [{"workload": p.workload, "id": p.id, "max_tokens": p.max_tokens,
                     "prompt_tokens": len(prepared[(p.workload, p.id)]["tokens"])} for p in config.prompts],
    }


def _keep_latency_percentiles(runs: list[dict]) -> None:
    """Per-token latencies are in the aggregates; the runs keep only their p50 and p95 (a small JSON)."""
    for r in runs:
        lat = r.pop("latencies", [])
        r["latency_p50"] = percentile(lat, 50) if lat else None
        r["latency_p95"] = percentile(lat, 95) if lat else None


class _Bench:
    """One benchmark run's systems as it goes: their status ("ok" or "skipped" with a reason, their
    load info and peak RSS), their worker processes, the anchor's binaries, the prompts as the
    baseline tokenized them, and notes for the report."""

    def __init__(self, config: BenchConfig, say: Callable[[str], None], threads: int, models: dict,
                 systems: list[SystemSpec]) -> None:
        self.config, self.say, self.threads, self.models, self.systems = config, say, threads, models, systems
        self.status: dict[str, dict] = {s.name: {"status": "ok", "info": {}} for s in systems}
        self.workers: dict[str, Worker] = {}
        self.anchor_bins: dict[str, Path] = {}
        self.notes: list[str] = []
        self.prepared: dict[tuple[str, str], dict] = {}  # (workload, prompt id) -> the baseline's "prepare" reply

    def skip(self, spec: SystemSpec, reason: str) -> None:
        """Take a system out of the rest of the run, saying why."""
        self.status[spec.name] = {"status": "skipped", "reason": reason,
                                  "info": self.status[spec.name].get("info", {})}
        self.say(f"{spec.name}: skipped: {reason}")

    def load_systems(self) -> None:
        """Find each C++ anchor's binary and load every other system in a worker of its own; a system
        that cannot is skipped, a baseline that cannot is a BenchError."""
        for spec in self.systems:
            if spec.uses_draft_model and not self.models["draft"]:
                self.skip(spec, "no draft model given")
            elif spec.kind == LLAMA_CPP_PYTHON and self.config.temperature:
                self.skip(spec, "llama-cpp-python's runs are greedy")
            elif spec.kind == LLAMA_CPP:
                self._find_anchor(spec)
            else:
                self._load_worker(spec)

    def _find_anchor(self, spec: SystemSpec) -> None:
        try:
            self.anchor_bins[spec.name] = anchor.find_binary(spec.params["binary"], self.config.anchor_bin)
            anchor.Flags.detect(str(self.anchor_bins[spec.name]))
        except anchor.AnchorUnavailable as e:
            self.skip(spec, str(e))

    def _load_worker(self, spec: SystemSpec) -> None:
        self.say(f"loading {spec.name} ...")
        w = Worker(spec.name)
        try:
            reply = w.call(op="load", system=spec.to_dict(), models=self.models, n_ctx=self.config.n_ctx,
                           threads=self.threads)
            self.status[spec.name]["info"] = w.info = reply["info"]
            self.workers[spec.name] = w
        except Exception as e:
            w.close()
            if spec.is_baseline:
                raise BenchError(f"the baseline does not load: {e}") from e
            self.skip(spec, f"does not load: {_first_line(e)}")

    def prepare_prompts(self) -> None:
        """Have the baseline tokenize every prompt (and render the anchor's text); note the prompts
        whose anchor text does not tokenize to the same tokens, when an anchor runs."""
        prompts = self.config.prompts
        prepared = self.workers["baseline"].call(op="prepare", prompts=[p.to_dict() for p in prompts])["prompts"]
        self.prepared = {(p.workload, p.id): prep for p, prep in zip(prompts, prepared)}
        mismatched = [p["id"] for p in prepared if not p["anchor_tokens_match"]]
        if mismatched and self.anchor_bins:
            self.notes.append("the C++ anchor's prompt text does not tokenize to exactly localspec's prompt tokens "
                              "for: " + ", ".join(mismatched))

    def tokens(self, prompt: BenchPrompt) -> list[int]:
        return self.prepared[(prompt.workload, prompt.id)]["tokens"]

    def warm_up(self) -> None:
        """Untimed: one short greedy run of the first prompt per worker, then each drafting localspec
        system's sampled requests, then (with one_shot) one `localspec generate` process."""
        first = self.config.prompts[0]
        for spec in self.systems:
            if spec.name in self.workers:
                self._warm_up_greedy(spec, first)
        for spec in self.systems:
            if (spec.name in self.workers and spec.kind == LOCALSPEC and spec.params.get("draft") is not None
                    and self.config.mixed_warmup):
                self._warm_up_sampled(spec)
        if self.config.one_shot:  # one untimed process first: bytecode cached and files paged in, as for a user
            one_shot_run(next(s for s in self.systems if s.is_baseline), replace(first, max_tokens=WARMUP_TOKENS),
                         self.models, self.threads, self.config.n_ctx)

    def _warm_up_greedy(self, spec: SystemSpec, prompt: BenchPrompt) -> None:
        self.say(f"warming up {spec.name} ...")
        try:
            self.workers[spec.name].call(op="run", tokens=self.tokens(prompt),
                                         max_tokens=min(WARMUP_TOKENS, prompt.max_tokens), json_schema=_schema(prompt))
        except Exception as e:
            if spec.is_baseline:
                raise BenchError(f"the baseline failed to warm up: {e}") from e
            self.skip(spec, f"failed to warm up: {_first_line(e)}")

    def _warm_up_sampled(self, spec: SystemSpec) -> None:
        """config.mixed_warmup sampled requests over the prompts in turn, MIXED_WARMUP_TEMPERATURES in turn."""
        prompts = self.config.prompts
        self.say(f"warming up {spec.name} with {self.config.mixed_warmup} sampled requests ...")
        for j in range(self.config.mixed_warmup):
            prompt = prompts[j % len(prompts)]
            try:
                self.workers[spec.name].call(
                    op="run", tokens=self.tokens(prompt), max_tokens=min(MIXED_WARMUP_TOKENS, prompt.max_tokens),
                    json_schema=_schema(prompt),
                    temperature=MIXED_WARMUP_TEMPERATURES[j % len(MIXED_WARMUP_TEMPERATURES)])
            except Exception as e:
                self.skip(spec, f"failed to warm up: {_first_line(e)}")
                break

    def timed_runs(self) -> tuple[list[dict], dict[tuple[str, str, str, int], dict], float]:
        """Every repetition of every prompt on every system still running, interleaved (see the module
        docstring): (run records, outputs by (system, workload, prompt id, rep), seconds taken)."""
        prompts = self.config.prompts
        active = [s for s in self.systems if self.status[s.name]["status"] == "ok"]
        runs: list[dict] = []
        outputs: dict[tuple[str, str, str, int], dict] = {}  # (system, workload, id, rep) -> tokens/text
        total = self.config.reps * len(prompts) * len(active)
        done = 0
        t_run = time.perf_counter()
        for rep in range(self.config.reps):
            for i, prompt in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(active)
                for spec in active[shift:] + active[:shift]:
                    if self.status[spec.name]["status"] != "ok":
                        continue
                    done += 1
                    result = self._run(spec, prompt, rep, paired_first=(rep + i) % 2 == 0)
                    if result is None:
                        continue
                    record, output = result
                    runs.append(record)
                    outputs[(spec.name, prompt.workload, prompt.id, rep)] = output
                    self.say(_progress_line(done, total, rep, prompt, spec, record))
        return runs, outputs, time.perf_counter() - t_run

    def _run(self, spec: SystemSpec, prompt: BenchPrompt, rep: int, paired_first: bool) -> tuple[dict, dict] | None:
        """One timed run (see _run_one); None when it failed and the system is skipped from now on."""
        try:
            return _run_one(spec, prompt, self.prepared[(prompt.workload, prompt.id)], rep, self.workers,
                            self.anchor_bins, self.models, self.threads, self.config.n_ctx, paired=self.config.paired,
                            paired_first=paired_first, one_shot=self.config.one_shot,
                            temperature=self.config.temperature)
        except Exception as e:
            if spec.is_baseline:
                raise BenchError(f"the baseline failed on {prompt.id}: {e}") from e
            self.skip(spec, f"failed on {prompt.id}: {_first_line(e)}")
            return None

    def record_workers_rss(self) -> None:
        """Each worker's peak RSS (where it still answers)."""
        for name, w in self.workers.items():
            try:
                self.status[name]["peak_rss"] = w.call(op="rss")["peak_rss"]
                self.status[name]["peak_rss_scope"] = "the system's own worker process (model load included)"
            except Exception:
                pass

    def record_anchor_rss(self, runs: list[dict]) -> None:
        """Each C++ anchor's peak RSS: the largest of its runs' processes."""
        for spec in self.systems:
            if spec.kind == LLAMA_CPP:
                rss = [r["peak_rss"] for r in runs if r["system"] == spec.name and r.get("peak_rss")]
                if rss:
                    self.status[spec.name]["peak_rss"] = max(rss)
                    self.status[spec.name]["peak_rss_scope"] = "the largest of its per-generation processes (wait4)"

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def _progress_line(done: int, total: int, rep: int, prompt: BenchPrompt, spec: SystemSpec, record: dict) -> str:
    paired_tps = record.get("paired_tokens_per_second")
    return (f"[{done}/{total}] rep {rep + 1} {prompt.id} {spec.name}: "
            f"{record['tokens_per_second']:.1f} tok/s ({record['completion_tokens']} tokens)"
            + (f", drafting off {paired_tps:.1f} tok/s" if paired_tps else "")
            + (f", one-shot {record['one_shot_wall']:.2f} s" if record.get("one_shot_wall") else ""))


def _schema(prompt: BenchPrompt) -> dict | None:
    """A structured workload's schema, for localspec's workers (the C++ anchor runs unconstrained)."""
    return json.loads(prompt.json_schema) if prompt.json_schema is not None else None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _run_one(spec: SystemSpec, prompt: BenchPrompt, prep: dict, rep: int, workers: dict[str, Worker],
             anchor_bins: dict[str, Path], models: dict, threads: int, n_ctx: int, *, paired: bool = False,
             paired_first: bool = True, one_shot: bool = False, temperature: float = 0.0) -> tuple[dict, dict]:
    base = {"system": spec.name, "workload": prompt.workload, "prompt_id": prompt.id, "rep": rep,
            "prompt_tokens": len(prep["tokens"]), "max_tokens": prompt.max_tokens}
    if spec.kind == LLAMA_CPP:
        r = anchor.run(anchor_bins[spec.name], oracle=models["oracle"], draft=models["draft"],
                       prompt_text=prep["anchor_text"], prompt_echo=prep["echo"], n_predict=prompt.max_tokens,
                       k=spec.params["k"], threads=threads, n_ctx=n_ctx, spec_type=spec.params.get("spec_type"),
                       flash_attn=spec.params.get("flash_attn"), temperature=temperature)
        n_accept, n_drafted = r.get("n_accept") or 0, r.get("n_drafted") or 0
        n_predict = r.get("n_predict") if r.get("n_predict") is not None else r["completion_tokens"]
        record = {**base, "completion_tokens": r["completion_tokens"], "decode_time": r["decode_time"],
                  "tokens_per_second": r["tokens_per_second"], "ttft": None,
                  "drafted": n_drafted, "accepted": n_accept, "steps": max(0, n_predict - n_accept),
                  "finish_reason": None, "latencies": [], "peak_rss": r.get("peak_rss"),
                  "anchor_prompt_tokens": r.get("prompt_tokens"), "one_shot_wall": r["wall_time"]}
        if rep == 0:  # the same command line every time but for the prompt file and -n
            record["anchor_command"] = " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(r["command"]))
        return record, {"text": r["text"], "tokens": None}
    w = workers[spec.name]

    def drafting_off() -> dict:
        return w.call(op="run", tokens=prep["tokens"], max_tokens=prompt.max_tokens, speculative=False,
                      json_schema=_schema(prompt), temperature=temperature)["result"]

    off = None
    paired = paired and spec.kind == LOCALSPEC and not spec.is_baseline
    if paired and paired_first:
        off = drafting_off()
    r = w.call(op="run", tokens=prep["tokens"], max_tokens=prompt.max_tokens, json_schema=_schema(prompt),
               temperature=temperature)["result"]
    if paired and not paired_first:
        off = drafting_off()
    latencies: list[float] = []
    prev = None
    for t, n in r["chunks"]:
        if prev is not None and n > 0:
            latencies.extend([(t - prev) / n] * n)
        if n > 0:
            prev = t
    record = {**base, "completion_tokens": r["completion_tokens"], "decode_time": r["decode_time"],
              "tokens_per_second": r["tokens_per_second"], "ttft": r["ttft"], "drafted": r["drafted"],
              "accepted": r["accepted"], "steps": r["steps"], "draft_lengths": r.get("draft_lengths"),
              "finish_reason": r["finish_reason"], "latencies": latencies, "records": r.get("records")}
    stats = r.get("stats") or {}
    record.update({k: stats[k] for k in ("host_ms_per_token", "host_ms_per_step", "host_draft_time", "host_verify_time",
                                         "host_other_time") if k in stats})
    if off is not None:  # its one-token passes, in this process, inform the ceiling's cost fit too
        record["paired_tokens_per_second"] = off["tokens_per_second"]
        record["paired_records"] = off.get("records")
    if one_shot and spec.kind == LOCALSPEC:
        shot = one_shot_run(spec, prompt, models, threads, n_ctx, temperature)
        if shot is not None:
            record.update(one_shot_wall=shot["wall"], one_shot_tokens=shot["completion_tokens"],
                          one_shot_ttft=shot["ttft"])
    return record, {"text": r["text"], "tokens": r["tokens"]}


def one_shot_command(spec: SystemSpec, prompt: BenchPrompt, models: dict, threads: int, n_ctx: int,
                     temperature: float = 0.0) -> list[str] | None:
    """`localspec generate ... --json` for this system and prompt, as a user would type it; None for a
    prompt that one command line cannot express (chat messages other than an optional system message
    and one user message)."""
    cmd = [sys.executable, "-m", "localspec.cli", "generate", "--json", "--max-tokens", str(prompt.max_tokens),
           "--oracle", models["oracle"], "--threads", str(threads)]
    if n_ctx != DEFAULT_CTX:  # else the context `generate` sizes for the prompt, as a user gets it
        cmd += ["--ctx", str(n_ctx)]
    if temperature:
        cmd += ["--temperature", f"{temperature:g}"]
    if prompt.messages is not None:
        roles = [m["role"] for m in prompt.messages]
        if roles not in (["user"], ["system", "user"]):
            return None
        if roles[0] == "system":
            cmd += ["--system", prompt.messages[0]["content"]]
        text = prompt.messages[-1]["content"]
    else:
        cmd.append("--raw")
        text = prompt.prompt
    params = spec.params
    if params.get("draft") is None:
        cmd.append("--no-draft")
    elif params["draft"] == "ngram":
        cmd += ["--draft", "ngram"]
    else:
        cmd += ["--draft", models["draft"]] + (["--cross-tokenizer"] if models.get("cross_tokenizer") else [])
        if not params.get("lookup"):
            cmd.append("--no-lookup")
    if params.get("draft") is not None and params.get("draft_length") is not None:
        cmd += ["--draft-length", str(params["draft_length"])]
    if params.get("flash_attn"):
        cmd += ["--flash-attn", params["flash_attn"]]
    return cmd + ["--", text]


def one_shot_env() -> dict[str, str]:
    """A one-shot process's environment: this one's, except that Python may cache bytecode. An
    installed localspec has its modules compiled at install time (pip does that); with
    PYTHONDONTWRITEBYTECODE set (some CI and container images set it) an editable checkout would
    compile them from source in every process instead, ~40 ms that no user's `localspec generate`
    pays, in the baseline's wall time and localspec's alike."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def one_shot_run(spec: SystemSpec, prompt: BenchPrompt, models: dict, threads: int, n_ctx: int,
                 temperature: float = 0.0) -> dict | None:
    """Run a fresh `localspec generate` process; its wall time from start to exit, and its stats."""
    cmd = one_shot_command(spec, prompt, models, threads, n_ctx, temperature)
    if cmd is None:
        return None
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", timeout=1800, env=one_shot_env())
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"one-shot `localspec generate` exited with {p.returncode}: {p.stderr.strip()[-500:]}")
    stats = json.loads(p.stdout)["stats"]
    return {"wall": wall, "completion_tokens": stats["completion_tokens"], "ttft": stats["time_to_first_token"]}


def _add_matches(runs: list[dict], outputs: dict) -> None:
    """Greedy match against the baseline's output of the same prompt in the same repetition:
    the common prefix over the longer of the two (tokens; text characters for the C++ anchor)."""
    for r in runs:
        key = (r["system"], r["workload"], r["prompt_id"], r["rep"])
        ref = outputs.get(("baseline", r["workload"], r["prompt_id"], r["rep"]))
        out = outputs.get(key)
        if ref is None or out is None:
            r["match"] = None
            continue
        if out["tokens"] is not None:
            a, b, unit = ref["tokens"], out["tokens"], "tokens"
        else:
            a, b, unit = ref["text"], out["text"][:len(ref["text"])], "chars"
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        longest = max(len(a), len(b))
        r["match"] = n / longest if longest else 1.0
        r["match_unit"] = unit
        r["first_divergence"] = None if n == longest else n
