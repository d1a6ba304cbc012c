"""CALVO's policies vs FIFO through the real HTTP server, every prefix in L3 behind a paced link.

Workload (CALVO §4: long contexts in the pool, short queries): every request is a document whose
KV sits in L3 (`--doc-pages`: its size in 16-token pages, drawn uniformly per request, so a few big
loads share the link with many small ones) plus a 5-token question, max_tokens 2, streamed at
temperature 0. Prompts are token ids (exact page counts). Every run uses documents no server has
seen, so each one is an L3 read. The pool process stores every document's pages before the servers
start, under the keys `jkv serve` computes for them, with *synthetic* KV (random values of the
cache's dtype and page shape): computing them through a seeding server took ~16 s a document on
the loaded 2-core box, and what is timed (the paced read, the copy into device pages, the prefill
of the question, the first token) does not depend on the values. So the answers are not the
model's answers to the documents; they are still compared across policies (the same for all).

Validity on a shared, loaded machine:
- Side by side: one `jkv serve --schedule P` per policy, all running at once, and every request of
  a run is sent to all of them at the same instant; each server reads from its own paced link (one
  pool process, one store, one `--link`-paced endpoint per server). Machine load hits all policies
  alike; the ratios are taken within a run.
- The link dominates: a page (16 tokens of SmolLM2's f32 KV, 737 KB) crosses the 10 Mbit/s link
  in 0.6 s; the 5-token prefill after it takes tens of ms on a quiet CPU, so the policy effect is
  mostly link time, which machine load does not change.
- FIFO sustained: the runs sweep the modelled link utilisation (`--utilizations`: arrival rate x
  mean link time per request) upwards; a run counts as sustained by FIFO when all requests finish
  and the mean TTFT of the last third of arrivals is at most SUSTAIN_GROWTH x that of the first
  third, floored at the steady-state FIFO TTFT of the link alone at that rate (the M/G/1 model,
  `modelled_ttft`; at least the mean link time per request): a queue that keeps growing past what
  a stable queue at this rate shows fails this. (The floor was the link time per request until
  2026-12-02: a 24-request run starting from an empty queue then failed a stable rate whenever its
  first third happened to meet no queue, e.g. rho 0.6 read unsustained in one run and sustained in
  the next two.) The
  sweep stops at the first unsustained rate; the comparison is at the highest sustained one, with
  `--reps` runs (new arrivals and documents each) there; ratios SJF/FIFO and SRPT/FIFO per run,
  with their mean, min and max.

Each server's cost model is its start-up probe refitted from `--warmup` L3 reads of different sizes
before the timed runs (the probe times an L2 copy, not the link; admission.py refits from L3
reads). Writes prefix_serve_policies.{csv,json,png} under `--out`. The quiet-box rerun:

    PYTHONPATH=. python experiments/prefix_serve_policies.py --out experiments/results   # ~15-20 min
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.common import RESULTS, add_model_arg, add_out_arg, add_seed_arg, machine_info, write_csv  # noqa: E402
from experiments.serve_load import Server, stream_request  # noqa: E402
from jkv.serving.prefix_loader import CHUNK_PAGES  # noqa: E402

PAGE = 16  # jkv serve's default --page-size
QUESTION = [1034, 3312, 2957, 5028, 30]
START_TIMEOUT_S = 1800  # a start-up (load, compile, probe) on a loaded shared CPU took over 5 minutes
SUSTAIN_GROWTH = 2.0
FIELDS = ["run", "phase", "rho", "rate", "policy", "completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
          "mean_ttft_ms_small", "mean_ttft_ms_big", "ttft_ratio_vs_fifo", "answers_identical_to_fifo",
          "fifo_sustained", "fifo_first_third_ms", "fifo_last_third_ms", "modelled_fifo_ms", "modelled_sjf_ms",
          "modelled_sjf_ratio", "chunked_sjf_ratio", "chunked_srpt_ratio", "hit_tokens_remote", "expected_remote_tokens",
          "requests", "link", "doc_pages", "max_slots", "model", "cpu_model", "cores", "loadavg_before",
          "loadavg_after"]


def document(doc_id: str, pages: int) -> list[int]:
    """`pages` full pages of token ids, its own from the first token on (a str seed is stable)."""
    rng = random.Random(f"doc {doc_id}")
    return [rng.randrange(1000, 30000) for _ in range(pages * PAGE)]


def trace(args, run: int, rate: float, n: int) -> list[tuple[float, str, int]]:
    """(arrival s, document id, pages) of run `run`: Poisson at `rate`; the documents depend on the
    run only, so every run's documents can be seeded before the rates are known."""
    rng = random.Random(args.seed * 7919 + run)
    t, out = 0.0, []
    for k in range(n):
        out.append((t, f"{args.seed}-{run}-{k}", rng.choice(args.doc_pages)))
        t += rng.expovariate(rate)
    return out


