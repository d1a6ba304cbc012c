"""Cache-aware routing end to end: a `--routing least-load` and a `--routing cache-aware` router over
the same two `--role all` instances (tiny checkpoint, prefix caching on, a KV pool of 16 usable
pages: about two groups' system prompts), 4 prefix groups x 6 chat requests in a seeded shuffled
order, one at a time. Least load alternates the instances, so every instance sees every group and
its small cache keeps evicting them; cache-aware routing keeps each group on one instance. The
prefix hit rate comes from the instances' own prefix-cache counters."""
import random
import signal

import httpx
import openai
import pytest

from conftest import ServerProcess, metric, wait_idle
from tiny_ckpt import CORPUS

GROUPS, PER_GROUP = 4, 6
INSTANCE = ["--served-model-name", "tiny", "--port", "0", "--max-slots", "2", "--max-model-len", "256",
            "--num-pages", "17"]


@pytest.fixture(scope="module")
def instances(tiny_dir, cache_env):
    procs = [ServerProcess(["--model", str(tiny_dir), *INSTANCE], env=cache_env, wait=False, ready_timeout=600)
             for _ in range(2)]  # two start-ups at once on a loaded box
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def start_router(instances, policy: str) -> ServerProcess:
    return ServerProcess(["--role", "router", "--port", "0", "--routing", policy, "--health-interval", "0.5",
                          *[a for s in instances for a in ("--upstream", s.url)]])


def system_prompt(group: int) -> str:
    """~100 tiny-tokenizer tokens (6 pages), distinct from the first page on."""
    words = " ".join(CORPUS[(group + i) % 3] for i in range(3))
    return f"group {group} rules: {words} ({group})"


def counters(instances) -> list[tuple[float, float]]:
    return [(metric(s.url, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"}),
             metric(s.url, "jkv_prefix_cache_query_tokens_total")) for s in instances]


def run(router: ServerProcess, instances, first_group: int) -> dict:
    """Send the workload through `router`; hit rate and per-instance request counts of this run."""
    order = [g for g in range(GROUPS) for _ in range(PER_GROUP)]
    random.Random(0).shuffle(order)
    before = counters(instances)
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i, g in enumerate(order):
        msgs = [{"role": "system", "content": system_prompt(first_group + g)},
                {"role": "user", "content": f"question {i} about the fox"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
    after = counters(instances)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queried = sum(a[1] - b[1] for a, b in zip(after, before))
    per = [metric(router.url, "jkv_router_upstream_requests_total", {"upstream": s.url, "outcome": "ok"})
           for s in instances]
    assert sum(per) == len(order) and queried > 0
    return {"hit_rate": hits / queried, "requests": per}


def test_cache_aware_routing_beats_least_load_on_prefix_hits_with_balanced_load(instances):
    least = start_router(instances, "least-load")
    aware = start_router(instances, "cache-aware")
    try:
        base = run(least, instances, first_group=0)
        got = run(aware, instances, first_group=10)  # new prefixes: nothing of the first run helps
        routed = {by: metric(aware.url, "jkv_router_routed_total", {"kind": "all", "by": by})
                  for by in ("prefix", "cache_size", "load")}
        assert metric(least.url, "jkv_router_routed_total", {"by": "load"}) == GROUPS * PER_GROUP
        assert "cache-aware (prefix chunks of 64 characters" in "".join(aware.log)
        assert routed["cache_size"] == GROUPS and routed["prefix"] == GROUPS * (PER_GROUP - 1), routed
        assert sorted(got["requests"]) == [2 * PER_GROUP, 2 * PER_GROUP]  # two groups on each instance
        assert max(base["requests"]) <= 2 * min(base["requests"])
        assert got["hit_rate"] > 1.5 * base["hit_rate"], (got, base)
        records = [metric(aware.url, "jkv_router_prefix_record_chunks", {"upstream": s.url}) for s in instances]
        assert all(n > 0 for n in records), records
        for s in instances:
            assert wait_idle(s.url) == (0, 0)
        assert httpx.get(aware.url + "/health").json()["status"] == "ok"
    finally:
        assert least.stop() == 0 and aware.stop() == 0
