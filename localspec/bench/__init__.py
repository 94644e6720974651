"""`localspec bench`: speed at unchanged output, side by side with the baseline (the oracle alone),
the ceiling (what the measured acceptance and costs predict) and llama.cpp's own speculative decoding.

    from localspec.bench import BenchConfig, run_bench, workloads, parse_systems
    report = run_bench(BenchConfig(oracle, draft, workloads.load(["chat"], max_prompts=2),
                                   parse_systems("k4,adaptive"), reps=3))
"""

from localspec.bench.runner import BenchConfig, BenchError, run_bench
from localspec.bench.systems import DEFAULT_SYSTEMS, SystemSpec, parse_system, parse_systems
from localspec.bench.workloads import WORKLOADS, BenchPrompt

__all__ = ["BenchConfig", "BenchError", "run_bench", "SystemSpec", "parse_system", "parse_systems",
           "DEFAULT_SYSTEMS", "WORKLOADS", "BenchPrompt"]
