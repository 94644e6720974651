"""`localspec bench --clients 1,4,8`: servers under several clients at once, as a team or a chat UI
and an agent use one.

For each workload (client_workloads: open-ended prompts, records in one format, an agent loop), each
number of clients N and each repetition, every system is started afresh as a server with N slots
(`localspec serve --parallel N`, llama.cpp's `llama-server -np N` with its speculative types, the
same GGUF files, threads, context per slot, flash attention as localspec's "auto" resolves it and no
weight repacking), warmed up with one round of N short requests none of the workloads asks, then N
clients at once work through the workload's conversations, streaming greedy answers through the
OpenAI API (`/v1/chat/completions`); records runs its queue twice on the same server (pass 2: what
the server learned from pass 1). Measured per pass: the aggregate tokens/s (every request's tokens
over the wall time from the first request to the last token), each request's time to first token
(by turn, for the agent loop) and its own tokens/s, the draft tokens each server reports (localspec:
by source, from /metrics), and every answer's text. llama.cpp's plain batched decoding of the oracle
alone (`llama-batched-bench`, N sequences) is the reference line. The programs come from
scripts/build_llama_anchor.sh (the llama.cpp of the installed llama-cpp-python) or --anchor-bin.

Every localspec server starts from the costs and acceptance learned before the run (a copy of the
cost cache as the run found it, one copy per server): what one server learns reaches neither the
next system's start (an A/B of `localspec-base` against this checkout compares the code, not the
order they ran in) nor the user's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from localspec.bench import anchor
from localspec.bench import client_workloads as cw
from localspec.bench.client_workloads import CLIENT_PROMPTS, Workload  # noqa: F401  (CLIENT_PROMPTS: tests use it)
from localspec.llama.context import resolve_flash_attn

# localspec serve's flags per system: today's default (the suffix cache on), as it was before the cache, no draft model
LOCALSPEC_SYSTEMS = {"localspec": (), "localspec-no-suffix": ("--suffix-cache-tokens", "0"),
                     "localspec-no-prompt-cache": ("--prompt-cache-mib", "0"),
                     "localspec-no-caches": ("--suffix-cache-tokens", "0", "--prompt-cache-mib", "0"),
                     "localspec-no-draft": ("--no-draft",),
                     # llama.cpp's CPU threads at one (the later --threads wins): where every layer is on a
                     # GPU they only look up embedding rows, and OpenMP's workers may take the cores the
                     # server's Python threads need
                     "localspec-no-draft-1-thread": ("--no-draft", "--threads", "1"),
                     # localspec served from another checkout (`base_tree`: an earlier commit's worktree)
                     "localspec-base": ()}
# llama-server's --spec-type per system (draft-simple: the draft model; -md alone drafts nothing)
LLAMA_SERVER_SYSTEMS = {"llama-server": (), "llama-server-draft": ("draft-simple",),
                        "llama-server-ngram-mod": ("ngram-mod",), "llama-server-ngram-cache": ("ngram-cache",),
                        "llama-server-ngram-mod-draft": ("ngram-mod", "draft-simple"),
                        "llama-server-ngram-cache-draft": ("ngram-cache", "draft-simple")}
SYSTEMS = (*LOCALSPEC_SYSTEMS, *LLAMA_SERVER_SYSTEMS)
ASKED_ONLY = ("localspec-base", "localspec-no-draft-1-thread")  # not among the defaults: run when named
WARMUP_TOKENS = 32
SCHEMA = "localspec-bench-clients/2"


class ServingError(RuntimeError):
    pass


@dataclass
class Reply:
    """One request of one conversation, as its client saw it. Times in seconds from the pass's start."""

    conversation: str
    turn: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None  # from the request to its first content
    tokens: int = 0
    text: str = ""
    drafted: int | None = None  # draft tokens the server reports for it (None: it reports none)
    accepted: int | None = None
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tokens_per_second(self) -> float:
        """The request's own decoding speed: its tokens after the first over the time after it."""
        if self.ttft is None or self.tokens <= 1 or self.seconds <= self.ttft:
            return 0.0
        return (self.tokens - 1) / (self.seconds - self.ttft)


