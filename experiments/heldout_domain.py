"""InfiniGen's and HATA's fidelity on a domain kept out of calibration (issue 23).

InfiniGen's skew is fitted three ways: (A) default, one 256+32-token window of the documentation
corpus' calibration split (jkv.disagg.selectors.build_selector); (B) small mix: that window plus a
1024+32 corpus window and two windows of Python stdlib code (512+32 and 1024+32 tokens, calibration
half of the stdlib files, jkv.corpus.code_text); (C) broad mix: window (A) plus
calibration.MIX_WINDOWS (code and corpus prose at 1024 and 2048 tokens, 192 decode queries each:
768 queries); (D) joint: window (A), the 4 corpus windows of HATA default and the broad mix (1536
queries, the broad mix's corpus 1K window being corpus window 0 itself, so once). Queries and keys
are pooled per layer. HATA's hashes are trained
(train_projection_windows, --hata-steps steps per window, windows in turn) twice: default as `jkv
train-hata` builds them, on 4 corpus windows of 1024 + 192 (768 queries); broad: on MIX_WINDOWS
(768 queries; `jkv train-hata --calibration mix`); and joint: on the default's 4 corpus windows and
the broad mix less its corpus 1K window (corpus window 0 itself) together, interleaved (one Adam
run, step i on window i mod 7; 1344 queries, 5 of the 7 windows at 1K). hata_mix is HATA on the small mix (128
queries). Fidelity (teacher-forced top-1 agreement with dense over 31 positions,
jkv.eval.fidelity) is measured at max_ratio 0.2 (no budget floor) on
  - held-out prose: the licence texts of /usr/share/common-licenses (in no calibration), and
  - code: the evaluation half of the stdlib files (unseen files; code is in the mixes, not the defaults),
against Oracle on the same samples (the paired gap). Training time is logged ("trained in").
--split validation scores other windows of the same texts, each halfway between two evaluation
windows (disjoint from them at 1K and 2K), for choosing among fits before reporting once on --split
eval (the third run, docs/selection.md 'Joint fits', fixed its two fits in advance and chose none).

    nice -n 10 python experiments/heldout_domain.py --lengths 2048,1024 --samples 16 --hata-steps 150 \
        --hata-cache /tmp/hd2/proj --csv experiments/results/heldout_domain_{k}.csv
    # the joint fits on the same windows, Oracle paired from an earlier run's rows:
    nice -n 19 python experiments/heldout_domain.py --lengths 2048 --samples 16 --selectors infinigen_joint,hata_joint \
        --pair-with experiments/results/heldout_domain_{k}_broad.csv --hata-cache /tmp/hd3/proj --csv /tmp/hd3/hd_{k}.csv
"""
from __future__ import annotations

import argparse
import csv as csv_module
import logging
import math
import os
import re
import pickle
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import add_model_arg, setup_logging, write_csv


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv_module.DictReader(f))

from jkv.corpus import code_text, licence_text
from jkv.eval.fidelity import fidelity_metrics
from jkv.selection import get_selector
from jkv.selection.calibration import (calibration_tokens, calibration_windows, collect_calibration, joint_windows,
                                       mixed_calibration_windows)
from jkv.selection.hata_train import HATATrainConfig, train_projection_windows
from jkv.selection.infinigen import InfiniGen, InfiniGenConfig
from jkv.selection.simple import Dense
from jkv.selection.sparse_decode import decode, prefill_to_host
from models import load_model

log = logging.getLogger("heldout")
CONTINUATION = 32