def serve_pools(n: int, link: str, capacity: str, model_name: str, docs_file: str):
    """The pool process: n endpoints paced at `link` over one store, so each server reads through its
    own link and all of them find every document. Before serving it stores every document of
    `docs_file` ([[id, pages], ...]) under the keys `jkv serve` computes for it (the model's
    namespace, the chained page hashes) with synthetic KV (seeded random values, the cache's dtype
    and page shape): computing them on a seeding server took ~16 s a document on the loaded CPU.
    Prints {"paced": [addresses]}; serves until stdin closes."""
    from jkv.kvcache.prefix import extend_page_keys, prefix_namespace, shareable_pages
    from jkv.kvpool.hashing import ChunkKey
    from jkv.kvpool.server import PoolServer, parse_size
    from models import load_model_spec

    model = load_model_spec(model_name)
    cfg = model.cfg
    namespace = prefix_namespace(model, cfg.dtype, PAGE)
    rng = np.random.default_rng(0)
    pages = [(0.1 * rng.standard_normal((cfg.num_layers, 2, cfg.num_kv_heads, PAGE, cfg.head_dim))).astype(cfg.dtype)
             for _ in range(8)]
    # timeout: a client is dropped after this long without a message, and a RemoteKVPool with a 60 s op
    # timeout sends a heartbeat only every 12 s; with the default 5 s a first run had L3 errors on
    # every server (suspected: clients dropped mid-read of a big document, 7 s at 10 Mbit/s)
    servers = [PoolServer(parse_size(capacity), secret=os.environ["JKV_SECRET"], bandwidth=link, timeout=300.0)
               for _ in range(n)]
    store = servers[0].pool
    for s in servers[1:]:
        s.pool.close()
        s.pool = store  # the handlers read self.pool: one store behind every endpoint
    for doc_id, n_pages in json.loads(Path(docs_file).read_text()):
        tokens = document(doc_id, n_pages) + QUESTION
        for i, key in enumerate(extend_page_keys([], tokens, namespace, limit=shareable_pages(len(tokens), PAGE))):
            if not store.put(ChunkKey(namespace, -1, key), pages[i % len(pages)]):
                raise RuntimeError(f"the pool refused page {i} of document {doc_id}: raise its capacity")
    print(json.dumps({"paced": [s.start() for s in servers], "pages": store.stats().entries}), flush=True)
    sys.stdin.read()
    for s in servers:
        s.close()


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


