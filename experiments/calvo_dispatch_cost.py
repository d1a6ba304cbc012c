"""CPU the loading pipeline spends dispatching under each policy (calvo.py's LSTF finding).

Every dispatcher re-sorts the queued requests at each pick when the policy has a dynamic key
(LSTF), under the pipeline's lock and the GIL, so a slow key steals CPU from the fetch and
compute stages exactly when the queue is long. Fake stages that sleep (releasing the GIL) make
the dispatch overhead the only CPU work: 60 requests x 8 chunks submitted at once, the cost
model profiled by calvo.py. Prints and writes experiments/results/calvo_dispatch_cost.csv.

    python experiments/calvo_dispatch_cost.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jkv.scheduling import CostModel, LoadingPipeline, PipelineConfig, make_policy  # noqa: E402
from jkv.scheduling.testing import FakeStages, make_request  # noqa: E402

from experiments.common import RESULTS, add_out_arg, write_csv  # noqa: E402


def run(policy_name: str, model: CostModel, requests: int) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) to serve `requests` queued requests."""
    stages = FakeStages(32, 64, fetch_s=0.002, upload_s=0.0005)
    reqs = [make_request(i, i % 6, 8, 10, deadline=0.5 + 0.01 * i, compute_s=0.004)
            for i in range(requests)]
    cpu, wall = time.process_time(), time.perf_counter()
    t0 = time.monotonic()
    policy = make_policy(policy_name, model)
    with LoadingPipeline(stages.functions(), PipelineConfig(32, 64), policy,
                         clock=lambda: time.monotonic() - t0) as pipeline:
        for future in [pipeline.submit(r) for r in reqs]:
            future.result(timeout=120)
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--cost-model", default=str(RESULTS / "calvo_cost_model.json"))
    add_out_arg(parser, RESULTS / "calvo_dispatch_cost.csv")
    args = parser.parse_args(argv)
    model = CostModel.load(args.cost_model)
    rows = []
    for repeat in range(args.repeats):
        for name in ("fifo", "sjf", "edf", "lstf"):
            cpu, wall = run(name, model, args.requests)
            rows.append(dict(policy=name, repeat=repeat, requests=args.requests, cpu_s=cpu,
                             wall_s=wall))
            print(f"{name:>5} repeat {repeat}: CPU {cpu:.3f} s, wall {wall:.3f} s")
    edf = [r["cpu_s"] for r in rows if r["policy"] == "edf"]
    lstf = [r["cpu_s"] for r in rows if r["policy"] == "lstf"]
    print(f"LSTF / EDF dispatch CPU: {sum(lstf) / sum(edf):.2f}x")
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
