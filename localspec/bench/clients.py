"""`localspec bench --clients 1,4,8`: servers under several clients at once, as a team or a chat UI
and an agent use one.

For each number of clients N, every system is started as a server with N slots (`localspec serve
--parallel N`, llama.cpp's `llama-server -np N`, the same GGUF files, threads, context per slot,
flash attention off and no weight repacking), warmed up with one round of N short requests, then
N clients at once, each its own open-ended prompt, stream a greedy answer of up to `max_tokens`
tokens through the OpenAI API (`/v1/chat/completions`). Measured: the aggregate tokens/s (every
client's tokens over the wall time from the first request to the last token), each client's time
to first token and its own tokens/s. llama.cpp's plain batched decoding of the oracle alone
(`llama-batched-bench`, N sequences) is the reference line. The programs come from
scripts/build_llama_anchor.sh (the llama.cpp of the installed llama-cpp-python).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from localspec.bench import anchor
from localspec.llama.context import resolve_flash_attn

# open-ended prompts, one per client (a client count above their number cycles them)
CLIENT_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how the internet works to a ten-year-old.",
    "What are some good habits for staying healthy? Explain each one.",
    "Describe a day in the life of a medieval blacksmith.",
    "Give me a plan for learning a new language in six months.",
    "Why do leaves change color in the autumn?",
    "Write a letter to a friend about a trip to the mountains.",
    "What should someone know before adopting a dog?",
    "Explain the difference between weather and climate.",
    "Describe how bread is made, from wheat to loaf.",
    "Write a poem about a city at night.",
    "What are the pros and cons of electric cars?",
    "Tell me about the life cycle of a butterfly.",
    "How does a refrigerator keep food cold?",
    "Give me ideas for a rainy weekend at home.",
    "Explain what makes a good team leader.",
)
SYSTEMS = ("localspec", "localspec-no-draft", "llama-server", "llama-server-draft")
CTX_PER_SLOT = 1024
WARMUP_TOKENS = 32


class ServingError(RuntimeError):
    pass


@dataclass
class ClientResult:
    prompt: int
    ttft: float | None  # seconds to the first content
    seconds: float  # from the request to the end of the stream
    tokens: int
    text: str
    error: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """The client's own decoding speed: its tokens after the first over the time after it."""
        if self.ttft is None or self.tokens <= 1 or self.seconds <= self.ttft:
            return 0.0
        return (self.tokens - 1) / (self.seconds - self.ttft)


@dataclass
class Round:
    clients: list[ClientResult] = field(default_factory=list)
    wall: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.clients)

    @property
    def aggregate(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0


def _sse_chat(url: str, model: str, prompt: str, max_tokens: int, start: float, result: ClientResult,
              timeout: float) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, usage_tokens, chunks = [], None, 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        text.append(piece)
                        chunks += 1
    except Exception as e:  # a client that failed is reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - start
    result.text = "".join(text)
    result.tokens = usage_tokens if usage_tokens is not None else chunks


def run_round(url: str, model: str, n_clients: int, max_tokens: int, *, first_prompt: int = 0,
              timeout: float = 600) -> Round:
    """N clients at once (released together), each its own prompt."""
    results = [ClientResult(prompt=(first_prompt + i) % len(CLIENT_PROMPTS), ttft=None, seconds=0.0, tokens=0, text="")
               for i in range(n_clients)]
    barrier = threading.Barrier(n_clients + 1)
    t0: list[float] = []

    def client(i: int) -> None:
        barrier.wait()
        _sse_chat(url, model, CLIENT_PROMPTS[results[i].prompt], max_tokens, t0[0], results[i], timeout)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n_clients)]
    for t in threads:
        t.start()
    t0.append(time.perf_counter())
    barrier.wait()
    for t in threads:
        t.join(timeout + 30)
    return Round(results, wall=max(r.seconds for r in results))


# ------------------------------------------------------------------------------------ servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback, its log in a temporary file."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"localspec-serve-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

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
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


