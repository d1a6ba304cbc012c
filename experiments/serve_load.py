"""Load test of `jkv serve`: Poisson arrivals at several rates, vLLM benchmark_serving-style report.

Starts the servers itself on loopback (free ports): target `all` is one `--role all` server;
target `router` is a `--role router` in front of two `--role all` upstreams; target `disagg` is
the disaggregated SmartGen setup — two `--role prefill` servers (paced links, `--link`) and one
`--role decode` server (mode smartgen) behind `--role router --prefill ... --decode ...`; the
selector is built once here and shipped to every role as a file (they must share it). For each target and
rate it sends `--num-prompts` streaming /v1/completions requests (short prompts, fixed output
length via ignore_eos) with exponential inter-arrival gaps, and measures per request:
TTFT (first content chunk), TTST (second chunk), TBT (gaps after the second chunk, DESIGN.md
"Metrics"), e2e; then prints a vLLM-style block and writes
experiments/results/serve_load_<target>_r<rate>.json plus one summary CSV row per run.

    python experiments/serve_load.py --model smollm2-135m-instruct --rates 0.5 1 --num-prompts 12
    python experiments/serve_load.py --targets all disagg --rates 0.25 0.5 1

Both `all` and the disaggregated decode worker batch continuously (a request joins the running
decode batch at a step boundary; disaggregated: once its prefill hand-off arrives).

Absolute numbers on a shared CPU machine are only comparable side by side within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.common import RESULTS, add_model_arg, add_out_arg, add_seed_arg, write_csv  # noqa: E402

log = logging.getLogger("serve_load")

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the ocean:",
    "List three primary colors:",
    "Explain what a KV cache is in one sentence:",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The most important idea in computer science is",
]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (and its reaped children), from /proc; nan
    where /proc is missing. A process's own cost, which the load of the box moves less than its
    wall-clock figures."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


LIVE: set[subprocess.Popen] = set()  # server processes started here and not stopped yet (stop_all's list)


def stop_process(proc: subprocess.Popen, grace: float = 60.0):
    """SIGTERM, then SIGKILL after `grace` seconds; forgets it in LIVE."""
    LIVE.discard(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_all():
    """Stop every server process started here: a script's SIGTERM handler calls it, so no server
    outlives the script (Python runs no `finally` on SIGTERM by itself)."""
    for proc in list(LIVE):
        stop_process(proc, grace=10.0)


def wait_for_start(name: str, proc: subprocess.Popen, up, timeout: float, last_line, progress_s: float = 30.0) -> float:
    """Wait until `up(seconds)` (which may block that long) says the server `proc` serves; returns
    the seconds it took. Every `progress_s` seconds one log line says how long it has run, its CPU
    seconds and `last_line()` (its newest log line), so a start-up of minutes (a jkv server compiles
    every program it serves) shows progress and a stuck one (CPU seconds not rising) shows as such.
    Raises RuntimeError if `proc` exits or `timeout` passes first; the caller stops the process."""
    t0 = time.monotonic()
    next_note = t0 + progress_s
    while not up(max(0.0, min(1.0, t0 + timeout - time.monotonic()))):
        now = time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} while starting; last line: {last_line()}")
        if now >= t0 + timeout:
            raise RuntimeError(f"{name} did not start within {timeout:.0f}s (--start-timeout); last line: {last_line()}")
        if now >= next_note:
            next_note = now + progress_s
            log.info("%s (pid %d): starting for %.0fs, %.0f CPU-s so far; last line: %s", name, proc.pid, now - t0,
                     process_cpu_seconds(proc.pid), last_line())
    took = time.monotonic() - t0
    log.info("%s (pid %d) up after %.0fs, %.0f CPU-s", name, proc.pid, took, process_cpu_seconds(proc.pid))
    return took


class Server:
    """`jkv serve --port 0 ARGS` on loopback; returns once it prints its listening line (`url`),
    logging progress while it starts (`wait_for_start`). Raises RuntimeError with the server's last
    log lines if it exits or is not up within `timeout` seconds."""

    def __init__(self, args: list[str], timeout: float = 300, env: dict | None = None, name: str = "jkv serve",
                 progress_s: float = 30.0):
        env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "jkv.cli", "serve", "--port", "0", *args], cwd=REPO,
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        LIVE.add(self.proc)
        self.url, ready, self.log = None, threading.Event(), []

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                if "listening on http://" in line:
                    self.url = line.split("listening on ")[1].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            self.start_s = wait_for_start(name, self.proc, lambda s: ready.wait(s) and self.url is not None, timeout,
                                          lambda: self.log[-1].strip() if self.log else "(none yet)", progress_s)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}\n" + "".join(self.log[-30:])) from None
        self.start_cpu_s = process_cpu_seconds(self.proc.pid)  # its start-up's cost (load, compiles, warm-up)

    def stop(self):
        stop_process(self.proc)


async def stream_request(client: httpx.AsyncClient, url: str, path: str, body: dict, piece) -> dict:
    """One streamed OpenAI request: per-chunk times of the chunks `piece(choice)` finds text in,
    the text and usage (the shared reader of serve_load and prefix_serve)."""
    t0 = time.perf_counter()
    times, text, usage, error = [], [], None, None
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]["message"]
                elif obj.get("usage"):
                    usage = obj["usage"]
                elif obj["choices"] and piece(obj["choices"][0]):
                    times.append(time.perf_counter() - t0)
                    text.append(piece(obj["choices"][0]))
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if error or not times or usage is None:
        return {"ok": False, "error": error or "no tokens / no usage"}
    return {"ok": True, "times": times, "e2e": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return await stream_request(client, url, "/v1/completions", body, lambda choice: choice["text"])


async def run_load(url: str, model: str, rate: float, n: int, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            tasks.append(asyncio.create_task(one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: np.asarray(xs, float) * 1e3  # noqa: E731
    ttft = ms([r["times"][0] for r in ok])
    ttst = ms([r["times"][1] for r in ok if len(r["times"]) > 1])
    tbt = ms([b - a for r in ok for a, b in zip(r["times"][1:], r["times"][2:])])  # excludes the second token
    tpot = ms([(r["e2e"] - r["times"][0]) / max(r["output_tokens"] - 1, 1) for r in ok])
    e2e = ms([r["e2e"] for r in ok])
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "total_input_tokens": sum(r["prompt_tokens"] for r in ok),
           "total_output_tokens": sum(r["output_tokens"] for r in ok)}
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    for name, xs in (("ttft", ttft), ("ttst", ttst), ("tpot", tpot), ("tbt", tbt), ("e2el", e2e)):
        xs = xs if len(xs) else np.zeros(1)
        out[f"mean_{name}_ms"] = float(xs.mean())
        out[f"median_{name}_ms"] = float(np.median(xs))
        out[f"p99_{name}_ms"] = float(np.percentile(xs, 99))
    out["errors"] = sorted({r["error"] for r in results if not r["ok"]})[:5]
    return out


def print_report(title: str, s: dict):
    w = 50
    print(f"{' ' + title + ' ':=^{w}}")
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, v in rows:
        print(f"{label:<40}{v:<10}")
    for name, head in (("ttft", "Time to First Token"), ("ttst", "Time to Second Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("tbt", "Time Between Tokens (excl. 1st, 2nd)"), ("e2el", "End-to-end Latency")):
        print(f"{head:-^{w}}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{label + ' ' + name.upper() + ' (ms):':<40}{s[f'{stat}_{name}_ms']:<10.2f}")
    print("=" * w)


def start_disaggregated(args, common, out: Path) -> list[Server]:
    """2 x --role prefill, 1 x --role decode (smartgen), router --prefill --decode (last in the list)."""
    import secrets

    from jkv.disagg.selectors import build_selector, save_selector
    from models import load_model

    import tempfile

    path = Path(tempfile.mkdtemp(prefix="jkv-serve-load-")) / f"selector_{args.selector}.pkl"
    save_selector(build_selector(load_model(args.model), args.selector), path)
    env = {"JKV_SECRET": secrets.token_hex(16)}
    shared = ["--selector-file", str(path), "--transport", "tcp"]
    started: list[Server] = []
    try:
        box: list = [None, None]
        threads = [threading.Thread(target=lambda i=i: box.__setitem__(i, Server(
            ["--role", "prefill", "--model", args.model, *shared, "--bandwidth", args.link,
             "--worker-name", f"prefill-{i}"], env=env))) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        started += [p for p in box if p is not None]
        if len(started) != 2:
            raise RuntimeError("a prefill server did not start")
        addrs = [httpx.get(p.url + "/health").json()["transport_address"] for p in started]
        started.append(Server([*common, "--role", "decode", *shared, "--disaggregation", "smartgen", "--strategy",
                               "streaming", "--kr-fraction", str(args.kr_fraction), "--bandwidth", args.link,
                               "--max-blocks", "64", *[a for x in addrs for a in ("--prefill-worker", x)]], env=env))
        started.append(Server(["--role", "router", "--health-interval", "1",
                               *[a for p in started[:2] for a in ("--prefill", p.url)], "--decode", started[2].url]))
        return started
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise


def kv_metrics(servers: list[Server]) -> dict:
    """KV-transfer counters of the decode server and prefill request counts (cumulative, incl. warm-up)."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(url):
        out = {}
        for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for smp in fam.samples:
                key = smp.name + "".join(f",{k}={v}" for k, v in sorted(smp.labels.items()))
                out[key] = smp.value
        return out

    d = samples(servers[2].url)
    res = {f"kv_bytes_{p}": d.get(f"jkv_kv_transfer_bytes_total,path={p},role=decode", 0.0)
           for p in ("proactive", "speculative", "on_demand")}
    n = d.get("jkv_kv_on_demand_ratio_count", 0.0)
    res["mean_on_demand_ratio"] = d.get("jkv_kv_on_demand_ratio_sum", 0.0) / n if n else 0.0
    res["kv_transfer_failures"] = d.get("jkv_kv_transfer_failures_total,role=decode", 0.0)
    res["decode_batches"] = d.get("jkv_decode_batches_total", 0.0)
    for i, p in enumerate(servers[:2]):
        res[f"prefill{i}_requests"] = samples(p.url).get("jkv_prefill_requests_total,outcome=prefilled", 0.0)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0], help="request rates (req/s, Poisson)")
    ap.add_argument("--num-prompts", type=int, default=12, help="requests per (target, rate)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    ap.add_argument("--targets", nargs="+", default=["all", "router", "disagg"], choices=["all", "router", "disagg"])
    ap.add_argument("--selector", default="infinigen", help="disagg: sparse-attention selector")
    ap.add_argument("--link", default="1gbit", help="disagg: paced link of each prefill worker")
    ap.add_argument("--kr-fraction", type=float, default=0.3, help="disagg: proactive share of the KV blocks")
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    add_seed_arg(ap)
    add_out_arg(ap, RESULTS)
    ap.add_argument("--csv", default=None, help="summary CSV name under --out (default serve_load.csv)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--model", args.model, "--served-model-name", "m", "--max-slots", str(args.max_slots),
              "--max-model-len", str(args.max_model_len)]
    rows = []
    for target in args.targets:
        t = time.perf_counter()
        if target == "disagg":
            servers = start_disaggregated(args, common, out)
        else:
            servers = [Server(common)] if target == "all" else [Server(common), Server(common)]
        if target == "router":
            ups = [a for s in servers for a in ("--upstream", s.url)]
            servers.append(Server(["--role", "router", "--health-interval", "1", *ups]))
        url = servers[-1].url
        print(f"[{target}] servers up in {time.perf_counter() - t:.1f}s at {url}", flush=True)
        try:
            # warm every prompt-length bucket on every upstream outside the timed runs
            asyncio.run(run_load(url, "m", 100.0, 2 * len(PROMPTS), 2, seed=1))
            if target == "disagg":  # compile the small running-set sizes low rates produce
                for b in range(1, 5):
                    asyncio.run(run_load(url, "m", 1000.0, b, 3, seed=b))
            for rate in args.rates:
                results, duration = asyncio.run(run_load(url, "m", rate, args.num_prompts, args.max_tokens,
                                                         args.seed))
                s = summarize(results, duration)
                s.update(target=target, request_rate=rate, model=args.model, max_tokens=args.max_tokens,
                         num_prompts=args.num_prompts, max_slots=args.max_slots)
                if target == "disagg":
                    s.update(kv_metrics(servers), link=args.link, selector=args.selector,
                             kr_fraction=args.kr_fraction)
                print_report(f"Serving Benchmark Result: {target}, {rate} req/s", s)
                (out / f"serve_load_{target}_r{rate:g}.json").write_text(json.dumps(s, indent=2))
                rows.append(s)
        finally:
            for s in reversed(servers):
                s.stop()
    keys = ["target", "request_rate", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_ttst_ms", "median_ttst_ms", "p99_ttst_ms",
            "mean_tbt_ms", "median_tbt_ms", "p99_tbt_ms", "mean_e2el_ms", "mean_on_demand_ratio", "kv_bytes_proactive",
            "kv_bytes_speculative", "kv_bytes_on_demand", "decode_batches", "prefill0_requests", "prefill1_requests"]
    csv_name = "serve_load.csv" if args.csv is None else args.csv
    write_csv(out / csv_name, rows, fields=keys)
    print(f"wrote {out}/{csv_name} and {len(rows)} JSON files")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