def windows(ids: list[int], length: int, count: int, split: str = "eval") -> list[tuple[list[int], np.ndarray]]:
    """`count` disjoint windows of length + CONTINUATION tokens, spread over ids: at i·step for
    split 'eval', at i·step + step/2 for 'validation' (disjoint from the eval windows when
    step >= 2·span; raises otherwise)."""
    span = length + CONTINUATION
    if len(ids) < count * span:
        raise ValueError(f"{len(ids)} tokens < {count} windows of {span}")
    step = len(ids) // count
    if split not in ("eval", "validation"):
        raise ValueError(f"split={split!r} must be 'eval' or 'validation'")
    offset = 0 if split == "eval" else step // 2
    if split == "validation" and (step // 2 < span or step - step // 2 < span):
        raise ValueError(f"validation windows of {span} tokens would overlap the eval windows (step {step})")
    return [(ids[offset + i * step:offset + i * step + length],
             np.asarray(ids[offset + i * step + length:offset + i * step + span], np.int32)) for i in range(count)]


def mix_calibration(model) -> list:
    """The prose+code calibration mix: the default 256+32 corpus window, a 1024+32 corpus window
    and two stdlib code windows (512+32, 1024+32) from the first half of the files."""
    corpus = calibration_tokens(model, 1056 + 288)
    code = model.tokenizer.encode(code_text("calibration"))
    return [collect_calibration(model, corpus[:288], 256, 32),
            collect_calibration(model, corpus[288:288 + 1056], 1024, 32),
            collect_calibration(model, code[:544], 512, 32),
            collect_calibration(model, code[544:544 + 1056], 1024, 32)]


def mixed_skew(model, config: InfiniGenConfig, cals: list | None = None) -> InfiniGen:
    """InfiniGen with its skew fitted on the queries and keys of `cals` pooled per layer."""
    return InfiniGen.from_calibration(config, cals if cals is not None else mix_calibration(model))


def trained_hata(cals, steps: int, label: str, cache: str | None = None, interleave: bool = False):
    """HATA (default config, max_ratio 0.2) with hashes trained on `cals()` in turn, `steps` each;
    the projection is kept in `cache` (.npy) when given, and loaded from it when it exists."""
    if cache and os.path.exists(cache):
        log.info("%s: projection loaded from %s", label, cache)
        return get_selector("hata", projection=np.load(cache))
    windows_ = cals()
    start = time.perf_counter()
    projection, losses = train_projection_windows(windows_, HATATrainConfig(train_steps=steps), interleave=interleave)
    log.info("%s trained in %.1fs (%d windows x %d steps): loss %.4f -> %.4f", label,
             time.perf_counter() - start, len(windows_), steps, losses[0], losses[-1])
    if cache:
        np.save(cache, projection)
    return get_selector("hata", projection=projection)


def cached_skew(fit, cache: str | None = None, config: InfiniGenConfig | None = None) -> InfiniGen:
    """InfiniGen from `fit()`, its skew f32[L, H_kv, D, d_p] kept in `cache` (.npy) when given and
    loaded from it when it exists (the broad calibration then need not be collected again); a
    loaded skew gets `config` (default InfiniGenConfig()), which must be the one `fit` used."""
    if cache and os.path.exists(cache):
        log.info("InfiniGen skew loaded from %s", cache)
        return InfiniGen(config or InfiniGenConfig(), list(np.load(cache)))
    selector = fit()
    if cache:
        np.save(cache, np.stack([np.asarray(s) for s in selector.skew]))
    return selector


def infinigen_variant(name: str, head_dim: int) -> tuple[str, InfiniGenConfig, str]:
    """'infinigen_joint_c32_a20_nospec' -> ('joint', config, cache tag): a fit ('default', 'broad',
    'joint') with InfiniGenConfig knobs as suffixes — cN: N partial channels of head_dim
    (partial_ratio N/head_dim; the default 0.3 keeps ceil(0.3·64) = 20), aX: alpha X ('ainf': no
    threshold, every head fetches the full budget), nospec: the true query instead of the
    speculated one. Raises ValueError on anything else."""
    parts = name.split("_")
    if len(parts) < 3 or parts[0] != "infinigen" or parts[1] not in ("broad", "joint"):
        raise ValueError(f"{name!r}: an InfiniGen variant is infinigen_{{broad,joint}}_<suffix>[_<suffix>...]")
    knobs = {}
    for part in parts[2:]:
        if re.fullmatch(r"c\d+", part) and 0 < int(part[1:]) <= head_dim:
            knobs["partial_ratio"] = int(part[1:]) / head_dim
        elif re.fullmatch(r"a(inf|\d+(\.\d+)?)", part):
            knobs["alpha"] = math.inf if part == "ainf" else float(part[1:])
        elif part == "nospec":
            knobs["speculate"] = False
        else:
            raise ValueError(f"{name!r}: suffix {part!r} is none of cN (1..{head_dim} channels), aX / ainf, nospec")
    config = InfiniGenConfig(**knobs)
    # Only the channel count changes the fitted skew; alpha and speculation are applied online.
    channels = math.ceil(config.partial_ratio * head_dim)
    return parts[1], config, f"{parts[1]}" if channels == math.ceil(0.3 * head_dim) else f"{parts[1]}_c{channels}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("--lengths", default="1024")
    p.add_argument("--samples", type=int, default=8, help="windows per domain and length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hata-steps", type=int, default=150,
                   help="HATA training steps per calibration window (accuracy.py's 150; `jkv train-hata`: 300)")
    p.add_argument("--hata-windows", type=int, default=4, help="corpus windows (1024+192) of the default HATA")
    p.add_argument("--selectors", default="oracle,infinigen_default,infinigen_mix,infinigen_broad,hata_default,"
                   "hata_broad", help="comma list; also hata_mix (HATA on the small mix, 128 queries), "
                   "infinigen_joint, hata_joint, and InfiniGen variants infinigen_{broad,joint}_<suffixes>: "
                   "c24 (24 partial channels), a20 / ainf (alpha), nospec (true query), e.g. infinigen_joint_c32")
    p.add_argument("--split", choices=("eval", "validation"), default="eval",
                   help="which windows are scored: eval (reported) or validation (where fits are chosen)")
    p.add_argument("--first-sample", type=int, default=0, help="score windows from this one on (a resumed run)")
    p.add_argument("--pair-with", default=None,
                   help="CSV of an earlier run holding the oracle rows of the same windows ('{k}' per length): "
                   "oracle is then not run again (dense and Oracle are deterministic: the 1K rerun reproduced "
                   "48 of 48 rows) and the summary pairs with those rows")
    p.add_argument("--only", default=None,
                   help="comma list: score only these windows of the --samples grid (e.g. 1,5,9,13)")
    p.add_argument("--hata-cache", default=None,
                   help="path prefix: keep/reuse the trained projections as PREFIX_{default,mix,broad}_STEPS.npy "
                   "and InfiniGen's skews as PREFIX_infinigen_{broad,joint}.npy; the calibration windows "
                   "as PREFIX_cal_{broad,corpus}.pkl")
    p.add_argument("--csv", default=None, help="output CSV; '{k}' in it is replaced per length (1k, 2k), "
                   "each file rewritten after every batch")
    args = p.parse_args(argv)
    setup_logging()
    model = load_model(args.model)
    from jkv.disagg.selectors import build_selector

    domains = {"licence_prose (held out)": model.tokenizer.encode(licence_text()),
               "stdlib_code (in mix)": model.tokenizer.encode(code_text("eval"))}
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:  # fail before the fitting if a domain is too short
        for domain, ids in domains.items():
            windows(ids, length, args.samples, args.split)
    memo = {}
    cache = args.hata_cache

    def once(key, build):
        if key not in memo:
            path = cache and key in ("broad", "corpus") and f"{cache}_cal_{key}.pkl"
            if path and os.path.exists(path):
                with open(path, "rb") as f:
                    memo[key] = pickle.load(f)
                log.info("%s calibration loaded from %s", key, path)
            else:
                memo[key] = build()
                if path:
                    with open(path, "wb") as f:
                        pickle.dump(memo[key], f)
        return memo[key]

    def mix():
        return once("mix", lambda: mix_calibration(model))

    def broad():
        def build():
            start = time.perf_counter()
            cals = mixed_calibration_windows(model)  # calibration.MIX_WINDOWS: code and prose at 1K and 2K
            log.info("broad calibration: %d windows in %.1fs", len(cals), time.perf_counter() - start)
            return cals
        return once("broad", build)

    def corpus():
        def build():
            start = time.perf_counter()
            cals = calibration_windows(model, args.hata_windows, 1024, 192)
            log.info("HATA default calibration: %d windows in %.1fs", len(cals), time.perf_counter() - start)
            return cals
        return once("corpus", build)

    def first():  # build_selector's own 256+32 window: the first 288 calibration tokens
        return once("first", lambda: collect_calibration(model, calibration_tokens(model, 288), 256, 32))

    def joint():
        """HATA default's 4 corpus windows (1024 + 192) and the broad mix less its corpus 1K
        window (the same tokens as corpus window 0), alternating: 7 windows, 1344 queries."""
        return joint_windows(corpus(), broad())

    factories = {
        "oracle": lambda: get_selector("oracle", max_ratio=0.2),
        "infinigen_default": lambda: build_selector(model, "infinigen"),
        "infinigen_mix": lambda: mixed_skew(model, InfiniGenConfig(), mix()),
        # mix()[0] is build_selector's own 256+32 corpus window
        "infinigen_broad": lambda: cached_skew(lambda: mixed_skew(model, InfiniGenConfig(), [mix()[0]] + broad()),
                                               cache and f"{cache}_infinigen_broad.npy"),
        "infinigen_joint": lambda: cached_skew(
            lambda: mixed_skew(model, InfiniGenConfig(), [first()] + joint()),
            cache and f"{cache}_infinigen_joint.npy"),
        # build_selector(model, "hata") needs trained weights: train them as `jkv train-hata` does.
        "hata_default": lambda: trained_hata(corpus, args.hata_steps, "hata_default",
                                             cache and f"{cache}_default_{args.hata_steps}.npy"),
        "hata_mix": lambda: trained_hata(mix, args.hata_steps, "hata_mix",
                                         cache and f"{cache}_mix_{args.hata_steps}.npy"),
        "hata_broad": lambda: trained_hata(broad, args.hata_steps, "hata_broad",
                                           cache and f"{cache}_broad_{args.hata_steps}.npy"),
        "hata_joint": lambda: trained_hata(joint, args.hata_steps, "hata_joint",
                                           cache and f"{cache}_joint_{args.hata_steps}.npy", interleave=True),
    }
    names = args.selectors.split(",")
    head_dim = model.cfg.head_dim
    calibrations = {"broad": lambda: [mix()[0]] + broad(), "joint": lambda: [first()] + joint()}
    for name in names:
        if name.startswith("infinigen_") and name not in factories:
            fit, config, tag = infinigen_variant(name, head_dim)
            factories[name] = (lambda fit=fit, config=config, tag=tag: cached_skew(
                lambda: mixed_skew(model, config, calibrations[fit]()), cache and f"{cache}_infinigen_{tag}.npy",
                config))
    unknown = [n for n in names if n not in factories]
    if unknown or ("oracle" not in names and not args.pair_with):
        raise SystemExit(f"--selectors {args.selectors!r}: unknown {unknown} or no 'oracle' (the pairing); "
                         f"valid: {', '.join(factories)}")
    selectors = {name: factories[name]() for name in names}
    rows = []
    for length in lengths:
        csv = args.csv and "{k}" in args.csv and args.csv.replace(
            "{k}", f"{length // 1024}k" if length % 1024 == 0 else str(length))
        # Domains alternate batch by batch, and the CSV is rewritten after each batch, so a run
        # stopped early still holds paired rows of both domains.
        chosen = (list(range(args.first_sample, args.samples)) if args.only is None
                  else [int(i) for i in args.only.split(",")])
        for b0 in range(0, len(chosen), args.batch):
            for domain, ids in domains.items():
                samples = windows(ids, length, args.samples, args.split)
                index = chosen[b0:b0 + args.batch]
                batch = [samples[i] for i in index]
                prompts = [s[0] for s in batch]
                forced = np.stack([s[1] for s in batch])
                host = prefill_to_host(model, prompts, length + CONTINUATION)
                saved = ([k.copy() for k in host.keys], [v.copy() for v in host.values])
                dense = decode(model, host, Dense(), CONTINUATION, forced_tokens=forced, keep_logits=True)
                for name, sel in selectors.items():
                    host.keys, host.values = [k.copy() for k in saved[0]], [v.copy() for v in saved[1]]
                    out = decode(model, host, sel, CONTINUATION, forced_tokens=forced, keep_logits=True)
                    for i in range(len(batch)):
                        m = fidelity_metrics(dense.logits[i, 1:], out.logits[i, 1:], forced[i, 1:])
                        rows.append(dict(length=length, domain=domain, split=args.split, sample=index[i],
                                         selector=name, **m))
                log.info("%s @%d: samples %s done", domain, length, index)
                if csv:
                    write_csv(csv, [r for r in rows if r["length"] == length])
    if args.pair_with:  # the oracle rows of the same windows from the earlier run
        for length in lengths:
            path = args.pair_with.replace("{k}", f"{length // 1024}k" if length % 1024 == 0 else str(length))
            done = {(r["domain"], r["sample"]) for r in rows if r["length"] == length}
            for r in read_csv(path):
                if (r["selector"] == "oracle" and int(r["length"]) == length
                        and (r["domain"], int(r["sample"])) in done):
                    rows.append(dict(length=length, domain=r["domain"], split=args.split, sample=int(r["sample"]),
                                     selector="oracle", top1=float(r["top1"]), kl=float(r["kl"])))
        selectors = {"oracle": None, **selectors}
    print(f"{'domain':<26}{'len':>6} {'selector':<19}{'top1':>7}{'gap to oracle':>15}{'KL':>9}")
    for length in sorted({r["length"] for r in rows}):
        for domain in domains:
            sub = [r for r in rows if r["length"] == length and r["domain"] == domain]
            top1 = {s: np.mean([r["top1"] for r in sub if r["selector"] == s]) for s in selectors}
            for s in selectors:
                kl = np.mean([r["kl"] for r in sub if r["selector"] == s])
                print(f"{domain:<26}{length:>6} {s:<19}{top1[s]:>7.3f}{100 * (top1[s] - top1['oracle']):>+14.1f}"
                      f"{kl:>9.4f}")
    if args.csv and "{k}" not in args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