ALL_LAYERS = "999"


def _placement() -> list[str]:
    """llama.cpp's flags for where its server and batched bench run, as `localspec serve` runs by
    default: every layer offloaded where there is a GPU (none here: the CPU), flash attention as
    localspec's "auto" resolves it (on with a local GPU, off on the CPU, where it slows multi-token
    passes), CPU weights not repacked (as localspec's bindings: the same kernels)."""
    return ["-ngl", ALL_LAYERS, "-fa", resolve_flash_attn("auto", n_gpu_layers=-1), "--no-repack"]


def start_server(system: str, *, n_slots: int, oracle: str, draft: str | None, threads: int,
                 anchor_bin: str | None, model_name: str) -> Server:
    port = _free_port()
    if system.startswith("localspec"):
        argv = [sys.executable, "-m", "localspec.cli", "serve", "--port", str(port), "--parallel", str(n_slots),
                "--ctx", str(CTX_PER_SLOT), "--threads", str(threads), "--oracle", oracle, "--max-queue", "64",
                "--model-name", model_name]
        argv += ["--no-draft"] if system == "localspec-no-draft" or draft is None else ["--draft", draft]
        return Server(system, argv, port)
    binary = str(anchor.find_binary("llama-server", anchor_bin))
    argv = [binary, "-m", oracle, "--port", str(port), "--host", "127.0.0.1", "-np", str(n_slots),
            "-c", str(CTX_PER_SLOT * n_slots), "-t", str(threads), *_placement(), "--no-webui"]
    if system == "llama-server-draft":
        if draft is None:
            raise ServingError("no draft model")
        argv += ["-md", draft, "-ngld", ALL_LAYERS, "--spec-draft-threads", str(threads)]
    return Server(system, argv, port)


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


