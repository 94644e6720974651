#!/usr/bin/env bash
# The GPU check, in one call: build llama.cpp once (for llama-cpp-python and for llama.cpp's own
# llama-server / llama-speculative-simple / llama-batched-bench), install localspec against it, run
# the tests marked `gpu`, and benchmark localspec against llama.cpp's speculative programs and
# llama-server built in the same step. Results go under benchmarks/gpu/<card>/.
#
#   scripts/gpu_check.sh --prepare     # here, with network: make .gpu_carry/ (trimmed llama.cpp
#                                      # sources + the wheels a device's Python lacks) and the default
#                                      # pair's draft, xz-compressed, in .gpu_models/<n>/ parts sized
#                                      # so that the whole check takes two calls
#   scripts/gpu_check.sh --start       # there, call 1 (carrying .gpu_carry and .gpu_models/1): stage
#                                      # that part, start the build in a session of its own, return
#   scripts/gpu_check.sh --stage       # there: add the .gpu_models/<n>/ parts carried by this call
#                                      # to the model cache (one call per part; see benchmarks/gpu/README.md)
#   scripts/gpu_check.sh               # there: the check on CUDA (needs nvcc, CMake, Python 3.12);
#                                      # it waits for a build --start began
#   scripts/gpu_check.sh --cpu         # the same steps without CUDA, smaller (how CI keeps this working)
#
# Options: --results DIR (default benchmarks/gpu/<card> with CUDA, <work>/results with --cpu),
#          --jobs N (compile jobs; default: every core), --full (with --cpu: the
#          full benchmark sizes, not CI's small ones), --wide (with CUDA: also derive the
#          8B-shaped oracle smollm2-135m-as-8b, 13.4 GB of which ~2 GB written, and benchmark its
#          pairs with the Q4_1 and the Q2_K drafts; not yet run on a card), --wide-only (with CUDA:
#          the tests, then only the 8B-shaped oracle's stages), --budget S (seconds
#          the check may take, from its start, the wait for the build included: a stage that
#          would not fit what is left is skipped, and SUMMARY.md says so; default: no limit).
# Stages, in this order (issue 48's before issue 50's): the tests marked gpu; fresh `generate`
#   processes against --no-draft; the single-stream bench; serving 1/4/8 clients; with --wide the
#   8B-shaped oracle's derivation, its bench, its serving, T = 0.7, the Q2_K draft.
# Results: written as the check goes; where $OUT is a folder (the device tool's), SUMMARY.md,
#   tests.log and results.tar.gz (everything) are refreshed there after every stage, so a check
#   cut off by its time limit still brings back what it finished (the tool returns <= 8 files).
# Environment: PYTHON (default python3), LOCALSPEC_CACHE (models, builds), GPU_CHECK_CMAKE_ARGS
#   (extra cmake arguments), GPU_CHECK_ARCH (CUDA architectures; default: the card's, from nvidia-smi).
#
# Layout: <cache>/gpu-check/llama.cpp-<version>-<cpu|cuda-smNN>/ holds the build tree's bin/ (the
# shared libraries and programs), the llama-cpp-python wheel built from that same tree, a venv with
# localspec installed from this checkout, and (with --cpu) the results. A finished build is reused.
# Offline (no package index), everything comes from .gpu_carry/ (or the copy --start keeps in
# <cache>/gpu-check/carry), over the packages the machine's own Python already has.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
CARRY=$REPO/.gpu_carry
MODELS_CARRY=$REPO/.gpu_models
CALL_MIB=${GPU_CHECK_CALL_MIB:-64}   # what the device tool carries a call, the working tree included

die() { echo "gpu_check: $*" >&2; exit 1; }
say() { echo "gpu_check: $*" >&2; }

mode=check target=cuda results="" jobs="" full=0 wide=0 budget=0
while (($#)); do
    case $1 in
        --prepare) mode=prepare ;;
        --start) mode=start ;;
        --build-only) mode=build ;;   # (what --start runs in the background)
        --stage) mode=stage ;;
        --budget) budget=$2; shift ;;
        --cpu) target=cpu ;;
        --full) full=1 ;;
        --wide) wide=1 ;;
        --wide-only) wide=2 ;;
        --results) results=$2; shift ;;
        --jobs) jobs=$2; shift ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

