#!/usr/bin/env bash
# Build llama.cpp's RPC backend for localspec (`--rpc HOST:PORT`), from the llama.cpp sources vendored
# in the sdist of the llama-cpp-python version that is installed, so both ends speak the same RPC
# protocol and compute with the same kernels as the rest of localspec:
#
#   - an RPC-enabled llama-cpp-python (CMAKE_ARGS="-DGGML_RPC=on"), installed into a private
#     directory (`pip install --target`), not over the one in your environment;
#   - llama.cpp's RPC server (`ggml-rpc-server`, formerly `rpc-server`), a static binary.
#
#   scripts/build_rpc.sh            # build (or reuse) and print the directory of the build
#
# Layout: $LOCALSPEC_CACHE/rpc/llama.cpp-<version>/ (the cache defaults to $XDG_CACHE_HOME/localspec,
# i.e. ~/.cache/localspec)
#   site/            the RPC-enabled llama_cpp package: put it first on PYTHONPATH to use it
#                    (PYTHONPATH=.../site localspec serve --rpc B:50052)
#   bin/rpc-server   the RPC server: run it on each machine that lends its memory and cores
# A finished build is reused (the tests and the CI reuse it too); delete that directory to rebuild.
#
# To enable RPC in your own environment instead, rebuild llama-cpp-python there (pip's wheel cache is
# keyed by the sdist, not by CMAKE_ARGS, hence --no-cache-dir):
#   CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==<version>
#
# Environment:
#   PYTHON               the interpreter with llama-cpp-python installed (default: python3)
#   LLAMA_CPP_SDIST      the llama-cpp-python sdist (.tar.gz) to build from instead of `pip download`ing it
#   JOBS                 parallel compile jobs (default: 1 on 2-core machines, else cores - 1)
#   LOCALSPEC_RPC_CMAKE_ARGS   extra cmake arguments for both builds (e.g. -DGGML_CUDA=on: a GPU
#                        machine lends its GPU through its rpc-server; the client needs it only for its own GPU)
#
# Needs cmake, a C/C++ compiler and (without LLAMA_CPP_SDIST) network access to PyPI.
# The builds run under `nice`: ~18 minutes on a 2-core VM (one compile job; the server ~2.5 of them).
set -euo pipefail

PYTHON=${PYTHON:-python3}

die() { echo "build_rpc: $*" >&2; exit 1; }
say() { echo "build_rpc: $*" >&2; }

command -v cmake >/dev/null || die "cmake not found (needed to build llama.cpp)"
command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || die "no C++ compiler found"

VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))') \
    || die "llama-cpp-python is not installed for $PYTHON"