def run_clients_bench(*, oracle: str, draft: str | None, clients: list[int], systems: list[str], reps: int,
                      max_tokens: int, threads: int, anchor_bin: str | None, model_name: str = "bench",
                      progress: Callable[[str], None] = lambda _: None) -> dict:
    from localspec.bench.runner import machine_info

    rows = []
    notes: list[str] = []
    for n in clients:
        for system in systems:
            progress(f"{n} client{'s' if n > 1 else ''}: starting {system} ...")
            try:
                server = start_server(system, n_slots=n, oracle=oracle, draft=draft, threads=threads,
                                      anchor_bin=anchor_bin, model_name=model_name)
            except (anchor.AnchorUnavailable, ServingError) as e:
                notes.append(f"{system}: skipped ({e})")
                continue
            try:
                server.wait_ready()
                run_round(server.url, model_name, n, WARMUP_TOKENS, first_prompt=len(CLIENT_PROMPTS) // 2)
                for rep in range(reps):
                    r = run_round(server.url, model_name, n, max_tokens, first_prompt=rep * n)
                    errors = [c.error for c in r.clients if c.error]
                    ttfts = sorted(c.ttft for c in r.clients if c.ttft is not None)
                    row = {"clients": n, "system": system, "rep": rep, "aggregate_tokens_per_second": r.aggregate,
                           "tokens": r.tokens, "wall": r.wall, "errors": errors,
                           "ttft_p50": _percentile(ttfts, 50), "ttft_p95": _percentile(ttfts, 95),
                           "client_tokens_per_second": [c.tokens_per_second for c in r.clients],
                           "texts": [c.text for c in r.clients]}
                    rows.append(row)
                    progress(f"{n} clients, {system}, rep {rep + 1}: {r.aggregate:.1f} tok/s aggregate, first token "
                             f"p50 {row['ttft_p50'] or 0:.2f} s" + (f", {len(errors)} errors" if errors else ""))
            except ServingError as e:
                notes.append(f"{system} with {n} clients: {e}")
            finally:
                server.stop()
    reference = {}
    try:
        progress("llama-batched-bench (the oracle alone, plain batched decoding) ...")
        reference = batched_bench(oracle=oracle, n_clients=clients, prompt_tokens=40, max_tokens=max_tokens,
                                  threads=threads, anchor_bin=anchor_bin)
    except (anchor.AnchorUnavailable, ServingError, subprocess.TimeoutExpired) as e:
        notes.append(f"llama-batched-bench: {e}")
    return {"schema": "localspec-bench-clients/1", "machine": machine_info(threads),
            "config": {"oracle": oracle, "draft": draft, "clients": clients, "systems": systems, "reps": reps,
                       "max_tokens": max_tokens, "threads": threads, "ctx_per_slot": CTX_PER_SLOT,
                       "prompts": list(CLIENT_PROMPTS)},
            "runs": rows, "batched_bench": reference, "summary": summarize(rows, reference), "notes": notes}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(rows: list[dict], reference: dict) -> list[dict]:
    """Per (clients, system): medians over repetitions, and each against llama-server's best."""
    out = []
    for n in sorted({r["clients"] for r in rows}):
        at_n = [r for r in rows if r["clients"] == n]
        best = {}
        for system in dict.fromkeys(r["system"] for r in at_n):
            mine = [r for r in at_n if r["system"] == system]
            best[system] = {"clients": n, "system": system,
                            "aggregate_tokens_per_second": statistics.median(r["aggregate_tokens_per_second"] for r in mine),
                            "ttft_p50": statistics.median(r["ttft_p50"] for r in mine if r["ttft_p50"] is not None)
                            if any(r["ttft_p50"] is not None for r in mine) else None,
                            "ttft_p95": max((r["ttft_p95"] for r in mine if r["ttft_p95"] is not None), default=None),
                            "client_tokens_per_second": statistics.median(
                                [x for r in mine for x in r["client_tokens_per_second"]] or [0.0]),
                            "errors": sum(len(r["errors"]) for r in mine)}
        anchors = [v["aggregate_tokens_per_second"] for k, v in best.items() if k.startswith("llama-server")]
        server_best = max(anchors) if anchors else None
        for v in best.values():
            v["vs_llama_server_best"] = v["aggregate_tokens_per_second"] / server_best if server_best else None
            v["batched_bench"] = reference.get(n)
            out.append(v)
    return out


def markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    lines = ["# Serving several clients at once", "",
             f"Machine: {m.get('cpu')} ({', '.join(m.get('cpu_flags') or [])}), {m.get('threads')} threads; "
             f"llama-cpp-python {m.get('llama_cpp_python')}; localspec commit {m.get('git_commit')}.", "",
             f"Oracle `{Path(c['oracle']).name}`, draft `{Path(c['draft']).name if c['draft'] else '-'}`; greedy; "
             f"each client its own open-ended prompt, streamed answers of up to {c['max_tokens']} tokens through "
             f"/v1/chat/completions; {c['reps']} repetitions (medians); each server with one slot per client and "
             f"{c['ctx_per_slot']} tokens of context per slot, flash attention off, no weight repacking, one warm-up "
             "round first.", "",
             "| clients | system | aggregate tok/s | vs llama-server's best | first token p50 | p95 | tok/s per client "
             "| llama-batched-bench (oracle alone) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for s in report["summary"]:
        fmt = lambda x, spec: format(x, spec) if x is not None else "–"  # noqa: E731
        lines.append(f"| {s['clients']} | {s['system']} | {s['aggregate_tokens_per_second']:.1f} | "
                     f"{fmt(s['vs_llama_server_best'], '.2f')}x | {fmt(s['ttft_p50'], '.2f')} s | "
                     f"{fmt(s['ttft_p95'], '.2f')} s | {s['client_tokens_per_second']:.1f} | "
                     f"{fmt(s['batched_bench'], '.1f')} |" + (f" {s['errors']} errors" if s["errors"] else ""))
    if report["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines) + "\n"
