"""CALVO admission policies vs FIFO through the real HTTP server, prefixes in L3 behind a paced link.

`experiments/prefix_serve.py --policies fifo,sjf,srpt` runs this. One `jkv pool` server (the L3)
paces everything it sends at `--link` (the transport's token bucket, as experiments/calvo.py
emulates a thin pool link on one machine). A seeding `jkv serve` with a small page pool
(`--num-pages`) computes `--docs` long documents one after another, so each document's pages
are evicted by the next request and written back to L3; it is stopped (its write-back drains).
Then, per policy, a fresh `jkv serve --schedule POLICY --prefix-cache-l3 jkvpool://...` (empty
device cache, no host tier) serves the same timed workload: Poisson arrivals at `--policy-rate`
of long requests (a seeded document + a question: its pages come from L3 through the paced link)
and short ones (a short unique prompt), `--short-per-long` shorts per long, streamed at
temperature 0. Reported per policy: mean / median / p99 TTFT, overall and for long and short
requests, the remote-tier hit tokens, and each policy's mean TTFT over FIFO's.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from experiments.common import REPO, machine_info
from experiments.serve_load import Server, stream_request, summarize

START_TIMEOUT_S = 1800  # a start-up (load, compile, probe) on a loaded shared CPU took over 5 minutes
QUESTIONS = ["Summarize the rules.", "Which rule is the longest?", "Name two rules about caching.",
             "What does rule 3 say?", "Is anything repeated?", "Give the group number."]


def document(i: int, words: int) -> str:
    """A long document, distinct from its first token on (so its pages are its own)."""
    lines = [f"Document {i}, section {k + 1}: the cache keeps page {k * 7 + i} warm, evicts the least "
             f"recently used page first and writes it back to the pool for later reuse." for k in range(words // 24)]
    return " ".join(lines)


def start_pool(link: str, secret: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, JKV_SECRET=secret, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "jkv.kvpool.server", "--capacity", "8GiB", "--bandwidth", link,
                             "--stdin-eof-exits"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    return proc, json.loads(proc.stdout.readline())["address"]


def _body(prompt: str, max_tokens: int) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


async def _completion(client, url: str, prompt: str, max_tokens: int) -> dict:
    return await stream_request(client, url, "/v1/completions", _body(prompt, max_tokens),
                                lambda choice: choice.get("text"))


def workload(args, offset: int = 0) -> list[tuple[float, str, str]]:
    """(arrival s, kind, prompt): each document asked once, `short_per_long` short prompts per long one,
    shuffled, Poisson arrivals at policy_rate. offset > 0: other documents (warm-up)."""
    rng = random.Random(args.seed + offset)
    items = [("long", document(d + offset, args.doc_words) + " Question: " + QUESTIONS[d % len(QUESTIONS)])
             for d in range(args.docs)]
    items += [("short", f"Note {offset + s}: {QUESTIONS[s % len(QUESTIONS)]} Answer in one word.")
              for s in range(args.docs * args.short_per_long)]
    rng.shuffle(items)
    t, out = 0.0, []
    for kind, prompt in items:
        out.append((t, kind, prompt))
        t += rng.expovariate(args.policy_rate)
    return out


async def _run(url: str, requests, max_tokens: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10)) as client:
        t0 = time.perf_counter()

        async def one(at, kind, prompt):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            r = await _completion(client, url, prompt, max_tokens)
            r["kind"] = kind
            return r

        results = await asyncio.gather(*(one(*r) for r in requests))
        return list(results), time.perf_counter() - t0


def hits_by_tier(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "jkv_prefix_cache_hit_tokens_total":
                out[s.labels["tier"]] = out.get(s.labels["tier"], 0.0) + s.value
    return out


def seed_l3(args, l3: list[str], env: dict):
    """Compute every document on a server whose small page pool evicts it (to L3) at the next request."""
    doc_pages = -(-(args.doc_words * 2 + 64) // 16)  # generous: words -> tokens is about 1.3 here
    server = Server(l3 + ["--num-pages", str(doc_pages + 8), "--max-slots", "1", "--schedule", "fifo"], env=env,
                    timeout=START_TIMEOUT_S)
    try:
        seeds = [(0.0, "long", p) for _, kind, p in workload(args) if kind == "long"]
        fillers = [(0.0, "filler", document(900 + k, args.doc_words)) for k in range(2)]
        for req in seeds + fillers:  # one at a time: each evicts the one before
            asyncio.run(_run(server.url, [req], 1))
        time.sleep(2.0)
    finally:
        server.stop()


def run_policy(args, policy: str, l3: list[str], env: dict) -> dict:
    server = Server(l3 + ["--schedule", policy, "--max-slots", str(args.max_slots)], env=env, timeout=START_TIMEOUT_S)
    try:
        asyncio.run(_run(server.url, [(0.0, k, p) for _, k, p in workload(args, offset=500)[:6]], args.max_tokens))
        before = hits_by_tier(server.url)
        results, duration = asyncio.run(_run(server.url, workload(args), args.max_tokens))
        after = hits_by_tier(server.url)
    finally:
        server.stop()
    s = summarize(results, duration)
    for kind in ("long", "short"):
        ttft = [r["times"][0] for r in results if r["ok"] and r["kind"] == kind]
        s[f"mean_ttft_ms_{kind}"] = 1e3 * float(np.mean(ttft)) if ttft else float("nan")
    s.update({f"hit_tokens_{tier}": after[tier] - before.get(tier, 0.0) for tier in after})
    s.update(policy=policy, link=args.link, rate=args.policy_rate, docs=args.docs, doc_words=args.doc_words,
             short_per_long=args.short_per_long, max_tokens=args.max_tokens, max_slots=args.max_slots,
             model=args.model, answers=[r.get("text") for r in results], **machine_info())
    print(f"[{policy}] mean TTFT {s['mean_ttft_ms']:.0f} ms (long {s['mean_ttft_ms_long']:.0f}, short "
          f"{s['mean_ttft_ms_short']:.0f}), p99 {s['p99_ttft_ms']:.0f}, failed {s['failed']}, "
          f"L3 hit tokens {s.get('hit_tokens_remote', 0):.0f}, load {s['loadavg_1m']}", flush=True)
    return s


def compare(args) -> list[dict]:
    """Seed L3, then run every policy in args.policies (FIFO first as the baseline)."""
    secret = secrets.token_hex(16)
    pool, address = start_pool(args.link, secret)
    env = {"JKV_SECRET": secret}
    l3 = ["--model", args.model, "--served-model-name", "m", "--max-model-len", str(args.max_model_len),
          "--prefix-cache-l3", f"jkvpool://{address}", "--prefix-cache-l3-timeout", str(args.l3_timeout)]
    try:
        seed_l3(args, l3, env)
        rows = []
        for p in args.policies:  # each row also saved as it comes: a long run stopped early keeps its rows
            rows.append(run_policy(args, p, l3, env))
            (Path(args.out) / "prefix_serve_policies.partial.json").write_text(json.dumps(rows, indent=2))
    finally:
        pool.stdin.close()
        pool.wait(30)
    base = next((r for r in rows if r["policy"] == "fifo"), rows[0])
    for r in rows:
        r["ttft_ratio_vs_fifo"] = r["mean_ttft_ms"] / base["mean_ttft_ms"]
        r["answers_identical_to_fifo"] = r["answers"] == base["answers"]
    return rows


FIELDS = ["policy", "completed", "failed", "duration_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
          "mean_ttft_ms_long", "mean_ttft_ms_short", "ttft_ratio_vs_fifo", "answers_identical_to_fifo",
          "hit_tokens_device", "hit_tokens_remote", "link", "rate", "docs", "doc_words", "short_per_long",
          "max_tokens", "max_slots", "model", "cpu_model", "cores", "loadavg_1m"]


def plot(rows: list[dict], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("mean_ttft_ms", "all"), ("mean_ttft_ms_long", "long (L3 prefix)"),
                                      ("mean_ttft_ms_short", "short"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] / 1e3 for r in rows], 0.27, label=label)
    ax.set_xticks(x, [f"{r['policy']}\n{r['ttft_ratio_vs_fifo']:.2f}x" for r in rows])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"jkv serve --schedule, L3 over a {rows[0]['link']} link, {rows[0]['rate']}/s", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
