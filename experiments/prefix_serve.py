"""Prefix caching through the real HTTP server: mean TTFT with vs without it, vLLM-style report.

Starts one `jkv serve --role all` (paged KV) with `--enable-prefix-caching true`, runs the
workload, stops it, then the same with `false`, and reports both side by side plus the ratio of
mean TTFTs (with / without; < 1 means prefix caching helps). The workload, streamed
/v1/chat/completions at temperature 0 with a fixed output length (ignore_eos):

- shared system prompt: `--groups` long system prompts (~`--system-words` words each), each asked
  `--users` different short questions; requests arrive as Poisson at `--rate`;
- multi-turn: `--conversations` chats of `--turns` turns each under one system prompt, each turn's
  request carrying the whole history (the server's own earlier answers), turns of one chat in
  order, chats concurrent (started as Poisson at `--rate`).

Both modes send the same requests in the same order (greedy answers are identical with and
without prefix caching, so the histories match); a warm-up pass per server compiles the prompt
buckets with different system prompts before the timed run. The server's own
`jkv_prefix_cache_hit_tokens_total` and `_query_tokens_total` are read after each run. Writes
`prefix_serve_<mode>.json` and one CSV (`--csv`, default prefix_serve.csv) under `--out`, with the
CPU model, core count and load average (absolute times on a shared CPU only compare side by
side within one run).

    PYTHONPATH=. python experiments/prefix_serve.py --groups 4 --users 6 --conversations 4 --turns 4
    PYTHONPATH=. python experiments/prefix_serve.py --smoke --out /tmp/prefix_smoke   # seconds, not figures

`--disaggregation MODE` measures prefix reuse across the prefill/decode split instead: the
multi-turn chats, one turn at a time, through `--role all --disaggregation MODE` with and without
prefix caching; per follow-up turn the server's `jkv_kv_transfer_bytes_total` (proactive,
speculative, on demand) against the KV of the turn's uncached tokens and of its whole prompt.

With `--policies fifo,sjf,srpt,...` it runs experiments/prefix_serve_policies.py instead (its
defaults, with this script's --model, --seed and --out): `jkv serve --schedule` policies side by
side against FIFO with every prefix in L3 behind a paced link, at the highest rate FIFO sustains:

    PYTHONPATH=. python experiments/prefix_serve.py --policies fifo,sjf,srpt
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.common import RESULTS, add_model_arg, add_out_arg, add_seed_arg, machine_info, write_csv  # noqa: E402
from experiments.serve_load import stream_request  # noqa: E402
from experiments.serve_load import Server, print_report, summarize  # noqa: E402

TOPICS = ["a paged KV cache", "continuous batching", "speculative decoding", "tensor parallelism",
          "prefix caching", "chunked prefill", "quantized attention", "request scheduling"]
QUESTIONS = ["What is it?", "Why does it matter?", "Give one example.", "What does it cost?", "When is it wrong?",
             "Name a trade-off.", "How is it measured?", "Summarize it in five words."]


def system_prompt(i: int, words: int) -> str:
    """A long, distinct system prompt per group (its leading pages differ from the first token on)."""
    topic = TOPICS[i % len(TOPICS)]
    body = " ".join(f"Rule {k + 1} for group {i}: when asked about {topic}, answer plainly and cite the "
                    f"part of the system that implements it." for k in range(max(1, words // 20)))
    return f"Group {i}. You are an expert on {topic}. {body}"


async def chat_stream(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: per-content-chunk times, the answer text and usage."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return await stream_request(client, url, "/v1/chat/completions", body,
                                lambda choice: choice["delta"].get("content"))


async def shared_system(client, url, args, rng: random.Random, offset: int = 0) -> list[dict]:
    """groups x users single-turn requests, Poisson arrivals, groups interleaved."""
    jobs = [(g, u) for u in range(args.users) for g in range(args.groups)]
    tasks = []
    for g, u in jobs:
        msgs = [{"role": "system", "content": system_prompt(g + offset, args.system_words)},
                {"role": "user", "content": f"About {TOPICS[(g + offset) % len(TOPICS)]}: {QUESTIONS[u % len(QUESTIONS)]}"}]
        tasks.append(asyncio.create_task(chat_stream(client, url, msgs, args.max_tokens)))
        await asyncio.sleep(rng.expovariate(args.rate))
    return list(await asyncio.gather(*tasks))


async def multi_turn(client, url, args, rng: random.Random, offset: int = 0) -> list[dict]:
    """conversations x turns; each turn carries the history, turns of one chat run in order."""

    async def conversation(c: int, delay: float) -> list[dict]:
        await asyncio.sleep(delay)
        msgs = [{"role": "system", "content": system_prompt(100 + c + offset, args.system_words // 2)}]
        out = []
        for t in range(args.turns):
            msgs.append({"role": "user", "content": f"Turn {t + 1}: {QUESTIONS[(c + t) % len(QUESTIONS)]}"})
            r = await chat_stream(client, url, list(msgs), args.max_tokens)
            out.append(r)
            if not r["ok"]:
                break
            msgs.append({"role": "assistant", "content": r["text"]})
        return out

    starts, t = [], 0.0
    for _ in range(args.conversations):
        starts.append(t)
        t += rng.expovariate(args.rate)
    chats = await asyncio.gather(*(conversation(c, s) for c, s in enumerate(starts)))
    return [r for chat in chats for r in chat]


KV_WIRE_PATHS = ("proactive", "speculative", "on_demand")  # KV rows on the wire (metadata apart)


def prefix_counters(url: str) -> dict:
    """The server's prefix-cache counters and, on a disaggregated server, its KV bytes by path."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"prefix_hit_tokens": 0.0, "prefix_query_tokens": 0.0, "kv_bytes": 0.0, "metadata_bytes": 0.0}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "jkv_prefix_cache_hit_tokens_total":
                out["prefix_hit_tokens"] += s.value
            elif s.name == "jkv_prefix_cache_query_tokens_total":
                out["prefix_query_tokens"] += s.value
            elif s.name == "jkv_kv_transfer_bytes_total" and s.labels.get("path") in KV_WIRE_PATHS:
                out["kv_bytes"] += s.value
            elif s.name == "jkv_kv_transfer_bytes_total" and s.labels.get("path") == "metadata":
                out["metadata_bytes"] += s.value
    return out


