#!/usr/bin/env bash
# The GPU check, in one call: build llama.cpp once (for llama-cpp-python and for llama.cpp's own
# llama-server / llama-speculative-simple / llama-batched-bench), install localspec against it, run
# the tests marked `gpu`, and benchmark localspec against llama.cpp's speculative programs and
# llama-server built in the same step. Results go under benchmarks/gpu/<card>/.
#
#   scripts/gpu_check.sh --prepare     # here, with network: make .gpu_carry/ (trimmed llama.cpp
#                                      # sources + the wheels localspec needs, <= 64 MiB) and the
#                                      # default pair's draft split into .gpu_models/<n>/ parts
#   scripts/gpu_check.sh --stage       # there: add the .gpu_models/<n>/ parts carried by this call
#                                      # to the model cache (one call per part; see benchmarks/gpu/README.md)
#   scripts/gpu_check.sh               # there: the check on CUDA (needs nvcc, CMake, Python 3.12)
#   scripts/gpu_check.sh --cpu         # the same steps without CUDA, smaller (how CI keeps this working)
#
# Options: --results DIR (default benchmarks/gpu/<card> with CUDA, <work>/results with --cpu),
#          --jobs N (compile jobs; default: every core), --full (with --cpu: the
#          full benchmark sizes, not CI's small ones), --wide (with CUDA: also derive the
#          8B-shaped oracle smollm2-135m-as-8b, 13.4 GB of which ~2 GB written, and benchmark its
#          pairs with the Q4_1 and the Q2_K drafts; not yet run on a card).
# Environment: PYTHON (default python3), LOCALSPEC_CACHE (models, builds), GPU_CHECK_CMAKE_ARGS
#   (extra cmake arguments), GPU_CHECK_ARCH (CUDA architectures; default: the card's, from nvidia-smi).
#
# Layout: <cache>/gpu-check/llama.cpp-<version>-<cpu|cuda-smNN>/ holds the build tree's bin/ (the
# shared libraries and programs), the llama-cpp-python wheel built from that same tree, a venv with
# localspec installed from this checkout, and (with --cpu) the results. A finished build is reused.
# Offline (no package index), everything comes from .gpu_carry/; with an index, from it.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
CARRY=$REPO/.gpu_carry
MODELS_CARRY=$REPO/.gpu_models
CARRY_LIMIT_MB=${GPU_CHECK_CARRY_LIMIT_MB:-60}   # the device tool carries 64 MiB with the repo (~7 MB)
PART_MB=${GPU_CHECK_PART_MB:-56}

die() { echo "gpu_check: $*" >&2; exit 1; }
say() { echo "gpu_check: $*" >&2; }

mode=cuda results="" jobs="" full=0 wide=0
while (($#)); do
    case $1 in
        --prepare) mode=prepare ;;
        --stage) mode=stage ;;
        --cpu) mode=cpu ;;
        --full) full=1 ;;
        --wide) wide=1 ;;
        --results) results=$2; shift ;;
        --jobs) jobs=$2; shift ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

cache_dir() {
    echo "${LOCALSPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}"
}

llama_version() {
    if [[ -f $CARRY/VERSION ]]; then cat "$CARRY/VERSION"; return; fi
    "$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null \
        || sed -n 's/.*"llama-cpp-python>=\([0-9.]*\).*/\1/p' "$REPO/pyproject.toml"
}

# the wheels localspec and this check need, for the device's Python (3.12, manylinux x86-64)
WHEELS=(numpy click pydantic jinja2 fastapi uvicorn prometheus-client llguidance huggingface_hub tqdm gguf
        diskcache typing-extensions pytest httpx setuptools wheel scikit-build-core pathspec packaging)
# what the trimmed llama.cpp source leaves out: other backends, models, docs, tests, conversion
TRIM=(models docs media benches gguf-py conversion tests skills .github app
      ggml/src/ggml-sycl ggml/src/ggml-vulkan ggml/src/ggml-opencl ggml/src/ggml-cann ggml/src/ggml-hexagon
      ggml/src/ggml-musa ggml/src/ggml-metal ggml/src/ggml-webgpu ggml/src/ggml-zdnn ggml/src/ggml-zendnn
      ggml/src/ggml-openvino ggml/src/ggml-virtgpu ggml/src/ggml-et)

