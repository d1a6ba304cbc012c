"""Side-by-side runs of transfer modes on one set of prefill workers (demo and benchmarks).

    h = Harness("smollm2-135m-instruct", prefill_workers=2)
    prompts = h.eval_prompts(4, 1024)
    h.build_profile(1024)                       # calibration split, never the eval prompts
    tp, bw = h.pace_link(prompts, ratio=6.5)    # measure Tp, then pace so Tt = ratio * Tp
    outs = h.run("full", prompts, 32); outs = h.run("smartgen", prompts, 32)
    outs = h.run("smartgen", prompts, 32, compression="auto", compression_options={"profiles": [path]})

DESIGN.md "Emulating the papers' testbed": absolute times only mean something on a GPU, so the
harness measures the prefill time Tp of the batch on this machine first and then re-paces
every prefill worker's link so the full transfer of its share takes `ratio` * Tp.

Processes: the caller's process is the decode worker; `LocalPrefillWorkers` runs the prefill
workers. A fresh `DecodeWorker` (one endpoint) is made per run, so modes share the workers and
their compiled programs; only one run at a time. `compression` ("off" | "auto" | a pipeline id,
docs/compression.md) gives each run a fresh decode-side `CompressionPolicy` whose bandwidth
estimate starts at the paced link (as `Disaggregation.compression_policy` does in serving).
"""
from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time

import numpy as np

from jkv.disagg import protocol as proto
from jkv.disagg.cluster import LocalPrefillWorkers
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.handshake import role_config
from jkv.disagg.selectors import build_selector, save_selector
from jkv.engine import Request
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from jkv.transfer.profile import build_profile
from models import load_model
from transport import Endpoint

log = logging.getLogger(__name__)

QUESTION = "\n\nSummarize the text above in two sentences."


