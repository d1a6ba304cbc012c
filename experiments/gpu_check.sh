#!/usr/bin/env bash
# GPU check: every step runs even when one fails; everything it measures goes under $OUT.
#
#   bash experiments/gpu_check.sh --prepare        # here, with network: wheels the GPU image lacks
#   OUT=/some/dir bash experiments/gpu_check.sh    # on the GPU machine (< 8 minutes on an H200)
#   OUT=/tmp/x bash experiments/gpu_check.sh --cpu-dry-run   # the same steps on CPU, tiny sizes (CI)
#
# Steps (each with its own time limit; status, seconds and log in $OUT/steps.csv):
#   env       jax version, devices, nvidia-smi, dispatch's backend choice
#   wheels    installs what `import models, pallas_kernels, jkv` needs and the image lacks, from
#             experiments/gpu/wheels/ (made by --prepare; carry it: it is git-ignored)
#   kernels   tests/kernel_tests with the kernels compiled (JKV_KERNEL_MODE=compiled), no -x
#   bench     experiments/bench_kernels.py: each op per backend (mosaic / triton / xla), GB/s,
#             fraction of measured HBM bandwidth, at k = 2,048, B*H_kv = 64
#   f32_attention  f32 sparse decode attention per backend (the Mosaic kernel runs it as 3xbf16
#             products): time, GB/s, and max error against an f64 reference, in
#             attention_f32.csv (on CPU: the XLA reference, and the Mosaic kernel interpreted
#             where jax >= 0.11 has the interpreter; interpret mode is never timed)
#   programs  experiments/gpu_programs.py: end-to-end generate (random-weight model, token-id
#             prompts) and the decode programs' times vs XLA (the dense step, a sparse layer, and
#             the decode worker's own fused / landed / attend_landed), GB/s vs the H200's 4.8 TB/s
# Then $OUT/summary.md: one table of the steps and the CSVs' contents.
set -u
cd "$(dirname "$0")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/experiments/gpu/wheels"
MODE=gpu
case "${1:-}" in
    --cpu-dry-run) MODE=cpu ;;
    --prepare) MODE=prepare ;;
    "") ;;
    *) echo "usage: $0 [--cpu-dry-run | --prepare]" >&2; exit 2 ;;
esac

if [ "$MODE" = prepare ]; then
    # Pure-python or cp312 manylinux wheels of the packages the GPU image (jax 0.11.2, numpy,
    # pytest, hypothesis on Python 3.12) lacks; --no-deps keeps jax/numpy out (the image has them).
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --implementation cp -d "$WHEELS" \
        crc32c flax optax chex msgpack rich markdown-it-py mdurl pygments treescope orbax-checkpoint \
        tensorstore etils absl-py typing_extensions PyYAML jinja2 MarkupSafe tokenizers \
        huggingface_hub tqdm filelock fsspec packaging humanize simplejson protobuf nest_asyncio \
        aiofiles zipp importlib_resources toolz 2>&1 | grep -v "is ignored"
    du -sh "$WHEELS"
    echo "carry it: run(..., carry=[\"experiments/gpu/wheels\"])"
    exit 0
fi

OUT="${OUT:-$ROOT/experiments/results/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$MODE" = cpu ]; then
    export JAX_PLATFORMS=cpu
    KERNEL_MODE=interpret
    # A quick subset: the point is that every step of the script runs (pytest, its junit XML, the
    # summary), not kernel coverage, which the main suite's run of tests/kernel_tests has. The dispatch
    # tests of this file lower Triton/Mosaic programs for CUDA (~1 min of CPU between them) and run
    # in the suite anyway; the refusal and backend-choice tests take a second.
    KERNEL_TESTS=(tests/kernel_tests/test_mosaic_attention.py -k "refused or auto_prefers")
    BENCH_ARGS=(--device cpu --batch 1 --kv-heads 2 --tokens 2048 --head-dim 64 --repeats 1)
    PROGRAM_ARGS=(--small)
