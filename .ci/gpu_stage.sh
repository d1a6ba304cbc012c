#!/usr/bin/env bash
# Second CI stage (after `make test`): the kernels on the newest jax, and everything compiled to
# real Hopper code without a GPU.
#   1. a Python 3.12 venv (.venv312) with the pinned jax >= 0.11 + CUDA 13 plugin
#      (.ci/requirements-gpu-stage.txt); installed once, then reused (a stamp keyed on the file);
#   2. tests/kernel_tests on that jax: interpret mode (Triton and Mosaic GPU kernels) and export;
#   3. experiments/compile_sm90.py: deviceless compilation of every kernel configuration and the
#      jitted decode programs to sm_90a cubins with the machine's ptxas, plus a negative control
#      that must be refused; results in experiments/results/gpu_compile.csv.
# `gpu_stage.sh --install-only` does step 1 and stops. .ci/run runs the whole stage in the
# background at nice 10 while `make test` runs (see there).
# Needs: Python 3.12 (JKV_PYTHON312, else pyenv's 3.12.1, else python3.12 on PATH) and CUDA
# >= 12.8's ptxas on PATH for step 3. Where either is missing the stage says so loudly and skips
# what it cannot run (exit 0); set JKV_GPU_STAGE_REQUIRED=1 to make that a failure instead.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv312
REQ=.ci/requirements-gpu-stage.txt
required="${JKV_GPU_STAGE_REQUIRED:-0}"

loud_skip() {
    printf '\n%s\n!! GPU STAGE SKIPPED: %s\n%s\n\n' "$(printf '!%.0s' {1..78})" "$1" "$(printf '!%.0s' {1..78})" >&2
    [ "$required" = "1" ] && exit 1
    exit 0
}

py312="${JKV_PYTHON312:-}"
if [ -z "$py312" ]; then
    for candidate in "$HOME/.pyenv/versions/3.12.1/bin/python3.12" "$(command -v python3.12 || true)"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then py312="$candidate"; break; fi
    done
fi
if [ -z "$py312" ] || ! "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    loud_skip "no Python 3.12 found (jax >= 0.11 needs it). Install one (e.g. 'pyenv install 3.12.1') or point JKV_PYTHON312 at it, then rerun: bash .ci/gpu_stage.sh"
fi

stage_start=$(date +%s)
stamp="$VENV/.installed-$(sha256sum "$REQ" | cut -c1-16)"
install_s=0
if [ ! -f "$stamp" ]; then
    t0=$(date +%s)
    echo "# gpu stage: creating $VENV with $py312 and installing $REQ (first run only)"
    rm -rf "$VENV"
    bash .ci/venv_install.sh "$py312" "$VENV" -r "$REQ" || true  # uv, else pip; checked next
    "$VENV/bin/python" -c 'import jax, jax_plugins.xla_cuda13, flax, pytest' || { echo "gpu stage: install failed" >&2; exit 1; }
    touch "$stamp"
    install_s=$(( $(date +%s) - t0 ))
fi
if [ "${1:-}" = "--install-only" ]; then
    echo "# gpu stage: $VENV ready (install ${install_s}s)"
    exit 0
fi
echo "# gpu stage: $("$VENV/bin/python" -c 'import sys, jax; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}")'), install ${install_s}s"

export JAX_PLATFORMS=cpu PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
t0=$(date +%s)
echo "# gpu stage 1/2: tests/kernel_tests on jax >= 0.11 (interpret + export)"
# -m "not slow": the gpu_check.sh dry run (slow) already runs in the main stage.
# XLA:CPU at LLVM -O0, as in the main stage: tests/conftest.py leaves XLA_FLAGS alone where a jax
# plugin is installed (this venv has the CUDA one), but this step compiles nothing for a GPU (CPU
# only: interpret mode and jax.export), and its CPU time is mostly XLA compiling the interpreted
# kernels. Only this command gets the flag: step 2 compiles for sm_90a with XLA's defaults.
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0" \
    "$VENV/bin/python" -m pytest -q tests/kernel_tests -m "not slow" -p no:cacheprovider -W ignore::DeprecationWarning || status=1
tests_s=$(( $(date +%s) - t0 ))

t0=$(date +%s)
if command -v ptxas >/dev/null 2>&1; then
    echo "# gpu stage 2/2: deviceless sm_90a compile ($(ptxas --version | tail -1))"
    "$VENV/bin/python" experiments/compile_sm90.py 2>&1 | grep -v -e DeprecationWarning -e "return rule(" || true
    "$VENV/bin/python" - <<'PY' || status=1
import csv, sys
rows = list(csv.DictReader(open("experiments/results/gpu_compile.csv")))
bad = [r for r in rows if r["ok"] != "True"]
for r in bad:
    print(f"gpu stage: FAILED {r['kernel_or_program']} [{r['config']}]: {r['error']}", file=sys.stderr)
print(f"# gpu stage: {len(rows) - len(bad)}/{len(rows)} compile checks ok")
sys.exit(1 if bad or not rows else 0)
PY
else
    compile_note="SKIPPED (no ptxas)"
    printf '!! gpu stage 2/2 SKIPPED: no ptxas on PATH. Install the CUDA toolkit (>= 12.8) ptxas to compile to sm_90a.\n' >&2
    [ "$required" = "1" ] && status=1
fi
compile_s=$(( $(date +%s) - t0 ))
echo "# gpu stage timings: install ${install_s}s, kernel tests ${tests_s}s, sm_90a compile ${compile_s}s ${compile_note:-}, total $(( $(date +%s) - stage_start ))s"
exit $status
