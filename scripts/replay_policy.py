#!/usr/bin/env python3
"""The length policy on recorded traces, against every fixed draft length and the hindsight ceiling.

Replays each trace (scripts/record_traces.py) with the default adaptive policy fresh (a new process
without learned state) and warm (after serving every trace once), each fixed K with the draft model
alone and with prompt lookup beside it, and the hindsight ceiling (`replay.hindsight`), priced by
the recording's own cost table, by a GPU-like one and by the default pair's on an H200 (a draft as dear
as its oracle). Speedups are over the oracle alone (K = 0).

    python scripts/replay_policy.py tests/data/traces/smollm2.json
"""

from __future__ import annotations

import argparse
import statistics

from localspec.bench.replay import Costs, hindsight, load_traces, measured_costs, replay
from localspec.runtime.factory import hybrid_policy
from localspec.speculative.policy import AdaptiveLength, FixedLength

FIXED = (2, 4, 8, 12, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces")
    args = ap.parse_args()
    traces, doc = load_traces(args.traces)
    print(f"{doc['oracle']} <- {doc['draft']}; costs measured on {doc['machine']['cpu']} "
          f"({', '.join(doc['machine']['cpu_flags'])}), {doc['machine']['threads']} threads")

    def adaptive():
        return hybrid_policy(AdaptiveLength(k_max=16, draft_cost_ratio=doc["draft_cost_ratio"]))

    for costs in (measured_costs(doc), Costs.gpu_like(), Costs.h200_smollm2(), Costs.h200_as_8b(),
                  Costs.h200_as_8b(host_draft_token=0.0001)):
        warm = adaptive()
        for trace in traces:
            replay(trace, warm, costs)
        table: dict[str, list[float]] = {}
        for trace in traces:
            base = replay(trace, FixedLength(0), costs, lookup=False).tokens_per_second
            runs = {"adaptive (fresh)": replay(trace, adaptive(), costs), "adaptive (warm)": replay(trace, warm, costs)}
            for k in FIXED:
                runs[f"k{k}"] = replay(trace, FixedLength(k), costs, lookup=False)
                runs[f"k{k}+lookup"] = replay(trace, FixedLength(k), costs)
            runs["hindsight"] = hindsight(trace, costs)
            for name, run in runs.items():
                table.setdefault(name, []).append(run.tokens_per_second / base)
        host = f" ({1000 * costs.host_draft_token:.1f} ms of host time a drafted token)" if costs.host_draft_token else ""
        print(f"\n{costs.name} costs{host}: speedup over the oracle alone, mean and per trace")
        for name, speedups in table.items():
            print(f"  {name:18} {statistics.mean(speedups):.3f}  " + " ".join(f"{s:.2f}" for s in speedups))
        fixed = {n: statistics.mean(v) for n, v in table.items() if n.startswith("k")}
        best = max(fixed, key=fixed.get)
        for name in ("adaptive (fresh)", "adaptive (warm)", "hindsight"):
            print(f"  {name} / best fixed ({best}): {statistics.mean(table[name]) / fixed[best]:.3f}")


if __name__ == "__main__":
    main()