else
    KERNEL_MODE=compiled
    KERNEL_TESTS=(tests/kernel_tests -m "not slow")  # not the CPU dry run of this very script
    BENCH_ARGS=(--device gpu --batch 8 --kv-heads 8 --tokens 10240 --ratio 0.2 --head-dim 128)
    PROGRAM_ARGS=()
fi
echo "step,status,seconds,log" > "$OUT/steps.csv"

run_step() {  # run_step NAME LIMIT_S CMD...: never aborts the script
    local name="$1" limit="$2"; shift 2
    local log="$OUT/$name.log" start rc
    start=$(date +%s)
    echo "# step $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local status=ok
    [ $rc -ne 0 ] && status="failed(rc=$rc)"
    [ $rc -eq 124 ] && status="timed-out"
    echo "$name,$status,$(( $(date +%s) - start )),$name.log" >> "$OUT/steps.csv"
    tail -3 "$log"
}

run_step env 60 "$PYTHON" - <<'PY'
import logging, subprocess, sys
import jax
logging.basicConfig(level=logging.INFO)
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, backend {jax.default_backend()}")
for d in jax.devices():
    print(f"device {d.id}: {d.device_kind} compute capability {getattr(d, 'compute_capability', '-')}")
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.memory,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout)
except (OSError, subprocess.SubprocessError) as exc:
    print(f"nvidia-smi: {exc}")
from pallas_kernels import dispatch
print("dispatch auto ->", dispatch.resolved_backend())
PY