def text_prompts(tok, split: str, count: int, prompt_len: int) -> list[list[int]]:
    """`count` chat prompts of `prompt_len` tokens: windows spread over the corpus split
    (`jkv.corpus.long_text`) followed by `QUESTION` (the SmartGen benchmarks' prompts)."""
    from jkv.corpus import long_text

    ids = tok.encode(long_text(split))
    suffix = len(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    body = prompt_len - suffix
    if body < 16 or (count * body) > len(ids):
        raise ValueError(f"cannot cut {count} prompts of {prompt_len} tokens from the {split} corpus")
    out = []
    for i in range(count):
        start = i * (len(ids) // count)
        text = tok.decode(ids[start:start + body])
        p = tok.apply_chat_template([{"role": "user", "content": text + QUESTION}])
        out.append(p[:prompt_len] if len(p) > prompt_len else p)
    return out


class Harness:
    def __init__(self, model_name: str, selector: str = "infinigen", prefill_workers: int = 2,
                 transport: str = "tcp", max_blocks: int = 64, say=print):
        self.say = say
        t = time.perf_counter()
        self.model = load_model(model_name)
        self.model_name = model_name
        self.selector = build_selector(self.model, selector)
        self.selector_name = selector
        self.max_blocks = max_blocks
        self.transport = transport
        self.profile = None
        self.bandwidth_bps: float | None = None
        self._secret = secrets.token_hex(16)
        self._tmp = tempfile.TemporaryDirectory(prefix="jkv-harness-")
        path = os.path.join(self._tmp.name, "selector.pkl")
        save_selector(self.selector, path)
        self.workers = LocalPrefillWorkers(prefill_workers, model_name, path, secret=self._secret,
                                           transport=transport, bandwidth="100gbit")
        # the decode process's control connection: declares the decode side's configuration, as its
        # DecodeWorkers do (a prefill worker refuses a peer that declares none)
        self._control = Endpoint("control", transport, secret=self._secret,  # same timeout as the workers
                                 config_check=role_config(self.model, "decode", self.selector, max_blocks=None).check())
        self._control_peers = [self._control.connect(a.partition("|")[0]) for a in self.workers.addresses]
        self.say(f"decode process: {self.model}, selector {selector}; {prefill_workers} prefill worker processes "
                 f"ready in {time.perf_counter() - t:.1f}s")

    # ------------------------------------------------------------------ data
    def _text_prompts(self, split: str, count: int, prompt_len: int) -> list[list[int]]:
        return text_prompts(self.model.tokenizer, split, count, prompt_len)

    def eval_prompts(self, count: int, prompt_len: int) -> list[list[int]]:
        return self._text_prompts("eval", count, prompt_len)

    def build_profile(self, prompt_len: int, count: int = 1, steps: int = 12):
        t = time.perf_counter()
        calib = self._text_prompts("calibration", count, prompt_len)
        self.profile = build_profile(self.model, self.selector, self.selector_name, {prompt_len: calib}, steps,
                                     max_blocks=self.max_blocks, model_name=self.model_name)
        self.say(f"importance profile: {count} calibration prompts x {steps} steps at {prompt_len} tokens "
                 f"(Tp={self.profile.bins[0].prefill_s:.2f}s) in {time.perf_counter() - t:.1f}s")
        return self.profile

    # ------------------------------------------------------------------ link
    def set_bandwidth(self, bits_per_s: float) -> None:
        for peer in self._control_peers:
            peer.call("set_bandwidth", proto.pack(dict(bps=float(bits_per_s))), timeout=30)
        self.bandwidth_bps = float(bits_per_s)

    def pace_link(self, prompts, ratio: float = 6.5, max_tokens: int = 3, tp_runs: int = 3,
                  tp: float | None = None, bandwidth_bps: float | None = None) -> tuple[float, float]:
        """Warm up (compiles everything) with full transfer on the fast link, take the batch's
        prefill time Tp, then pace each worker so its share's full transfer takes ratio * Tp.

        Tp is the *minimum* over `tp_runs` warm prefills that push no KV (Kr = 0, one token): the
        pace must come from what a quiet box achieves, not from one sample taken while other
        jobs share the cores (one such sample, 38.8 s against 13.5 s quiet at 4 x 2K, paced the
        link 2.9x slower than intended and made smartgen's per-step on-demand rows 2.6x full's
        TBT). Load only ever lengthens a prefill, so the minimum is the robust estimate. A full
        push over the unpaced loopback competes with prefill for the cores (up to ~1.3x at
        4 x 1K), so the warm-up's prefill time is not used. `tp` (seconds) skips the
        measurement (e.g. to pace a second run like the first); `bandwidth_bps` (per worker)
        skips the pacing formula as well."""
        if tp_runs < 1:
            raise ValueError(f"tp_runs={tp_runs!r} must be >= 1 (Tp is the minimum over that many prefills)")
        self.set_bandwidth(100e9)
        outs = self.run("full", prompts, max_tokens)
        self.tp_loaded = max(o.metrics.extra["prefill_s"] for o in outs)
        cfg = self.model.cfg
        per_worker = {}
        for o in outs:
            nbytes = 2 * cfg.num_layers * cfg.num_kv_heads * o.metrics.prompt_tokens * cfg.head_dim * 4
            per_worker[o.metrics.extra["owner"]] = per_worker.get(o.metrics.extra["owner"], 0) + nbytes
        self.tp_samples = []
        if tp is None and bandwidth_bps is None:
            for _ in range(tp_runs):
                quiet = self.run("partial", prompts, 1, kr_fraction=0.0)
                self.tp_samples.append(max(o.metrics.extra["prefill_s"] for o in quiet))
            tp = min(self.tp_samples)
        elif tp is None:
            tp = max(per_worker.values()) * 8 / (ratio * bandwidth_bps)
        bw = float(bandwidth_bps) if bandwidth_bps is not None else max(per_worker.values()) * 8 / (ratio * tp)
        self.set_bandwidth(bw)
        self.tp = tp
        if self.profile is not None:
            # Eq. 2 per request: the prefill window is the batch's Tp and the request gets its share
            # of the worker's link, so the profile's Tp (measured solo) is rescaled to Tp_batch / share.
            share = max(sum(1 for o in outs if o.metrics.extra["owner"] == w) for w in per_worker)
            n = int(np.mean([o.metrics.prompt_tokens for o in outs]))
            factor = (tp / share) / self.profile.prefill_time(n)
            for b in self.profile.bins:
                b.prefill_s *= factor
        how = (f"min of {len(self.tp_samples)} warm prefills: " + ", ".join(f"{t:.2f}" for t in self.tp_samples)
               + " s") if self.tp_samples else "given"
        self.say(f"Tp={tp:.2f}s for the batch ({how}; {self.tp_loaded:.2f}s while pushing all KV unpaced); paced "
                 f"each prefill worker to {bw / 1e6:.2f} Mbit/s so full transfer takes ~"
                 f"{max(per_worker.values()) * 8 / bw / tp:.3g} x Tp")
        return tp, bw

    # ------------------------------------------------------------------ runs
    def run(self, mode: str, prompts, max_tokens: int, compression: str = "off",
            compression_options: dict | None = None, **overrides):
        kw = dict(mode=mode, max_blocks=self.max_blocks, bandwidth_bps=self.bandwidth_bps)
        kw.update(overrides)
        if self.profile is None and kw.get("kr_fraction") is None and mode != "full":
            raise ValueError("build_profile() first (or pass kr_fraction)")
        policy = self.compression_policy(compression, compression_options)
        decode = DecodeWorker(self.model, self.selector, TransferConfig(**kw), secret=self._secret,
                              profile=self.profile, oracle_profile=getattr(self, "oracle_profile", None),
                              compression=policy)
        decode.phases.probe = self.prefill_cpu_s  # per step: the prefill processes' CPU (probe_cpu_us_n)
        try:
            decode.connect(self.workers.addresses)
            requests = [Request(f"{mode}-{i}", p, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                        for i, p in enumerate(prompts)]
            outs = decode.generate(requests)
        finally:
            decode.close()
        bad = [o.metrics.extra.get("error") for o in outs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"{mode}: {bad[0]}")
        return outs

    def compression_policy(self, compression: str, options: dict | None = None):
        """A fresh decode-side policy for one run (None for "off"), its estimate starting at the
        paced link of one prefill worker."""
        if compression == "off":
            return None
        from jkv.compression.policy import CompressionConfig, CompressionPolicy
        return CompressionPolicy(CompressionConfig.from_options(compression, options or {}),
                                 bandwidth_bps=self.bandwidth_bps)

    def prefill_cpu_s(self) -> float:
        """CPU seconds (user + system) the local prefill worker processes have used so far."""
        total = 0
        for proc in self.workers.procs:
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:  # not Linux, or the process is gone
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        return total / os.sysconf("SC_CLK_TCK")

    def build_oracle_profile(self, prompts, steps: int = 16):
        """The 'oracle' proactive strategy: a profile fitted on the served prompts themselves."""
        n = min(len(p) for p in prompts)
        self.oracle_profile = build_profile(self.model, self.selector, self.selector_name,
                                            {n: [p[:n] for p in prompts]}, steps, max_blocks=self.max_blocks)
        return self.oracle_profile

    def close(self) -> None:
        self._control.close()
        self.workers.close()
        self._tmp.cleanup()


def summarize(outs) -> dict:
    """Batch figures: mean TTFT, TTST, TBT (excluding the second token), on-demand ratio, bytes."""
    ttft = np.mean([o.metrics.ttft for o in outs])
    ttst = np.mean([o.metrics.ttst for o in outs])
    tbt = np.mean([o.metrics.mean_tbt for o in outs])
    ratio = np.mean([o.metrics.extra["on_demand_ratio"] for o in outs])
    nbytes = {k: sum(o.metrics.extra["bytes"][k] for o in outs) for k in outs[0].metrics.extra["bytes"]}
    return dict(ttft=float(ttft), ttst=float(ttst), mean_tbt=float(tbt), on_demand_ratio=float(ratio), **{
        f"bytes_{k}": int(v) for k, v in nbytes.items()})