sdist() {   # the llama-cpp-python sdist of the version localspec pins, downloaded once
    local version=$1 dir
    dir="$(cache_dir)/gpu-check/src"
    mkdir -p "$dir"
    local f="$dir/llama_cpp_python-$version.tar.gz"
    if [[ ! -f $f ]]; then
        local rpc_copy
        rpc_copy="$(cache_dir)/rpc/llama.cpp-$version/src/llama_cpp_python-$version.tar.gz"
        if [[ -f $rpc_copy ]]; then
            cp "$rpc_copy" "$f"   # scripts/build_rpc.sh downloaded it already
        else
            "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$dir" "llama-cpp-python==$version" \
                || die "could not download the llama-cpp-python $version sdist"
        fi
    fi
    echo "$f"
}

prepare() {
    local version src tmp
    version=$(llama_version)
    say "preparing .gpu_carry/ for llama-cpp-python $version"
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
    tmp=$(mktemp -d)
    tar -xzf "$(sdist "$version")" -C "$tmp"
    src=$(ls -d "$tmp"/llama_cpp_python-*)
    for t in "${TRIM[@]}"; do rm -rf "${src:?}/vendor/llama.cpp/$t"; done
    rm -rf "$src/docs" "$src/examples" "$src/tests" "$src/docker" "$src/.git" "$src/.github" "$src/vendor/llama.cpp/.git"
    tar -C "$tmp" -cJf "$CARRY/llama-cpp-python-src.tar.xz" "$(basename "$src")"
    rm -rf "$tmp"
    echo "$version" >"$CARRY/VERSION"
    "$PYTHON" -m pip download --quiet --dest "$CARRY/wheels" --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any "${WHEELS[@]}" \
        || die "could not download the wheels for Python 3.12"
    # the default pair's draft (its F32 oracle is derived from it there), in parts that fit a call each
    rm -rf "$MODELS_CARRY"
    local draft
    draft=$("$PYTHON" -c 'from localspec.models import Registry; r = Registry.load(); print(r.resolve(r.pair(None).draft))') \
        || die "could not find the default pair's draft (localspec models pull)"
    mkdir -p "$MODELS_CARRY"
    (cd "$MODELS_CARRY" && split -b "${PART_MB}M" -d -a 1 "$draft" part && sha256sum "$draft" | cut -d' ' -f1 >SHA256 \
        && basename "$draft" >NAME)
    local n=0
    for p in "$MODELS_CARRY"/part*; do
        n=$((n + 1)); mkdir -p "$MODELS_CARRY/$n"; mv "$p" "$MODELS_CARRY/$n/"
        cp "$MODELS_CARRY/SHA256" "$MODELS_CARRY/NAME" "$MODELS_CARRY/$n/"
    done
    rm -f "$MODELS_CARRY/SHA256" "$MODELS_CARRY/NAME"
    local mb
    mb=$(du -sm "$CARRY" | cut -f1)
    (cd "$CARRY" && find . -type f -printf '%s %p\n' | sort -k2) >"$CARRY/MANIFEST"
    say ".gpu_carry: $mb MB (limit $CARRY_LIMIT_MB); .gpu_models: $n part(s) of <= $PART_MB MB"
    ((mb <= CARRY_LIMIT_MB)) || die ".gpu_carry is $mb MB, over $CARRY_LIMIT_MB"
}

stage() {   # add the model part(s) this call carried to the cache; the file is whole when the last arrives
    local models part name sha
    models="$(cache_dir)/models"
    mkdir -p "$models/.parts"
    for part in "$MODELS_CARRY"/*/part*; do
        [[ -f $part ]] || continue
        name=$(cat "$(dirname "$part")/NAME")
        cp "$part" "$models/.parts/$name.$(basename "$part")"
        say "staged $(basename "$part") of $name"
    done
    for name in $(ls "$models/.parts" 2>/dev/null | sed 's/\.part[0-9]*$//' | sort -u); do
        sha=$(cat "$MODELS_CARRY"/*/SHA256 2>/dev/null | head -n 1)
        cat "$models/.parts/$name".part* >"$models/$name.tmp"
        if [[ -n $sha && $(sha256sum "$models/$name.tmp" | cut -d' ' -f1) == "$sha" ]]; then
            mv "$models/$name.tmp" "$models/$name"
            rm -f "$models/.parts/$name".part*
            say "$name is whole: $models/$name"
        else
            rm -f "$models/$name.tmp"
            say "$name: not whole yet (carry the next part)"
        fi
    done
}