@dataclass
class Pass:
    """Every request of one pass through a workload, in the workload's order (conversation, turn)."""

    replies: list[Reply] = field(default_factory=list)
    wall: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    @property
    def aggregate(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0


def _read_event(event: dict, reply: Reply, pieces: list[str], t0: float) -> None:
    """One streamed chunk: its content, and the final chunk's usage (localspec: drafted and accepted
    there; llama-server: in its `timings`)."""
    usage, timings = event.get("usage"), event.get("timings") or {}
    if usage:
        reply.tokens = usage.get("completion_tokens", reply.tokens)
        if "drafted" in usage:
            reply.drafted, reply.accepted = usage["drafted"], usage.get("accepted")
    if usage and "draft_n" in timings:
        reply.drafted, reply.accepted = timings["draft_n"], timings.get("draft_n_accepted")
    for choice in event.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            if reply.ttft is None:
                reply.ttft = time.perf_counter() - t0 - reply.start
            pieces.append(piece)


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int, reply: Reply, t0: float,
                timeout: float) -> None:
    """Send one greedy streamed chat request and fill in `reply` (times from `t0`)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    reply.start = time.perf_counter() - t0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                reply.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
            for line in r.iter_lines() if reply.error is None else ():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    _read_event(json.loads(line[6:]), reply, pieces, t0)
    except Exception as e:  # a request that failed is reported, not fatal to the run
        reply.error = f"{type(e).__name__}: {e}"
    reply.end = time.perf_counter() - t0
    reply.text = "".join(pieces)
    if not reply.tokens:
        reply.tokens = len(pieces)  # a server without usage: its chunks


def _conversation(url: str, model: str, workload: Workload, index: int, t0: float, timeout: float) -> list[Reply]:
    """One conversation's requests in turn, each after the reply before it (a failed one ends it)."""
    conversation, replies = workload.conversations[index], []
    for turn in range(conversation.turns):
        reply = Reply(conversation.id, turn)
        stream_chat(url, model, conversation.request([r.text for r in replies]), workload.max_tokens, reply, t0,
                    timeout)
        replies.append(reply)
        if reply.error:
            break
    return replies


def run_pass(url: str, model: str, workload: Workload, n_clients: int, *, timeout: float = 600) -> Pass:
    """N clients at once (released together) working through the workload's conversations as one
    queue: each takes the next one when it is done with one."""
    done: list[list[Reply]] = [[] for _ in workload.conversations]
    queue, lock = iter(range(len(workload.conversations))), threading.Lock()
    barrier = threading.Barrier(n_clients + 1)
    t0: list[float] = []

    def client() -> None:
        barrier.wait()
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            done[index] = _conversation(url, model, workload, index, t0[0], timeout)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n_clients)]
    for t in threads:
        t.start()
    t0.append(time.perf_counter())
    barrier.wait()
    for t in threads:
        t.join()
    replies = [r for conversation in done for r in conversation]
    return Pass(replies, wall=max((r.end for r in replies), default=0.0))


def warmup_workload(n_clients: int) -> Workload:
    """N short requests none of the workloads asks."""
    prompts = cw.WARMUP_PROMPTS
    return Workload("warmup", tuple(cw.Conversation(f"warmup-{i + 1}", ({"role": "user",
                                                                         "content": prompts[i % len(prompts)]},))
                                    for i in range(n_clients)), WARMUP_TOKENS, ctx_per_slot=256)


# ------------------------------------------------------------------------------------ servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback, its log in a temporary file."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None, cwd: str | None = None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"localspec-serve-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServingError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise ServingError(f"{self.name} did not come up in {timeout} s: {self.tail()}")

    def tail(self, n: int = 8) -> str:
        return anchor.file_tail(self.log.name, n)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        anchor.discard_log(self.log)


ALL_LAYERS = "999"
CTX_PER_SLOT = 1024  # llama-batched-bench's context per sequence


