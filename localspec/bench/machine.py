"""The machine a benchmark ran on, for its report (and the measurement scripts' JSON): the CPU, its
features and cores, memory, software versions and the load average."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from localspec import __version__
from localspec.bench import anchor


# the CPU features llama.cpp's kernels care about (from /proc/cpuinfo's flags)
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve", "i8mm", "bf16")


def machine_info(threads: int) -> dict:
    """The machine a run ran on, for the report: CPU, its features and cores, memory, software
    versions and the load average at the start."""
    cpu, flags, physical_cores = _cpu()
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "llama_cpp_system_info": _llama_cpp_system_info(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores,
        "threads": threads,
        "ram_bytes": _ram_bytes(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "llama_cpp_python": anchor.llama_cpp_python_version(),
        "localspec": __version__,
        "git_commit": _git_commit(),
        "load_average_start": load_average(),
    }


def _cpu() -> tuple[str, list[str], int | None]:
    """(CPU model, its CPU_FLAGS, physical cores) from /proc/cpuinfo; without it, the platform's
    processor name, no flags and None."""
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return cpu, [], None
    return _parse_cpuinfo(text, cpu)


def _parse_cpuinfo(text: str, cpu: str) -> tuple[str, list[str], int | None]:
    """/proc/cpuinfo's model name (else `cpu`), the CPU_FLAGS its first flags line lists, and its
    physical cores: the distinct (physical id, core id) of its blocks (None when it names none)."""
    physical: set[tuple[str, str]] = set()
    flags: list[str] = []
    phys = core = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = [f for f in CPU_FLAGS if f in present]
        if key == "model name":
            cpu = value
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not key and phys is not None:
            physical.add((phys, core or ""))
            phys = core = None
    if phys is not None:
        physical.add((phys, core or ""))
    return cpu, flags, len(physical) or None


def _ram_bytes() -> int | None:
    """Total memory: /proc/meminfo's MemTotal, else the page size times the physical pages."""
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    if ram is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    return ram


def _llama_cpp_system_info() -> str | None:
    """llama.cpp's own account of its backend (the SIMD features it was built with), if it loads."""
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    except Exception:
        return None


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        p = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        return p.stdout.strip() or None if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the system keeps none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