run_step wheels 120 bash -c '
missing=$("'"$PYTHON"'" - <<PY
import importlib.util
need = ["crc32c", "flax", "jinja2", "tokenizers", "yaml"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
echo "missing: ${missing:-none}"
[ -z "$missing" ] && exit 0
[ -d "'"$WHEELS"'" ] || { echo "no '"$WHEELS"': run gpu_check.sh --prepare where pip can reach PyPI and carry it"; exit 1; }
"'"$PYTHON"'" -m pip install -q --no-index --no-deps --find-links "'"$WHEELS"'" "'"$WHEELS"'"/*.whl
"'"$PYTHON"'" -c "import crc32c, flax, jinja2, tokenizers; print(\"wheels ok\")"'

run_step kernels 200 env JKV_KERNEL_MODE="$KERNEL_MODE" "$PYTHON" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning --junitxml="$OUT/kernels_junit.xml" "${KERNEL_TESTS[@]}"

run_step bench 120 "$PYTHON" experiments/bench_kernels.py "${BENCH_ARGS[@]}" --out "$OUT"

run_step f32_attention 150 "$PYTHON" - "$OUT" "$MODE" <<'PY'
import csv, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import dispatch, mosaic_attention

out, mode = sys.argv[1], sys.argv[2]
batch, kv_heads, group, k, head_dim = (1, 2, 4, 200, 64) if mode == "cpu" else (8, 8, 4, 2048, 128)
rows, repeats = batch * kv_heads, 20
rng = np.random.default_rng(0)
q = rng.standard_normal((batch, kv_heads * group, head_dim), dtype=np.float32)
keys = rng.standard_normal((rows, k, head_dim), dtype=np.float32)
values = rng.standard_normal((rows, k, head_dim), dtype=np.float32)
valid = np.full(rows, k, np.int32)
valid[1:] = rng.integers(1, k + 1, rows - 1)  # mixed lengths, one row full
# f64 reference: head h of batch b attends row b * H_kv + h // G.
qr = q.reshape(rows, group, head_dim).astype(np.float64)
want = np.zeros_like(qr)
for r in range(rows):
    s = qr[r] @ keys[r, : valid[r]].T.astype(np.float64) / np.sqrt(head_dim)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want[r] = p @ values[r, : valid[r]].astype(np.float64) / p.sum(axis=1, keepdims=True)
want = want.reshape(q.shape)
args = tuple(map(jnp.asarray, (q, keys, values, valid)))
traffic = sum(a.nbytes for a in args) + q.nbytes
if mode == "cpu":
    runs = [("xla", "xla", None)]
    if mosaic_attention.INTERPRET_AVAILABLE:
        interpreted = mosaic_attention.sparse_decode_attention_partials_mosaic
        runs.append(("mosaic-interpret", None, lambda *a: interpreted(*a, interpret=True)[0]))
else:
    with dispatch.backend("auto"):
        auto = dispatch.resolved_backend()
    backends = ("mosaic", "pallas", "xla") if auto == "mosaic" else ("pallas", "xla")
    runs = [(b, b, None) for b in backends]
records, failed = [], 0
for name, backend, direct in runs:
    record = dict(backend=name, rows=rows, k=k, head_dim=head_dim, group=group, dtype="float32",
                  ms="", gbps="", hbm_fraction_4800="", max_abs_err_vs_f64="", error="")
    try:
        if direct is not None:
            got = direct(*args)
        else:
            with dispatch.backend(backend):
                fn = jax.jit(lambda *a: dispatch.sparse_decode_attention_partials(*a)[0])
                got = jax.block_until_ready(fn(*args))
                times = []
                for _ in range(repeats if mode != "cpu" else 1):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            record.update(ms=f"{seconds * 1e3:.4f}", gbps=f"{traffic / seconds / 1e9:.1f}")
            if mode != "cpu":  # the H200's 4.8 TB/s
                record["hbm_fraction_4800"] = f"{traffic / seconds / 4.8e12:.3f}"
        record["max_abs_err_vs_f64"] = f"{np.abs(np.asarray(got, np.float64) - want).max():.2e}"
    except Exception as exc:  # recorded; the other backends still run
        failed += 1
        first = (str(exc).strip().splitlines() or [""])[0]
        record["error"] = f"{type(exc).__name__}: {first[:200]}"
    print(record)
    records.append(record)
with open(os.path.join(out, "attention_f32.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
sys.exit(1 if failed else 0)
PY

run_step programs 200 "$PYTHON" experiments/gpu_programs.py --out "$OUT" "${PROGRAM_ARGS[@]}"

"$PYTHON" - "$OUT" "$MODE" <<'PY'
import csv, datetime, os, sys, xml.etree.ElementTree as ET
out, mode = sys.argv[1], sys.argv[2]
lines = [f"# GPU check ({'CPU dry run' if mode == 'cpu' else 'GPU'}), "
         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}", ""]
env_log = os.path.join(out, "env.log")
if os.path.exists(env_log):
    lines += ["```", *open(env_log).read().strip().splitlines()[-8:], "```", ""]
lines += ["| step | status | seconds |", "|---|---|---|"]
for row in csv.DictReader(open(os.path.join(out, "steps.csv"))):
    lines.append(f"| {row['step']} | {row['status']} | {row['seconds']} |")
junit = os.path.join(out, "kernels_junit.xml")
if os.path.exists(junit):
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    a = suite.attrib
    lines += ["", f"Kernel tests: {a.get('tests')} run, {a.get('failures')} failed, "
              f"{a.get('errors')} errors, {a.get('skipped')} skipped."]
    for case in suite.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            lines.append(f"- FAILED {case.get('name')}: {(bad.get('message') or '')[:200]}")
for name in sorted(os.listdir(out)):
    if name.endswith(".csv") and name != "steps.csv":
        rows = list(csv.reader(open(os.path.join(out, name))))
        if not rows:
            continue
        lines += ["", f"## {name}", "", "| " + " | ".join(rows[0]) + " |",
                  "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print(f"# wrote {os.path.join(out, 'summary.md')}")
PY
cat "$OUT/steps.csv"
# Exit status: failed steps are in the summary; the script itself always completes.
! grep -q -e ',failed' -e ',timed-out' "$OUT/steps.csv"
