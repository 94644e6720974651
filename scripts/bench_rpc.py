#!/usr/bin/env python3
"""Speculation when the oracle is split over llama.cpp's RPC backend (issue 16).

The oracle alone against speculative decoding (fixed K=4 and adaptive), greedy, on the same prompts:
  local    the oracle on this machine (no RPC): the reference
  direct   the oracle split between this machine and an rpc-server on 127.0.0.1 (loopback)
  delayed  the same through a delay proxy that adds a round-trip time (RTT) to every exchange,
           as a network between two machines would: one process, the proxy's delay changed between
           settings, the model loaded once
The draft stays local. Each oracle pass crosses the link a few times whatever its number of tokens,
so the pass gets dearer with the RTT while the draft's cost does not: the gain grows.

    scripts/bench_rpc.py --delays 0,1,2,5,10,20 --markdown benchmarks/rpc/RESULTS.md --json benchmarks/rpc/results.json

Refuses to start on a busy machine (1-minute load average above $MAX_LOAD, default 0.5) unless FORCE=1.
Needs the RPC build (scripts/build_rpc.sh; run here when missing): every mode runs on its
RPC-enabled llama_cpp (PYTHONPATH), so the three compare the same library. `tc netem` would be the
kernel's way to add the delay; the proxy is used because it needs no privileges or kernel module.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------- delay proxy


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every chunk `rtt / 2` seconds in each direction before
    passing it on, in order (a link's latency; its bandwidth is left unlimited). `rtt` may change
    while it runs."""

    def __init__(self, upstream: tuple[str, int], rtt: float = 0.0) -> None:
        self.upstream, self.rtt = upstream, rtt
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pump(client, server)
            self._pump(server, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.Queue = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                chunks.put((time.perf_counter() + self.rtt / 2, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = chunks.get()
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


# ---------------------------------------------------------------------------------------- worker


def load_prompts(n: int) -> list[list[dict]]:
    lines = (ROOT / "localspec" / "bench" / "workloads" / "chat.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:n]]


def worker(args: argparse.Namespace) -> None:
    """One mode in one process: load once, then for each delay setting run every system on every prompt."""
    import llama_cpp

    from localspec.runtime.engine import Engine
    from localspec.runtime.factory import draft_cost_ratio
    from localspec.models import Registry
    from localspec.speculative.policy import AdaptiveLength, FixedLength

    assert llama_cpp.llama_supports_rpc(), "run through the parent: it puts the RPC build on PYTHONPATH"
    registry = Registry.load()
    pair = registry.pair(args.pair)
    oracle, draft = registry.resolve(args.oracle or pair.oracle), registry.resolve(args.draft or pair.draft)
    proxy = None
    rpc = None
    if args.mode == "direct":
        rpc = args.server
    elif args.mode == "delayed":
        host, port = args.server.rsplit(":", 1)
        proxy = DelayProxy((host, int(port)))
        rpc = f"127.0.0.1:{proxy.port}"
    delays = [float(d) for d in args.delays.split(",")] if args.mode == "delayed" else [0.0]
    prompts = load_prompts(args.prompts)
    notes: list[str] = []
    # the draft model alone (no prompt lookup beside it): what crosses the link is the question here
    engine = Engine(oracle, draft, n_threads=args.threads, rpc=rpc, cost_cache=False, draft_length=4, lookup=False,
                    progress=notes.append)
    out = {"mode": args.mode, "placement": notes, "flash_attn": engine.oracle.flash_attn, "settings": []}
    try:
        for delay in delays:
            if proxy is not None:
                proxy.rtt = delay / 1000
            systems = {"baseline": None, "k4": FixedLength(4), "adaptive": None}
            setting = {"rtt_ms": delay, "systems": {}}
            engine.generate(prompts[0], max_tokens=16, speculative=False)  # warm-up
            for rep in range(args.reps):
                order = list(systems) if rep % 2 == 0 else list(reversed(systems))
                for name in order:
                    if name == "adaptive" and systems[name] is None:  # fresh per setting, taught one prompt
                        systems[name] = AdaptiveLength(k_max=16, draft_cost_ratio=draft_cost_ratio(
                            engine.oracle_model, engine.draft_model))
                        with engine.using_policy(systems[name]):
                            engine.generate(prompts[-1], max_tokens=args.max_tokens)
                    runs = setting["systems"].setdefault(name, [])
                    with engine.using_policy(systems[name] or engine.policy):
                        for i, messages in enumerate(prompts):
                            r = engine.generate(messages, max_tokens=args.max_tokens,
                                                speculative=name != "baseline")
                            s = r.stats
                            runs.append({"prompt": i, "rep": rep, "tokens": r.tokens,
                                         "completion_tokens": s.completion_tokens,
                                         "time": s.total_time - s.prompt_time, "drafted": s.drafted,
                                         "accepted": s.accepted,
                                         "passes": [(rec.drafted + 1, rec.verify_time) for rec in s.records]})
            out["settings"].append(setting)
            print(f"bench_rpc: {args.mode} rtt {delay:g} ms done", file=sys.stderr, flush=True)
    finally:
        engine.close()
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------- report


def summarise(setting: dict) -> dict:
    base_runs = {(r["prompt"], r["rep"]): r for r in setting["systems"]["baseline"]}
    rows = {}
    for name, runs in setting["systems"].items():
        tokens = sum(r["completion_tokens"] for r in runs)
        seconds = sum(r["time"] for r in runs)
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        same = sum(r["tokens"] == base_runs[(r["prompt"], r["rep"])]["tokens"] for r in runs)
        passes: dict[int, list[float]] = {}
        for r in runs:
            for n, t in r["passes"]:
                passes.setdefault(n, []).append(t)
        rows[name] = {"tokens_per_second": tokens / seconds if seconds else 0.0, "tokens": tokens,
                      "acceptance": accepted / drafted if drafted else None, "same_text": f"{same}/{len(runs)}",
                      "pass_ms": {n: 1000 * sorted(ts)[len(ts) // 2] for n, ts in passes.items()}}
    base = rows["baseline"]["tokens_per_second"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_second"] / base if base else None
    return rows


def markdown(results: list[dict], machine: dict, args: argparse.Namespace, placement: list[str]) -> str:
    cpu = f"{machine['cpu']} ({machine.get('logical_cpus')} logical CPUs; {', '.join(machine['cpu_flags'])})"
    lines = [
        "# Speculation with the oracle over llama.cpp's RPC backend",
        "",
        f"Generated by `scripts/bench_rpc.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d')}.",
        "",
        f"- Machine: {cpu}; {args.threads} threads for localspec, {args.server_threads} for the rpc-server (same "
        f"machine); 1-minute load average {machine['load_average']['start']} at the start, "
        f"{machine['load_average']['end']} at the end.",
        f"- Pair: `{args.pair or 'smollm2'}` (oracle {args.oracle or 'the pair’s'}, "
        f"draft {args.draft or 'the pair’s'}); "
        f"greedy; {args.prompts} chat prompts x {args.reps} repetitions, at most {args.max_tokens} tokens each.",
        f"- Oracle placement over RPC: {'; '.join(placement) or 'n/a'}. The draft stays on this machine.",
        "- `local`: no RPC. `direct`: the rpc-server over loopback. `+RTT`: through a delay proxy adding that "
        "round-trip time to every exchange (a Python proxy: `tc netem` is not available in this VM).",
        "- tokens/s excludes prompt evaluation; the speedup is against the oracle alone in the same setting; "
        "pass times are medians of the oracle's verify passes (1 token: the oracle alone; 5 tokens: K=4 steps that "
        "drafted all 4).",
        "",
        "| setting | CPU | oracle alone tok/s | 1-token pass ms | 5-token pass ms | K=4 tok/s | K=4 speedup "
        "| adaptive tok/s | adaptive speedup | acceptance (K=4) | same text as the oracle alone |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, rows in results:
        b, k4, ad = rows["baseline"], rows["k4"], rows["adaptive"]
        lines.append(
            f"| {label} | {machine['cpu']} ({', '.join(machine['cpu_flags'])}) | {b['tokens_per_second']:.1f} "
            f"| {b['pass_ms'].get(1, float('nan')):.1f} | {k4['pass_ms'].get(5, float('nan')):.1f} "
            f"| {k4['tokens_per_second']:.1f} | {k4['speedup']:.2f}x | {ad['tokens_per_second']:.1f} "
            f"| {ad['speedup']:.2f}x | {k4['acceptance']:.0%} | K=4 {k4['same_text']}, adaptive {ad['same_text']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None)
    ap.add_argument("--oracle", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--delays", default="0,1,2,5,10,20", help="added round-trip times in ms (delayed mode)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--server-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--modes", default="local,direct,delayed")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", dest="mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--server", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        worker(args)
        return

    load = float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else 0.0
    max_load = float(os.environ.get("MAX_LOAD", "0.5"))
    if load > max_load and os.environ.get("FORCE") != "1":
        sys.exit(f"bench_rpc: the load average is {load} (> {max_load}): other work would skew the timings; wait for "
                 "a quiet machine, or set FORCE=1 to run anyway")
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build_rpc.sh")],
                           env={**os.environ, "PYTHON": sys.executable},
                           stdout=subprocess.PIPE, text=True, check=True).stdout.strip().splitlines()[-1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(build) / "site"), str(ROOT)])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(build) / "bin" / "rpc-server"), "-H", "127.0.0.1", "-p", str(port),
                               "-t", str(args.server_threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=30).close()
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit("rpc-server did not start")
                time.sleep(0.1)
        results, raw, placement = [], [], []
        passthrough = ["--prompts", str(args.prompts), "--reps", str(args.reps), "--max-tokens", str(args.max_tokens),
                       "--threads", str(args.threads), "--delays", args.delays, "--server", f"127.0.0.1:{port}"]
        for flag in ("pair", "oracle", "draft"):
            if getattr(args, flag):
                passthrough += [f"--{flag}", getattr(args, flag)]
        for mode in args.modes.split(","):
            print(f"bench_rpc: {mode} ...", file=sys.stderr, flush=True)
            p = subprocess.run([sys.executable, __file__, "--worker", mode, *passthrough], env=env,
                               stdout=subprocess.PIPE, text=True, check=True)
            out = json.loads(p.stdout.strip().splitlines()[-1])
            raw.append(out)
            placement = placement or [n for n in out["placement"] if "layers" in n]
            for setting in out["settings"]:
                label = {"local": "local", "direct": "direct"}.get(mode) or f"+{setting['rtt_ms']:g} ms RTT"
                results.append((label, summarise(setting)))
    finally:
        server.terminate()
        server.wait()

    from localspec.bench.machine import machine_info

    machine = machine_info(args.threads)
    machine["load_average"] = {"start": load, "end": float(Path("/proc/loadavg").read_text().split()[0])
                               if Path("/proc/loadavg").exists() else None}
    doc = markdown(results, machine, args, placement)
    print(doc)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(doc)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "args": vars(args), "raw": raw,
                                               "summary": [{"setting": l, **r} for l, r in results]}, indent=1))


if __name__ == "__main__":
    main()