def _placement() -> list[str]:
    """llama.cpp's flags for where its server and batched bench run, as `localspec serve` runs by
    default: every layer offloaded where there is a GPU (none here: the CPU), flash attention as
    localspec's "auto" resolves it (on with a local GPU, off on the CPU, where it slows multi-token
    passes), CPU weights not repacked (as localspec's bindings: the same kernels)."""
    return ["-ngl", ALL_LAYERS, "-fa", resolve_flash_attn("auto", n_gpu_layers=-1), "--no-repack"]


def server_argv(system: str, *, port: int, n_slots: int, oracle: str, draft: str | None, threads: int,
                anchor_bin: str | None, model_name: str, ctx_per_slot: int = CTX_PER_SLOT) -> list[str]:
    """The command line that serves `system` on `port`."""
    if system in LOCALSPEC_SYSTEMS:
        argv = [sys.executable, "-m", "localspec.cli", "serve", "--port", str(port), "--parallel", str(n_slots),
                "--ctx", str(ctx_per_slot), "--threads", str(threads), "--oracle", oracle, "--max-queue", "64",
                "--model-name", model_name, *LOCALSPEC_SYSTEMS[system]]
        if "--no-draft" not in LOCALSPEC_SYSTEMS[system]:
            argv += ["--draft", draft] if draft is not None else ["--no-draft"]
        return argv
    if system not in LLAMA_SERVER_SYSTEMS:
        raise ServingError(f"no such system: {system}")
    binary = str(anchor.find_binary("llama-server", anchor_bin))
    argv = [binary, "-m", oracle, "--port", str(port), "--host", "127.0.0.1", "-np", str(n_slots),
            "-c", str(ctx_per_slot * n_slots), "-t", str(threads), *_placement(), "--no-webui"]
    return argv + _llama_spec_flags(LLAMA_SERVER_SYSTEMS[system], draft, threads)


def start_server(system: str, *, base_tree: str | None = None, costs: str | None = None, **kw) -> Server:
    """`system` serving on a free port of loopback (`kw`: server_argv's). "localspec-base" runs
    the localspec of the checkout at `base_tree` (its package first on the path), with this one's
    Python and models. `costs`: the cost cache a localspec server learns in (its
    $LOCALSPEC_COST_CACHE; None: the user's)."""
    port = _free_port()
    env = {**os.environ, "LOCALSPEC_COST_CACHE": costs} if costs is not None and system in LOCALSPEC_SYSTEMS else None
    if system != "localspec-base":
        return Server(system, server_argv(system, port=port, **kw), port, env=env)
    if not base_tree or not (Path(base_tree) / "localspec" / "cli").is_dir():
        raise ServingError(f"localspec-base needs --base-tree: a localspec checkout (got {base_tree!r})")
    tree = str(Path(base_tree).resolve())
    env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))}
    return Server(system, server_argv(system, port=port, **kw), port, env=env, cwd=tree)


def cost_snapshot(into: Path) -> Path:
    """A copy of the cost cache as it is now (`runtime.learning.CostStore`'s folder; an empty
    folder where there is none yet), at `into`."""
    from localspec.runtime.learning import CostStore

    source = CostStore().directory
    if source.is_dir():
        shutil.copytree(source, into)
    else:
        into.mkdir(parents=True)
    return into


def _llama_spec_flags(spec_types: tuple[str, ...], draft: str | None, threads: int) -> list[str]:
    """llama-server's speculative flags: its --spec-type list, and the draft model for draft-simple."""
    if not spec_types:
        return []
    flags = ["--spec-type", ",".join(spec_types)]
    if "draft-simple" in spec_types:
        if draft is None:
            raise ServingError("no draft model")
        flags += ["-md", draft, "-ngld", ALL_LAYERS, "--spec-draft-threads", str(threads)]
    return flags


