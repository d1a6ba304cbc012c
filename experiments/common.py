"""What every experiment script shares: where outputs go, the CSV writer, the common flags
(`--model`, `--seed`, `--out` / `--out-dir`) and logging.

Scripts import it as `from experiments.common import ...` with the repository root on the path
(`PYTHONPATH=.`, as every script's usage line assumes). Only the standard library is imported
at module level, so `--help` and the light benchmarks (bench_transport.py, serve_load.py) stay
free of the JAX stack; `write_csv` loads the package's writer when it is first called.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
from collections.abc import Iterable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"
# models.DEFAULT_MODEL, spelled out so that parsing arguments does not import JAX.
DEFAULT_MODEL = "smollm2-135m-instruct"
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"


def write_csv(path: str | os.PathLike, rows: Iterable[dict],
              fields: Sequence[str] | None = None) -> None:
    """`jkv.eval.csvfile.write_csv`: columns are `fields` when given (other keys dropped), else
    every key in first-seen order over the rows."""
    # Imported here, not at the top: importing jkv loads JAX (seconds), which scripts that only
    # parse arguments or time sockets should not pay before they need to write.
    from jkv.eval.csvfile import write_csv as write
    write(path, rows, fields)


def add_model_arg(parser: argparse.ArgumentParser, default: str = DEFAULT_MODEL) -> None:
    parser.add_argument("--model", default=default,
                        help=f"model name or path (default {default})")


def add_seed_arg(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument("--seed", type=int, default=default,
                        help=f"random seed (default {default})")


def add_out_arg(parser: argparse.ArgumentParser, default: str | os.PathLike = RESULTS,
                flag: str = "--out") -> None:
    """`flag` (e.g. --out, --out-dir) naming where the script writes: a folder, or a file when
    `default` names one (default under experiments/results/)."""
    what = "folder" if pathlib.Path(default).suffix == "" else "file"
    parser.add_argument(flag, default=str(default), help=f"output {what} (default {default})")


def describe_machine(info: dict) -> str:
    return (f"cpu: {info['cpu_model']} x{info['cores']} ({info['vector_extensions'] or 'no listed vector extensions'}); "
            f"load average {info['loadavg_1m']:.2f} {info['loadavg_5m']:.2f} {info['loadavg_15m']:.2f}")


def setup_logging(level: int = logging.INFO) -> None:
    """Timestamped `name: message` lines on stderr; absl's and JAX's backend chatter at WARNING."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for noisy in ("absl", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def machine_info() -> dict:
    """CPU model, its vector extensions, cores and the load average (1, 5, 15 min), for result rows
    and benchmark headers: a ratio measured on one machine says little about another without them."""
    model, flags = "unknown", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the platform string is the best we have
        import platform
        model = platform.processor() or platform.machine()
    vector = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                          "amx_tile", "amx_bf16", "asimd", "sve") if f in flags]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu_model": model, "vector_extensions": " ".join(vector), "cores": os.cpu_count(),
            "loadavg_1m": round(load[0], 2), "loadavg_5m": round(load[1], 2), "loadavg_15m": round(load[2], 2)}