async def _send(urls: list[str], requests, max_tokens: int) -> list[list[dict]]:
    """Every request to every server at its arrival time (the same instant for all); results per server."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()

        async def one(url, at, doc_id, pages):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            r = await stream_request(client, url, "/v1/completions",
                                     _body(document(doc_id, pages) + QUESTION, max_tokens), lambda c: c.get("text"))
            r.update(pages=pages, arrival=at)
            return r

        return list(await asyncio.gather(*(asyncio.gather(*(one(u, *req) for req in requests)) for u in urls)))


def remote_hits(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
               for s in fam.samples
               if s.name == "jkv_prefix_cache_hit_tokens_total" and s.labels.get("tier") == "remote")


def _server_args(args, l3_address: str, policy: str, max_slots: int) -> list[str]:
    return ["--model", args.model, "--served-model-name", "m", "--max-model-len", str(args.max_model_len),
            "--max-slots", str(max_slots), "--schedule", policy, "--prefix-cache-l3", f"jkvpool://{l3_address}",
            "--prefix-cache-l3-timeout", str(args.l3_timeout)]


def fifo_sustained(results: list[dict], floor_s: float) -> tuple[bool, float, float]:
    """(sustained, mean TTFT of the first third of arrivals, of the last third) in ms: sustained when
    every request finished and the last third's mean TTFT <= SUSTAIN_GROWTH x max(first third's,
    floor_s: the link's steady-state FIFO TTFT at this rate): a FIFO queue that keeps growing over the
    run fails it."""
    ordered = sorted(results, key=lambda r: r["arrival"])
    third = max(1, len(ordered) // 3)
    mean = lambda rs: 1e3 * float(np.mean([r["times"][0] if r["ok"] else np.inf for r in rs]))  # noqa: E731
    first, last = mean(ordered[:third]), mean(ordered[-third:])
    ok = all(r["ok"] for r in results) and last <= SUSTAIN_GROWTH * max(first, 1e3 * floor_s)
    return ok, first, last


def summarize_run(args, run: int, rho: float, rate: float, policy: str, results: list[dict], hits: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = np.array([r["times"][0] for r in ok]) * 1e3
    small = max(1, min(args.doc_pages))
    by_size = lambda cond: [t for t, r in zip(ttft, ok) if cond(r["pages"])]  # noqa: E731
    return {"run": run, "rho": rho, "rate": round(rate, 4), "policy": policy, "completed": len(ok),
            "failed": len(results) - len(ok), "mean_ttft_ms": float(ttft.mean()) if len(ttft) else float("nan"),
            "median_ttft_ms": float(np.median(ttft)) if len(ttft) else float("nan"),
            "p99_ttft_ms": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "mean_ttft_ms_small": float(np.mean(by_size(lambda p: p <= small) or [np.nan])),
            "mean_ttft_ms_big": float(np.mean(by_size(lambda p: p == max(args.doc_pages)) or [np.nan])),
            "hit_tokens_remote": hits, "expected_remote_tokens": PAGE * sum(r["pages"] for r in results),
            "requests": len(results), "link": args.link, "doc_pages": " ".join(map(str, args.doc_pages)),
            "max_slots": args.max_slots, "model": args.model, "answers": [r.get("text") for r in results],
            "errors": [f"request {i} ({r['pages']} pages, arrival {r['arrival']:.1f} s): {r.get('error')}"
                       for i, r in enumerate(results) if not r["ok"]]}


def run_once(args, servers: dict, run: int, rho: float, floor_s: float, phase: str) -> list[dict]:
    """One run side by side: the same trace to every policy's server at once; one row per policy."""
    rate = rho / floor_s
    requests = trace(args, run, rate, args.requests)
    before = {p: remote_hits(s.url) for p, s in servers.items()}
    log_from = {p: len(s.log) for p, s in servers.items()}
    load_before = os.getloadavg()[0]
    results = asyncio.run(_send([s.url for s in servers.values()], requests, args.max_tokens))
    load_after = os.getloadavg()[0]
    rows = [summarize_run(args, run, rho, rate, p, res, remote_hits(servers[p].url) - before[p])
            for p, res in zip(servers, results)]
    fifo = dict(zip(servers, results)).get("fifo", results[0])
    page_s = floor_s / float(np.mean(args.doc_pages))
    model_fifo, model_sjf = modelled_ttft(rho, args.doc_pages, page_s)
    sustained, first, last = fifo_sustained(fifo, max(floor_s, model_fifo))
    chunked = {p: simulated_link_ttft(rho, args.doc_pages, page_s, CHUNK_PAGES, p, args.seed)
               for p in ("fifo", "sjf", "srpt")}
    base = next(r for r in rows if r["policy"] == ("fifo" if "fifo" in servers else rows[0]["policy"]))
    for r in rows:
        r.update(phase=phase, modelled_fifo_ms=1e3 * model_fifo, modelled_sjf_ms=1e3 * model_sjf,
                 modelled_sjf_ratio=model_sjf / model_fifo, chunked_sjf_ratio=chunked["sjf"] / chunked["fifo"],
                 chunked_srpt_ratio=chunked["srpt"] / chunked["fifo"], ttft_ratio_vs_fifo=r["mean_ttft_ms"] / base["mean_ttft_ms"],
                 answers_identical_to_fifo=r["answers"] == base["answers"], fifo_sustained=sustained,
                 fifo_first_third_ms=first, fifo_last_third_ms=last, loadavg_before=round(load_before, 2),
                 loadavg_after=round(load_after, 2), **{k: v for k, v in machine_info().items()
                                                          if k in ("cpu_model", "cores")})
        print(f"run {run} rho {rho:.2f} ({rate:.3f}/s) {r['policy']:>5}: mean TTFT {r['mean_ttft_ms']:.0f} ms "
              f"= {r['ttft_ratio_vs_fifo']:.2f}x FIFO (small docs {r['mean_ttft_ms_small']:.0f}, big "
              f"{r['mean_ttft_ms_big']:.0f}), failed {r['failed']}, L3 hit tokens {r['hit_tokens_remote']:.0f}/"
              f"{r['expected_remote_tokens']}, load {load_before:.1f}->{load_after:.1f}", flush=True)
    for r in rows:  # a failed request: what the client saw and what its server logged meanwhile
        if r["errors"]:
            server_log = [line.rstrip() for line in servers[r["policy"]].log[log_from[r["policy"]]:]
                          if any(w in line for w in ("WARNING", "ERROR", "Traceback", "Error"))]
            r["server_log"] = server_log[-40:]
            print(f"run {run} {r['policy']}: failed requests: {r['errors']}\n  server log: " + "\n  ".join(server_log[-40:]),
                  flush=True)
    print(f"run {run}: link-only M/G/1 model at rho {rho}: FIFO {model_fifo:.1f} s, non-preemptive SJF "
          f"{model_sjf:.1f} s = {model_sjf / model_fifo:.2f}x; the link taken chunk by chunk ({CHUNK_PAGES} pages) in "
          f"policy order (the server's loader): SJF {chunked['sjf'] / chunked['fifo']:.2f}x, SRPT "
          f"{chunked['srpt'] / chunked['fifo']:.2f}x FIFO", flush=True)
    print(f"run {run}: FIFO sustained = {sustained} (mean TTFT last third {last:.0f} ms <= {SUSTAIN_GROWTH} x "
          f"max(first third {first:.0f} ms, the link's steady-state FIFO TTFT {1e3 * max(floor_s, model_fifo):.0f} ms), "
          "all finished)", flush=True)
    return rows