cache_dir() {
    echo "${LOCALSPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}"
}

# a copy of .gpu_carry kept by --start outside the checkout, for the calls after it
KEPT_CARRY="$(cache_dir)/gpu-check/carry"
[[ -f $CARRY/VERSION || ! -f $KEPT_CARRY/VERSION ]] || CARRY=$KEPT_CARRY

llama_version() {
    if [[ -f $CARRY/VERSION ]]; then cat "$CARRY/VERSION"; return; fi
    "$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null \
        || sed -n 's/.*"llama-cpp-python>=\([0-9.]*\).*/\1/p' "$REPO/pyproject.toml"
}

# the wheels localspec and this check need, for the device's Python (3.12, manylinux x86-64) ...
WHEELS=(numpy click pydantic jinja2 fastapi uvicorn prometheus-client llguidance huggingface_hub tqdm gguf
        diskcache typing-extensions pytest httpx setuptools wheel scikit-build-core pathspec packaging)
# ... less the big ones its Python already has (/work/.library/device/KINDS.md: numpy, huggingface-hub
# and its hf-xet, pygments, pyyaml), which the check's venv sees (`see_base_packages`)
DEVICE_HAS=(numpy hf_xet pygments huggingface_hub pyyaml)
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

tree_bytes() {   # what the device tool sends of this checkout: tracked and untracked-not-ignored files
    git -C "$REPO" ls-files -z -c -o --exclude-standard | (cd "$REPO" && xargs -0 stat -c %s 2>/dev/null) \
        | awk '{s += $1} END {print s + 0}'
}

prepare() {
    local version src tmp w
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
    for w in "${DEVICE_HAS[@]}"; do rm -f "$CARRY"/wheels/"$w"-*.whl; done
    echo cp312 >"$CARRY/PYTHON_TAG"
    (cd "$CARRY" && find . -type f -printf '%s %p\n' | sort -k2) >"$CARRY/MANIFEST"
    # the default pair's draft (its F32 oracle is derived from it there), xz-compressed (~8% smaller),
    # in parts: the first fits beside .gpu_carry and the working tree in call 1, each other one a call
    rm -rf "$MODELS_CARRY" && mkdir -p "$MODELS_CARRY"
    local draft name call tree carry first rest size n=1
    draft=$("$PYTHON" -c 'from localspec.models import Registry; r = Registry.load(); print(r.resolve(r.pair(None).draft))') \
        || die "could not find the default pair's draft (localspec models pull)"
    name=$(basename "$draft")
    xz -T0 -6 -c "$draft" >"$MODELS_CARRY/$name.xz"
    call=$(((CALL_MIB - 1) * 1048576))   # a MiB kept for what the tool adds
    tree=$(tree_bytes)
    carry=$(du -sb "$CARRY" | cut -f1)
    first=$((call - tree - carry)) rest=$((call - tree))
    ((first > 1048576)) || die "the working tree ($tree bytes) and .gpu_carry ($carry) leave no room in a call"
    size=$(stat -c %s "$MODELS_CARRY/$name.xz")
    mkdir -p "$MODELS_CARRY/1"
    head -c "$first" "$MODELS_CARRY/$name.xz" >"$MODELS_CARRY/1/part1"
    if ((size > first)); then
        tail -c +$((first + 1)) "$MODELS_CARRY/$name.xz" | (cd "$MODELS_CARRY" && split -b "$rest" -d -a 1 - rest)
        for p in "$MODELS_CARRY"/rest*; do
            n=$((n + 1)); mkdir -p "$MODELS_CARRY/$n"; mv "$p" "$MODELS_CARRY/$n/part$n"
        done
    fi
    for d in "$MODELS_CARRY"/[0-9]*; do
        echo "$name" >"$d/NAME"
        sha256sum "$draft" | cut -d' ' -f1 >"$d/SHA256"
        sha256sum "$MODELS_CARRY/$name.xz" | cut -d' ' -f1 >"$d/SHA256XZ"
        echo "$n" >"$d/PARTS"
    done
    rm -f "$MODELS_CARRY/$name.xz"
    say ".gpu_carry: $((carry / 1048576)) MiB; the draft in $n part(s): call 1 carries .gpu_carry and .gpu_models/1" \
        "($(du -sm "$MODELS_CARRY/1" | cut -f1) MiB) beside a working tree of $((tree / 1048576)) MiB; limit $CALL_MIB MiB a call"
    ((n <= 2)) || say "more than two calls: call k (k >= 2) carries .gpu_models/k and runs --stage, the last one the check"
}

