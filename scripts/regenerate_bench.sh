#!/usr/bin/env bash
# Regenerate the committed benchmark results: benchmarks/RESULTS.md, benchmarks/results.json and the
# PNG charts, on this machine, with every system side by side in one run.
#
#   scripts/regenerate_bench.sh                      # the default pair, every workload, 2 prompts each
#   scripts/regenerate_bench.sh --pair qwen2.5-7b    # extra options go to `localspec bench`
#
# Every system runs in the same run: the oracle alone, localspec at fixed K 4/8/16, adaptive (the default:
# draft model and prompt lookup), the draft model alone (adaptive) and prompt
# lookup, llama.cpp's own speculative decoding at K 4/8/16 with flash attention auto and off (the
# report names its best), llama.cpp's and llama-cpp-python's prompt lookup; answers of up to 400
# tokens; and a one-shot figure per system (a fresh `localspec generate` process per prompt).
#
# Environment:
#   SYSTEMS     systems to compare (default below; see `localspec bench --help`)
#   REPS        interleaved repetitions (default 2)
#   PROMPTS     prompts per workload (default 2)
#   THREADS     CPU threads for every system (default: all cores)
#   OUT         output directory (default: benchmarks/ in the repository)
#   NO_ANCHOR=1 do not build llama.cpp's C++ programs (the anchor rows are then skipped)
#   FORCE=1     run even if the machine looks busy (timings will be noisy)
#   MAX_LOAD    the 1-minute load average above which the run refuses to start (default 0.5)
#
# Needs: localspec installed with the bench extra (pip install -e '.[bench]') for the charts; cmake and
# a C++ compiler for the anchor (built once, cached; ~15 min on a small machine).
set -euo pipefail

cd "$(dirname "$0")/.."
SYSTEMS=${SYSTEMS:-baseline,k4,k8,k16,adaptive,model,lookup,llama.cpp-grid,llama.cpp-ngram,llama.cpp-ngram-fa-off,lcp-lookup}
REPS=${REPS:-2}
PROMPTS=${PROMPTS:-2}
THREADS=${THREADS:-$(nproc 2>/dev/null || echo 4)}
OUT=${OUT:-benchmarks}
MAX_LOAD=${MAX_LOAD:-0.5}
PYTHON=${PYTHON:-python3}

load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
if [[ "${FORCE:-0}" != 1 ]] && awk -v l="$load" -v m="$MAX_LOAD" 'BEGIN { exit !(l > m) }'; then
    echo "regenerate_bench: the load average is $load (> $MAX_LOAD): other work would skew the timings." >&2
    echo "regenerate_bench: wait for a quiet machine, or set FORCE=1 to run anyway." >&2
    exit 1
fi

if [[ "${NO_ANCHOR:-0}" != 1 ]]; then
    PYTHON=$PYTHON scripts/build_llama_anchor.sh >/dev/null \
        || echo "regenerate_bench: the llama.cpp anchor could not be built; its rows will be skipped" >&2
fi

mkdir -p "$OUT"
"$PYTHON" -m localspec.cli bench --systems "$SYSTEMS" --reps "$REPS" --threads "$THREADS" --max-prompts "$PROMPTS" \
    --max-tokens 400 --one-shot --json "$OUT/results.json" --charts "$OUT" --markdown "$OUT/RESULTS.md" "$@"
echo "regenerate_bench: wrote $OUT/RESULTS.md, $OUT/results.json and the charts" >&2