if [[ $mode == prepare ]]; then prepare; exit 0; fi
if [[ $mode == stage ]]; then stage; exit 0; fi

# ------------------------------------------------------------------------------------ the check
t0=$SECONDS
version=$(llama_version)
cores=$(nproc 2>/dev/null || echo 2)
[[ -n $jobs ]] || jobs=$cores
cmake_args="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"
if [[ $mode == cuda ]]; then
    command -v nvcc >/dev/null || die "no nvcc on PATH (a CUDA toolkit is needed; --cpu checks without one)"
    arch=${GPU_CHECK_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '. ')}
    [[ -n $arch ]] || arch=native
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    card=${card:-CUDA sm_$arch}
    flavour=cuda-sm$arch
    cmake_args+=" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$arch"
else
    card="CPU: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)"
    flavour=cpu
fi
cmake_args+=" ${GPU_CHECK_CMAKE_ARGS:-}"
WORK="$(cache_dir)/gpu-check/llama.cpp-$version-$flavour"
BUILD=$WORK/build
BIN=$BUILD/bin
slug=$(echo "$card" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-//; s/-$//' | tr 'A-Z' 'a-z')
[[ -n $results ]] || { if [[ $mode == cuda ]]; then results=$REPO/benchmarks/gpu/$slug; else results=$WORK/results; fi; }
mkdir -p "$WORK" "$results"
exec 9>"$WORK/.lock"
flock 9 2>/dev/null || true
say "$card; llama-cpp-python $version; $jobs job(s); work: $WORK; results: $results"

pip_offline=()   # the carried wheels, where they are for this Python (--prepare fetches Python 3.12's)
tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if ls "$CARRY"/wheels/numpy-*-"$tag"-*.whl >/dev/null 2>&1; then
    pip_offline=(--no-index --find-links "$CARRY/wheels")
fi

# --- 1. one llama.cpp build: the llama-cpp-python wheel and, from the same tree, llama.cpp's programs
PROGRAMS=(llama-server llama-speculative-simple llama-batched-bench)
built() {
    [[ -f $WORK/BUILT ]] && ls "$WORK"/wheels/llama_cpp_python-*.whl >/dev/null 2>&1 || return 1
    for p in "${PROGRAMS[@]}"; do [[ -x $BIN/$p ]] || return 1; done
}
if built; then
    say "llama.cpp already built ($WORK/BUILT)"
else
    # the tree of an earlier try is kept: what it compiled is not compiled again
    rm -rf "$WORK/wheels" && mkdir -p "$WORK/src" "$WORK/wheels"
    src=$(ls -d "$WORK"/src/llama_cpp_python-* 2>/dev/null || true)
    if [[ -z $src ]]; then
        if [[ -f $CARRY/llama-cpp-python-src.tar.xz ]]; then
            tar -xJf "$CARRY/llama-cpp-python-src.tar.xz" -C "$WORK/src"
        else
            tar -xzf "$(sdist "$version")" -C "$WORK/src"
        fi
        src=$(ls -d "$WORK"/src/llama_cpp_python-*)
    fi
    # the build backend, where the wheel is built without isolation (offline: from the carried wheels)
    BUILDENV=$WORK/buildenv
    [[ -x $BUILDENV/bin/pip ]] || "$PYTHON" -m venv "$BUILDENV"
    "$BUILDENV/bin/pip" install --quiet "${pip_offline[@]}" scikit-build-core pathspec packaging setuptools wheel \
        || die "could not install scikit-build-core for the build"
    say "building llama.cpp ($flavour) into $BUILD ..."
    b0=$SECONDS
    # the libraries, as llama-cpp-python's wheel (it installs every program a configuration builds:
    # the programs are off here) ...
    # shellcheck disable=SC2086
    CMAKE_ARGS="$cmake_args -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$jobs nice -n 10 "$BUILDENV/bin/pip" wheel --no-deps --no-build-isolation \
        --wheel-dir "$WORK/wheels" --config-settings=build-dir="$BUILD" --config-settings=cmake.build-type=Release \
        "$src" >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; die "the build failed (log: $WORK/build.log)"; }
    # ... then, in the same tree, llama.cpp's programs over those libraries
    nice -n 10 cmake -S "$src" -B "$BUILD" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
        >>"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; die "cmake configure failed (log: $WORK/build.log)"; }
    nice -n 10 cmake --build "$BUILD" --config Release -j "$jobs" --target "${PROGRAMS[@]}" >>"$WORK/build.log" 2>&1 \
        || { tail -n 40 "$WORK/build.log" >&2; die "the programs' build failed (log: $WORK/build.log)"; }
    for p in "${PROGRAMS[@]}"; do [[ -x $BIN/$p ]] || die "built, but $BIN/$p is missing (log: $WORK/build.log)"; done
    echo "$((SECONDS - b0))" >"$WORK/BUILD_SECONDS"
    find "$BUILD" -name '*.o' -delete   # keep bin/ (programs and shared libraries), drop the objects
    rm -rf "$WORK/src" "$BUILDENV"
    touch "$WORK/BUILT"
    say "built in $(cat "$WORK/BUILD_SECONDS") s"
fi
build_s=$(cat "$WORK/BUILD_SECONDS" 2>/dev/null || echo 0)

# --- 2. localspec from this checkout, against that llama-cpp-python, in a venv of its own
VENV=$WORK/venv
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "${pip_offline[@]}" --find-links "$WORK/wheels" --force-reinstall --no-deps \
    "$WORK"/wheels/llama_cpp_python-*.whl || die "could not install the built llama-cpp-python"
"$VENV/bin/pip" install --quiet "${pip_offline[@]}" --find-links "$WORK/wheels" -e "$REPO" pytest \
    || die "could not install localspec"
PY=$VENV/bin/python
"$PY" - "$mode" <<'EOF' || die "the built llama-cpp-python cannot offload to the GPU"
import sys, llama_cpp
from localspec.llama.context import has_local_gpu
print(f"gpu_check: llama_supports_gpu_offload={llama_cpp.llama_supports_gpu_offload()} local GPU={has_local_gpu()}",
      file=sys.stderr)
sys.exit(0 if sys.argv[1] != "cuda" or has_local_gpu() else 1)
EOF
# the models: the default pair (its oracle is derived from the draft, offline) and Gemma 3 270M if cached
"$VENV/bin/localspec" pull smollm2 \
    || die "the default pair is not in the model cache (offline: carry the .gpu_models/ parts with --stage first)"

# --- 3. the tests marked gpu
say "tests marked gpu ..."
set +e
LOCALSPEC_GPU_CHECK=$mode LOCALSPEC_GPU_CHECK_RESULTS="$results" "$PY" -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/test_gpu.py" \
    --junitxml="$results/tests.xml" 2>&1 | tee "$results/tests.log"
tests_rc=${PIPESTATUS[0]}
set -e

# --- 4. the benchmarks: localspec against llama.cpp's programs from the same build
if [[ $mode == cpu && $full == 0 ]]; then   # CI: every step runs, small
    bench_args=(--workload chat --max-prompts 1 --max-tokens 24 --reps 1 --mixed-warmup 0
                --systems baseline,k4,adaptive,llama.cpp-k4)
    clients_args=(--clients 2 --systems localspec,llama-server --max-tokens 24 --reps 1)
else
    bench_args=(--workload chat,code --max-prompts 3 --max-tokens 256 --reps 2
                --systems baseline,k4,k8,adaptive,lookup,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16,llama.cpp-spec)
    clients_args=(--clients 1,4,8 --max-tokens 128 --reps 1)
fi
bench_rc=0
run_bench() {   # name, then localspec bench's arguments
    local name=$1; shift
    say "bench $name ..."
    "$VENV/bin/localspec" bench --anchor-bin "$BIN" --json "$results/$name.json" --markdown "$results/$name.md" "$@" \
        2>&1 | tee "$results/$name.log" || bench_rc=1
}
run_bench bench-smollm2 "${bench_args[@]}"
run_bench clients-smollm2 "${clients_args[@]}"
if [[ $mode == cuda ]] && "$VENV/bin/python" -c 'from localspec.models import Registry; import sys
sys.exit(0 if Registry.load().is_present("gemma-3-270m-q4_k_m") else 1)' 2>/dev/null; then   # never fetched here
    run_bench bench-gemma --pair gemma3-270m-smollm2 "${bench_args[@]}"
fi
if [[ $mode == cuda && $wide == 1 ]]; then   # an 8B model's cost with SmolLM2's answers (issue 50)
    w0=$SECONDS
    "$VENV/bin/localspec" pull smollm2-as-8b smollm2-as-8b-q2k 2>&1 | tail -n 3 >&2 || bench_rc=1
    say "the 8B-shaped oracle derived in $((SECONDS - w0)) s"
    run_bench bench-as-8b --pair smollm2-as-8b --workload chat,code --max-prompts 2 --max-tokens 256 --reps 1 \
        --mixed-warmup 0 --systems baseline,k8,adaptive,lookup,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16
    run_bench bench-as-8b-t07 --pair smollm2-as-8b --temperature 0.7 --workload chat --max-prompts 2 --max-tokens 256 \
        --reps 1 --mixed-warmup 0 --systems baseline,adaptive,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16
    run_bench bench-as-8b-q2k --pair smollm2-as-8b-q2k --workload chat,code --max-prompts 2 --max-tokens 256 \
        --reps 1 --mixed-warmup 0 --systems baseline,adaptive,llama.cpp-k8
    run_bench clients-as-8b --pair smollm2-as-8b --clients 1,4,8 --max-tokens 128 --reps 1 \
        --systems localspec,localspec-no-draft,llama-server,llama-server-draft
fi

cat >"$results/SUMMARY.md" <<EOF
# GPU check: $card

- date: $(date -u +%Y-%m-%dT%H:%MZ); llama-cpp-python $version; commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "?")
- build: $flavour, $jobs job(s), ${build_s} s (cmake: $cmake_args)
- tests marked gpu: exit $tests_rc (tests.log, tests.xml)
- benchmarks: exit $bench_rc (bench-*.md, clients-*.md and their .json)
- the whole check: $((SECONDS - t0)) s
EOF
if [[ -f $results/idle_host_time.json ]]; then   # tests/test_gpu.py's record of an idle step's host time
    "$PY" - "$results/idle_host_time.json" >>"$results/SUMMARY.md" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
