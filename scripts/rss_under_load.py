"""Memory of `localspec serve --parallel 8` under load: is the resident set flat after warm-up?

Starts the real command on the default pair, sends `--warmup` requests, then `--requests` more from
`--clients` threads at once (varied prompts and lengths, streamed and not, some cancelled
mid-stream), and prints the server's VmRSS after the warm-up and after every `--every` requests.

    python scripts/rss_under_load.py --requests 500 --clients 8
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = ["Tell me about the sea.", "Write a haiku about autumn.", "What is a prime number?",
           "List three colours.", "Explain rain to a child.", "1, 2, 3, 4, 5,", "The capital of France is",
           "Describe a cat in one sentence."]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def one_request(client: httpx.Client, rng: random.Random) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.choice([8, 16, 32, 48]), "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.5:
        body["stream"] = True
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if rng.random() < 0.02 and i > 2:
                    break  # a client that goes away mid-stream
    else:
        client.post("/v1/chat/completions", json=body).raise_for_status()


def run(url: str, n: int, clients: int, seed: int) -> None:
    counter = iter(range(n))
    lock = threading.Lock()

    def work(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=300) as client:
            while True:
                with lock:
                    if next(counter, None) is None:
                        return
                one_request(client, rng)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("localspec") or os.path.join(os.path.dirname(sys.executable), "localspec")
    server = subprocess.Popen([exe, "serve", "--port", str(port), "--parallel", str(args.parallel), "--ctx", "512"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"started: VmRSS {rss_kib(server.pid) / 1024:.1f} MiB")
        run(url, args.warmup, args.clients, seed=0)
        base = rss_kib(server.pid)
        print(f"after {args.warmup} warm-up requests: VmRSS {base / 1024:.1f} MiB")
        done, t0 = 0, time.monotonic()
        while done < args.requests:
            batch = min(args.every, args.requests - done)
            run(url, batch, args.clients, seed=1 + done)
            done += batch
            now = rss_kib(server.pid)
            print(f"after {done} more ({time.monotonic() - t0:.0f} s): VmRSS {now / 1024:.1f} MiB "
                  f"({(now - base) / 1024:+.1f} MiB)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
