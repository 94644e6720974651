#!/usr/bin/env python3
"""Compare the decisions of two or more bench runs (e.g. two versions of the length policy) without
the machine's drift: every run's steps priced with one pass-cost fit made over all of them.

    localspec bench --systems baseline,k8,adaptive --workload code,copy --json before.json   # on one commit
    localspec bench --systems baseline,k8,adaptive --workload code,copy --json after.json    # on another
    python scripts/reprice_bench.py before.json after.json

Prints, per workload and system, each run's predicted speedup over the oracle alone for the steps
it took. A shared VM's speed drifts by 5-15% between runs, more than most policy changes move a
run's measured tokens/s; these figures move only with the steps chosen (measured timings remain
the bench's own job: the fit is an average, and it cannot see a cost the steps do not record).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from localspec.bench.report import repriced


def main(paths: list[str]) -> int:
    if len(paths) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    reports = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    table = repriced(reports)
    if not table:
        print("reprice_bench: no per-step records with a one-token pass to fit", file=sys.stderr)
        return 1
    labels = list(reports)
    print("| workload | system | " + " | ".join(labels) + " |")
    print("|---|---|" + "---:|" * len(labels))
    for workload, system in sorted({(w, s) for _, w, s in table}):
        cells = [f"{table[(label, workload, system)]:.2f}x" if (label, workload, system) in table else "–"
                 for label in labels]
        print(f"| {workload} | {system} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
