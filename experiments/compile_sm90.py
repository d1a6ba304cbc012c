"""Deviceless compilation of every kernel configuration and decode program to an sm_90a cubin.

    JAX_PLATFORMS=cpu python experiments/compile_sm90.py [--out CSV] [--only SUBSTRING]

Needs jax >= 0.11 with jax-cuda13-plugin + jax-cuda13-pjrt (.ci/requirements-gpu-stage.txt) and
CUDA's `ptxas` (>= 12.8) on the PATH; no GPU. XLA gets its target from an H200 description
(experiments/gpu/h200_target.txtpb) through `jax.experimental.topologies.get_topology_desc`, and
`jax.jit(f).trace(*avals).lower().compile()` runs the whole GPU pipeline (XLA fusion, Triton and
Mosaic GPU kernel compilation, ptxas). The ptxas shim in experiments/gpu/ keeps each cubin and
ptxas's resource report, so every row of the CSV says how many cubin bytes that compile produced,
and the most registers / shared memory any of its kernels uses.

Checks (exit status 1 if any fails):
  - every kernel configuration and decode program compiles and produced at least one cubin;
  - the negative control (a Triton kernel whose tiles need more shared memory than an H200 SM
    has) is refused with RESOURCE_EXHAUSTED, so a compile that "passes" means something.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels import dispatch, mosaic_attention as ma, paged_gather as pg  # noqa: E402
from pallas_kernels import sparse_attention as sa, split_reorder as sr, topk  # noqa: E402
from pallas_kernels._common import compiler_params  # noqa: E402

log = logging.getLogger("compile_sm90")
TARGET = HERE / "gpu" / "h200_target.txtpb"
DEFAULT_OUT = HERE / "results" / "gpu_compile.csv"
S = jax.ShapeDtypeStruct
I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Case:
    """One thing to compile: `fn(*avals)` under `backend` (a dispatch backend name or None)."""

    name: str
    config: str
    fn: Callable
    avals: tuple
    backend: str | None = None
    donate: tuple[int, ...] = ()


def kernel_cases() -> list[Case]:
    """Every kernel configuration the tests lower (tests/kernel_tests/test_gpu_lowering.py: top-k,
    split/reorder, Triton attention, the paged gather) and the Mosaic attention kernels (selected
    rows and pages) at decode sizes, in bf16 / f16 and in f32 (3xbf16 products) at both head dims
    f32 takes (64, 128: the SMEM-tightest)."""
    cases = []
    for rows, n, k, dtype in [(64, 32_768, 6_554, BF16), (8, 131_072, 26_215, F32), (3, 1000, 77, F32)]:
        cases.append(Case("topk_select", f"R={rows} N={n} k={k} {jnp.dtype(dtype).name}",
                          functools.partial(_topk, k=k), (S((rows, n), dtype), S((rows,), I32))))
    for group, d_p in [(1, 19), (7, 38)]:
        rows, n, k = 16, 32_768, 6_554
        cases.append(Case("topk_select_fused", f"R={rows} N={n} k={k} G={group} d_p={d_p} bf16",
                          functools.partial(_topk_fused, k=k),
                          (S((rows, group, d_p), BF16), S((rows, n, d_p), BF16), S((rows,), I32))))
    for hpb in (1, 8):
        batch, n, k = 8, 131_072, 26_215
        cases.append(Case("split_reorder", f"B={batch} H_kv={hpb} N={n} k={k}",
                          functools.partial(_split_reorder, heads_per_batch=hpb),
                          (S((batch * hpb, k), I32), S((batch, n), jnp.int8))))
    # (backend, entry, G, dtype, D, k) of the sparse attention kernels, one row of B=8, H_kv=8 each
    attention = [("triton", _triton_attention, *shape) for shape in
                 [(1, BF16, 128, 6_554), (7, F32, 64, 6_554), (4, BF16, 128, 6_554)]]
    attention += [("mosaic", _mosaic_attention, *shape) for shape in
                  [(4, BF16, 128, 6_554), (3, BF16, 64, 2_048), (1, BF16, 128, 100), (7, jnp.float16, 64, 2_048),
                   (4, F32, 128, 6_554), (7, F32, 64, 2_048)]]
    for backend, entry, group, dtype, head_dim, k in attention:
        batch, kv_heads = 8, 8
        rows = batch * kv_heads
        avals = (S((batch, kv_heads * group, head_dim), dtype), S((rows, k, head_dim), dtype),
                 S((rows, k, head_dim), dtype), S((rows,), I32))
        cases.append(Case(f"sparse_decode_attention[{backend}]",
                          f"B={batch} H_kv={kv_heads} G={group} k={k} D={head_dim} "
                          f"{jnp.dtype(dtype).name}", entry, avals))
    for page_size, head_dim, pages, dtype in [(16, 128, 256, BF16), (16, 64, 128, BF16),
                                              (64, 128, 32, BF16), (16, 128, 256, F32),
                                              (16, 64, 128, F32)]:
        batch, kv_heads, group, num_pages = 8, 8, 4, 4096
        avals = (S((batch, kv_heads * group, head_dim), dtype),
                 S((num_pages, kv_heads, page_size, head_dim), dtype),
                 S((num_pages, kv_heads, page_size, head_dim), dtype),
                 S((batch, pages), I32), S((batch,), I32))
        cases.append(Case("paged_decode_attention[mosaic]",
                          f"B={batch} H_kv={kv_heads} G={group} P={page_size} pages={pages} "
                          f"D={head_dim} {jnp.dtype(dtype).name}", _mosaic_paged, avals))
    for page_size, head_dim, k, dtype in [(16, 128, 2_048, BF16), (16, 64, 6_554, F32),
                                          (64, 96, 100, jnp.float16)]:
        batch, kv_heads, num_pages, pages = 8, 8, 4096, 512
        cache = S((num_pages, kv_heads, page_size, head_dim), dtype)
        cases.append(Case("paged_gather[triton]",
                          f"B={batch} H_kv={kv_heads} P={page_size} pages={pages} k={k} D={head_dim} "
                          f"{jnp.dtype(dtype).name}", _paged_gather,
                          (cache, cache, S((batch, pages), I32), S((batch * kv_heads, k), I32))))
    return cases


def program_cases() -> list[Case]:
    """The whole jitted decode programs (experiments/decode_programs.py), per kernel backend."""
    from experiments import decode_programs as dp

    cfg = dp.small_config()
    geometry = (f"L={cfg.num_layers} hidden={cfg.hidden_size} H={cfg.num_heads} "
                f"H_kv={cfg.num_kv_heads} D={cfg.head_dim} {cfg.dtype}")
    dense_fn, dense_avals = dp.dense_decode_program(cfg, batch=8, n_max=4096)
    cases = [Case("decode_step[dense xla]", f"{geometry} B=8 N=4096", dense_fn, dense_avals,
                  donate=(1,))]
    paged_fn, paged_avals = dp.paged_decode_program(cfg, batch=8, num_pages=2049, page_size=16, max_pages=256)
    # the step DenseEngine and the serve batcher run, with the Mosaic paged kernel a Hopper GPU takes
    cases.append(Case("decode_step[paged mosaic]", f"{geometry} B=8 P=16 pages=2049 table=256",
                      paged_fn, paged_avals, backend="mosaic", donate=(1,)))
    sparse_fn, sparse_avals = dp.sparse_decode_layer_program(cfg, batch=8, n_max=4096)
    for backend in ("mosaic", "pallas", "xla"):
        cases.append(Case(f"sparse_decode_layer[{backend}]", f"{geometry} B=8 N=4096 k=20%",
                          sparse_fn, sparse_avals, backend=backend))
    # the SmartGen decode worker's own layer programs on the paged cache (jkv/disagg/decode_program.py),
    # as a Hopper runs them: oracle select + Triton top-k, Triton split/reorder and paged gather,
    # Mosaic attention; `landed` and `attend_landed` also scatter the landing rows into the pages
    for name, (fn, avals, donate) in dp.worker_layer_programs(cfg, batch=8, page_size=16, capacity=4096).items():
        cases.append(Case(f"sparse_paged_decode_layer[{name} mosaic]",
                          f"{geometry} B=8 P=16 pages=2049 table=256 oracle k=20%", fn, avals, backend="mosaic",
                          donate=donate))
    return cases


def _topk(s, v, *, k):
    return topk.topk_select_pallas(s, v, k)


def _topk_fused(q, kp, v, *, k):
    return topk.topk_select_fused_pallas(q, kp, v, k)


def _split_reorder(i, m, *, heads_per_batch):
    return sr.split_reorder_pallas(i, m, heads_per_batch)


def _triton_attention(q, ks, vs, c):
    return sa.sparse_decode_attention_partials_pallas(q, ks, vs, c)


def _mosaic_attention(q, ks, vs, c):
    return ma.sparse_decode_attention_partials_mosaic(q, ks, vs, c)


def _mosaic_paged(q, kp, vp, table, lengths):
    return ma.paged_decode_attention_partials_mosaic(q, kp, vp, table, lengths)


def _paged_gather(kp, vp, table, index):
    return pg.paged_gather_pallas(kp, vp, table, index)


def _smem_overflow(x, y):
    """Negative control: a [256, 256] x [256, 256] f32 dot in one program. Triton stages both
    operands in shared memory (2 x 256 KiB), more than the 227 KiB an H200 block may opt in to."""

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

    return pl.pallas_call(
        kernel, out_shape=S(x.shape, F32), compiler_params=compiler_params(num_warps=4),
    )(x, y)


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    config: str
    ok: bool
    compile_s: float
    cubins: int
    cubin_bytes: int
    max_registers: int | None
    max_smem_bytes: int | None
    error: str = ""


_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def _collect(dump: Path) -> tuple[int, int, int | None, int | None]:
    cubins = sorted(dump.glob("*.cubin"))
    regs, smem = [], []
    for info in dump.glob("*.info"):
        text = info.read_text(errors="replace")
        regs += [int(m) for m in _REGS.findall(text)]
        smem += [int(m) for m in _SMEM.findall(text)]
    return (len(cubins), sum(c.stat().st_size for c in cubins),
            max(regs) if regs else None, max(smem) if smem else None)


def _compile(case: Case, mesh: jax.sharding.Mesh, dump: Path) -> Result:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    avals = jax.tree_util.tree_map(lambda a: S(a.shape, a.dtype, sharding=sharding), case.avals)
    os.environ["JKV_PTXAS_DUMP"] = str(dump)
    backend = dispatch.backend(case.backend) if case.backend else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with backend, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            # A fresh function per compile: jit caches traces per function object, and the
            # dispatch backend is read at trace time (two backends, one program, two traces).
            fresh = functools.wraps(case.fn)(lambda *a: case.fn(*a))
            jax.jit(fresh, donate_argnums=case.donate).trace(*avals).lower().compile()
    except Exception as exc:  # noqa: BLE001 - recorded per case; the run goes on
        seconds = time.perf_counter() - start
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Result(case.name, case.config, False, seconds, *_collect(dump),
                      error=f"{type(exc).__name__}: {first[:300]}")
    finally:
        os.environ.pop("JKV_PTXAS_DUMP", None)
    seconds = time.perf_counter() - start
    cubins, nbytes, regs, smem = _collect(dump)
    error = "" if cubins else "compiled, but ptxas produced no cubin"
    return Result(case.name, case.config, bool(cubins), seconds, cubins, nbytes, regs, smem, error)


def gpu_mesh(target: Path) -> jax.sharding.Mesh:
    """A one-device mesh of a compile-only H200 described by `target` (no GPU needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology_name="", topology="1x1x1", target_config=target.read_text()
    )
    return jax.sharding.Mesh(topology.devices, ("x",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--only", default="", help="compile only cases whose name contains this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if jax.__version_info__ < (0, 11):
        parser.error(f"jax {jax.__version__}: deviceless GPU compilation needs jax >= 0.11 "
                     "with jax-cuda13-plugin (see .ci/requirements-gpu-stage.txt)")
    shim = HERE / "gpu"
    os.environ["PATH"] = f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("ptxas") is None:
        parser.error("no ptxas on PATH: install CUDA >= 12.8's ptxas (deviceless compile needs it)")
    mesh = gpu_mesh(args.target)
    log.info("# jax %s, target %s (%s)", jax.__version__, mesh.devices.flat[0].device_kind,
             args.target.name)

    cases = [c for c in kernel_cases() + program_cases() if args.only in c.name]
    results = []
    with tempfile.TemporaryDirectory(prefix="jkv-sm90-") as tmp:
        for i, case in enumerate(cases):
            result = _compile(case, mesh, Path(tmp) / f"{i:03d}")
            results.append(result)
            log.info("%-34s %-44s %s %6.2f s %3d cubin(s) %9d B regs=%s smem=%s %s",
                     result.name, result.config, "ok  " if result.ok else "FAIL",
                     result.compile_s, result.cubins, result.cubin_bytes, result.max_registers,
                     result.max_smem_bytes, result.error)
        control = _compile(
            Case("negative_control[smem overflow]", "256x256x256 f32 dot, 1 program",
                 _smem_overflow, (S((256, 256), F32), S((256, 256), F32))),
            mesh, Path(tmp) / "control",
        )
    refused = not control.ok and "RESOURCE_EXHAUSTED" in control.error
    log.info("%-34s %-44s %s (%s)", control.name, control.config,
             "refused as it must be" if refused else "FAIL: was not refused", control.error)
    # In the CSV the control's `ok` says whether the check behaved (it was refused).
    results.append(dataclasses.replace(control, ok=refused))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["kernel_or_program", "config", "ok", "compile_s", "cubins", "cubin_bytes",
                         "max_registers", "max_smem_bytes", "error", "jax", "target"])
        for r in results:
            writer.writerow([r.name, r.config, r.ok, f"{r.compile_s:.2f}", r.cubins, r.cubin_bytes,
                             "" if r.max_registers is None else r.max_registers,
                             "" if r.max_smem_bytes is None else r.max_smem_bytes, r.error,
                             jax.__version__, "sm_90a H200"])
    failed = [r for r in results if not r.ok]
    log.info("# wrote %s: %d rows, %d failed", args.out, len(results), len(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
