"""KVServe benchmark on SmolLM2-135M: Table-1-style accuracy / CR per method and JCT vs bandwidth.

Part 1 (Table 1). Three workload classes (`jkv.compression.workloads`: code, qa = needle / key-value
retrieval, continuation of local documents), `--samples` prompts of `--tokens` tokens each. Methods:

- CacheGen-like: delta encoding along tokens (anchor every 16) + per-token 4-bit + zstd;
- KIVI-2bit: K per-channel, V per-token, 2 bits, group 32, no codec;
- DuoAttention-like: per request, the half of the KV heads with the lowest retrieval score (attention
  mass outside sinks + recent window, from the prompt's own last 32 queries) become streaming heads
  that keep only 16 sink + 64 recent tokens; the rest stay fp16 (`jkv.compression.streaming`; the
  decode attends per head to exactly the kept tokens). An earlier version quantized the "streaming"
  heads to 1 bit instead of dropping their middle tokens, which destroyed the output (top-1 0.02);
- Duo + KIVI: the same pruning (25 % / 50 % streaming heads) with the kept KV quantized;
- >= 8x probe: Hadamard + KIVI-2 with group 128 + zstdh (the cheapest quantization-only point);
- jkv-unified: Algorithm 1 (`bayesian_search`) over the `jkv compress-profile` space on all
  workloads' samples at once — one pipeline for everything;
- SnapKV + KIVI-4: token tiers (`jkv.compression.tokens`): per head the 40 % / 35 % most-attended
  middle tokens (observation window of the prompt's last 32 queries) + sinks + recent at 4 bits, the
  rest dropped;
- jkv-per-workload: Algorithm 1 per workload (on `--bo-samples` of its samples; the space includes
  token tiers and per-layer tables from `layer_sensitivity`), its best feasible spec.
Reported: CR vs fp16 KV (the papers' baseline, every container byte counted at the wire's chunk
size) and vs the float32 rows jkv's uncompressed path actually sends (2x), top-1 agreement with the
uncompressed cache over a teacher-forced continuation, and the relative task score (task score on
decompressed KV / on the original; continuation: exp(-NLL increase)).

Part 2 (JCT vs bandwidth). One prefill worker (in process, real TCP on loopback, paced link) and
the decode worker, mode "full", dense decode (no selector metadata shares the link). DESIGN.md "Emulating the papers' testbed": measure Tp of the
request here, then pace the link so that Tt / Tp = 6.5 x 25 / b (SmartGen's 6.5x stall at
25 Gbit/s) for b = 5 ... 100 Gbit/s "equivalents". Side by side per b: uncompressed vs the online
controller (`compression="auto"` with the continuation profile from part 1, pipelines only:
`kvserve_profile_continuation_serving.json`). JCT = time to the last token. One long-lived controller
serves the whole sweep (its residual bandit learns as in serving); per b one warm-up request, then
interleaved rounds in shuffled order, reported as the median / quartiles / range of the per-round ratio;
at the fastest point each round adds a second uncompressed request (A/A control) and the profile forced on. The controller charges each profile's measured transfer-path cost (`calibrate_path` on
this request's real KV: encode + prefill-side decode + framing + receiver decode), not the profile
file's encode + decode round trip; every profile's codec path is compiled before the sweep.

Writes experiments/results/kvserve_table1.csv, kvserve_jct.csv, kvserve.png, kvserve_profile_*.json.
Usage: python experiments/kvserve.py [--quick] [--samples 8] [--code-samples 24] [--limit 12] [--skip-jct | --jct-only]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import re
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jkv.compression.cli import head_scores, strategy_space, tier_space  # noqa: E402
from jkv.compression.policy import TIERS_PREFIX, CompressionConfig, CompressionPolicy  # noqa: E402
from jkv.compression.profiling import SearchConfig, bayesian_search, build_profile, nominal_cr, save_profile  # noqa: E402,E501
from jkv.compression.spec import CodecSpec, PipelineSpec, QuantizerSpec, TransformSpec  # noqa: E402
from jkv.compression.streaming import StreamingConfig  # noqa: E402
from jkv.compression.tokens import TierConfig  # noqa: E402
from jkv.compression.workloads import WORKLOADS, ModelObjective, layer_sensitivity, workload_samples  # noqa: E402

from experiments.common import RESULTS, write_csv  # noqa: E402

SECRET = "kvserve-benchmark-secret"
BANDWIDTHS_GBIT = (5, 10, 25, 50, 100)


def combined(objectives) -> ModelObjective:
    """One objective over every workload's samples (jkv-unified)."""
    obj = ModelObjective.__new__(ModelObjective)
    first = objectives[0]
    obj.model, obj.chunk_tokens, obj.calibration = first.model, first.chunk_tokens, first.calibration
    obj.gen_tokens = first.gen_tokens
    for name in ("samples", "kv16", "first_logits", "reference", "greedy_reference"):
        setattr(obj, name, [x for o in objectives for x in getattr(o, name)])
    obj.probe_bytes = sum(o.probe_bytes for o in objectives)
    obj._scores = {}
    return obj