alone, default = d["oracle_alone"], d["default"]
print(f"- host ms a step: the oracle alone {alone['host_ms_per_step']:.3f}, the default {default['host_ms_per_step']:.3f}"
      f" ({default['idle_steps']} of {default['steps']} steps idle; an idle step's target: <= 0.10 ms)")
EOF
fi
for f in "$results"/bench-*.json; do   # the controller's share of each system's wall time (issue 50's target)
    [[ -f $f ]] || continue
    "$PY" - "$f" >>"$results/SUMMARY.md" <<'EOF' || true
import json, sys
from pathlib import Path
d = json.load(open(sys.argv[1]))
shares = [f"{r['system']} ({r['workload']}) {r['host_ms_per_token'] * r['tokens_per_second'] / 10:.1f}%"
          for r in d.get("results", []) if r.get("host_ms_per_token") and r.get("tokens_per_second")]
if shares:
    print(f"- {Path(sys.argv[1]).stem}, host time's share of the wall: " + ", ".join(shares)
          + " (a speculative step's target on the 8B-shaped oracle: <= 10%)")
EOF
done
[[ -n ${OUT:-} && -d ${OUT:-} ]] && cp "$results"/*.md "$results"/*.json "$results"/tests.log "$OUT"/ 2>/dev/null
say "done in $((SECONDS - t0)) s: $results/SUMMARY.md"
((tests_rc == 0 && bench_rc == 0))