def modelled_ttft(rho: float, doc_pages: list[int], page_s: float) -> tuple[float, float]:
    """(FIFO, SJF) mean TTFT in s of the link alone as an M/G/1 queue at utilisation rho: one read
    at a time, never pre-empted, compute ignored; SJF as non-preemptive priority by read size
    (Cobham's formula). The reference for what ordering whole reads can give at this rate."""
    sizes = sorted(set(doc_pages))
    prob = [doc_pages.count(k) / len(doc_pages) for k in sizes]
    service = [k * page_s for k in sizes]
    mean = sum(p * t for p, t in zip(prob, service))
    w0 = rho / mean * sum(p * t * t for p, t in zip(prob, service)) / 2
    fifo = w0 / (1 - rho) + mean
    sjf, before = 0.0, 0.0
    for p, t in zip(prob, service):
        upto = before + rho / mean * p * t
        sjf += p * (w0 / ((1 - before) * (1 - upto)) + t)
        before = upto
    return fifo, sjf


def simulated_link_ttft(rho: float, doc_pages: list[int], page_s: float, chunk_pages: int, policy: str,
                        seed: int = 0, n: int = 20000, slots: int = 4) -> float:
    """Mean TTFT in s of the link alone as the server's loader takes it: Poisson arrivals at
    utilisation rho, sizes drawn from doc_pages, at most `slots` loads admitted (the rest wait,
    admitted in policy order), the link given chunk by chunk (`chunk_pages` pages, never
    pre-empted within one) to the admitted load first in `policy` order (fifo: arrival; sjf: size;
    srpt: pages left), compute ignored; the first tenth of arrivals is warm-up. The reference for
    what chunk-granular ordering can give at this rate (fetch depth 1: the loader on a slow link)."""
    rng = random.Random(seed)
    rate = rho / (float(np.mean(doc_pages)) * page_s)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append((t, rng.choice(doc_pages)))

    def key(r):  # r: [arrival, pages, pages left]
        return {"fifo": (r[0],), "sjf": (r[1], r[0]), "srpt": (r[2], r[0])}[policy]

    ttft, waiting, loading, i, now = [], [], [], 0, 0.0
    while i < n or waiting or loading:
        while i < n and arrivals[i][0] <= now:
            waiting.append([arrivals[i][0], arrivals[i][1], arrivals[i][1]])
            i += 1
        while waiting and len(loading) < slots:
            r = min(waiting, key=key)
            waiting.remove(r)
            loading.append(r)
        if not loading:
            now = arrivals[i][0]
            continue
        r = min(loading, key=key)
        pages = min(chunk_pages, r[2])
        now += pages * page_s
        r[2] -= pages
        if r[2] == 0:
            loading.remove(r)
            ttft.append((r[0], now - r[0]))
    ttft.sort()
    return float(np.mean([d for _, d in ttft[n // 10:]]))


def link_seconds_per_request(args) -> float:
    """Modelled link time of the mean request: its pages' KV bytes over the paced link."""
    from jkv.kvcache import kv_bytes_per_token
    from models import load_model_spec
    from transport import parse_bandwidth

    page_bytes = PAGE * kv_bytes_per_token(load_model_spec(args.model).cfg)
    return float(np.mean(args.doc_pages)) * page_bytes * 8 / parse_bandwidth(args.link)


def start_servers(args, env: dict, servers: dict, pool: subprocess.Popen) -> list[threading.Thread]:
    """Start one `jkv serve` per policy into `servers`, each on its own thread, once the pool process
    has stored the documents and printed its addresses (the model loads overlap); join the threads,
    then `warm`."""
    addresses = json.loads(pool.stdout.readline())
    print(f"the pool stores {addresses['pages']} pages", flush=True)

    def start(policy, address):
        try:
            servers[policy] = Server(_server_args(args, address, policy, args.max_slots), env=env,
                                     timeout=START_TIMEOUT_S)
        except RuntimeError as e:
            servers.setdefault("errors", []).append(e)

    threads = [threading.Thread(target=start, args=pa) for pa in zip(args.policies, addresses["paced"])]
    for t in threads:
        t.start()
    return threads


def warm(args, servers: dict):
    """`--warmup` L3 reads per server (sequential per server, the servers in parallel): the shapes
    the runs use compile, and the cost model refits from real link times."""
    warm = [(0.0, f"{args.seed}-warm-{k}", args.doc_pages[k % len(args.doc_pages)]) for k in range(args.warmup)]

    async def warm_one(url):
        for req in warm:
            await _send([url], [req], args.max_tokens)

    async def warm_all():
        await asyncio.gather(*(warm_one(s.url) for s in servers.values()))

    asyncio.run(warm_all())


def compare(args) -> tuple[list[dict], dict]:
    secret = secrets.token_hex(16)
    env = {"JKV_SECRET": secret}
    floor_s = link_seconds_per_request(args)
    runs = list(range(len(args.utilizations) + args.reps - 1))
    docs = [(d, p) for run in runs for _, d, p in trace(args, run, 1.0, args.requests)]
    docs += [(f"{args.seed}-warm-{k}", args.doc_pages[k % len(args.doc_pages)]) for k in range(args.warmup)]
    docs_file = Path(args.out) / "prefix_serve_policies.docs.json"
    docs_file.write_text(json.dumps(docs))
    partial = Path(args.out) / "prefix_serve_policies.partial.json"
    pool = subprocess.Popen([sys.executable, __file__, "--serve-pools", str(len(args.policies)), "--link", args.link,
                             "--model", args.model, "--docs-file", str(docs_file)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, JKV_SECRET=secret, PYTHONPATH=str(REPO)))
    rows, servers = [], {}
    try:
        threads = start_servers(args, env, servers, pool)
        for t in threads:
            t.join()
        if "errors" in servers:
            raise servers["errors"][0]
        servers = {p: servers[p] for p in args.policies}
        warm(args, servers)
        chosen = None
        for run, rho in enumerate(sorted(args.utilizations)):
            rows += run_once(args, servers, run, rho, floor_s, "sweep")
            partial.write_text(json.dumps(rows, indent=2))  # a run stopped early keeps its rows
            if not rows[-1]["fifo_sustained"]:
                break
            chosen = rho
        if chosen is None:
            chosen = min(args.utilizations)
            print(f"FIFO sustained none of the rates; the reps run at the lowest, rho {chosen}", flush=True)
        for run in range(len(args.utilizations), len(runs)):
            rows += run_once(args, servers, run, chosen, floor_s, "rep")
            partial.write_text(json.dumps(rows, indent=2))
    finally:
        for s in servers.values():
            if isinstance(s, Server):
                s.stop()
        pool.stdin.close()
        pool.wait(30)
        docs_file.unlink()
    return rows, summary(args, rows, chosen, floor_s)


def summary(args, rows: list[dict], chosen: float, floor_s: float) -> dict:
    """Per policy at the chosen rate: mean TTFT over FIFO's per run, their mean, min and max."""
    at = [r for r in rows if r["rho"] == chosen]
    out = {"chosen_rho": chosen, "chosen_rate": at[0]["rate"] if at else None, "link_s_per_request": floor_s,
           "runs_at_chosen": sorted({r["run"] for r in at}), "criterion": f"last third mean TTFT <= {SUSTAIN_GROWTH}"
           " x max(first third, the link's steady-state M/G/1 FIFO TTFT at the rate), all finished", "ratios": {}, **machine_info()}
    for p in args.policies:
        ratios = [r["ttft_ratio_vs_fifo"] for r in at if r["policy"] == p]
        out["ratios"][p] = {"per_run": ratios, "mean": float(np.mean(ratios)), "min": float(np.min(ratios)),
                            "max": float(np.max(ratios))}
    return out


def plot(rows: list[dict], summ: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for p in policies:
        pts = sorted((r["rho"], r["mean_ttft_ms"] / 1e3) for r in rows if r["policy"] == p and r["phase"] == "sweep")
        left.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=p)
    for r in rows:
        if r["policy"] == policies[0] and not r["fifo_sustained"]:
            left.axvline(r["rho"], color="grey", ls=":", lw=1)
    left.set_xlabel("modelled link utilisation (rate x link time per request)")
    left.set_ylabel("mean TTFT (s)")
    left.set_title("rate sweep, policies side by side (dotted: FIFO not sustained)", fontsize=8)
    left.legend(fontsize=8)
    others = [p for p in policies if p != "fifo"]
    for i, p in enumerate(others):
        ratios = summ["ratios"][p]["per_run"]
        right.scatter([i] * len(ratios), ratios, color=f"C{policies.index(p)}")
        right.hlines(summ["ratios"][p]["mean"], i - 0.25, i + 0.25, color=f"C{policies.index(p)}")
    right.axhline(1.0, color="grey", lw=1)
    right.axhline(0.6, color="red", ls="--", lw=1, label="goal 0.6x")
    right.set_xticks(range(len(others)), [f"{p}/fifo\nmean {summ['ratios'][p]['mean']:.2f}" for p in others])
    right.set_ylabel("mean TTFT / FIFO's (per run)")
    right.set_title(f"at rho {summ['chosen_rho']} ({summ['chosen_rate']}/s), runs {summ['runs_at_chosen']}",
                    fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(f"jkv serve --schedule, {rows[0]['model']}, L3 over a {rows[0]['link']} link, "
                 f"{summ['cpu_model']} x{summ['cores']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--policies", type=lambda v: v.split(","), default=["fifo", "sjf", "srpt"],
                    help="--schedule policies, run side by side (fifo first: the baseline)")
    ap.add_argument("--link", default="10mbit", help="each server's paced L3 link")
    ap.add_argument("--doc-pages", type=lambda v: [int(x) for x in v.split(",")], default=[1, 1, 1, 2, 4, 12],
                    help="document sizes in pages, one drawn uniformly per request")
    ap.add_argument("--utilizations", type=lambda v: [float(x) for x in v.split(",")], default=[0.6, 0.75, 0.9],
                    help="modelled link utilisations of the rate sweep (rate = rho / link time per request)")
    ap.add_argument("--requests", type=int, default=24, help="requests per run")
    ap.add_argument("--reps", type=int, default=3, help="runs at the chosen rate (the sweep's run there counts)")
    ap.add_argument("--warmup", type=int, default=10, help="L3 reads per server before the runs (cost-model refit)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--max-slots", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--l3-timeout", type=float, default=60.0, help="--prefix-cache-l3-timeout")
    ap.add_argument("--serve-pools", type=int, default=None, help=argparse.SUPPRESS)  # the pool process
    ap.add_argument("--docs-file", default=None, help=argparse.SUPPRESS)  # its documents
    add_seed_arg(ap)
    add_out_arg(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.serve_pools is not None:
        serve_pools(args.serve_pools, args.link, "8GiB", args.model, args.docs_file)
        return 0
    if "fifo" not in args.policies:
        ap.error("--policies must include fifo (the baseline)")
    if max(args.doc_pages) * PAGE + len(QUESTION) + args.max_tokens > args.max_model_len:
        ap.error(f"--max-model-len {args.max_model_len} is too small for {max(args.doc_pages)}-page documents")
    args.policies = ["fifo"] + [p for p in args.policies if p != "fifo"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_info()}; uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}",
          flush=True)
    t0 = time.perf_counter()
    rows, summ = compare(args)
    summ.update(wall_s=time.perf_counter() - t0, command="PYTHONPATH=. python experiments/prefix_serve_policies.py "
                + " ".join(sys.argv[1:]))
    (out / "prefix_serve_policies.json").write_text(json.dumps({"summary": summ, "rows": rows}, indent=2))
    write_csv(out / "prefix_serve_policies.csv", rows, fields=FIELDS)
    plot(rows, summ, out / "prefix_serve_policies.png")
    for p, r in summ["ratios"].items():
        print(f"{p:>5}/fifo at rho {summ['chosen_rho']} ({summ['chosen_rate']}/s): mean {r['mean']:.3f} "
              f"(min {r['min']:.3f}, max {r['max']:.3f}) over runs {summ['runs_at_chosen']}")
    print(f"wall {summ['wall_s']:.0f} s; load average now {os.getloadavg()}")
    return 0 if all(r["failed"] == 0 and r["answers_identical_to_fifo"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