def subset(objective, n: int) -> ModelObjective:
    """The first n samples of an objective (the profile search runs on a sampled subset)."""
    obj = ModelObjective.__new__(ModelObjective)
    obj.model, obj.chunk_tokens, obj.calibration = objective.model, objective.chunk_tokens, objective.calibration
    obj.gen_tokens = objective.gen_tokens
    for name in ("samples", "kv16", "first_logits", "reference", "greedy_reference"):
        setattr(obj, name, getattr(objective, name)[:n])
    obj.probe_bytes = sum(k.nbytes + v.nbytes for kv in obj.kv16 for k, v in kv)
    obj._scores = {}
    return obj


def short_id(spec_id: str) -> str:
    """A readable spec id: per-layer `mixed-` tables become their set of bit widths."""
    return re.sub(r"mixed-([0-9f.]+)-g(\d+)",
                  lambda m: "mixed{" + ",".join(sorted(set(m[1]) - {"."})) + "}g" + m[2], spec_id)


def search(objective, space, threshold, limit, say, label):
    t = time.perf_counter()
    shape = objective.kv16[0][0][0].shape
    n_tokens = shape[1]
    shape = (shape[0], min(objective.chunk_tokens, shape[1]), shape[2])
    result = bayesian_search(space, objective, SearchConfig(acc_threshold=threshold, max_iters=limit,
                                                            n_init=min(5, limit), patience=max(4, limit // 2)),
                             cr_prior=lambda s: nominal_cr(s, shape, n_tokens=n_tokens))
    best = result.best
    say(f"  BO {label}: {len(result.evaluations)}/{len(space)} evaluations ({result.stopped}) in "
        f"{time.perf_counter() - t:.0f}s; best feasible: "
        + (f"{short_id(best.spec_id)} acc={best.accuracy:.3f} CR={best.cr:.2f}" if best else "none")
        + "; evaluated: " + ", ".join(f"{short_id(e.spec_id)} {e.accuracy:.3f}/{e.cr:.2f}" for e in result.evaluations))
    return result


def fixed_methods() -> dict:
    """Table 1's fixed rows: {name: (PipelineSpec or TierConfig, StreamingConfig or None)}."""
    h4 = "hadamard+kivi4g128+zstdh3"
    return {"CacheGen-like": (PipelineSpec(TransformSpec("delta", 16), QuantizerSpec("tok", 4, 32), CodecSpec("zstd", 3)), None),
            "KIVI-2bit": (PipelineSpec.parse("identity+kivi2g32+none"), None),
            "DuoAttention-like": (PipelineSpec.parse("identity+none+none"), StreamingConfig(0.5, 16, 64)),
            "Duo25 + KIVI-4": (PipelineSpec.parse("hadamard+kivi4g32+none"), StreamingConfig(0.25, 16, 64)),
            "Duo50 + KIVI-4": (PipelineSpec.parse(h4), StreamingConfig(0.5, 16, 64)),
            "Duo50 + KIVI-3 (8x probe)": (PipelineSpec.parse("hadamard+kivi3g128+zstdh3"), StreamingConfig(0.5, 16, 64)),
            "hadamard+kivi2g128 (8x probe)": (PipelineSpec.parse("hadamard+kivi2g128+zstdh3"), None),
            # SnapKV-like: per head the 40 % most-attended middle tokens (+ sinks + recent) at 4 bits
            "SnapKV-40 + KIVI-4": (TierConfig(h4, None, 0.4, 0.0), None),
            "SnapKV-35 + KIVI-4 (8x probe)": (TierConfig(h4, None, 0.35, 0.0), None)}


def table1(model, args, say):
    count = {w: args.code_samples if w == "code" else args.samples for w in WORKLOADS}
    length = {w: args.code_tokens if w == "code" else args.tokens for w in WORKLOADS}
    objectives = {w: ModelObjective(model, workload_samples(model.tokenizer, w, count[w], length[w]),
                                    chunk_tokens=args.chunk_tokens) for w in WORKLOADS}
    say("prefilled " + ", ".join(f"{w}: {count[w]} x ~{length[w]} tokens" for w in WORKLOADS))
    calib = objectives["continuation"]
    scores = head_scores(calib.kv16[0], model, calib.samples[0].prompt)  # real observation-window queries
    fixed = fixed_methods()
    per_workload, spaces = {}, {}
    n_kv_heads = model.cfg.num_kv_heads
    sens_all = []
    for w, obj in objectives.items():
        bo = subset(obj, args.bo_samples)
        sens = None if args.quick or args.no_tiers else layer_sensitivity(bo)
        if sens is not None:
            sens_all.append(sens)
            say(f"  {w} layer sensitivity (KL, 2-bit groups of 5): " + " ".join(f"{x:.3f}" for x in sens[::5]))
        tiers = None if args.no_tiers else tier_space(sens, n_kv_heads, args.quick)
        spaces[w] = {s.id: s for s in strategy_space(scores, args.quick, tiers)}
        result = search(bo, list(spaces[w].values()), args.threshold, args.limit, say, w)
        per_workload[w] = result
        save_profile(RESULTS / f"kvserve_profile_{w}.json", build_profile(result, w, bo.probe_bytes))
        # The serving KV path takes pipelines only (token tiers drop tokens per head): its own Pareto file.
        servable = dataclasses.replace(result, evaluations=[e for e in result.evaluations
                                                            if not e.spec_id.startswith(TIERS_PREFIX)])
        if servable.feasible:
            save_profile(RESULTS / f"kvserve_profile_{w}_serving.json", build_profile(servable, w, bo.probe_bytes))
    tiers = None if args.no_tiers else tier_space(np.mean(sens_all, axis=0) if sens_all else None, n_kv_heads, args.quick)
    spaces["unified"] = {s.id: s for s in strategy_space(scores, args.quick, tiers)}
    unified = search(combined([subset(o, args.unified_samples) for o in objectives.values()]),
                     list(spaces["unified"].values()), args.threshold, args.limit, say, "unified")
    methods = dict(fixed)
    if unified.best:
        methods["jkv-unified"] = (spaces["unified"][unified.best.spec_id], None)
    reuse = {}
    if args.reuse_rows and Path(args.reuse_rows).exists():
        with open(args.reuse_rows) as f:
            for r in csv.DictReader(f):
                key = (r["workload"], r["method"], r["spec"], r["streaming"], r.get("samples") or "8", r.get("tokens") or "512")
                reuse[key] = r
    rows = []
    for w, obj in objectives.items():
        base_scores = np.asarray(obj.task_scores(None))
        base = float(np.mean(base_scores))
        todo = dict(methods)
        if per_workload[w].best:
            todo["jkv-per-workload"] = (spaces[w][per_workload[w].best.spec_id], None)
        for name, (spec, streaming) in todo.items():
            sid = short_id(spec.id)
            key = (w, name, sid, streaming.id if streaming else "", str(count[w]), str(length[w]))
            if key in reuse and name not in ("jkv-unified", "jkv-per-workload"):
                # deterministic samples and pipeline: the same row as the last run (only codec speed differs)
                row = dict(reuse[key], samples=count[w], tokens=length[w], reused="yes")
                say("  reused  " + "  ".join(f"{k}={v}" for k, v in row.items()))
                rows.append(row)
                continue
            r = obj.measure(spec, streaming)
            scores = np.asarray(obj.task_scores(spec, streaming))
            score = float(np.mean(scores))
            # paired standard error of the relative score (same samples with and without compression)
            se = float(np.std(scores - base_scores, ddof=1) / np.sqrt(len(scores)) / base) if len(scores) > 1 and base > 0 else float("nan")
            row = dict(workload=w, method=name, spec=sid, streaming=streaming.id if streaming else "",
                       cr_fp16=round(r.cr, 3), cr_wire_f32=round(2 * r.cr, 3), top1=round(r.accuracy, 3),
                       kl=round(r.kl, 4), task_score=round(score, 3), task_score_uncompressed=round(base, 3),
                       rel_task_accuracy=round(score / base, 3) if base > 0 else float("nan"), rel_task_se=round(se, 3),
                       codec_MBps_fp16=round(obj.probe_bytes / r.latency_s / 1e6, 1),
                       samples=count[w], tokens=length[w], reused="no")
            rows.append(row)
            say("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    write_csv(RESULTS / "kvserve_table1.csv", rows)
    return rows


def jct_sweep(model, args, say):
    from jkv.compression.controller import BASELINE, BASELINE_PROFILE, Context, predicted_time
    from jkv.compression.kv_transfer import KVCodec
    from jkv.compression.profiling import load_profile
    from jkv.disagg.decode_worker import DecodeWorker
    from jkv.disagg.prefill_worker import PrefillWorker
    from jkv.disagg.selectors import build_selector
    from jkv.engine import Request
    from jkv.eval.fidelity import fidelity_sample
    from jkv.sampling import SamplingParams
    from jkv.transfer.plan import TransferConfig
    from jkv.transfer.profile import ImportanceProfile, ProfileBin

    selector = build_selector(model, "dense")  # no selector metadata on the link: KV only
    worker = PrefillWorker(model, selector, "prefill-0", secret=SECRET, bandwidth="100gbit",
                           codec=KVCodec(min_chunk_tokens=args.chunk_tokens))
    address = worker.listen()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    prompt, _ = fidelity_sample(model.tokenizer, args.jct_tokens, 2, 7)
    cfg = model.cfg
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * len(prompt) * cfg.head_dim * 4
    name = "kvserve_profile_continuation_serving.json"
    if not (RESULTS / name).exists():
        name = "kvserve_profile_continuation.json"
    profile = load_profile(RESULTS / name)
    say(f"JCT sweep profile {name}: " + ", ".join(p.spec_id for p in profile.points))

    prefill_profile = None  # set once Tp is measured: gives the controller T_model (overlap-aware model)

    def once(policy):
        decode = DecodeWorker(model, selector, TransferConfig(mode="full", max_blocks=64), secret=SECRET,
                              compression=policy, profile=prefill_profile)
        try:
            decode.connect([address])
            out = decode.generate([Request("jct", prompt, prompt, SamplingParams(max_tokens=args.new_tokens,
                                                                                   ignore_eos=True))])[0]
        finally:
            decode.close()
        if out.finish_reason == "error":
            raise RuntimeError(out.metrics.extra["error"])
        return out

    rows = []
    try:
        once(None)  # compile
        for p in profile.points:  # compile every profile's codec path (the first use would pay it)
            once(CompressionPolicy(CompressionConfig(p.spec_id)))
        # Tp and each profile's codec cost *in place*: JCT over the uncompressed one on the initial
        # 100 Gbit/s pacing (link time ~0), where the inline prefill-side encode + decode and the
        # receiver's decode share the 2 cores with the prefill; 5 interleaved rounds. The charge is the
        # costliest round over the median uncompressed JCT: the codec's gain is small exactly where a
        # pessimistic cost matters (the break-even point), and a median under-predicted the in-place
        # JCT by ~0.1 s at 100 Gbit/s-eq (one run: 0.83x).
        fast = {None: []} | {p.spec_id: [] for p in profile.points}
        for _ in range(5):
            for spec in fast:
                fast[spec].append(once(CompressionPolicy(CompressionConfig(spec)) if spec else None))
        tp = min(o.metrics.extra["prefill_s"] for o in fast[None])  # uncontended: others load this box
        jct_fast = float(np.median([o.metrics.e2e for o in fast[None]]))
        insitu_s = {k: max(o.metrics.e2e for o in v) - jct_fast for k, v in fast.items() if k}
        # The decode worker's prefill-time profile (Tp only; `full` mode uses no importance): the
        # controller then knows T_model and uses its overlap-aware prediction (layer-wise push).
        prefill_profile = ImportanceProfile("dense", "smollm2-135m-instruct", 64,
                                            [ProfileBin(len(prompt), np.ones((cfg.num_layers, 1)), tp)])
        # The controller's s_p: the measured transfer path (encode + prefill-side decode + framing +
        # receiver decode) on this request's real KV and geometry, not the profile's round trip.
        import jax.numpy as jnp
        _, kv = model.prefill(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32))
        probe = np.stack([np.stack([np.asarray(x[0, :, :len(prompt)], np.float32) for x in pair]) for pair in kv], 1)
        calib = CompressionPolicy(CompressionConfig("auto", profiles=(name,),
                                                    q_min=min(0.97, args.threshold)), bandwidth_bps=1e9,
                                  profiles=[profile])
        alone_Bps = calib.calibrate_path(probe, min_chunk_tokens=args.chunk_tokens, blocks_per_layer=64)
        # Charge the larger of the two costs: the path measured alone, or in place (what the JCT pays).
        path_Bps = {k: min(v, kv_bytes / max(insitu_s[k], 1e-9)) for k, v in alone_Bps.items()}
        say(f"JCT sweep: {len(prompt)} prompt tokens, KV {kv_bytes / 1e6:.1f} MB (f32), Tp = {tp:.2f}s, "
            f"JCT at 100 Gbit/s uncompressed {jct_fast:.3f}s, in-place codec s "
            + ", ".join(f"{k} {v:.3f}" for k, v in insitu_s.items()) + "; "
            "codec s_p (f32 MB/s) charged / path alone / in place / round trip: " + ", ".join(
                f"{p.spec_id} {path_Bps[p.spec_id] / 1e6:.0f} / {alone_Bps[p.spec_id] / 1e6:.0f} / "
                f"{kv_bytes / max(insitu_s[p.spec_id], 1e-9) / 1e6:.0f} / {2 * p.throughput_Bps / 1e6:.0f}"
                for p in profile.points))
        # ONE long-lived controller for the whole sweep, as in serving: the default config (epsilon 0.1
        # exploration), and every request's observed time to the hand-off feeds Eq. 7's residual
        # (`CompressionPolicy.observe`, called by the decode worker since T_model is known).
        policy = CompressionPolicy(CompressionConfig("auto", profiles=(name,),
                                                     q_min=min(0.97, args.threshold)),
                                   bandwidth_bps=1e9, profiles=[profile], path_Bps=path_Bps)
        for b in BANDWIDTHS_GBIT:
            ratio = 6.5 * 25 / b  # Tt / Tp
            bps = kv_bytes * 8 / (ratio * tp)
            worker.set_bandwidth(bps)
            policy.estimator.reset(bps / 8)  # the link was re-paced to a known rate; samples refine it
            load0 = os.getloadavg()[0]
            pctx = Context(policy.workload, math.inf, policy.config.q_min, kv_bytes, tp, bps / 8)
            pred = policy.controller.decide(pctx)  # the controller's choice as this point starts
            once(policy)  # warm-up: one request lets the estimator and the residual see this link
            # Interleaved rounds, the order shuffled each round (a rotation gave every arm a fixed
            # predecessor, and two identical uncompressed arms then differed by a median 9 %): uncompressed,
            # controller, and at the fastest point also a second uncompressed run (an A/A control: the
            # noise between two identical paths) and the profile forced on (what compressing would give).
            arms = ["unc", "ctl"] + (["unc2", "forced"] if b == BANDWIDTHS_GBIT[-1] else [])
            # forced: the last profile the controller compressed with in this sweep (else the top CR)
            used = [c.rsplit("x", 1)[0] for r in rows for c in r["choice"].split("|") if not c.startswith(BASELINE)]
            forced = CompressionPolicy(CompressionConfig(used[-1] if used else max(profile.points, key=lambda p: p.cr).spec_id))
            runs = {a: [] for a in arms}
            n_rounds = args.jct_repeats_fast if b == BANDWIDTHS_GBIT[-1] else args.jct_repeats
            order_rng = np.random.default_rng(b)
            for _ in range(n_rounds):
                for a in order_rng.permutation(arms):  # shuffled: no fixed position or predecessor per arm
                    runs[str(a)].append(once({"ctl": policy, "forced": forced}.get(str(a))))
            jct = {a: np.array([o.metrics.e2e for o in v]) for a, v in runs.items()}
            # Per-round ratio (uncompressed / controller of the same round): the median and its spread.
            speed = jct["unc"] / jct["ctl"]
            choices = [o.metrics.extra.get("compression", "off") for o in runs["ctl"]]
            base = runs["unc"][int(np.argsort(jct["unc"])[len(jct["unc"]) // 2])]
            ctl = runs["ctl"][int(np.argsort(jct["ctl"])[len(jct["ctl"]) // 2])]
            row = dict(gbit_equiv=b, tt_over_tp=round(ratio, 2), paced_mbit=round(bps / 1e6, 2),
                       choice="|".join(f"{c}x{choices.count(c)}" for c in sorted(set(choices))),
                       repeats=n_rounds, jct_uncompressed_s=round(float(np.median(jct["unc"])), 3),
                       jct_controller_s=round(float(np.median(jct["ctl"])), 3),
                       speedup=round(float(np.median(jct["unc"]) / np.median(jct["ctl"])), 3),
                       ratio_median=round(float(np.median(speed)), 3),
                       ratio_q25=round(float(np.percentile(speed, 25)), 3),
                       ratio_q75=round(float(np.percentile(speed, 75)), 3),
                       ratio_min=round(float(speed.min()), 3), ratio_max=round(float(speed.max()), 3),
                       aa_ratio_median=round(float(np.median(jct["unc"] / jct["unc2"])), 3) if "unc2" in jct else "",
                       aa_ratio_min=round(float((jct["unc"] / jct["unc2"]).min()), 3) if "unc2" in jct else "",
                       aa_ratio_max=round(float((jct["unc"] / jct["unc2"]).max()), 3) if "unc2" in jct else "",
                       forced_spec=forced.config.mode if "forced" in jct else "",
                       forced_ratio_median=round(float(np.median(jct["unc"] / jct["forced"])), 3) if "forced" in jct else "",
                       bytes_uncompressed=base.metrics.extra["bytes"]["proactive"],
                       bytes_controller=ctl.metrics.extra["bytes"]["proactive"],
                       same_tokens=base.token_ids == ctl.token_ids,
                       prefill_s_uncompressed=round(base.metrics.extra["prefill_s"], 3),
                       prefill_s_controller=round(ctl.metrics.extra["prefill_s"], 3),
                       predicted_choice=pred.profile.name, predicted_s=round(pred.predicted_s, 3),
                       predicted_uncompressed_s=round(predicted_time(BASELINE_PROFILE, pctx, bps / 8, True), 3),
                       path_MBps=round(path_Bps.get(pred.profile.name, float("nan")) / 1e6, 1),
                       bandwidth_estimate_mbit=round(policy.estimator.estimate() * 8 / 1e6, 1),
                       load_start=round(load0, 2), load_end=round(os.getloadavg()[0], 2))
            rows.append(row)
            say("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    finally:
        worker.close()
        thread.join(5)
    write_csv(RESULTS / "kvserve_jct.csv", rows)
    return rows


def _number(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def plot(table, jct, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for w, marker in zip(WORKLOADS, "os^"):
        rows = [r for r in table if r["workload"] == w]
        a.scatter([float(r["cr_fp16"]) for r in rows], [float(r["rel_task_accuracy"]) for r in rows], marker=marker, label=w)
        for r in rows:
            a.annotate(r["method"].split(" ")[0], (float(r["cr_fp16"]), float(r["rel_task_accuracy"])), fontsize=7)
    a.axhline(0.97, ls=":", c="gray")
    a.axvline(8, ls=":", c="gray")
    a.set_xlabel("CR vs fp16 KV (all container bytes)")
    a.set_ylabel("relative task accuracy")
    a.set_title("Table 1: accuracy vs CR (SmolLM2-135M)")
    a.legend()
    if jct:
        x = [r["gbit_equiv"] for r in jct]
        b.plot(x, [r["jct_uncompressed_s"] for r in jct], "o-", label="uncompressed")
        b.plot(x, [r["jct_controller_s"] for r in jct], "s-", label="KVServe controller")
        for r in jct:
            spread = f" [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]" if "ratio_min" in r else ""
            b.annotate(f"{r.get('ratio_median', r['speedup']):.2f}x{spread}", (r["gbit_equiv"], r["jct_controller_s"]),
                       fontsize=7)
        b.set_xscale("log")
        b.set_yscale("log")
        b.set_xlabel("link (Gbit/s equivalent, paced)")
        b.set_ylabel("JCT (s)")
        b.set_title("JCT vs bandwidth")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 sample x 256 tokens, 16-spec space, small BO")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=0.9, help="BO accuracy floor (top-1 agreement)")
    ap.add_argument("--limit", type=int, default=16, help="BO evaluations per search")
    ap.add_argument("--code-samples", type=int, default=None, help="code samples (default --samples; edit "
                    "similarity of one code sample can move the mean by > 3 %%, so the code rows need more)")
    ap.add_argument("--code-tokens", type=int, default=None, help="code prompt tokens (default --tokens)")
    ap.add_argument("--bo-samples", type=int, default=8, help="samples per workload the profile search runs on")
    ap.add_argument("--unified-samples", type=int, default=4, help="samples per workload of the unified search")
    ap.add_argument("--no-tiers", action="store_true", help="no token-tier points in the search space")
    ap.add_argument("--reuse-rows", default=None,
                    help="a previous kvserve_table1.csv: fixed-method rows with the same workload, spec, samples and "
                         "tokens are copied instead of recomputed (deterministic; marked reused=yes)")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--jct-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--jct-repeats", type=int, default=5, help="interleaved rounds per sweep point (medians)")
    ap.add_argument("--jct-repeats-fast", type=int, default=12,
                    help="rounds at the fastest point (uncompressed, controller, A/A control, forced profile)")
    ap.add_argument("--skip-jct", action="store_true", help="Table 1 only (the figure reuses kvserve_jct.csv)")
    ap.add_argument("--jct-only", action="store_true",
                    help="JCT sweep only, with the continuation profile of the last Table-1 run (the figure "
                         "reuses kvserve_table1.csv); run it inside `flock /work/timing.lock`")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.tokens, args.limit, args.jct_tokens = 1, 256, 6, 256
        args.code_samples = args.code_tokens = None
        args.bo_samples = args.unified_samples = 1
    args.code_samples = args.code_samples or args.samples
    args.code_tokens = args.code_tokens or args.tokens
    from models import load_model

    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    model = load_model("smollm2-135m-instruct")
    say(f"{model}; load {os.getloadavg()[0]:.1f}")
    if args.jct_only:
        with open(RESULTS / "kvserve_table1.csv") as f:
            table = [{k: (float(v) if k in ("cr_fp16", "rel_task_accuracy") else v) for k, v in r.items()}
                     for r in csv.DictReader(f)]
    else:
        table = table1(model, args, say)
    jct = [] if args.skip_jct else jct_sweep(model, args, say)
    if args.skip_jct and (RESULTS / "kvserve_jct.csv").exists():  # keep the last sweep in the figure
        with open(RESULTS / "kvserve_jct.csv") as f:
            jct = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]
    plot(table, jct, RESULTS / "kvserve.png")
    say(f"done; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