def batched_bench(*, oracle: str, n_clients: list[int], prompt_tokens: int, max_tokens: int, threads: int,
                  anchor_bin: str | None, unified_kv: bool = False) -> dict[int, float]:
    """llama.cpp's plain batched decoding of the oracle alone: N sequences' generation tokens/s
    (`unified_kv`: one KV cache all sequences attend over, not a stream per sequence)."""
    binary = str(anchor.find_binary("llama-batched-bench", anchor_bin))
    argv = [binary, "-m", oracle, "-c", str(CTX_PER_SLOT * max(n_clients)), "-b", "512", "-ub", "512",
            "-npp", str(prompt_tokens), "-ntg", str(max_tokens), "-npl", ",".join(map(str, n_clients)),
            "-t", str(threads), *_placement()] + (["-kvu"] if unified_kv else [])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    out = {}
    for line in (p.stdout + p.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            out[int(cells[2])] = float(cells[7])  # B, S_TG t/s
    if not out:
        raise ServingError(f"llama-batched-bench printed no table: {(p.stdout + p.stderr)[-500:]}")
    return out


# ------------------------------------------------------------------------------------ the run


@dataclass
class ClientsConfig:
    """What one `localspec bench --clients` run measures."""

    oracle: str
    draft: str | None
    clients: list[int]
    systems: list[str]
    workloads: list[str] = field(default_factory=lambda: ["open"])
    reps: int = 1
    threads: int = 1
    anchor_bin: str | None = None
    base_tree: str | None = None  # the checkout "localspec-base" serves from
    model_name: str = "bench"
    max_tokens: int | None = None  # every workload's (default: its own)
    max_prompts: int | None = None  # at most this many records listings
    turns: int = cw.AGENT_TURNS

    def workload(self, name: str, n_clients: int, rep: int) -> Workload:
        return cw.build(name, n_clients, rep, max_tokens=self.max_tokens, max_prompts=self.max_prompts,
                        turns=self.turns)


def metrics_by_source(url: str) -> dict[str, dict[str, float]]:
    """localspec's draft tokens so far by source ({"suffix": {"drafted": .., "accepted": ..}, ...}),
    from /metrics; {} from a server that does not count them so."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"localspec_spec_decode_num_draft_tokens_by_source": "drafted",
             "localspec_spec_decode_num_accepted_tokens_by_source": "accepted"}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text) if text.startswith("#") else ():
        for sample in family.samples if family.name in names else ():
            if sample.name.endswith("_total"):
                out.setdefault(sample.labels["source"], {"drafted": 0.0, "accepted": 0.0})[names[family.name]] = sample.value
    return out


def _difference(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """By source, what a pass added to the counters."""
    zero = {"drafted": 0.0, "accepted": 0.0}
    return {source: {k: v - before.get(source, zero)[k] for k, v in counts.items()} for source, counts in after.items()
            if any(v - before.get(source, zero)[k] for k, v in counts.items())}


def pass_row(system: str, workload: Workload, n: int, rep: int, number: int, result: Pass,
             by_source: dict | None) -> dict:
    """A pass's row of the report: its figures and every request's (`by_source`: the draft tokens
    by source, None from a server that does not count them so)."""
    replies = result.replies
    ttfts = sorted(r.ttft for r in replies if r.ttft is not None)
    turns = range(max((r.turn for r in replies), default=-1) + 1)
    reported = [r for r in replies if r.drafted is not None]
    return {"workload": workload.name, "clients": n, "system": system, "rep": rep, "pass": number,
            "aggregate_tokens_per_second": result.aggregate, "tokens": result.tokens, "wall": result.wall,
            "errors": [f"{r.conversation} turn {r.turn}: {r.error}" for r in replies if r.error],
            "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
            "ttft_p50_by_turn": [percentile(sorted(r.ttft for r in replies if r.turn == t and r.ttft is not None), 50)
                                 for t in turns],
            "client_tokens_per_second": [r.tokens_per_second for r in replies],
            "drafted": sum(r.drafted for r in reported) if reported else None,
            "accepted": sum(r.accepted or 0 for r in reported) if reported else None,
            "by_source": by_source, "requests": [asdict(r) for r in replies]}


def _measure(server: Server, config: ClientsConfig, system: str, workload: Workload, n: int, rep: int,
             progress: Callable[[str], None]) -> list[dict]:
    """Warm the server up, then run the workload's passes on it."""
    run_pass(server.url, config.model_name, warmup_workload(n), n)
    rows = []
    for number in range(1, workload.passes + 1):
        counted = system in LOCALSPEC_SYSTEMS  # llama-server does not say where its drafts came from
        before = metrics_by_source(server.url) if counted else {}
        result = run_pass(server.url, config.model_name, workload, n)
        by_source = _difference(metrics_by_source(server.url), before) if counted else None
        row = pass_row(system, workload, n, rep, number, result, by_source)
        rows.append(row)
        progress(f"{workload.name}, {n} client{'s' if n > 1 else ''}, {system}, rep {rep + 1}"
                 + (f", pass {number}" if workload.passes > 1 else "")
                 + f": {result.aggregate:.1f} tok/s aggregate, first token p50 {row['ttft_p50'] or 0:.2f} s"
                 + (f", {len(row['errors'])} errors" if row["errors"] else ""))
    return rows


def _run_system(config: ClientsConfig, system: str, workload: Workload, n: int, rep: int,
                notes: list[str], progress: Callable[[str], None], costs: Path | None = None) -> list[dict]:
    """One system's repetition on a server of its own (nothing learned in the run before it: a
    localspec server learns in a copy of `costs`, the cost cache as the run found it)."""
    progress(f"{workload.name}, {n} client{'s' if n > 1 else ''}: starting {system} ...")
    with tempfile.TemporaryDirectory(prefix="localspec-bench-costs-") as scratch:
        own = (str(shutil.copytree(costs, Path(scratch) / "costs"))
               if costs is not None and system in LOCALSPEC_SYSTEMS else None)
        try:
            server = start_server(system, n_slots=n, oracle=config.oracle, draft=config.draft, threads=config.threads,
                                  anchor_bin=config.anchor_bin, model_name=config.model_name,
                                  ctx_per_slot=workload.ctx_per_slot, base_tree=config.base_tree, costs=own)
        except (anchor.AnchorUnavailable, ServingError) as e:
            notes.append(f"{system}: skipped ({e})")
            return []
        try:
            server.wait_ready()
            return _measure(server, config, system, workload, n, rep, progress)
        except ServingError as e:
            notes.append(f"{system}, {workload.name}, {n} clients: {e}")
            return []
        finally:
            server.stop()


def _reference(config: ClientsConfig, notes: list[str], progress: Callable[[str], None]) -> dict[int, float]:
    try:
        progress("llama-batched-bench (the oracle alone, plain batched decoding) ...")
        return batched_bench(oracle=config.oracle, n_clients=config.clients, prompt_tokens=40,
                             max_tokens=config.max_tokens or 128, threads=config.threads, anchor_bin=config.anchor_bin)
    except (anchor.AnchorUnavailable, ServingError, subprocess.TimeoutExpired) as e:
        notes.append(f"llama-batched-bench: {e}")
        return {}


def run_clients_bench(config: ClientsConfig, progress: Callable[[str], None] = lambda _: None,
                      reference: bool = True) -> dict:
    """Every workload, client count, repetition and system (interleaved by repetition), and the
    reference line (`reference`: llama-batched-bench)."""
    from localspec.bench.clients_report import summarize
    from localspec.bench.machine import machine_info

    rows: list[dict] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="localspec-bench-") as scratch:
        costs = cost_snapshot(Path(scratch) / "costs")  # every localspec server starts from it
        for name in config.workloads:
            for n in config.clients:
                for rep in range(config.reps):
                    workload = config.workload(name, n, rep)
                    if workload.repeats:
                        notes.append(f"{name}, {n} clients: some conversations repeat within a pass "
                                     "(more clients than tasks)")
                    for system in config.systems:
                        rows += _run_system(config, system, workload, n, rep, notes, progress, costs)
    batched = _reference(config, notes, progress) if reference else {}
    workloads = {name: config.workload(name, max(config.clients), 0).to_dict() for name in config.workloads}
    return {"schema": SCHEMA, "machine": machine_info(config.threads),
            "config": {"oracle": config.oracle, "draft": config.draft, "clients": config.clients,
                       "systems": config.systems, "reps": config.reps, "threads": config.threads,
                       "max_tokens": config.max_tokens, "workloads": workloads},
            "runs": rows, "batched_bench": batched, "summary": summarize(rows, batched),
            "notes": list(dict.fromkeys(notes))}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of sorted `values`, interpolated (None for none)."""
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)
