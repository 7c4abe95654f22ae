#!/usr/bin/env bash
# The one GPU check (issue 19), for a lent GPU machine; meant to finish in under 8 minutes.
#
#   bash tools/gpu_check.sh            # from the repository root; figures also go to $OUT (or ./gpu-check-out)
#
# 1. environment: GPU, torch/CUDA, onnxruntime; `import dspark` through a path shim (the machine
#    keeps its own torch: nothing is pip-resolved), carried wheels from $DSPARK_WHEELS (or ./wheels)
#    installed with --no-deps --no-index first
# 2. builds the CUDA plugins (plugins/build.sh)
# 3. runs every GPU-marked test: the CUDA kernels against their numpy references
#    (tests/test_plugins_cuda.py: masks and accepted paths compared exactly, i.e. max |diff| = 0),
#    the batched engine on CUDA, lossless (tests/test_gpu_engine.py), `dspark generate --device cuda` (test_cli.py)
# 4. a short bench on the COST STAND-IN target (models/inflate.py: the demo target inflated to
#    $STANDIN_PARAMS, same outputs, a 1-2B model's cost): tok/s of autoregressive, chain and tree
#    decoding at 1, 16, 64 requests, with the ratios to autoregressive (tools/engine_tree_bench.py)
# 5. the same bench without CUDA graphs (--no-cuda-graphs) at 1 and 16 requests, and at 16 requests
#    with the target's KV cache kept on the host (--host-kv): what replay and the resident cache save
#
# Ran on a lent H200 on 2026-12-04 (figures: README, docs/gpu-trees.md). Exit status: the number of failed
# parts. GPU_BENCH_REQUESTS (default 1,16,64) and GPU_BENCH_REPEATS (default 2) size the bench;
# GPU_CHECK_BENCH=0 stops after the tests, GPU_CHECK_COMPARE=0 skips part 5.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo/gpu-check-out}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
failed=0
py="${PYTHON:-python3}"  # the machine's own interpreter (the one that holds its CUDA torch)
requests="${GPU_BENCH_REQUESTS:-1,16,64}"
repeats="${GPU_BENCH_REPEATS:-2}"
part() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }
note_failure() { echo "!! FAILED: $*"; failed=$((failed + 1)); }

part "1. environment"
shim="$(mktemp -d)"
ln -s "$repo" "$shim/dspark"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
wheels="${DSPARK_WHEELS:-$repo/wheels}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$py" -m pip install --no-index --no-deps "$wheels"/*.whl || note_failure "installing the carried wheels"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
"$py" - <<'EOF' || note_failure "environment (see the missing modules above)"
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}", flush=True)
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
missing = []
for name in ("numpy", "safetensors", "click", "tqdm", "onnx", "onnxruntime", "tokenizers", "scipy", "pytest"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except ImportError:
        missing.append(name)
import dspark.runtime.batch_loop  # noqa: F401  (the package imports under this torch)
if missing:
    sys.exit(f"missing modules: {missing} (carry their wheels in $DSPARK_WHEELS)")
EOF

part "2. build the CUDA plugins"
timeout 180 bash "$repo/plugins/build.sh" || note_failure "plugins/build.sh"

part "3. GPU-marked tests (kernels vs references; the engine on CUDA, lossless)"
(cd "$repo/tests" && timeout 300 "$py" -m pytest -q -ra -m gpu -p no:cacheprovider test_plugins_cuda.py \
   test_gpu_engine.py test_cli.py --junitxml="$out/gpu_tests.xml") || note_failure "GPU-marked tests"

if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then  # GPU_CHECK_BENCH=0: parts 1-3 only
part "4. bench on the cost stand-in (${STANDIN_PARAMS:=1B} parameters)"
standin="${STANDIN_DIR:-$out/standin-$STANDIN_PARAMS}"
timeout 120 "$py" - "$standin" "$STANDIN_PARAMS" <<'EOF' || note_failure "making the stand-in"
import sys
from importlib import resources
from pathlib import Path
from dspark.models.inflate import inflate_checkpoint, is_current, parse_params, KV_PER_PARAM
out, params = Path(sys.argv[1]), parse_params(sys.argv[2])
target = Path(str(resources.files("dspark.models") / "demo" / "target"))
if not is_current(out, target, params, KV_PER_PARAM):
    record = inflate_checkpoint(target, out, params, progress=print)
    print(f"stand-in: {record['params']:,} parameters in {out}")
EOF
timeout 300 "$py" -m dspark.tools.engine_tree_bench --device cuda --target "$standin" \
  --drafter "$repo/models/demo/dspark" --requests "$requests" --new-tokens 24 --repeats "$repeats" \
  | tee "$out/bench.txt" || note_failure "bench"

if [ "${GPU_CHECK_COMPARE:-1}" != 0 ]; then  # GPU_CHECK_COMPARE=0: no part 5
part "5. the same bench without CUDA graphs (eager modules), R=${EAGER_REQUESTS:=1,16}; then with the target's KV cache on the host (moved both ways every call), R=${HOST_KV_REQUESTS:=16}"
timeout 150 "$py" -m dspark.tools.engine_tree_bench --device cuda --target "$standin" --no-cuda-graphs \
  --drafter "$repo/models/demo/dspark" --requests "$EAGER_REQUESTS" --new-tokens 24 --repeats 1 \
  | tee "$out/bench_eager.txt" || note_failure "eager bench"
timeout 120 "$py" -m dspark.tools.engine_tree_bench --device cuda --target "$standin" --host-kv --no-cuda-graphs \
  --drafter "$repo/models/demo/dspark" --requests "$HOST_KV_REQUESTS" --new-tokens 24 --repeats 1 \
  | tee "$out/bench_host_kv.txt" || note_failure "host-KV bench"
fi
fi

part "done: $failed part(s) failed; log and figures in $out"
exit "$failed"