stage() {   # add the model part(s) this call carried to the cache; the file is whole when the last arrives
    local models part name sha shaxz have want
    models="$(cache_dir)/models"
    mkdir -p "$models/.parts"
    for part in "$MODELS_CARRY"/*/part*; do
        [[ -f $part ]] || continue
        name=$(cat "$(dirname "$part")/NAME")
        cp "$part" "$models/.parts/$name.$(basename "$part")"
        cp "$(dirname "$part")"/{SHA256,SHA256XZ,PARTS} "$models/.parts/" 2>/dev/null || true
        say "staged $(basename "$part") of $name"
    done
    for name in $(ls "$models/.parts" 2>/dev/null | sed -n 's/\.part[0-9]*$//p' | sort -u); do
        [[ -f $models/$name ]] && { rm -f "$models/.parts/$name".part*; continue; }
        want=$(cat "$models/.parts/PARTS" 2>/dev/null || echo 1)
        have=$(ls "$models/.parts/$name".part* | wc -l)
        if ((have < want)); then
            say "$name: $have of $want parts staged (carry the next one)"
            continue
        fi
        sha=$(cat "$models/.parts/SHA256") shaxz=$(cat "$models/.parts/SHA256XZ")
        ls "$models/.parts/$name".part* | sort -V | xargs cat >"$models/$name.xz.tmp"
        [[ $(sha256sum "$models/$name.xz.tmp" | cut -d' ' -f1) == "$shaxz" ]] \
            || { rm -f "$models/$name.xz.tmp"; die "$name: the parts do not make the carried file (sha256)"; }
        xz -T0 -d -c "$models/$name.xz.tmp" >"$models/$name.tmp" && rm -f "$models/$name.xz.tmp"
        [[ $(sha256sum "$models/$name.tmp" | cut -d' ' -f1) == "$sha" ]] \
            || { rm -f "$models/$name.tmp"; die "$name: decompressed, its sha256 is not the model's"; }
        mv "$models/$name.tmp" "$models/$name"
        rm -f "$models/.parts/$name".part*
        say "$name is whole: $models/$name"
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
if [[ $target == cuda ]]; then
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
[[ -n $results ]] || { if [[ $target == cuda ]]; then results=$REPO/benchmarks/gpu/$slug; else results=$WORK/results; fi; }
mkdir -p "$WORK"
if [[ $mode == start ]]; then   # call 1: the model's first part staged, the build started, back at once
    stage
    if [[ -f $CARRY/VERSION && $CARRY != "$KEPT_CARRY" ]]; then   # for the calls after this one
        rm -rf "$KEPT_CARRY" && mkdir -p "$(dirname "$KEPT_CARRY")" && cp -r "$CARRY" "$KEPT_CARRY"
    fi
    args=(--build-only) && [[ $target == cpu ]] && args+=(--cpu)
    [[ -n $jobs ]] && args+=(--jobs "$jobs")
    setsid nohup bash "$REPO/scripts/gpu_check.sh" "${args[@]}" >"$WORK/build-started.log" 2>&1 </dev/null &
    say "building in a session of its own (pid $!; log: $WORK/build-started.log); the check waits for it"
    exit 0
fi
[[ $mode == build ]] || mkdir -p "$results"
exec 9>"$WORK/.lock"
if ! flock -n 9 2>/dev/null; then
    say "waiting for the build that --start began ($WORK/build-started.log) ..."
    flock 9 2>/dev/null || true
fi
say "$card; llama-cpp-python $version; $jobs job(s); work: $WORK; results: $results"

pip_offline=()   # the carried wheels, where they are for this Python (--prepare fetches Python 3.12's)
tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if [[ -f $CARRY/PYTHON_TAG && $(cat "$CARRY/PYTHON_TAG") == "$tag" ]] || ls "$CARRY"/wheels/numpy-*-"$tag"-*.whl >/dev/null 2>&1; then
    pip_offline=(--no-index --find-links "$CARRY/wheels")
fi
see_base_packages() {   # offline, a venv of $PYTHON also sees what $PYTHON has (itself a venv there, whose
                        # packages a venv made from it does not see): the carry holds only what it lacks
    ((${#pip_offline[@]})) || return 0
    local base
    base=$("$PYTHON" -c 'import site, sysconfig; p = sysconfig.get_paths(); print("\n".join(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()])))')
    "$1/bin/python" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/_gpu_check_base.pth", "w").write(sys.argv[1] + "\n")' "$base"
}

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
    see_base_packages "$BUILDENV"
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
[[ $mode == build ]] && exit 0   # (--start's background build: the check does the rest)

# --- 2. localspec from this checkout, against that llama-cpp-python, in a venv of its own
VENV=$WORK/venv
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
see_base_packages "$VENV"
"$VENV/bin/pip" install --quiet "${pip_offline[@]}" --find-links "$WORK/wheels" --force-reinstall --no-deps \
    "$WORK"/wheels/llama_cpp_python-*.whl || die "could not install the built llama-cpp-python"
"$VENV/bin/pip" install --quiet "${pip_offline[@]}" --find-links "$WORK/wheels" -e "$REPO" pytest \
    || die "could not install localspec"
PY=$VENV/bin/python
"$PY" - "$target" <<'EOF' || die "the built llama-cpp-python cannot offload to the GPU"
import sys, llama_cpp
from localspec.llama.context import has_local_gpu
print(f"gpu_check: llama_supports_gpu_offload={llama_cpp.llama_supports_gpu_offload()} local GPU={has_local_gpu()}",
      file=sys.stderr)
sys.exit(0 if sys.argv[1] != "cuda" or has_local_gpu() else 1)
EOF
# the models: the default pair (its oracle is derived from the draft, offline) and Gemma 3 270M if cached
"$VENV/bin/localspec" pull smollm2 \
    || die "the default pair is not in the model cache (offline: carry the .gpu_models/ parts with --stage first)"

# --- 3. the stages, each only where it fits what is left of --budget; results published as they come
bench_rc=0 tests_rc=-1 skipped=()
fits() {   # stage name, the seconds it is expected to take (a 16-core H200 ran the tests, a bench and
          # serving of the default pair in 81 s all told; the 8B-shaped stages are guesses)
    local left=$((budget - (SECONDS - t0)))
    if ((budget > 0 && left < $2)); then
        say "skipped $1: about $2 s, $left s left of --budget $budget"
        skipped+=("$1 (~$2 s; $left s left)")
        return 1
    fi
    say "$1 ..."
}
summary() {
    {
        echo "# GPU check: $card"
        echo
        echo "- date: $(date -u +%Y-%m-%dT%H:%MZ); llama-cpp-python $version; commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "?")"
        echo "- build: $flavour, $jobs job(s), ${build_s} s (cmake: $cmake_args)"
        echo "- tests marked gpu: exit $tests_rc (tests.log, tests.xml)"
        echo "- benchmarks: exit $bench_rc (generate.md, bench-*.md, clients-*.md and their .json)"
        echo "- the whole check: $((SECONDS - t0)) s so far$( ((budget > 0)) && echo " (--budget $budget)")"
        ((${#skipped[@]} == 0)) || echo "- skipped (not enough of --budget left): ${skipped[*]}"
        if [[ -f $results/idle_host_time.json ]]; then   # tests/test_gpu.py's record of an idle step's host time
            "$PY" - "$results/idle_host_time.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
alone, default = d["oracle_alone"], d["default"]
print(f"- host ms a step: the oracle alone {alone['host_ms_per_step']:.3f}, the default {default['host_ms_per_step']:.3f}"
      f" ({default['idle_steps']} of {default['steps']} steps idle; an idle step's target: <= 0.10 ms)")
EOF
        fi
        if [[ -f $results/first_token.json ]]; then   # ... and where a request's first token's time goes
            "$PY" - "$results/first_token.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
print(f"- first token, the oracle alone: in-process {d['in_process_ms']:.1f} ms (its prompt pass {d['prompt_pass_ms']:.1f}),"
      f" served and streamed {d['served_ms']:.1f} ms (an HTTP round trip {d['http_round_trip_ms']:.1f})")
EOF
        fi
        if [[ -f $results/host_time.json ]]; then   # ... and of a speculative step, the draft's picks made two ways
            "$PY" - "$results/host_time.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
def fig(r):
    per = r["host_ms_per_step"] * r["steps"] / r["drafted"] if r["drafted"] else 0.0
    return f"{r['host_ms_per_step']:.3f} ms a step ({per:.3f} a drafted token, {r['tokens_per_second']:.0f} tok/s)"
if "speculative_whole_draft_rows" in d:
    picks = d.get("draft_picks", {})
    timed = ", ".join(f"{n} {1000 * t:.2f} ms" for n, t in picks.get("proposal_seconds", {}).items())
    print(f"- host time, speculative (k 6): the draft picking from its rows' top k on the device {fig(d['speculative'])};"
          f" from whole rows on the host {fig(d['speculative_whole_draft_rows'])}; chosen at load: top"
          f" {picks.get('chosen_top_k')} (0: whole rows; a 4-token proposal {timed or 'not timed'})")
EOF
        fi
        if [[ -f $results/serve_cost.json ]]; then   # what serving costs a token, with stand-in decodes
            "$PY" - "$results/serve_cost.json" <<'EOF' || true
import json, sys
rows = json.load(open(sys.argv[1]))
print("- serving's own cost (scripts/serve_cost.py, stand-in decodes of the H200's default pair): " + ", ".join(
    f"{r['clients']} client(s) {r['served_tok_s_median']:.0f} tok/s served (in-process {r['in_process_tok_s']:.0f}),"
    f" server CPU {r['server_cpu_ms_per_token']:.3f} ms a token" for r in rows))
EOF
        fi
        if [[ -f $results/generate.json ]]; then   # issue 48's first targets
            "$PY" - "$results/generate.json" <<'EOF' || true
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("- fresh `generate`, default / --no-draft tok/s: " + ", ".join(
    f"{r['prompt']} {r['phase']} {r['ratio']:.2f}x" for r in rows) + " (targets: open fresh >= 0.95x, again >= 0.98x; code-rewrite >= 1.0x)")
threads = json.load(open(sys.argv[1])).get("threads") or []
if threads:
    print("- llama.cpp's CPU threads, fresh `generate` of the open prompt: " + ", ".join(
        f"{t['system']} --threads {t['threads']} {t['tokens_per_second']:.0f} tok/s (host {t['host_ms_per_step']:.3f} ms a step)"
        for t in threads))
EOF
        fi
        for f in "$results"/bench-*.json; do   # the controller's share of each system's wall time (issue 50's target)
            [[ -f $f ]] || continue
            "$PY" - "$f" <<'EOF' || true
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
    } >"$results/SUMMARY.md"
}
publish() {   # SUMMARY.md now, and (the device tool brings back <= 8 files) everything as one tarball
    summary
    [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
    cp "$results/SUMMARY.md" "$OUT/" 2>/dev/null || true
    [[ ! -f $results/tests.log ]] || cp "$results/tests.log" "$OUT/"
    tar -czf "$OUT/results.tar.gz.tmp" -C "$results" . 2>/dev/null && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
run_bench() {   # name, then localspec bench's arguments
    local name=$1; shift
    "$VENV/bin/localspec" bench --anchor-bin "$BIN" --json "$results/$name.json" --markdown "$results/$name.md" "$@" \
        2>&1 | tee "$results/$name.log" || bench_rc=1
    publish
}
publish

# the tests marked gpu
if fits "the tests marked gpu" 60; then
    set +e
    LOCALSPEC_GPU_CHECK=$target LOCALSPEC_GPU_CHECK_RESULTS="$results" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        "$REPO/tests/test_gpu.py" --junitxml="$results/tests.xml" 2>&1 | tee "$results/tests.log"
    tests_rc=${PIPESTATUS[0]}
    set -e
    publish
fi

# the benchmarks: localspec against llama.cpp's programs from the same build
if [[ $target == cpu && $full == 0 ]]; then   # CI: every step runs, small
    generate_args=(--reps 1 --max-tokens 24 --threads-probe 1)
    bench_args=(--workload chat --max-prompts 1 --max-tokens 24 --reps 1 --mixed-warmup 0
                --systems baseline,k4,adaptive,llama.cpp-k4)
    clients_args=(--clients 2 --systems localspec,llama-server --max-tokens 24 --reps 1)
else
    generate_args=(--reps 2 --max-tokens 200 --threads-probe 1)
    bench_args=(--workload chat,code --max-prompts 2 --max-tokens 256 --reps 1 --mixed-warmup 0
                --systems baseline,k8,adaptive,lookup,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16)
    clients_args=(--clients 1,4,8 --max-tokens 128 --reps 1
                  --systems localspec,localspec-no-draft,localspec-no-draft-1-thread,llama-server,llama-server-draft)
fi
if ((wide < 2)) && fits "fresh generate processes" 60; then
    PATH="$VENV/bin:$PATH" "$PY" "$REPO/scripts/fresh_generate.py" --out "$results" "${generate_args[@]}" \
        2>&1 | tee "$results/generate.log" || bench_rc=1
    publish
fi
if ((wide < 2)) && fits "bench-smollm2" 60; then run_bench bench-smollm2 "${bench_args[@]}"; fi
if ((wide < 2)) && fits "clients-smollm2" 80; then run_bench clients-smollm2 "${clients_args[@]}"; fi
if [[ $target == cuda ]] && ((wide < 2)) && fits "serve-cost" 40; then   # the server's own cost a token, this host's cores
    "$VENV/bin/python" "$REPO/scripts/serve_cost.py" --reps 3 --json "$results/serve_cost.json" \
        2>&1 | tee "$results/serve_cost.log" || bench_rc=1
    publish
fi
if [[ $target == cuda ]] && ((wide < 2)) && "$VENV/bin/python" -c 'from localspec.models import Registry; import sys
sys.exit(0 if Registry.load().is_present("gemma-3-270m-q4_k_m") else 1)' 2>/dev/null; then   # never fetched here
    if fits "bench-gemma" 60; then run_bench bench-gemma --pair gemma3-270m-smollm2 "${bench_args[@]}"; fi
fi
if [[ $target == cuda ]] && ((wide > 0)) && fits "the 8B-shaped oracle's derivation" 60; then   # issue 50
    w0=$SECONDS
    "$VENV/bin/localspec" pull smollm2-as-8b smollm2-as-8b-q2k 2>&1 | tail -n 3 >&2 || bench_rc=1
    say "the 8B-shaped oracle derived in $((SECONDS - w0)) s"
    if fits "bench-as-8b" 90; then
        run_bench bench-as-8b --pair smollm2-as-8b --workload chat,code --max-prompts 2 --max-tokens 256 --reps 1 \
            --mixed-warmup 0 --systems baseline,k8,adaptive,lookup,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16
    fi
    if fits "clients-as-8b" 120; then
        run_bench clients-as-8b --pair smollm2-as-8b --clients 1,4,8 --max-tokens 128 --reps 1 \
            --systems localspec,localspec-no-draft,llama-server,llama-server-draft
    fi
    if fits "bench-as-8b-t07" 60; then
        run_bench bench-as-8b-t07 --pair smollm2-as-8b --temperature 0.7 --workload chat --max-prompts 2 \
            --max-tokens 256 --reps 1 --mixed-warmup 0 --systems baseline,adaptive,llama.cpp-k4,llama.cpp-k8,llama.cpp-k16
    fi
    if fits "bench-as-8b-q2k" 60; then
        run_bench bench-as-8b-q2k --pair smollm2-as-8b-q2k --workload chat,code --max-prompts 2 --max-tokens 256 \
            --reps 1 --mixed-warmup 0 --systems baseline,adaptive,llama.cpp-k8
    fi
fi
publish
say "done in $((SECONDS - t0)) s: $results/SUMMARY.md"
((tests_rc == 0 && bench_rc == 0 && ${#skipped[@]} == 0))
