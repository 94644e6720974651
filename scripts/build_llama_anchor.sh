#!/usr/bin/env bash
# Build llama.cpp's own speculative-decoding programs (the anchor for `localspec bench`), its server and
# its batched-decoding benchmark (the anchors of `localspec bench --clients`) from the
# llama.cpp sources vendored in the llama-cpp-python sdist of the version that is installed, so the
# anchor runs the same llama.cpp as localspec does.
#
#   scripts/build_llama_anchor.sh            # build (or reuse) and print the directory of the binaries
#
# The binaries land in $LOCALSPEC_CACHE/anchor/llama.cpp-<version>/bin (the cache defaults to
# $XDG_CACHE_HOME/localspec, i.e. ~/.cache/localspec), where `localspec bench` looks for them.
# A finished build is reused; delete that directory to rebuild.
#
# Environment:
#   PYTHON               the interpreter with llama-cpp-python installed (default: python3)
#   LLAMA_CPP_SRC        an already extracted llama-cpp-python sdist (or a llama.cpp checkout) to build
#                        from instead of `pip download`ing the sdist
#   JOBS                 parallel compile jobs (default: 1 on 2-core machines, else cores - 1)
#   LOCALSPEC_ANCHOR_CMAKE_ARGS   extra cmake arguments (e.g. -DGGML_CUDA=ON)
#
# Needs cmake, a C/C++ compiler and (without LLAMA_CPP_SRC) network access to PyPI.
# The build runs under `nice`: it takes ~10-20 minutes on a small machine.
set -euo pipefail

PYTHON=${PYTHON:-python3}
TARGETS=(llama-speculative-simple llama-speculative llama-lookup llama-server llama-batched-bench)

die() { echo "build_llama_anchor: $*" >&2; exit 1; }
say() { echo "build_llama_anchor: $*" >&2; }

command -v cmake >/dev/null || die "cmake not found (needed to build llama.cpp)"
command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || die "no C++ compiler found"

VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))') \
    || die "llama-cpp-python is not installed for $PYTHON"
CACHE=$("$PYTHON" -c 'from localspec.bench.anchor import anchor_dir; print(anchor_dir())' 2>/dev/null) || {
    base=${LOCALSPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
    CACHE="$base/anchor/llama.cpp-$VERSION"
}
BIN="$CACHE/bin"

have_all=1
for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || have_all=0; done
if [[ $have_all == 1 ]]; then
    say "already built for llama-cpp-python $VERSION"
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9 2>/dev/null || true   # one build at a time

# --- sources
if [[ -n "${LLAMA_CPP_SRC:-}" ]]; then
    SRC=$LLAMA_CPP_SRC
else
    SRC="$CACHE/src/llama_cpp_python-$VERSION"
    if [[ ! -d "$SRC" ]]; then
        say "downloading the llama-cpp-python $VERSION sdist ..."
        dl="$CACHE/src/download"
        rm -rf "$dl" && mkdir -p "$dl"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$dl" "llama-cpp-python==$VERSION" \
            || die "could not download the llama-cpp-python $VERSION sdist (set LLAMA_CPP_SRC to an extracted copy)"
        tar -xzf "$dl"/llama_cpp_python-*.tar.gz -C "$CACHE/src" || die "could not extract the sdist"
        rm -rf "$dl"
        [[ -d "$SRC" ]] || die "the sdist did not extract to $SRC"
    fi
fi
if [[ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    LLAMA="$SRC/vendor/llama.cpp"
elif [[ -f "$SRC/CMakeLists.txt" && -d "$SRC/examples/speculative-simple" ]]; then
    LLAMA="$SRC"
else
    die "no llama.cpp sources under $SRC"
fi

# --- build
cores=$(nproc 2>/dev/null || echo 2)
if [[ -z "${JOBS:-}" ]]; then
    if (( cores <= 2 )); then JOBS=1; else JOBS=$((cores - 1)); fi
fi
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
BUILD="$CACHE/build"
say "building ${TARGETS[*]} from $LLAMA (llama-cpp-python $VERSION, $JOBS job(s), niced) ..."
# shellcheck disable=SC2086
nice -n 19 cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON ${LOCALSPEC_ANCHOR_CMAKE_ARGS:-} >"$CACHE/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$CACHE/cmake-configure.log" >&2; die "cmake configure failed (log: $CACHE/cmake-configure.log)"; }
nice -n 19 cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" >"$CACHE/cmake-build.log" 2>&1 \
    || { tail -n 30 "$CACHE/cmake-build.log" >&2; die "build failed (log: $CACHE/cmake-build.log)"; }

mkdir -p "$BIN"
for t in "${TARGETS[@]}"; do
    exe=$(find "$BUILD" -type f -name "$t" -perm -u+x | head -n 1)
    [[ -n "$exe" ]] || die "built, but $t is missing under $BUILD"
    cp "$exe" "$BIN/$t.tmp" && mv "$BIN/$t.tmp" "$BIN/$t"
done
echo "$VERSION" >"$CACHE/VERSION"
rm -rf "$BUILD"   # the binaries are static; the object files are ~100s of MB
say "done: $BIN"
echo "$BIN"