DIR=$("$PYTHON" -c 'from localspec.llama.rpc import build_dir; print(build_dir())' 2>/dev/null) || {
    base=${LOCALSPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
    DIR="$base/rpc/llama.cpp-$VERSION"
}
SITE="$DIR/site"
BIN="$DIR/bin"

built() {
    [[ -x "$BIN/rpc-server" && -f "$DIR/VERSION" ]] || return 1
    PYTHONPATH="$SITE" "$PYTHON" -c 'import sys, llama_cpp; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)' \
        >/dev/null 2>&1
}
if built; then
    say "already built for llama-cpp-python $VERSION"
    echo "$DIR"
    exit 0
fi

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9 2>/dev/null || true   # one build at a time
if built; then   # another process finished it while this one waited
    echo "$DIR"
    exit 0
fi
start=$SECONDS

# --- sources: the sdist (pip builds the package from it) and its extracted llama.cpp (for the server)
if [[ -n "${LLAMA_CPP_SDIST:-}" ]]; then
    SDIST=$LLAMA_CPP_SDIST
    [[ -f "$SDIST" ]] || die "LLAMA_CPP_SDIST is not a file: $SDIST"
else
    SDIST=$(ls "$DIR"/src/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
    if [[ -z "$SDIST" ]]; then
        say "downloading the llama-cpp-python $VERSION sdist ..."
        mkdir -p "$DIR/src"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$DIR/src" "llama-cpp-python==$VERSION" \
            || die "could not download the llama-cpp-python $VERSION sdist (set LLAMA_CPP_SDIST to a copy)"
        SDIST="$DIR/src/llama_cpp_python-$VERSION.tar.gz"
        [[ -f "$SDIST" ]] || die "pip download did not produce $SDIST"
    fi
fi
SRC="$DIR/src/extracted"
rm -rf "$SRC" && mkdir -p "$SRC"
tar -xzf "$SDIST" -C "$SRC" || die "could not extract $SDIST"
LLAMA=$(ls -d "$SRC"/*/vendor/llama.cpp 2>/dev/null | head -n 1)
[[ -n "$LLAMA" && -f "$LLAMA/tools/rpc/rpc-server.cpp" ]] || die "no llama.cpp sources with tools/rpc in $SDIST"

cores=$(nproc 2>/dev/null || echo 2)
if [[ -z "${JOBS:-}" ]]; then
    if (( cores <= 2 )); then JOBS=1; else JOBS=$((cores - 1)); fi
fi

# --- the RPC-enabled llama-cpp-python, into a private directory
say "building llama-cpp-python $VERSION with GGML_RPC=on into $SITE ($JOBS job(s), niced; log: $DIR/pip-build.log) ..."
rm -rf "$SITE.tmp"
# shellcheck disable=SC2086
CMAKE_ARGS="-DGGML_RPC=on ${LOCALSPEC_RPC_CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    nice -n 19 "$PYTHON" -m pip install --no-deps --no-cache-dir --target "$SITE.tmp" "$SDIST" \
    >"$DIR/pip-build.log" 2>&1 \
    || { tail -n 30 "$DIR/pip-build.log" >&2; die "the llama-cpp-python build failed (log: $DIR/pip-build.log)"; }
PYTHONPATH="$SITE.tmp" "$PYTHON" -c 'import sys, llama_cpp; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)' \
    || die "built, but llama_supports_rpc() is false in $SITE.tmp"
rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
say "llama-cpp-python done after $((SECONDS - start)) s"

# --- the RPC server: only ggml and the server, linked statically
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
BUILD="$DIR/build"
say "building the RPC server from $LLAMA ($JOBS job(s), niced) ..."
# shellcheck disable=SC2086
nice -n 19 cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF ${LOCALSPEC_RPC_CMAKE_ARGS:-} >"$DIR/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$DIR/cmake-configure.log" >&2; die "cmake configure failed (log: $DIR/cmake-configure.log)"; }
target=ggml-rpc-server
grep -q "rpc-server" "$LLAMA/tools/rpc/CMakeLists.txt" || die "no RPC server target in $LLAMA/tools/rpc"
grep -q "set(TARGET ggml-rpc-server)" "$LLAMA/tools/rpc/CMakeLists.txt" || target=rpc-server   # older llama.cpp
nice -n 19 cmake --build "$BUILD" --config Release -j "$JOBS" --target "$target" >"$DIR/cmake-build.log" 2>&1 \
    || { tail -n 30 "$DIR/cmake-build.log" >&2; die "the RPC server build failed (log: $DIR/cmake-build.log)"; }
exe=$(find "$BUILD" -type f -name "$target" -perm -u+x | head -n 1)
[[ -n "$exe" ]] || die "built, but $target is missing under $BUILD"
mkdir -p "$BIN"
cp "$exe" "$BIN/rpc-server.tmp" && mv "$BIN/rpc-server.tmp" "$BIN/rpc-server"

rm -rf "$BUILD" "$SRC"   # object files and sources: ~100s of MB; the sdist stays for a rebuild
echo "$VERSION" >"$DIR/VERSION"
say "done after $((SECONDS - start)) s: $DIR (site/ for PYTHONPATH, bin/rpc-server)"
echo "$DIR"
