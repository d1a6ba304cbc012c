#!/usr/bin/env bash
# GPU check for the decode-path kernels (issue 3). Run on a machine with an NVIDIA GPU and a CUDA
# jax, from anywhere:  bash experiments/gpu_check.sh   (about 2-3 minutes on an H200)
#  1. the kernel tests with the kernels compiled by Triton (JKV_KERNEL_MODE=compiled), not
#     interpreted: every kernel against its reference on the adversarial inputs;
#  2. the micro-benchmark: time, achieved GB/s, fraction of the HBM bandwidth measured in the same
#     run, speed-up over the XLA reference (R=64, N=32K, k=20% N, D=128, bf16).
# Record the printed figures with date and device in experiments/results/gpu_kernels.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" - <<'PY'
import sys, jax
if jax.default_backend() != "gpu":
    sys.exit(f"gpu_check.sh needs a GPU: jax {jax.__version__} sees {jax.default_backend()!r} "
             "(install jax[cuda12] or jax[cuda13])")
print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true

echo "# 1/2 kernel tests, compiled on the GPU"
JKV_KERNEL_MODE=compiled XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 \
    "$PYTHON" -m pytest tests/kernels -q -x -p no:cacheprovider

echo "# 2/2 micro-benchmark"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 70 "$PYTHON" experiments/bench_kernels.py --device gpu
