"""Cache-aware vs least-load routing: prefix hit rate and per-instance load over two instances.

Starts two `jkv serve --role all` instances (paged KV, prefix caching on) with a KV pool of
`--num-pages` pages, about two groups' system prompts plus the running requests' own pages, and
two routers in front of both: `--routing least-load` and `--routing cache-aware`. Each router gets
the same workload shape with its own system prompts (so nothing cached by the first run helps the
second): `--groups` prefix groups (a long system prompt each, ~`--system-words` words) x
`--per-group` chat requests with distinct questions, in one seeded shuffled order, at most
`--concurrency` in flight, streamed at temperature 0 with `--max-tokens` output tokens.

Reported per policy, from the instances' own counters (`jkv_prefix_cache_hit_tokens_total` /
`_query_tokens_total`, deltas over the run): the prefix hit rate; from the router: requests per
instance and what decided each choice (`jkv_router_routed_total{by}`); from the instances: prompt
tokens per instance. Load balance = max / min requests per instance (goal: <= 2). Hit rate ratio =
cache-aware / least-load (goal: >= 1.5). Hit rates do not depend on the machine's load; the mean
TTFT printed alongside does.

Why this regime: with two instances whose caches each hold every group, least-load routing also
hits on all but the first request of each group on each instance, and the policies differ only by
a few cold misses. The routing policy matters when the groups' working set exceeds one
instance's cache but fits the instances together; that is what `--num-pages` sets up.

    PYTHONPATH=. python experiments/prefix_route.py                      # SmolLM2, 4 groups x 8
    PYTHONPATH=. python experiments/prefix_route.py --smoke --out /tmp/route_smoke   # seconds, not figures
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.common import machine_info, write_csv  # noqa: E402
from experiments.prefix_serve import QUESTIONS, chat_stream, prefix_counters, prefix_parser, system_prompt  # noqa: E402
from experiments.serve_load import Server  # noqa: E402

POLICIES = ("least-load", "cache-aware")


def metric_sum(url: str, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


async def send_all(url: str, jobs: list[tuple[int, int]], args, offset: int) -> list[dict]:
    """Every (group, question) job as a streamed chat through `url`, at most --concurrency at once."""
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client, g: int, i: int) -> dict:
        msgs = [{"role": "system", "content": system_prompt(g + offset, args.system_words)},
                {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]
        async with gate:
            return await chat_stream(client, url, msgs, args.max_tokens)

    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10)) as client:
        return list(await asyncio.gather(*(one(client, g, i) for i, (g, _) in enumerate(jobs))))


def instance_state(instances: list[Server]) -> list[dict]:
    return [dict(prefix_counters(s.url), prompt_tokens=metric_sum(s.url, "jkv_prompt_tokens_total"))
            for s in instances]


def run_policy(policy: str, instances: list[Server], router: Server, args, offset: int) -> dict:
    jobs = [(g, k) for g in range(args.groups) for k in range(args.per_group)]
    random.Random(args.seed).shuffle(jobs)
    before = instance_state(instances)
    t0 = time.perf_counter()
    results = asyncio.run(send_all(router.url, jobs, args, offset))
    duration = time.perf_counter() - t0
    after = instance_state(instances)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits = sum(d["prefix_hit_tokens"] for d in delta)
    queried = sum(d["prefix_query_tokens"] for d in delta)
    requests = [metric_sum(router.url, "jkv_router_upstream_requests_total", {"upstream": s.url, "outcome": "ok"})
                for s in instances]
    ok = [r for r in results if r["ok"]]
    row = {"policy": policy, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "hit_tokens": hits, "query_tokens": queried, "hit_rate": hits / queried if queried else float("nan"),
           "requests_0": requests[0], "requests_1": requests[1],
           "load_ratio_requests": max(requests) / max(min(requests), 1),
           "prompt_tokens_0": delta[0]["prompt_tokens"], "prompt_tokens_1": delta[1]["prompt_tokens"],
           "load_ratio_prompt_tokens": max(d["prompt_tokens"] for d in delta) / max(min(d["prompt_tokens"]
                                                                                        for d in delta), 1),
           "hit_rate_0": delta[0]["prefix_hit_tokens"] / max(delta[0]["prefix_query_tokens"], 1),
           "hit_rate_1": delta[1]["prefix_hit_tokens"] / max(delta[1]["prefix_query_tokens"], 1),
           "mean_ttft_ms": 1e3 * sum(r["times"][0] for r in ok) / max(len(ok), 1)}
    for by in ("prefix", "cache_size", "load"):
        row[f"routed_by_{by}"] = metric_sum(router.url, "jkv_router_routed_total", {"kind": "all", "by": by})
    print(f"[{policy}] {row['completed']}/{len(jobs)} done in {duration:.1f}s: prefix hit rate {row['hit_rate']:.3f} "
          f"({hits:.0f} / {queried:.0f} tokens; per instance {row['hit_rate_0']:.3f} / {row['hit_rate_1']:.3f}), "
          f"requests {requests[0]:.0f} / {requests[1]:.0f}, prompt tokens {row['prompt_tokens_0']:.0f} / "
          f"{row['prompt_tokens_1']:.0f}, routed by prefix / cache_size / load {row['routed_by_prefix']:.0f} / "
          f"{row['routed_by_cache_size']:.0f} / {row['routed_by_load']:.0f}, mean TTFT {row['mean_ttft_ms']:.0f} ms",
          flush=True)
    return row


def main(argv=None):
    ap = prefix_parser(__doc__, "prefix_route.csv", groups=4, system_words=150, max_tokens=8, max_slots=2,
                       max_model_len=512)
    # the servers' KV pool, next to prefix_parser's --max-slots / --max-model-len; then the workload
    ap.add_argument("--num-pages", type=int, default=None,
                    help="each instance's KV pages (default: two groups' system prompts + --max-slots requests' "
                         "own pages + the null page, from a probe of the prompt length)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8, help="requests per group")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    args = ap.parse_args(argv)
    if args.smoke:
        args.per_group, args.system_words, args.max_tokens = 3, 60, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.num_pages is None:
        args.num_pages = default_num_pages(args)
    common = ["--model", args.model, "--served-model-name", "m", "--max-slots", str(args.max_slots),
              "--max-model-len", str(args.max_model_len), "--page-size", str(args.page_size),
              "--num-pages", str(args.num_pages)]
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both warm up at once
        futures = [pool.submit(Server, common, timeout=1200) for _ in range(2)]
    failed = [f.exception() for f in futures if f.exception()]
    if failed:  # stop the one that did start before reporting the one that did not
        for f in futures:
            if not f.exception():
                f.result().stop()
        raise failed[0]
    instances = [f.result() for f in futures]
    print(f"instances up in {time.perf_counter() - t:.1f}s at {[s.url for s in instances]} "
          f"({args.num_pages} pages of {args.page_size} tokens each)", flush=True)
    rows = []
    try:
        for n, policy in enumerate(POLICIES):
            router = Server(["--role", "router", "--routing", policy, "--health-interval", "1",
                             *[a for s in instances for a in ("--upstream", s.url)]])
            try:
                rows.append(run_policy(policy, instances, router, args, offset=1000 * (n + 1)))
            finally:
                router.stop()
    finally:
        for s in instances:
            s.stop()
    least, aware = rows
    ratio = aware["hit_rate"] / least["hit_rate"] if least["hit_rate"] else float("inf")
    info = machine_info()
    for r in rows:
        r.update(hit_rate_ratio=ratio, model=args.model, groups=args.groups, per_group=args.per_group,
                 system_words=args.system_words, concurrency=args.concurrency, max_tokens=args.max_tokens,
                 max_slots=args.max_slots, num_pages=args.num_pages, page_size=args.page_size, seed=args.seed,
                 **info)
    print(f"prefix hit rate cache-aware / least-load: {aware['hit_rate']:.3f} / {least['hit_rate']:.3f} = "
          f"{ratio:.2f}x (goal >= 1.5); max/min requests per instance {aware['load_ratio_requests']:.2f} "
          f"(least-load {least['load_ratio_requests']:.2f}; goal <= 2); cpu {info['cpu_model']} x{info['cores']}, "
          f"load average {info['loadavg_1m']}", flush=True)
    write_csv(out / args.csv, rows)
    print(f"wrote {out}/{args.csv}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def default_num_pages(args) -> int:
    """Two groups' system prompts (as the model's tokenizer and chat template read them) in full
    pages, plus each running request's own pages (question and output), plus the null page."""
    from models.loader import load_model, resolve_model_path
    from models.tokenizer import Tokenizer

    src = resolve_model_path(args.model)  # the tokenizer only: no weights for a token count
    tok = Tokenizer.from_hf_dir(src) if src.is_dir() else load_model(args.model).tokenizer
    system = {"role": "system", "content": system_prompt(0, args.system_words)}
    sys_tokens = len(tok.apply_chat_template([system], add_generation_prompt=False))
    full = len(tok.apply_chat_template([system, {"role": "user", "content": f"Question 0: {QUESTIONS[0]}"}]))
    shared = sys_tokens // args.page_size
    per_request = math.ceil((full + args.max_tokens) / args.page_size)
    pages = 2 * shared + args.max_slots * (per_request - shared) + 1
    print(f"system prompt {sys_tokens} tokens ({shared} full pages), request {full} + {args.max_tokens} tokens "
          f"({per_request} pages): --num-pages {pages}", flush=True)
    return pages


if __name__ == "__main__":
    sys.exit(main())
