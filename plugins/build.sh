#!/usr/bin/env bash
# Build the dspark plugin libraries into plugins/build (or $DSPARK_PLUGINS_BUILD).
# Needs cmake and nvcc; builds the TensorRT plugin library too when NvInfer.h is found
# (set TENSORRT_ROOT). Fails on any compile error.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${DSPARK_PLUGINS_BUILD:-$here/build}"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
command -v nvcc >/dev/null 2>&1 || { echo "build.sh: nvcc not found (install the CUDA toolkit)" >&2; exit 1; }
command -v cmake >/dev/null 2>&1 || { echo "build.sh: cmake not found" >&2; exit 1; }
cmake -S "$here" -B "$build" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" "$@"
cmake --build "$build" -j "$(nproc)"
echo "build.sh: built $(ls "$build"/libdspark_plugins_*.so | xargs -n1 basename | tr '\n' ' ')in $build"
