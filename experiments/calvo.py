"""CALVO on SmolLM2 with a paced pool link (paper Figs. 7, 8, 10 on a real model, real pool).

A `jkv pool` server runs as a child process and paces everything it sends at `--link`
(transport token bucket); the engine loads cached KV chunks from it over tcp with
`RemoteKVPool`, copies them L2 -> L1, and prefills each request's uncached suffix with
SmolLM2-135M (`PrefixPrefill`). Compared side by side on the same requests:

  serialized-fifo   vLLM + LMCache-like baseline: one request at a time, load then compute
  fifo, sjf-pt, sjf, srpt, edf, lstf   the pipelined engine (`LoadingPipeline`) under each
                    policy (srpt: SJF on the remaining modelled cost)

Workload: long-context / short-query requests built from local documents (tokenized with the
model's tokenizer), Poisson arrivals, SLO = {2, 4, 8} x the request's interference-free TTFT
(§4: measured, by serving every request alone on the baseline; `--slo-from modelled`: the
fitted cost model's T). Scenarios: `full-hit` (every context cached: Figs. 7, 8) and
`mixed-hit` (each request's cached share drawn from {75, 87.5, 100}%: Fig. 10). QPS is swept as
a fraction of the baseline's capacity measured in the same run by that back-to-back probe
(`--load-basis modelled`: of 1 / mean modelled T); whether the baseline sustained each load is
checked from its run (jkv/scheduling/capacity.py) and the highest sustained load reported.

Order of work: start the pool, cache every context (prefill once, write chunks back), profile
isolated requests on the pipelined engine and fit the cost model T = a*ctx + b + c*query + d
(§3.2), then per (scenario, seed) probe the baseline and run every (load, policy) point in
real time on the same requests (same arrivals for every policy). First tokens of every run
are checked against the baseline's (the schedule must not change results).

    python experiments/calvo.py [--quick] [--link 2gbit]

Writes experiments/results/calvo.csv, calvo_summary.csv, calvo_requests.csv (per request),
calvo.png, calvo_cost_model.json (the bucketed fit),
calvo_cost_model_plain.json (the paper's plain lines) and calvo_profile.csv (profiling samples).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import queue
import secrets
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jkv.kvpool.hashing import ChunkNamespace, chunk_keys  # noqa: E402
from jkv.kvpool.remote_pool import RemoteKVPool  # noqa: E402
from jkv.scheduling import (CostModel, LoadingPipeline, PipelineConfig,  # noqa: E402
                            PipelineRequest, StageFunctions, make_policy, run_serialized)
from jkv.scheduling.metrics import summarize  # noqa: E402
from jkv.scheduling.policies import RequestInfo  # noqa: E402
from jkv.scheduling.pool_stages import pool_fetch, write_back  # noqa: E402
from jkv.scheduling.prefix_prefill import (ModelStages, PrefixPrefill, chunk_shape,  # noqa: E402
                                           split_chunks)
from jkv.scheduling.workload import WorkloadConfig, build_workload  # noqa: E402
from jkv.scheduling.capacity import (mg1_mean_ttft, probe_baseline, probe_from_rows,  # noqa: E402
                                     sustain_check)
from jkv.scheduling.report import (PLAIN_POLICIES, POLICIES, SCENARIOS,  # noqa: E402,F401
                                   aggregate, markdown_tables, merge_rows, read_csv,
                                   read_rows, report, write_outputs)
from jkv.scheduling.variants import recording_demotions  # noqa: E402

from experiments.common import RESULTS, add_model_arg, add_out_arg, write_csv  # noqa: E402



class Engine:
    """The model, the pool client and the L2/L1 buffers shared by every run."""

    def __init__(self, args, secret: str, address: str):
        from models import load_model

        self.args = args
        self.model = load_model(args.model)
        cfg = self.model.cfg
        self.C = args.chunk_tokens
        self.ns = ChunkNamespace(args.model, cfg.dtype, self.C)
        self.prefill = PrefixPrefill(self.model, prefix_bucket=512)
        shape = chunk_shape(cfg, self.C)
        self.host = np.zeros((args.host_slots,) + shape, np.dtype(cfg.dtype))
        self.device = np.zeros((args.device_slots,) + shape, np.dtype(cfg.dtype))
        self.chunk_bytes = self.host[0].nbytes
        self.pool = RemoteKVPool(address, secret=secret, op_timeout_s=30.0)
        self.prompts: dict = {}
        self.compiled: set = set()
        stages = ModelStages(self.prefill, self.host, self.device, self.C,
                             lambda r: self.prompts[r.request_id])
        self.functions = StageFunctions(pool_fetch(self.pool, self.host,
                                                   lambda r: r.payload["keys"]),
                                        stages.upload, stages.compute)

    def cache_context(self, context: np.ndarray, cached_tokens: int) -> None:
        """Prefill the context once and write its first cached_tokens // C chunks to the pool."""
        keys = chunk_keys(context, self.ns)[:cached_tokens // self.C]
        if not keys or all(self.pool.contains_many(keys)):
            return
        _, kv = self.prefill(None, 0, context)
        chunks = split_chunks(kv, self.C)[:len(keys)]
        write_back(self.pool, keys, chunks)

    def request(self, rid, prompt: np.ndarray, cached_tokens: int, info) -> PipelineRequest:
        """A pipeline request loading the prompt's cached chunks (those the workload says are
        cached and the pool really holds: the longest prefix match)."""
        keys = chunk_keys(prompt, self.ns)[:cached_tokens // self.C]
        hit = self.pool.longest_prefix_keys(keys)
        self.prompts[rid] = prompt
        compute_tokens = len(prompt) - hit * self.C
        info = dataclasses.replace(info, request_id=rid, cached_tokens=hit * self.C,
                                   compute_tokens=compute_tokens)
        return PipelineRequest(info, hit, compute_slots=-(-compute_tokens // self.C),
                               payload={"keys": keys[:hit]})

    def pipeline(self, policy, clock=time.monotonic) -> LoadingPipeline:
        return LoadingPipeline(self.functions, PipelineConfig(self.args.host_slots,
                                                              self.args.device_slots), policy,
                               clock=clock)


def start_pool(args, secret: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, JKV_SECRET=secret, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "jkv.kvpool.server", "--capacity",
                             args.pool_capacity, "--bandwidth", args.link, "--stdin-eof-exits"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    return proc, json.loads(proc.stdout.readline())["address"]


def run_realtime(engine: Engine, requests: list[PipelineRequest], policy_name: str,
                 cost_model: CostModel, plain_model: CostModel | None = None,
                 demoted: set | None = None) -> dict:
    """Submit each request at its arrival time; return {request_id: (ttft_s, first token)}.
    `<policy>-plain` runs <policy> ordered by plain_model; `demoted` collects the requests a
    dynamic policy ranked as hopeless."""
    out = {}
    if policy_name.endswith("-plain"):
        policy_name, cost_model = policy_name[:-len("-plain")], plain_model
    if policy_name == "serialized-fifo":
        inbox: queue.Queue = queue.Queue()

        def worker():
            while (item := inbox.get()) is not None:
                request, arrived = item
                result = run_serialized([request], engine.functions, engine.args.host_slots,
                                        engine.args.device_slots)[0]
                out[request.request_id] = (time.monotonic() - arrived, result.value[0])

        thread = threading.Thread(target=worker, name="calvo-serialized")
        thread.start()
        t0 = time.monotonic()
        for request in requests:
            time.sleep(max(0.0, t0 + request.info.arrival_s - time.monotonic()))
            inbox.put((request, time.monotonic()))
        inbox.put(None)
        thread.join()
        return out
    futures = {}
    t0 = time.monotonic()   # the workload's clock (arrival_s, deadline_s) starts here
    policy = make_policy(policy_name, cost_model)
    if demoted is not None:
        policy = recording_demotions(policy, demoted)
    with engine.pipeline(policy, clock=lambda: time.monotonic() - t0) as pipeline:
        for request in requests:
            time.sleep(max(0.0, t0 + request.info.arrival_s - time.monotonic()))
            futures[request.request_id] = pipeline.submit(request)
        for rid, future in futures.items():
            result = future.result(timeout=600)
            out[rid] = (result.ttft_s, result.value[0])
    return out


def profile(engine: Engine, contexts: list[np.ndarray], rng) -> tuple[CostModel, CostModel]:
    """Isolated requests on the pipelined engine -> per-stage times (load: submit -> compute
    start, compute: compute start -> first token) -> two least-squares fits on the same samples:
    the paper's plain lines (§3.2: T_comp = c*query + d) and the bucketed compute part
    (T_comp = c*q' + e*ctx'*q' + f*ctx' + d on the engine's padded suffix/prefix counts)."""
    ctx_s, query_s, load_s, comp_s = [], [], [], []
    samples = []
    C = engine.C
    for context in contexts:
        n = len(context)
        for q in (16, 64):
            samples.append((context, n, q))
        samples.append((context, n * 3 // 4 // C * C, 32))      # 75% hit
        samples.append((context, n * 7 // 8 // C * C, 48))      # 87.5% hit
    for i, (context, cached, q) in enumerate(samples * 2):     # 2 repeats; the first warms up
        prompt = np.concatenate([context, rng.integers(100, 20000, q).astype(np.int32)])
        request = engine.request(("profile", i), prompt, cached,
                                 RequestInfo(("profile", i), 0.0, 0, 0))
        with engine.pipeline(make_policy("fifo")) as pipeline:
            result = pipeline.submit(request).result(timeout=600)
        if i < len(samples):
            continue
        ctx_s.append(request.info.cached_tokens)
        query_s.append(request.info.compute_tokens)
        load_s.append(result.compute_started_s - result.submitted_s)
        comp_s.append(result.finished_s - result.compute_started_s)
    deployment = (f"{engine.args.model} fp32, pool link {engine.args.link}, chunk {engine.C}, "
                  "2-core CPU")
    plain = CostModel.fit(ctx_s, query_s, load_s, comp_s, relative=True,
                          deployment=deployment + ", plain lines")
    bucketed = CostModel.fit(ctx_s, query_s, load_s, comp_s, relative=True,
                             query_buckets=engine.prefill.suffix_buckets,
                             prefix_bucket=engine.prefill.prefix_bucket, context_terms=True,
                             deployment=deployment + ", bucketed compute")
    ctx, query = np.array(ctx_s), np.array(query_s)
    total, comp = np.array(load_s) + np.array(comp_s), np.array(comp_s)
    fields = ["ctx_tokens", "query_tokens", "t_load_s", "t_comp_s", "plain_T_s", "bucketed_T_s"]
    write_csv(pathlib.Path(engine.args.out_dir) / "calvo_profile.csv",
              [dict(zip(fields, row)) for row in zip(ctx_s, query_s, load_s, comp_s,
                                                     plain.cost(ctx, query),
                                                     bucketed.cost(ctx, query))], fields)
    engine.fit_median_error = {}
    for name, model in (("plain", plain), ("bucketed", bucketed)):
        err_t = np.abs(model.cost(ctx, query) / total - 1)
        err_c = np.abs(model.t_comp(query, ctx) / comp - 1)
        engine.fit_median_error[name] = float(np.median(err_t))
        print(f"{name:>8} fit on {len(ctx_s)} isolated requests: T_load = {model.a * 1e3:.4f} "
              f"ms/token * ctx + {model.b * 1e3:.1f} ms; T_comp = {model.c * 1e3:.3f} ms * q' + "
              f"{model.e * 1e6:.4f} us * ctx'q' + {model.f * 1e3:.4f} ms * ctx' + "
              f"{model.d * 1e3:.1f} ms; median |error| of T {100 * np.median(err_t):.1f}% "
              f"(max {100 * err_t.max():.0f}%), of T_comp {100 * np.median(err_c):.1f}%")
    return plain, bucketed


def warm_up(engine: Engine, requests: list[PipelineRequest]) -> None:
    """Compile every (prefix, suffix) bucket pair these requests need, outside the timed runs."""
    pp, C = engine.prefill, engine.C
    cfg = engine.model.cfg
    for prefix, suffix in sorted({(r.num_chunks * C, r.info.compute_tokens) for r in requests}):
        key = (pp.prefix_padded(prefix), pp.suffix_bucket(suffix))
        if key in engine.compiled:
            continue
        engine.compiled.add(key)
        kv = np.zeros((cfg.num_layers, 2, cfg.num_kv_heads, key[0], cfg.head_dim),
                      np.dtype(cfg.dtype)) if prefix else None
        pp(kv, prefix, np.ones(suffix, np.int32))


def build_requests(engine: Engine, workload, cost_model: CostModel,
                   isolated_s: dict | None = None):
    """Pipeline requests with deadline = arrival + SLO factor x interference-free TTFT: the
    measured one (`isolated_s`, by request id: the baseline probe, §4) or, without it, the
    cost model's T."""
    requests, slo = [], {}
    for w in workload:
        info = w.info()
        request = engine.request(w.request_id, w.tokens(), w.cached_tokens, info)
        isolated = (isolated_s[w.request_id] if isolated_s is not None else
                    cost_model.cost(request.info.cached_tokens, request.info.compute_tokens))
        deadline = w.arrival_s + w.slo_factor * isolated
        request = dataclasses.replace(request, info=dataclasses.replace(request.info,
                                                                        deadline_s=deadline))
        requests.append(request)
        slo[w.request_id] = w.slo_factor * isolated
    return requests, slo


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="full-hit only, one load, one seed, 16 requests")
    add_model_arg(parser)
    parser.add_argument("--link", default="1gbit", help="pool link pacing (server sends)")
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--contexts", type=int, default=6)
    parser.add_argument("--queries", type=int, default=8, help="queries per context")
    parser.add_argument("--min-context", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--loads", default="0.6,0.9",
                        help="full-hit offered loads as fractions of the baseline's capacity")
    parser.add_argument("--mixed-loads", default="0.7",
                        help="mixed-hit offered loads (each point costs ~2x a full-hit one)")
    parser.add_argument("--baseline-only-loads", default="",
                        help="loads (also listed in --loads / --mixed-loads) at which only "
                             "serialized-fifo runs: controls for the sustain check (e.g. 1.0)")
    parser.add_argument("--scenarios", default="full-hit,mixed-hit")
    parser.add_argument("--seeds", default="0,1,2",
                        help="workload seeds per point (contexts, queries, arrivals, hit ratios, "
                             "SLO factors); figures are reported as mean ± std over them")
    parser.add_argument("--append", action="store_true",
                        help="merge into the out-dir's calvo.csv (same scenario/load/seed/policy/"
                             "link rows are replaced): split the seeds across several runs")
    parser.add_argument("--reuse-probe", action="store_true",
                        help="no probe: take each (scenario, seed)'s capacity and isolated TTFTs "
                             "from the out-dir's calvo.csv / calvo_requests.csv (an earlier "
                             "held run), so the policies run here join that run's paired "
                             "comparison (same arrivals and SLOs; a load it did not sweep gets "
                             "new arrivals at the probe's capacity); implies --append")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: rebuild calvo_summary.csv / calvo.png from calvo.csv")
    parser.add_argument("--load-basis", choices=("measured", "modelled"), default="measured",
                        help="loads are fractions of the baseline's capacity measured by a "
                             "back-to-back probe in this run (default) or of the cost model's")
    parser.add_argument("--slo-from", choices=("measured", "modelled"), default="measured",
                        help="SLO base: each request's interference-free TTFT measured by the "
                             "probe (§4, default) or the cost model's T")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="order sjf/lstf by the profiled model as fitted (default: rescaled "
                             "per seed to the probe's measured isolated times)")
    parser.add_argument("--host-slots", type=int, default=32, help="L2 capacity in chunks")
    parser.add_argument("--device-slots", type=int, default=64, help="L1 capacity in chunks")
    parser.add_argument("--pool-capacity", default="2GiB")
    parser.add_argument("--cost-model", choices=("bucketed", "plain"), default="bucketed",
                        help="which fit orders sjf/lstf and sets SLOs and QPS (the other one "
                             "orders the *-plain A/B policies)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated; serialized-fifo first (tokens are checked "
                             "against the first policy's); sjf-plain, lstf-plain: A/B orders "
                             "by the other fit")
    parser.add_argument("--hit-ratios", default="0.75,0.875,1.0",
                        help="mixed-hit scenario: cached share of each context, drawn per request")
    add_out_arg(parser, RESULTS, flag="--out-dir")
    args = parser.parse_args(argv)
    if args.quick:
        args.scenarios, args.loads, args.contexts, args.queries = "full-hit", "0.9", 4, 4
        args.seeds = args.seeds.split(",")[0]
    loads = {"full-hit": [float(x) for x in args.loads.split(",")],
             "mixed-hit": [float(x) for x in args.mixed_loads.split(",")]}
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    baseline_only = {float(x) for x in args.baseline_only_loads.split(",") if x.strip()}
    if baseline_only and policies[0] != "serialized-fifo":
        parser.error(f"--baseline-only-loads {args.baseline_only_loads} runs the baseline alone: "
                     f"--policies must start with serialized-fifo, got {policies[0]}")
    swept = {load for scenario in scenarios for load in loads.get(scenario, [])}
    if baseline_only - swept:
        # a control load outside the sweep would be silently skipped
        parser.error(f"--baseline-only-loads {sorted(baseline_only - swept)} not among the swept "
                     f"loads {sorted(swept)}: add them to --loads / --mixed-loads too (e.g. "
                     "--loads 0.9,0.95,1.0 --baseline-only-loads 1.0)")
    SCENARIOS["mixed-hit"] = tuple(float(h) for h in args.hit_ratios.split(","))
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.reuse_probe:
        args.append = True
        earlier_runs = read_rows(out / "calvo.csv")
        earlier_requests = read_csv(out / "calvo_requests.csv")
    if args.report_only:
        rows = read_rows(out / "calvo.csv")
        summary = write_outputs(rows, out)
        report(summary)
        print("\n" + markdown_tables(summary, rows))
        return
    started = time.perf_counter()
    secret = secrets.token_hex(16)
    proc, address = start_pool(args, secret)
    rows, request_rows = [], []
    try:
        engine = Engine(args, secret, address)
        tokenizer = engine.model.tokenizer
        tokenize = lambda text: np.asarray(tokenizer.encode(text, add_special_tokens=False),
                                           np.int32)
        rng = np.random.default_rng(seeds[0])
        base = {(s, seed): WorkloadConfig(qps=1.0, num_contexts=args.contexts,
                                          queries_per_context=args.queries,
                                          min_context_tokens=args.min_context,
                                          max_context_tokens=args.max_context,
                                          chunk_tokens=args.chunk_tokens,
                                          hit_ratios=SCENARIOS[s], seed=seed)
                for s in scenarios for seed in seeds}
        t = time.perf_counter()
        contexts = {}
        for config in base.values():
            for w in build_workload(config, tokenize):
                contexts[w.context.tobytes()] = w.context
        for context in contexts.values():
            engine.cache_context(context, len(context))
        print(f"cached {len(contexts)} contexts ({sum(map(len, contexts.values()))} tokens, "
              f"{engine.pool.server_stats().bytes_used / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t:.1f} s; chunk {args.chunk_tokens} tokens = "
              f"{engine.chunk_bytes / 2**20:.2f} MiB; pool link paced at {args.link}")
        t = time.perf_counter()
        # profile on 4 contexts spread over the length range (shortest .. longest), so the
        # padded prefix ctx' takes several values and the bucketed fit is identifiable
        by_length = sorted(contexts.values(), key=len)
        picks = sorted(set(np.linspace(0, len(by_length) - 1, 4).round().astype(int)))
        plain_model, cost_model = profile(engine, [by_length[i] for i in picks], rng)
        cost_model.save(out / "calvo_cost_model.json")
        plain_model.save(out / "calvo_cost_model_plain.json")
        fit_error = engine.fit_median_error[args.cost_model]
        if args.cost_model == "plain":
            plain_model, cost_model = cost_model, plain_model
        print(f"profiling + compiling took {time.perf_counter() - t:.1f} s")

        for scenario in scenarios:
            print(f"\n== {scenario}: {base[scenario, seeds[0]].num_requests} requests per run; "
                  f"seeds {seeds} ==")
            print(f"{'load':>5} {'seed':>4} {'QPS':>6} " + " ".join(f"{p:>21}" for p in policies))
            for seed in seeds:
                workload = build_workload(base[scenario, seed], tokenize)
                requests, _ = build_requests(engine, workload, cost_model)
                warm_up(engine, requests)
                # the modelled capacity (1 / mean modelled service time) and the measured one:
                # every request back to back on the serialized baseline (jkv/scheduling/capacity.py)
                modelled = 1.0 / float(np.mean([cost_model.cost(r.info.cached_tokens,
                                                                r.info.compute_tokens)
                                                for r in requests]))
                if args.reuse_probe:
                    probe = probe_from_rows(earlier_requests, earlier_runs, scenario, seed)
                    missing = {r.request_id for r in requests} - set(probe.service_s)
                    if missing:
                        raise ValueError(f"--reuse-probe: {len(missing)} requests of {scenario} "
                                         f"seed {seed} have no earlier isolated TTFT")
                else:
                    probe = probe_baseline(lambda r: run_serialized(
                        [r], engine.functions, args.host_slots, args.device_slots), requests)
                capacity = probe.capacity_qps if args.load_basis == "measured" else modelled
                print(f"seed {seed}: baseline capacity measured {probe.capacity_qps:.2f} QPS "
                      f"(mean isolated TTFT {probe.mean_service_s:.3f} s), modelled "
                      f"{modelled:.2f} QPS; loads are fractions of the {args.load_basis} one; "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
                isolated = probe.service_s if args.slo_from == "measured" else None
                # the profile ran minutes earlier under another box load; the probe timed every
                # request of this workload alone: rescale the model to it (median ratio), so
                # LSTF's slack and the measured deadlines share one time scale (SJF's order is
                # unchanged by a uniform scale)
                scale = 1.0
                if args.calibrate:
                    scale = float(np.median([probe.service_s[r.request_id] / cost_model.cost(
                        r.info.cached_tokens, r.info.compute_tokens) for r in requests]))
                    print(f"seed {seed}: cost model rescaled x{scale:.3f} to the probe")
                seed_model = cost_model.scaled(scale)
                seed_plain = plain_model.scaled(scale)
                for load in loads[scenario]:
                    qps = load * capacity
                    workload = build_workload(dataclasses.replace(base[scenario, seed], qps=qps),
                                              tokenize)
                    requests, slo = build_requests(engine, workload, seed_model, isolated)
                    if args.reuse_probe:      # the earlier run's arrivals, to the microsecond
                        before = {int(r["request_id"]): float(r["arrival_s"])
                                  for r in earlier_requests if r["scenario"] == scenario
                                  and float(r["load"]) == load and int(r["seed"]) == seed
                                  and r["policy"] == "serialized-fifo"}
                        # a load the earlier run did not sweep has no arrivals to check: it
                        # joins the seed's probe (capacity, isolated TTFTs, hence SLOs) only
                        if before and max(abs(before[r.request_id] - r.info.arrival_s)
                                          for r in requests) > 1e-6:
                            raise ValueError(f"--reuse-probe: {scenario} @ {load} seed {seed}: "
                                             "arrivals differ from the earlier run's")
                    first = None
                    cells = []
                    # the steady state this run's baseline would reach (M/G/1, probe's service
                    # times): measured / predicted says how far from it a finite run gets
                    mg1 = mg1_mean_ttft(list(probe.service_s.values()), qps)
                    mine = policies if load not in baseline_only else policies[:1]
                    for policy in mine:
                        demoted: set = set()
                        res = run_realtime(engine, requests, policy, seed_model, seed_plain,
                                           demoted)
                        ids = [r.request_id for r in requests]
                        # hopeless by the model (demoted) yet on time: a prediction error
                        met_anyway = sum(res[i][0] <= slo[i] for i in demoted)
                        tokens = [res[i][1] for i in ids]
                        if first is None:
                            first = tokens
                        mismatched = sum(a != b for a, b in zip(tokens, first))
                        summary = summarize([res[i][0] for i in ids], [slo[i] for i in ids])
                        row = dict(scenario=scenario, load=load, seed=seed, qps=qps,
                                   policy=policy, link=args.link, load_basis=args.load_basis,
                                   slo_from=args.slo_from,
                                   capacity_measured_qps=probe.capacity_qps,
                                   capacity_modelled_qps=modelled, model_scale=scale,
                                   token_mismatches=mismatched,
                                   fit_median_error=fit_error, loadavg=os.getloadavg()[0],
                                   demoted=len(demoted), demoted_met_slo=met_anyway,
                                   **summary.as_row())
                        if policy == "serialized-fifo":
                            check = sustain_check([r.info.arrival_s for r in requests],
                                                  [res[i][0] for i in ids], qps)
                            row.update(check.as_row(), baseline_mg1_ttft_s=mg1)
                        rows.append(row)
                        request_rows.extend(
                            dict(scenario=scenario, load=load, seed=seed, policy=policy,
                                 link=args.link, request_id=r.request_id,
                                 arrival_s=r.info.arrival_s, cached_tokens=r.info.cached_tokens,
                                 compute_tokens=r.info.compute_tokens,
                                 modelled_s=seed_model.cost(r.info.cached_tokens,
                                                            r.info.compute_tokens),
                                 isolated_s=probe.service_s[r.request_id], slo_s=slo[i],
                                 ttft_s=res[i][0], demoted=int(i in demoted))
                            for r, i in zip(requests, ids))
                        cells.append(f"{summary.mean_s:>9.3f}s / "
                                     f"{100 * summary.slo_attainment:>5.1f}%  ")
                        if mismatched:
                            print(f"WARNING: {policy} produced {mismatched} first tokens "
                                  "different from the baseline's")
                    sustained = next((f" baseline in-run utilisation "
                                      f"{r['baseline_utilisation']:.3f}, mean TTFT "
                                      f"{r['mean_s']:.3f} s vs M/G/1 steady state {mg1:.3f} s "
                                      f"({r['mean_s'] / mg1:.2f}x); completed "
                                      f"{r['baseline_completed']} of {r['baseline_arrived']} "
                                      f"arrivals in the window, TTFT trend "
                                      f"{r['baseline_ttft_trend']:.2f}x"
                                      for r in rows[-len(mine):]
                                      if "baseline_arrived" in r), "")
                    print(f"{load:>5.2f} {seed:>4} {qps:>6.2f} " + " ".join(cells) + sustained,
                          flush=True)
    finally:
        if "engine" in locals():
            engine.pool.close()
        proc.stdin.close()
        proc.wait(timeout=30)

    if args.append:
        rows = merge_rows(read_rows(out / "calvo.csv"), rows)
        request_rows = merge_rows(read_csv(out / "calvo_requests.csv"), request_rows)
    write_csv(out / "calvo_requests.csv", request_rows)
    report(write_outputs(rows, out))
    print(f"first-token mismatches vs the baseline: {sum(r['token_mismatches'] for r in rows)}")
    print(f"\nwrote {out / 'calvo.csv'}, {out / 'calvo_summary.csv'}, {out / 'calvo.png'} in "
          f"{time.perf_counter() - started:.1f} s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
