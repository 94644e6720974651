#!/usr/bin/env python3
"""Take the screenshot of the chat page that docs/server.md shows (docs/webui.png): start
`localspec serve` (the default pair, or what the arguments after `--` say), open the page in
headless Chromium, send the messages one after the other (each once the reply before it has
ended), and save the window: the second reply repeats code from the first, which prompt lookup drafts.

    python scripts/webui_screenshot.py                      # docs/webui.png
    python scripts/webui_screenshot.py --out /tmp/page.png -- --pair NAME

Needs Debian's chromium and chromium-driver, and selenium (the test extra)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Write a Python function that returns the squares of a list of numbers.",
           "Rename it to squares and show it again."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localspec() -> list[str]:
    """The installed command beside this Python, else the module."""
    script = Path(sys.executable).with_name("localspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "localspec.cli"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"localspec serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit("localspec serve did not come up")


def browser(width: int, height: int) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def fill(driver, id_: str, text: str) -> None:
    # set, not typed: a typed newline in the message box would send it
    driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(By.ID, id_), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "webui.png"))
    parser.add_argument("--prompt", action="append", help="A message to send (repeatable; default: two of them).")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--temperature", default="0")
    parser.add_argument("--size", default="1280x1080", help="The window, WIDTHxHEIGHT.")
    parser.add_argument("serve_args", nargs="*", help="After --: arguments for localspec serve.")
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.split("x"))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_API_KEY"}  # no key field in the picture
    proc = subprocess.Popen(localspec() + ["serve", "--port", str(port), *args.serve_args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = None
    try:
        wait_ready(url, proc)
        driver = browser(width, height)
        driver.get(url + "/")
        fill(driver, "temperature", args.temperature)
        fill(driver, "max-tokens", str(args.max_tokens))
        for i, prompt in enumerate(args.prompt or PROMPTS):
            fill(driver, "input", prompt)
            driver.find_element(By.ID, "send").click()
            WebDriverWait(driver, 600, poll_frequency=0.2).until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message.assistant .figures")) > i)
        time.sleep(2.5)  # the live panel's next look at /metrics
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        for line in driver.find_elements(By.CSS_SELECTOR, ".message.assistant .figures"):
            print(line.text)
        print(f"saved {args.out}")
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
