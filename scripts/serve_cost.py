#!/usr/bin/env python3
"""What serving costs a token, with nothing to hide it: the real server (FastAPI, uvicorn, the
engine worker) over the stand-in contexts of `scripts/host_cost.py` whose decodes wait as a GPU's do
(without holding the GIL: the oracle alone's one-token pass 1.25 ms, a pass of several sequences
2.6 ms, the default pair's on an H200), against the same engine generating in-process.

Per number of clients: the in-process rate (one sequence), the served streaming rate (aggregate over
the clients, each streaming `/v1/completions`), and the server process's CPU time per token. The
clients run in this process, the server in a child process; on a machine of few cores they share
them, which a GPU workstation's 8-16 would not (say so beside the figures).

    python scripts/serve_cost.py                   # 1, 4 and 8 clients
    python scripts/serve_cost.py --clients 8 --reps 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONE, SEVERAL = 1.25e-3, 2.6e-3  # seconds: a pass of one token, of one token each of several sequences


def serve(clients: int, max_tokens: int, ready: Path) -> None:
    """The child: a stand-in engine of `clients` sequences; prints its in-process rate, then serves
    until stdin closes."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
    import host_cost
    from host_cost import StandInContext, StandInModel
    from serving import ThreadedServer

    from localspec.runtime.engine import Engine
    from localspec.server.app import create_app
    from localspec.speculative.policy import FixedLength

    host_cost.spin = time.sleep  # a GPU's wait: the GIL released
    model = StandInModel(49152, "stand-in")
    oracle = StandInContext(model, n_seq=clients, cost=lambda n: ONE if n <= 1 else SEVERAL)
    engine = Engine.from_parts(oracle=oracle, proposer=None, policy=FixedLength(0))
    engine.slots.backend_sampling = True  # greedy picks "on the device", as on a GPU
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        result = engine.generate("abc", max_tokens=max_tokens)
        rates.append(result.stats.completion_tokens / (time.perf_counter() - t0))
    server = ThreadedServer(create_app(engine, model_name="stand-in"))
    ready.write_text(json.dumps({"url": server.url, "in_process": statistics.median(rates)}))
    sys.stdin.read()
    server.stop()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_all(connections: list, max_tokens: int) -> int:
    """Every client streams one request at once (each on its kept connection); the tokens they got."""
    counts = [0] * len(connections)

    def one(i: int) -> None:
        body = {"model": "stand-in", "prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with connections[i].stream("POST", "/v1/completions", json=body) as r:
            data = b"".join(r.iter_raw())  # (read whole: a client that parses each event costs these cores too)
        counts[i] = data.count(b"data: ") - data.count(b"data: [DONE]")

    clients = len(connections)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def measure(clients: int, max_tokens: int, reps: int) -> dict:
    ready = Path(f"/tmp/serve_cost.{os.getpid()}.{clients}.json")
    ready.unlink(missing_ok=True)
    child = subprocess.Popen([sys.executable, __file__, "--child", str(clients), "--max-tokens", str(max_tokens),
                              "--ready", str(ready)], stdin=subprocess.PIPE, text=True)
    try:
        while not ready.exists():
            if child.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        time.sleep(0.1)
        info = json.loads(ready.read_text())
        import httpx

        connections = [httpx.Client(base_url=info["url"], timeout=120) for _ in range(clients)]
        stream_all(connections, 16)  # warm-up (and each client's connection made)
        rates, cpu = [], []
        for _ in range(reps):
            c0, t0 = cpu_seconds(child.pid), time.perf_counter()
            tokens = stream_all(connections, max_tokens)
            rates.append(tokens / (time.perf_counter() - t0))
            cpu.append((cpu_seconds(child.pid) - c0) / tokens)
        for c in connections:
            c.close()
    finally:
        child.stdin.close()
        child.wait(30)
        ready.unlink(missing_ok=True)
    return {"clients": clients, "max_tokens": max_tokens, "in_process_tok_s": info["in_process"],
            "served_tok_s": rates, "served_tok_s_median": statistics.median(rates),
            "server_cpu_ms_per_token": 1000 * statistics.median(cpu), "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        serve(args.child, args.max_tokens, args.ready)
        return
    print("| clients | in-process tok/s (one sequence) | served tok/s (streamed, all clients) | server CPU ms a token |"
          "\n|---:|---:|---:|---:|")
    results = []
    for clients in args.clients:
        r = measure(clients, args.max_tokens, args.reps)
        results.append(r)
        print(f"| {clients} | {r['in_process_tok_s']:.0f} | {r['served_tok_s_median']:.0f} | "
              f"{r['server_cpu_ms_per_token']:.3f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
