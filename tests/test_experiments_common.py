"""The benchmarks' shared machine record (experiments/common.py): one definition that every
benchmark's header and CSV columns read. Two definitions once shadowed each other and
bench_transport's header raised KeyError."""
import os

from experiments.common import describe_machine, machine_info


def test_machine_info_carries_what_the_benchmarks_record():
    info = machine_info()
    assert {"cpu_model", "vector_extensions", "cores", "loadavg_1m", "loadavg_5m", "loadavg_15m"} <= set(info)
    assert info["cores"] == os.cpu_count()
    line = describe_machine(info)
    assert info["cpu_model"] in line and f"x{info['cores']}" in line and "load average" in line
