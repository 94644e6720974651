#!/usr/bin/env python3
"""What the chat page costs generation: `localspec serve` (the default pair, or the arguments after
`--`) answers the same greedy request, with sources, alternately over the API with no page open
(A) and from the page in headless Chromium, loaded just before (B: page load, streaming into the
page, its /metrics panel), A-B-B-A. Prints the server's tokens/s for each (its own figures: after
the prompt, so the page's load before the request counts only where it overlaps), and the CPU time
the browser's processes used loading the page and during the reply, and the server's.

    python scripts/webui_cost.py [--reps 4] [-- SERVE ARGS]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sources_cost import cpu_name
from webui_screenshot import PROMPTS, browser, fill, free_port, localspec, wait_ready

TICK = os.sysconf("SC_CLK_TCK")

PROMPT = PROMPTS[0]


def cpu_seconds(root: int) -> float:
    """User + system CPU time of process `root` and its living descendants."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / TICK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=4, help="A-B-B-A rounds.")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("serve_args", nargs="*", help="After --: arguments for localspec serve.")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_API_KEY"}
    server = subprocess.Popen(localspec() + ["serve", "--port", str(port), *args.serve_args], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = None
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens, "temperature": 0,
            "speculative": {"sources": True}}
    try:
        wait_ready(url, server)
        driver = browser(1280, 860)
        chromium = driver.service.process.pid

        def over_api() -> float:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            return r.json()["choices"][0]["speculative"]["figures"]["tokens_per_second"]

        def from_page() -> tuple[float, float, float, float]:
            """tokens/s; CPU seconds of the browser loading the page, then during the reply; the server's."""
            browser_before, server_before = cpu_seconds(chromium), cpu_seconds(server.pid)
            driver.get(url + "/")
            WebDriverWait(driver, 60, poll_frequency=0.1).until(lambda d: d.find_element(By.ID, "model").text)
            browser_loaded = cpu_seconds(chromium)
            fill(driver, "temperature", "0")
            fill(driver, "max-tokens", str(args.max_tokens))
            fill(driver, "input", PROMPT)
            driver.find_element(By.ID, "send").click()
            while driver.execute_script("return chat.running !== null"):  # a look every half second costs little
                time.sleep(0.5)
            if driver.find_element(By.ID, "status").text:
                raise RuntimeError(f"the page's request failed: {driver.find_element(By.ID, 'status').text}")
            browser_cpu, server_cpu = cpu_seconds(chromium) - browser_loaded, cpu_seconds(server.pid) - server_before
            tps = float(driver.execute_script(
                "return document.querySelector('.message.assistant .figures').textContent.split(' · ')[1]"
            ).split()[0])
            driver.get("about:blank")  # no page open for the next A
            return tps, browser_loaded - browser_before, browser_cpu, server_cpu

        over_api()  # warm: the prompt is cached for both
        api, page, cpu, ratios = [], [], [], []
        for _ in range(args.reps):
            round_ = {}
            for i, where in enumerate("ABBA"):
                if where == "A":
                    round_[i] = over_api()
                    api.append(round_[i])
                else:
                    round_[i], *seconds = from_page()
                    page.append(round_[i])
                    cpu.append(seconds)
            ratios += [round_[1] / round_[0], round_[2] / round_[3]]  # page / API, one after the other
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        print(f"CPU: {cpu_name()}; {len(api)} replies each of {args.max_tokens} tokens")
        print(f"tokens/s (the server's figures), median: {statistics.median(api):.1f} over the API "
              f"({min(api):.1f}-{max(api):.1f}), {statistics.median(page):.1f} from the page "
              f"({min(page):.1f}-{max(page):.1f}); paired, page / API: median {q2 - 1:+.1%}, "
              f"quartiles {q1 - 1:+.1%} to {q3 - 1:+.1%}")
        load, reply, server_cpu = (statistics.median(c[i] for c in cpu) for i in range(3))
        print(f"CPU time, median: the browser loading the page {load:.2f} s, then during the reply {reply:.2f} s; "
              f"the server, page load and reply {server_cpu:.2f} s")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
