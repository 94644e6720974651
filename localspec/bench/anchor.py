"""The anchor: llama.cpp's own C++ speculative decoding (llama-speculative-simple, llama-speculative),
built by ``scripts/build_llama_anchor.sh`` from the llama.cpp sources in the installed
llama-cpp-python's sdist and cached in ``cache_dir()/anchor/llama.cpp-<version>/bin``.

One run = one process: it loads both models, evaluates the prompt, decodes, and prints its stats,
which are parsed here. Model loading is outside the decode time it reports, so its tokens/s compares
with localspec's (the oracle's prompt evaluation excluded in both; the draft's catch-up on the
prompt, in its first draft, included in both).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BUILD_SCRIPT = "scripts/build_llama_anchor.sh"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class AnchorUnavailable(RuntimeError):
    """The C++ anchor is not built (or cannot run) here: the message says why and what to do."""


def llama_cpp_python_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def anchor_dir(version: str | None = None) -> Path:
    """Where the build script puts the binaries for a llama-cpp-python version (default: the installed one)."""
    from localspec.cache import cache_dir

    return cache_dir() / "anchor" / f"llama.cpp-{version or llama_cpp_python_version()}"


def find_binary(name: str, bin_dir: str | os.PathLike | None = None) -> Path:
    """The path of a built anchor program, or AnchorUnavailable saying how to build it."""
    directory = Path(bin_dir) if bin_dir else Path(os.environ.get("LOCALSPEC_ANCHOR_BIN") or anchor_dir() / "bin")
    path = directory / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise AnchorUnavailable(f"{name} is not built ({path} missing); build it with {BUILD_SCRIPT} "
                            f"(~15 min, needs cmake and a C++ compiler)")


@functools.lru_cache(maxsize=None)
def _help_text(binary: str) -> str:
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AnchorUnavailable(f"{binary} does not run: {e}") from None
    return p.stdout + p.stderr


@dataclass(frozen=True)
class Flags:
    """Option names differ between llama.cpp versions (--draft-max became --spec-draft-n-max, ...)."""

    n_max: str
    n_min: str | None
    p_min: str | None
    spec_type: bool
    threads_draft: str | None
    flash_attn: str | None = None  # takes on|off|auto
    no_repack: str | None = None  # CPU weight repacking off (it crashes on Q4_1 with AMX)

    @classmethod
    def detect(cls, binary: str) -> "Flags":
        h = _help_text(binary)

        def first(*names: str) -> str | None:
            for n in names:
                if re.search(rf"(^|[\s,]){re.escape(n)}([\s,=]|$)", h, re.M):
                    return n
            return None

        n_max = first("--spec-draft-n-max", "--draft-max", "--draft")
        if n_max is None:
            raise AnchorUnavailable(f"{binary}: cannot find its draft-length option in --help")
        return cls(n_max=n_max, n_min=first("--spec-draft-n-min", "--draft-min"),
                   p_min=first("--spec-draft-p-min", "--draft-p-min"),
                   spec_type="--spec-type" in h, threads_draft=first("--spec-draft-threads", "-td", "--threads-draft"),
                   flash_attn=first("--flash-attn", "-fa"), no_repack=first("--no-repack", "-nr"))


def command(binary: str | os.PathLike, *, oracle: str, draft: str | None, prompt_file: str, n_predict: int,
            k: int | None, threads: int, n_ctx: int, p_min: float | None = None, seed: int = 1,
            spec_type: str | None = None, flash_attn: str | None = None, temperature: float = 0.0) -> list[str]:
    """The command line of one generation, greedy (or sampled at `temperature`, with no other filter:
    top-k 0, top-p 1, min-p 0, as localspec samples by default). `spec_type="ngram-simple"`: llama.cpp's prompt
    lookup, no draft model (`k`, if given, caps the drafted m-gram). `p_min` None: llama.cpp's own
    default; `flash_attn` None: its default (auto). CPU weight repacking is turned off where the
    program can (llama.cpp's repacked Q4_1 weights crash on AMX CPUs; elsewhere it did not change
    these models' speed, measured on an AVX512 EPYC), as in localspec's bindings: both run the same kernels."""
    binary = str(binary)
    f = Flags.detect(binary)
    cmd = [binary, "-m", oracle, "-f", prompt_file, "-n", str(n_predict), "-c", str(n_ctx),
           "-t", str(threads), "-tb", str(threads), "--repeat-penalty", "1.0", "--seed", str(seed)]
    cmd += (["--temp", f"{temperature:g}", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"] if temperature
            else ["--temp", "0", "--top-k", "1"])
    if f.no_repack:
        cmd.append(f.no_repack)
    if flash_attn is not None:
        if f.flash_attn is None:
            raise AnchorUnavailable(f"{binary} has no flash attention option")
        cmd += [f.flash_attn, flash_attn]
    if spec_type is not None:
        if not f.spec_type:
            raise AnchorUnavailable(f"{binary} has no --spec-type: this llama.cpp cannot do {spec_type}")
        cmd += ["--spec-type", spec_type]
        if k is not None and spec_type == "ngram-simple":
            cmd += ["--spec-ngram-simple-size-m", str(k)]
        return cmd
    if draft is None or k is None:
        raise ValueError("a draft model and a draft length are needed")
    cmd += ["-md", draft, f.n_max, str(k)]
    if f.threads_draft:
        cmd += [f.threads_draft, str(threads)]
    if f.n_min:
        cmd += [f.n_min, "0"]
    if f.p_min and p_min is not None:
        cmd += [f.p_min, str(p_min)]
    if f.spec_type and Path(binary).name == "llama-speculative-simple":
        cmd += ["--spec-type", "draft-simple"]
    return cmd


_NUM = r"([-+0-9.eE]+|nan|inf)"
_PATTERNS = {
    "encoded_tokens": rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds",
    "decoded": rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s",
    "n_draft": r"n_draft\s*=\s*(\d+)",
    "n_predict": r"n_predict\s*=\s*(\d+)",
    "n_drafted": r"n_drafted\s*=\s*(\d+)",
    "n_accept": r"n_accept\s*=\s*(\d+)",
    "accept": rf"accept\s*=\s*{_NUM}%",
}


def parse_stats(log: str) -> dict:
    """The stats llama-speculative(-simple) prints at the end of a run (stderr)."""
    log = _ANSI.sub("", log)
    out: dict = {}
    m = re.search(_PATTERNS["encoded_tokens"], log)
    if m:
        out["prompt_tokens"] = int(m.group(1))
        out["prompt_time"] = float(m.group(2))
    m = re.search(_PATTERNS["decoded"], log)
    if not m:
        raise ValueError("no 'decoded N tokens in T seconds, speed: S t/s' line in the output")
    out["completion_tokens"] = int(m.group(1))
    out["decode_time"] = float(m.group(2))
    out["tokens_per_second"] = float(m.group(3))
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(_PATTERNS[key], log)
        out[key] = int(m.group(1)) if m else None
    m = re.search(_PATTERNS["accept"], log)
    out["accept_percent"] = float(m.group(1)) if m else None
    return out


def generated_text(stdout: str, prompt_echo: str) -> str:
    """The generated text: stdout is "\\n\\n" + the prompt (token by token) + the output + "\\n\\n"."""
    s = _ANSI.sub("", stdout)
    if s.startswith("\n\n"):
        s = s[2:]
    for end in ("\n\n\n\n", "\n\n"):  # a blank line after the output, another at exit
        if s.endswith(end):
            s = s[:-len(end)]
            break
    if prompt_echo and s.startswith(prompt_echo):
        return s[len(prompt_echo):]
    # the echo is token pieces (specials included); fall back to the longest match of its end
    tail = prompt_echo[-40:]
    i = s.find(tail) if tail else -1
    return s[i + len(tail):] if i >= 0 else s


def last_lines(text: str, n: int) -> str:
    """The last n lines of `text` (a log's tail, for an error message)."""
    return "\n".join(text.strip().splitlines()[-n:])


def file_tail(path: str | os.PathLike, n: int) -> str:
    """The last n lines of the log file at `path` ("" when it cannot be read)."""
    try:
        return last_lines(Path(path).read_text("utf-8", errors="replace"), n)
    except OSError:
        return ""


def discard_log(log: IO) -> None:
    """Close and delete a process's temporary log file (a bench worker's, a server's) once it is done."""
    log.close()
    try:
        os.unlink(log.name)
    except OSError:
        pass


def run(binary: str | os.PathLike, *, oracle: str, draft: str | None, prompt_text: str, prompt_echo: str,
        n_predict: int, k: int | None, threads: int, n_ctx: int, p_min: float | None = None,
        spec_type: str | None = None, flash_attn: str | None = None, timeout: float = 1800.0,
        temperature: float = 0.0) -> dict:
    """Run one generation; returns the parsed stats, the generated text and the process's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="localspec-anchor-") as tmp:
        prompt_file = os.path.join(tmp, "prompt.txt")
        with open(prompt_file, "w", encoding="utf-8") as fh:
            fh.write(prompt_text + "\n")  # llama.cpp drops one trailing newline from -f files
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        cmd = command(binary, oracle=oracle, draft=draft, prompt_file=prompt_file, n_predict=n_predict, k=k,
                      threads=threads, n_ctx=n_ctx, p_min=p_min, spec_type=spec_type, flash_attn=flash_attn,
                      temperature=temperature)
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            status, rusage = _wait(proc, timeout)
        wall = time.perf_counter() - t0
        stdout = Path(out_path).read_text("utf-8", errors="replace")
        stderr = Path(err_path).read_text("utf-8", errors="replace")
    if status != 0:
        raise RuntimeError(f"{Path(str(binary)).name} exited with status {status}:\n{last_lines(stderr, 8)}")
    stats = parse_stats(stderr + "\n" + stdout)
    stats.update(text=generated_text(stdout, prompt_echo), wall_time=wall, command=cmd,
                 peak_rss=rusage.ru_maxrss * 1024 if rusage is not None else None)
    return stats


def _wait(proc: subprocess.Popen, timeout: float):
    """Wait for the process and return (exit status, its own rusage) via wait4."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, rusage
        if time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise RuntimeError(f"{proc.args[0]} timed out after {timeout:.0f}s")
        time.sleep(0.01)