def kv_row_bytes(model: str) -> int:
    """KV bytes of one token on the SmartGen wire (f32 K and V rows of every layer and KV head)."""
    from models import load_model_spec

    cfg = load_model_spec(model).cfg
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def disagg_follow_ups(args, enabled: bool) -> dict:
    """--role all --disaggregation MODE: the chats one turn at a time (so the server's byte counters
    split by turn); per follow-up turn, the KV bytes that crossed vs the KV of its uncached tokens
    (prompt - prefix hit) and of its whole prompt (the conversation so far)."""
    mode = "on" if enabled else "off"
    server = Server(["--model", args.model, "--served-model-name", "m", "--max-slots", str(args.max_slots),
                     "--max-model-len", str(args.max_model_len), "--enable-prefix-caching", str(enabled).lower(),
                     "--disaggregation", args.disaggregation, "--num-prefill-workers", "1",
                     "--selector", args.selector, "--strategy", "sequential", "--kr-fraction", "0.3"])
    row = kv_row_bytes(args.model)
    turns = []

    async def one(client, msgs):
        before = prefix_counters(server.url)
        r = await chat_stream(client, server.url, list(msgs), args.max_tokens)
        after = prefix_counters(server.url)
        for _ in range(50):  # a request's bytes are counted when it completes, just after its last chunk
            await asyncio.sleep(0.1)
            after, settled = prefix_counters(server.url), after
            if after == settled and after["kv_bytes"] > before["kv_bytes"]:
                break
        turns.append(dict(ok=r["ok"], prompt_tokens=r.get("prompt_tokens", 0), text=r.get("text"),
                          **{k: after[k] - before[k] for k in after}))
        return r

    async def chats():
        async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10)) as client:
            for c in range(args.conversations):
                msgs = [{"role": "system", "content": system_prompt(100 + c, args.system_words // 2)}]
                for t in range(args.turns):
                    msgs.append({"role": "user", "content": f"Turn {t + 1}: {QUESTIONS[(c + t) % len(QUESTIONS)]}"})
                    r = await one(client, msgs)
                    turns[-1]["turn"] = t
                    if not r["ok"]:
                        return
                    msgs.append({"role": "assistant", "content": r["text"]})

    try:
        asyncio.run(chats())
    finally:
        server.stop()
    follow = [t for t in turns if t["turn"] > 0 and t["ok"]]
    new_kv = sum((t["prompt_tokens"] - t["prefix_hit_tokens"]) * row for t in follow)
    whole_kv = sum(t["prompt_tokens"] * row for t in follow)
    moved = sum(t["kv_bytes"] for t in follow)
    out = dict(prefix_caching=mode, disaggregation=args.disaggregation, follow_up_turns=len(follow),
               failed=sum(not t["ok"] for t in turns), follow_up_kv_bytes=moved, follow_up_new_kv_bytes=new_kv,
               follow_up_whole_kv_bytes=whole_kv, follow_up_metadata_bytes=sum(t["metadata_bytes"] for t in follow),
               kv_over_new=moved / new_kv if new_kv else float("nan"),
               kv_over_whole=moved / whole_kv if whole_kv else float("nan"), turns=turns, **machine_info())
    print(f"[disaggregated {args.disaggregation}, prefix caching {mode}] follow-up turns {len(follow)}: KV moved "
          f"{moved:.0f} B = {out['kv_over_new']:.3f}x their uncached tokens' KV, {out['kv_over_whole']:.3f}x the "
          f"whole conversations' (+ {out['follow_up_metadata_bytes']:.0f} B selector metadata)", flush=True)
    return out


async def workload(url: str, args, seed: int, offset: int = 0) -> tuple[list[dict], list[dict], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10)) as client:
        t0 = time.perf_counter()
        shared = await shared_system(client, url, args, random.Random(seed), offset)
        turns = await multi_turn(client, url, args, random.Random(seed + 1), offset)
        return shared, turns, time.perf_counter() - t0


def run_mode(args, enabled: bool) -> dict:
    mode = "on" if enabled else "off"
    common = ["--model", args.model, "--served-model-name", "m", "--max-slots", str(args.max_slots),
              "--max-model-len", str(args.max_model_len), "--enable-prefix-caching", str(enabled).lower()]
    t = time.perf_counter()
    server = Server(common)
    print(f"[prefix caching {mode}] server up in {time.perf_counter() - t:.1f}s at {server.url}", flush=True)
    try:
        # warm-up: the same shapes with other system prompts (offset), so the timed run's prefixes are new
        asyncio.run(workload(server.url, args, args.seed + 7, offset=50))
        before = prefix_counters(server.url)
        shared, turns, duration = asyncio.run(workload(server.url, args, args.seed))
        after = prefix_counters(server.url)
    finally:
        server.stop()
    s = summarize(shared + turns, duration)
    s.update({k: after[k] - before[k] for k in after})
    for name, part in (("shared_system", shared), ("multi_turn", turns)):
        ok = [r for r in part if r["ok"]]
        s[f"mean_ttft_ms_{name}"] = 1e3 * sum(r["times"][0] for r in ok) / max(len(ok), 1)
    s["answers"] = [r.get("text") for r in shared + turns]
    s.update(prefix_caching=mode, model=args.model, max_tokens=args.max_tokens, groups=args.groups,
             users=args.users, conversations=args.conversations, turns=args.turns, rate=args.rate,
             max_slots=args.max_slots, **machine_info())
    print_report(f"Prefix caching {mode}", s)
    print(f"{'Prefix hit tokens / queried:':<40}{s['prefix_hit_tokens']:.0f} / {s['prefix_query_tokens']:.0f}")
    return s


def prefix_parser(description: str, csv: str, *, groups: int, system_words: int, max_tokens: int, max_slots: int,
                  max_model_len: int) -> argparse.ArgumentParser:
    """The flags this script and prefix_route.py share (model, workload, server size, --smoke,
    --seed, --out, --csv), with each script's defaults; the caller adds its own."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--groups", type=int, default=groups, help="prefix groups (one shared system prompt each)")
    ap.add_argument("--system-words", type=int, default=system_words, help="approximate words per system prompt")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens per request (ignore_eos)")
    ap.add_argument("--max-slots", type=int, default=max_slots, help="each server's --max-slots")
    ap.add_argument("--max-model-len", type=int, default=max_model_len)
    ap.add_argument("--smoke", action="store_true", help="a tiny workload to check the script runs (no figures)")
    ap.add_argument("--disaggregation", default=None, metavar="MODE",
                    help="instead: multi-turn chats through `--role all --disaggregation MODE` (full, partial, "
                         "+profile, +parallel, smartgen), KV bytes of the follow-up turns with / without prefix caching")
    ap.add_argument("--selector", default="infinigen", help="with --disaggregation: the sparse-attention selector")
    add_seed_arg(ap)
    add_out_arg(ap, RESULTS)
    ap.add_argument("--csv", default=csv, help="summary CSV name under --out")
    return ap


def main(argv=None):
    ap = prefix_parser(__doc__, "prefix_serve.csv", groups=4, system_words=300, max_tokens=24, max_slots=8,
                       max_model_len=2048)
    ap.add_argument("--users", type=int, default=6, help="questions per system prompt")
    ap.add_argument("--conversations", type=int, default=4, help="multi-turn chats")
    ap.add_argument("--turns", type=int, default=4, help="turns per chat")
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    ap.add_argument("--policies", default=None,
                    help="run experiments/prefix_serve_policies.py with these --schedule policies instead "
                         "(e.g. fifo,sjf,srpt)")
    args = ap.parse_args(argv)
    if args.policies is not None:
        return run_policies(args)
    if args.smoke:
        args.groups, args.users, args.conversations, args.turns = 2, 2, 1, 2
        args.system_words, args.max_tokens, args.rate, args.max_model_len = 60, 4, 20.0, 512
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.disaggregation:
        rows = [disagg_follow_ups(args, enabled) for enabled in (True, False)]
        same = [t["text"] for t in rows[0]["turns"]] == [t["text"] for t in rows[1]["turns"]]
        print(f"answers identical with and without prefix caching: {same}")
        for s in rows:
            s["answers_identical"] = same
            (out / f"prefix_serve_disagg_{args.disaggregation}_{s['prefix_caching']}.json").write_text(json.dumps(s, indent=2))
        write_csv(out / f"prefix_serve_disagg_{args.disaggregation}.csv", [{k: v for k, v in s.items() if k != "turns"}
                                                                           for s in rows])
        return 0 if same and all(s["failed"] == 0 for s in rows) else 1
    rows = [run_mode(args, enabled) for enabled in (True, False)]
    on, off = rows
    same = on["answers"] == off["answers"]
    ratio = on["mean_ttft_ms"] / off["mean_ttft_ms"] if off["mean_ttft_ms"] else float("nan")
    for s in rows:
        s.update(ttft_ratio_on_off=ratio, answers_identical=same)
        (out / f"prefix_serve_{s['prefix_caching']}.json").write_text(json.dumps(s, indent=2))
    print(f"mean TTFT with / without prefix caching: {on['mean_ttft_ms']:.1f} / {off['mean_ttft_ms']:.1f} ms "
          f"= {ratio:.3f}x (shared system prompt {on['mean_ttft_ms_shared_system']:.1f} / "
          f"{off['mean_ttft_ms_shared_system']:.1f}, multi-turn {on['mean_ttft_ms_multi_turn']:.1f} / "
          f"{off['mean_ttft_ms_multi_turn']:.1f}); answers identical: {same}; "
          f"cpu {on['cpu_model']} x{on['cores']}, load average {on['loadavg_1m']} / {off['loadavg_1m']}")
    keys = ["prefix_caching", "completed", "failed", "duration_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_ttft_ms_shared_system", "mean_ttft_ms_multi_turn", "mean_tpot_ms", "mean_e2el_ms",
            "prefix_hit_tokens", "prefix_query_tokens", "ttft_ratio_on_off", "answers_identical", "total_input_tokens",
            "total_output_tokens", "model", "groups", "users", "conversations", "turns", "rate", "max_tokens",
            "cpu_model", "vector_extensions", "cores", "loadavg_1m"]
    write_csv(out / args.csv, rows, fields=keys)
    print(f"wrote {out}/{args.csv} and 2 JSON files")
    return 0 if same and all(r["failed"] == 0 for r in rows) else 1


def run_policies(args) -> int:
    from experiments.prefix_serve_policies import main as policies_main

    return policies_main(["--policies", args.policies, "--model", args.model, "--seed", str(args.seed),
                          "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
