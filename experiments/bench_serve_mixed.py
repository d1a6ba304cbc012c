"""Mixed prompt lengths through `jkv serve`: the paged KV cache with chunked prefill vs the per-slot
batcher (`--kv-layout slots`), optionally vs `transformers serve --continuous-batching`, side by
side in one run.

Each target is a real HTTP server on loopback, all started side by side first (a jkv server
compiles every decode program at start-up: minutes of one core; each logs its progress every
30 s, and its programs go to a persistent XLA cache, `--xla-cache`, so a second run loads them),
then measured in turn, the order alternating between repeats. One pass sends streaming
/v1/completions requests, one per `--prompt-lens` entry (default 8 prompts of 64 to 4,096 tokens
of real English text, 64 output tokens each): all but the longest start together; the longest
starts once every other one streams, so its prefill lands in the middle of running decodes. Per pass:

  output tok/s       generated tokens / (last token - first request sent)
  TTFT               mean and p99 over the requests; the longest prompt's own TTFT
  TBT                p99 of the gaps after each request's second token (DESIGN.md "Metrics")
  TBT during admit   p99 and max of the other streams' gaps that overlap the window from the long
                     request's send to its first token (the stall a long prefill causes)

With `--concurrency 1 8`, steady passes follow: `--steady-requests` (24) prompts evenly spread
over 105-951 tokens, 48 output tokens each, at most N in flight (a new request as one ends): the
issue's comparison with `transformers serve` at concurrency 1 and 8 (its output tok/s, TTFT, TBT).

jkv gets token ids (every jkv target sees identical prompts); transformers gets their text (its
tokenizer built from the GGUF splits digits differently, so its prompt lengths differ a little; its
`usage` is recorded) and `eos_token_id: -1` as its ignore_eos. Before the timed passes prompts of
every length go through each target once, each stream closed after its second token (jkv compiles
its prefill shapes there); every pass gets new text of the same lengths (a prompt seen before would
be a prefix-cache hit on the paged server). Writes experiments/results/bench_serve_mixed.csv (one row per target, pass
and repeat, with each server's CPU seconds during the pass, its start-up seconds and CPU seconds,
the XLA programs it compiled during the pass (`compiles`: should be 0; a compile stalls every
stream), the CPU model, vector extensions and the load average before and after; `quiet` is False
when it reached half the cores: such a row is not a claim) and prints the ratios with the issue's
goals, then the run's wall and CPU seconds per phase. Refuses to run with XLA_FLAGS at -O0.

The two runs for issue 18, each sized for about 12 minutes on a quiet 2-core box
(docs/performance.md, "bench_serve_mixed: what a run costs"):

    PYTHONPATH=. python experiments/bench_serve_mixed.py        # paged vs slots, mixed pass, 1 repeat
    PYTHONPATH=. python experiments/bench_serve_mixed.py --targets paged transformers --no-mixed --concurrency 1 8
    PYTHONPATH=. python experiments/bench_serve_mixed.py --quick   # smoke run, tiny sizes (add --transformers --concurrency 1 2)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.common import (RESULTS, add_model_arg, add_out_arg, machine_info, setup_logging,  # noqa: E402
                                write_csv)
from experiments.serve_load import (LIVE, Server, process_cpu_seconds, stop_all, stop_process,  # noqa: E402
                                   wait_for_start)
from jkv.xla_options import require_optimized  # noqa: E402

log = logging.getLogger("bench_serve_mixed")
FIELDS = ["target", "pass", "concurrency", "repeat", "requests", "failed", "output_tokens", "duration_s", "output_tok_s", "mean_ttft_ms",
          "p99_ttft_ms", "long_ttft_ms", "long_prompt_tokens", "mean_tbt_ms", "p99_tbt_ms", "p99_tbt_admit_ms",
          "max_tbt_admit_ms", "admit_gaps", "server_cpu_s", "compiles", "start_s", "start_cpu_s", "prompt_lens", "max_tokens", "prefill_chunk", "page_size", "model",
          "cpu_model", "vector_extensions", "cores", "loadavg_1m", "loadavg_1m_after", "quiet"]


def corpus_prompts(tokenizer, lengths: list[int]):
    """`make(round)`: one prompt of each length, cut from different places of real text on this
    machine, a different place for every round. A warm-up or an earlier pass must not send the
    same prompts as a timed pass: `jkv serve --kv-layout paged` would find them in its prefix cache
    and prefill only the rest (the first quick runs did: their paged rows measured cached prompts
    and compiled the shorter chunks' programs mid-pass), while the slots batcher prefills them whole."""
    texts = [p.read_text(errors="ignore") for p in sorted(Path("/usr/share/common-licenses").glob("*"))[:8]
             if p.is_file()]
    ids = [int(t) for t in tokenizer.encode("\n".join(texts) or "The quick brown fox jumps over the lazy dog. " * 2000)]

    def make(round_: int) -> list[list[int]]:
        out, at = [], round_ * sum(lengths) + 7 * round_  # the odd shift: no round starts where another did
        for n in lengths:
            out.append([ids[(at + i) % len(ids)] for i in range(n)])
            at += n
        return out
    return make


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, on_first, stop_after: int | None = None) -> dict:
    """One streaming completion; `times` are absolute perf_counter seconds of each content chunk.
    With `stop_after`, the stream is closed after that many chunks (the server cancels the request)."""
    start = time.perf_counter()
    times, usage, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        error = str(obj["error"])
                    elif obj.get("usage") and not obj.get("choices"):
                        usage = obj["usage"]
                    elif obj.get("choices") and obj["choices"][0].get("text"):
                        times.append(time.perf_counter())
                        if len(times) == 1:
                            on_first()
                        if stop_after is not None and len(times) >= stop_after:
                            break
                    if obj.get("usage"):
                        usage = obj["usage"]
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        on_first()  # a request that fails must not hold the long one back
    return {"ok": error is None and bool(times), "error": error, "start": start, "times": times,
            "output_tokens": (usage or {}).get("completion_tokens", len(times)),
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


async def mixed_pass(url: str, bodies: list[dict], timeout: float, stop_after: int | None = None) -> list[dict]:
    """All bodies but the last at once; the last once every other one streams. Results in order."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10)) as client:
        started = [asyncio.Event() for _ in bodies[:-1]]
        tasks = [asyncio.create_task(stream_one(client, url, b, ev.set, stop_after)) for b, ev in zip(bodies, started)]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), timeout)
        tasks.append(asyncio.create_task(stream_one(client, url, bodies[-1], lambda: None, stop_after)))
        return list(await asyncio.gather(*tasks))


async def steady_pass(url: str, bodies: list[dict], concurrency: int, timeout: float,
                      stop_after: int | None = None) -> list[dict]:
    """The bodies in order, at most `concurrency` in flight (a new one as soon as one ends)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10)) as client:
        async def one(body):
            async with gate:
                return await stream_one(client, url, body, lambda: None, stop_after)
        return list(await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout))


def summarize(results: list[dict], long_last: bool = True) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: np.asarray(xs, float) * 1e3  # noqa: E731
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    out = {"requests": len(results), "failed": len(results) - len(ok),
           "errors": sorted({r["error"] for r in results if not r["ok"]})[:3]}
    if not ok:
        return out
    begin, end = min(r["start"] for r in ok), max(r["times"][-1] for r in ok)
    out["output_tokens"] = sum(r["output_tokens"] for r in ok)
    out["duration_s"] = end - begin
    out["output_tok_s"] = out["output_tokens"] / out["duration_s"]
    ttft = ms([r["times"][0] - r["start"] for r in ok])
    tbt = ms([b - a for r in ok for a, b in zip(r["times"][1:], r["times"][2:])])
    out.update(mean_ttft_ms=float(ttft.mean()), p99_ttft_ms=pct(ttft, 99), mean_tbt_ms=float(tbt.mean()),
               p99_tbt_ms=pct(tbt, 99))
    long_ = results[-1]
    if long_last and long_["ok"]:
        w0, w1 = long_["start"], long_["times"][0]
        admit = ms([b - a for r in results[:-1] if r["ok"] for a, b in zip(r["times"], r["times"][1:])
                    if b > w0 and a < w1])
        out.update(long_ttft_ms=(w1 - w0) * 1e3, long_prompt_tokens=long_["prompt_tokens"],
                   p99_tbt_admit_ms=pct(admit, 99), max_tbt_admit_ms=float(admit.max()) if len(admit) else float("nan"),
                   admit_gaps=len(admit))
    return out


class TransformersServer:
    """`transformers serve --continuous-batching` on a free loopback port, pinned to one model dir.

    Its KV cache is sized like the jkv targets' (`num_blocks` pages of `page_size` tokens): left to
    itself, continuous batching on a CPU takes 60 % of the machine's free memory for it."""

    def __init__(self, model_dir: str, page_size: int, num_blocks: int, timeout: float = 900):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        exe = Path(sys.executable).with_name("transformers")
        self.name, self.model_id = "transformers serve", model_dir
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="transformers-serve-", suffix=".log", delete=False)
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([str(exe), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port",
                                      str(port), "--device", "cpu", "--dtype", "float32", "--cb-block-size",
                                      str(page_size), "--cb-num-blocks", str(num_blocks), "--log-level", "info",
                                      model_dir], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        LIVE.add(self.proc)
        try:
            self.start_s = wait_for_start(self.name, self.proc, self._healthy, timeout, self._last_line)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}\nits log: {self.log.name}") from None
        self.start_cpu_s = process_cpu_seconds(self.proc.pid)

    def _healthy(self, wait: float) -> bool:
        try:
            if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(wait)
        return False

    def _last_line(self) -> str:
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1][-300:] if lines else "(none yet)"

    def stop(self):
        stop_process(self.proc)


def export_for_transformers(model_spec: str, cache: Path) -> str:
    """The jkv model's weights as a plain transformers checkpoint `transformers serve` can load, made
    once per model file under `cache` (a later run reuses it: ~40 CPU-s and 0.5 GB of writes).

    A GGUF-loaded model's config lacks `architectures` (transformers serve cannot load the GGUF
    offline) and `save_pretrained` refuses it, so its dequantized weights are copied into a fresh
    model of the same class, which saves; logits are identical (issue 18's notes). The GGUF's
    `quantization_config` is dropped from the saved config: left in, transformers would load the
    plain safetensors as a GGUF."""
    import hashlib

    from models import resolve_model_path

    src = resolve_model_path(model_spec)
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out_dir = cache / f"{src.stem}-{key}"
    if (out_dir / "config.json").is_file() and (out_dir / "tokenizer_config.json").is_file():
        log.info("transformers checkpoint of %s: %s (made earlier)", model_spec, out_dir)
        return str(out_dir)
    from transformers import AutoTokenizer

    from jkv.compare import load_hf_reference

    hf = load_hf_reference(model_spec)
    cfg = hf.config
    cfg.architectures = [type(hf).__name__]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = type(hf)(cfg)
    plain.load_state_dict(hf.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=cache))  # renamed into place once whole
    plain.save_pretrained(str(tmp))
    tok = AutoTokenizer.from_pretrained(str(src), use_fast=True) if src.is_dir() else \
        AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(tmp))
    tmp.rename(out_dir)
    log.info("transformers checkpoint of %s written to %s", model_spec, out_dir)
    return str(out_dir)


def jkv_body(ids, max_tokens):
    return {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


def hf_body(model_id, text, max_tokens):
    # eos_token_id -1 stands in for ignore_eos (continuous batching passes each request only its
    # max_new_tokens and eos_token_id, and -1 turns the stop off), so both generate max_tokens tokens.
    gen = {"do_sample": False, "max_new_tokens": max_tokens, "eos_token_id": -1}
    return {"model": model_id, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "generation_config": json.dumps(gen), "stream_options": {"include_usage": True}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 3072, 4096],
                    help="one request per length; the longest is sent once the others stream")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="paged target: --prefill-chunk")
    ap.add_argument("--page-size", type=int, default=16, help="paged target: --page-size")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per target (order alternates)")
    ap.add_argument("--targets", nargs="+", choices=["paged", "slots", "transformers"], default=["paged", "slots"],
                    help="servers to compare (paged: jkv serve's paged cache with chunked prefill; slots: its "
                         "per-slot batcher, --kv-layout slots; transformers: transformers serve --continuous-batching)")
    ap.add_argument("--transformers", action="store_true", help="add the transformers target")
    ap.add_argument("--no-mixed", action="store_true",
                    help="only the steady passes of --concurrency (the comparison with transformers serve)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[],
                    help="also one steady pass per level: --steady-requests requests, at most this many in flight")
    ap.add_argument("--steady-requests", type=int, default=24, help="requests of a steady pass")
    ap.add_argument("--steady-prompt-range", type=int, nargs=2, default=[105, 951],
                    help="a steady pass's prompt lengths, evenly spread over this range")
    ap.add_argument("--steady-max-tokens", type=int, default=48, help="output tokens per steady-pass request")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 prompts of 32-256 tokens, 12 output tokens, chunks of 64, 1 repeat; steady "
                         "passes of 6 requests of 32-128 tokens, 8 output tokens")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one pass may take")
    ap.add_argument("--start-timeout", type=float, default=3600,
                    help="seconds a server may take to load and compile (jkv warms up its programs; each one logs "
                         "its progress every 30 s while it starts)")
    ap.add_argument("--xla-cache", default="~/.cache/jkv/xla-bench-serve",
                    help="the jkv servers' persistent XLA compilation cache ('' for none): start-up compiles once")
    ap.add_argument("--hf-cache", default="~/.cache/jkv/hf-export",
                    help="--transformers: where the model's transformers checkpoint is made once and reused")
    add_out_arg(ap, RESULTS)
    ap.add_argument("--csv", default="bench_serve_mixed.csv", help="CSV name under --out")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_lens, args.max_tokens, args.prefill_chunk, args.repeats = [32, 64, 128, 256], 12, 64, 1
        args.steady_requests, args.steady_prompt_range, args.steady_max_tokens = 6, [32, 128], 8
    if any(c < 1 or c > len(args.prompt_lens) for c in args.concurrency):
        ap.error(f"--concurrency {args.concurrency}: each level must be 1 to {len(args.prompt_lens)} (the jkv "
                 "servers' --max-slots is the number of --prompt-lens)")
    if args.no_mixed and not args.concurrency:
        ap.error("--no-mixed leaves no pass to run: give --concurrency levels")
    if args.transformers and "transformers" not in args.targets:
        args.targets = [*args.targets, "transformers"]
    args.prompt_lens = sorted(args.prompt_lens)
    return args


def start_targets(args, max_len: int) -> dict:
    """The servers of --targets, started side by side (each start-up is mostly one compiling thread,
    so on 2 cores two of them take about as long as one), each with room for `max_len` tokens per
    request; transformers serve on an exported checkpoint. All are stopped if one fails to start."""
    from concurrent.futures import ThreadPoolExecutor

    common = ["--model", args.model, "--served-model-name", "m", "--max-slots", str(len(args.prompt_lens)),
              "--max-model-len", str(max_len)]
    env = {"JAX_LOG_COMPILES": "1"}  # names each program in the log: start-up progress, compiles mid-pass
    if args.xla_cache:
        # XLA's persistent cache: a second run loads the ~40 programs a server compiles at start-up
        # (minutes of one core) instead of compiling them; the programs, and so the figures, are the same
        env["JAX_COMPILATION_CACHE_DIR"] = str(Path(args.xla_cache).expanduser())
    jobs = {"paged": lambda: Server([*common, "--kv-layout", "paged", "--prefill-chunk", str(args.prefill_chunk),
                                     "--page-size", str(args.page_size)], timeout=args.start_timeout,
                                    env=env, name="jkv serve (paged)"),
            "slots": lambda: Server([*common, "--kv-layout", "slots"], timeout=args.start_timeout, env=env,
                                    name="jkv serve (slots)")}
    jobs = {name: job for name, job in jobs.items() if name in args.targets}
    if "transformers" in args.targets:
        cache = Path(args.hf_cache).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        # the same KV capacity as the jkv targets: every request at its longest, in pages
        blocks = len(args.prompt_lens) * -(-max_len // args.page_size)
        jobs["transformers"] = lambda: TransformersServer(export_for_transformers(args.model, cache), args.page_size,
                                                          blocks, timeout=args.start_timeout)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    targets, errors = {}, []
    for name, f in futures.items():
        if f.exception() is None:
            targets[name] = f.result()
        else:
            errors.append(f"{name}: {f.exception()}")
    if errors:
        for srv in targets.values():
            srv.stop()
        raise RuntimeError("a server did not start:\n" + "\n".join(errors))
    return targets


def print_table(rows: list[dict], targets: list[str], admission: bool = True):
    """Medians over repeats per target, then ratios: each target over slots, paged over transformers;
    with admission, the stall columns of the mixed pass's long request too."""
    cols = [("output_tok_s", "output tok/s", "{:.1f}"), ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
            ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"), ("mean_tbt_ms", "mean TBT ms", "{:.1f}"),
            ("p99_tbt_ms", "p99 TBT ms", "{:.1f}"), ("server_cpu_s", "server CPU s", "{:.1f}")]
    if admission:
        cols += [("long_ttft_ms", "longest TTFT ms", "{:.0f}"), ("p99_tbt_admit_ms", "p99 TBT admit ms", "{:.1f}"),
                 ("max_tbt_admit_ms", "max TBT admit ms", "{:.1f}")]
    med = {t: {k: float(np.median([r.get(k, np.nan) for r in rows if r["target"] == t])) for k, _, _ in cols}
           for t in targets}
    print(f"{'':<20}" + "".join(f"{t:>16}" for t in targets))
    for key, label, fmt in cols:
        print(f"{label:<20}" + "".join(f"{fmt.format(med[t][key]):>16}" for t in targets))
    print("ratios (median over repeats; issue 18's goals in brackets):")
    if "slots" in med:
        for t in [t for t in targets if t != "slots"]:
            goal = (lambda g: f" [{g}]") if t == "paged" else (lambda g: "")  # noqa: E731
            stall = (f"p99 TBT during the long admission "
                     f"{med[t]['p99_tbt_admit_ms'] / med['slots']['p99_tbt_admit_ms']:.2f}x{goal('<= 0.5x')}, "
                     if admission else "")
            print(f"  {t} / slots: output tok/s {med[t]['output_tok_s'] / med['slots']['output_tok_s']:.2f}x"
                  f"{goal('>= 1.5x')}, {stall}mean TTFT {med[t]['mean_ttft_ms'] / med['slots']['mean_ttft_ms']:.2f}x")
    if "transformers" in med and "paged" in med:
        p, h = med["paged"], med["transformers"]
        print(f"  paged / transformers: output tok/s {p['output_tok_s'] / h['output_tok_s']:.2f}x [steady passes: "
              f">= 1.5x at c=8, >= 1.0x at c=1], mean TTFT {p['mean_ttft_ms'] / h['mean_ttft_ms']:.2f}x [<= 1.0x], "
              f"mean TBT {p['mean_tbt_ms'] / h['mean_tbt_ms']:.2f}x, p99 TBT {p['p99_tbt_ms'] / h['p99_tbt_ms']:.2f}x, "
              f"server CPU-s {p['server_cpu_s'] / h['server_cpu_s']:.2f}x")


def pass_plan(args, tokenizer) -> list[tuple[str, int | None, list[list[int]], int]]:
    """(pass, concurrency or None for the mixed pass, make(round) -> prompts, max_tokens) of every
    timed pass."""
    plans = [] if args.no_mixed else [("mixed", None, corpus_prompts(tokenizer, args.prompt_lens), args.max_tokens)]
    if args.concurrency:
        lo, hi = args.steady_prompt_range
        steady = corpus_prompts(tokenizer, [int(n) for n in np.linspace(lo, hi, args.steady_requests)])
        plans += [(f"c={c}", c, steady, args.steady_max_tokens) for c in args.concurrency]
    return plans


def compiled(server) -> list[str]:
    """The programs a jkv server has compiled so far (JAX_LOG_COMPILES lines in its log); [] for
    transformers serve."""
    if not isinstance(server, Server):
        return []
    return [line.split("Compiling ", 1)[1].split(" with global shapes", 1)[0] for line in list(server.log)
            if "Compiling " in line and " with global shapes" in line]


def wait_idle(server, timeout: float = 120.0):
    """Until a jkv server runs and queues no request (a warm-up's closed streams are cancelled at
    its next step, which must not land in the next target's timed pass); transformers serve cancels
    on disconnect too but has no such gauge: a 2 s grace."""
    if not isinstance(server, Server):
        time.sleep(2)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        busy = sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(("jkv_num_requests_running ", "jkv_num_requests_waiting ")))
        if busy == 0:
            return
        time.sleep(0.5)
    log.warning("%s still has requests %.0fs after the warm-up", server.name, timeout)


def run_pass(server, bodies: list[dict], concurrency: int | None, timeout: float, stop_after: int | None = None) -> dict:
    """One pass against one server: its summary, the server's CPU seconds, the programs it compiled
    during the pass (a compile mid-pass stalls every stream: such a row measures XLA, not serving)
    and the load around it."""
    pid, load = server.proc.pid, os.getloadavg()[0]
    cpu, before = process_cpu_seconds(pid), len(compiled(server))
    if concurrency is None:
        results = asyncio.run(mixed_pass(server.url, bodies, timeout, stop_after))
    else:
        results = asyncio.run(steady_pass(server.url, bodies, concurrency, timeout, stop_after))
    summary = summarize(results, long_last=concurrency is None)
    cores = os.cpu_count() or 1
    after = os.getloadavg()[0]
    new = compiled(server)[before:]
    summary.update(compiled=sorted(set(new)), server_cpu_s=process_cpu_seconds(pid) - cpu, compiles=len(new) if isinstance(server, Server) else "",
                   loadavg_1m=round(load, 2), loadavg_1m_after=round(after, 2),
                   quiet=max(load, after) < 0.5 * cores)
    return summary


def warm_up(targets: dict, plans, bodies, timeout: float) -> dict:
    """Every prompt of the mixed pass and of the widest steady pass through each target, each
    stream closed after its second token: every prompt is prefilled (jkv compiles its prefill
    shapes; a prompt's chunk and page-table shapes depend on its own length and max_tokens only, and
    the decode programs were compiled at start-up) without paying for the decode of a whole pass.
    Returns each target's server CPU seconds in it."""
    steady = [p for p in plans if p[1] is not None]
    warm = [p for p in plans if p[1] is None] + ([max(steady, key=lambda p: p[1])] if steady else [])
    cpu = {}
    for name, srv in targets.items():
        cpu[name] = 0.0
        for pass_name, conc, make, max_tokens in warm:
            summary = run_pass(srv, bodies(name, make(0), max_tokens), conc, timeout, stop_after=2)
            wait_idle(srv)
            cpu[name] += summary["server_cpu_s"]
            log.info("warm-up %s %s: %d/%d ok %s, %.1f server CPU-s, %s XLA programs compiled", name, pass_name,
                     summary["requests"] - summary["failed"], summary["requests"], summary["errors"],
                     summary["server_cpu_s"], summary["compiles"] if summary["compiles"] != "" else "no")
    return cpu


def timed_passes(args, targets: dict, plans, bodies) -> list[dict]:
    """`--repeats` rounds of every pass through every target (the order reversed every other
    round): one CSV row each."""
    rows = []
    for rep in range(args.repeats):
        order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
        for i, (pass_name, conc, make, max_tokens) in enumerate(plans):
            prompts = make(1 + rep * len(plans) + i)  # the same for every target, new for every pass
            for name in order:
                srv = targets[name]
                summary = run_pass(srv, bodies(name, prompts, max_tokens), conc, args.timeout)
                row = {**machine_info(), **summary, "target": name, "pass": pass_name, "concurrency": conc or "",
                       "repeat": rep, "start_s": round(srv.start_s, 1), "start_cpu_s": round(srv.start_cpu_s, 1),
                       "prompt_lens": " ".join(str(len(p)) for p in prompts), "max_tokens": max_tokens,
                       "model": args.model, "prefill_chunk": args.prefill_chunk if name == "paged" else "",
                       "page_size": args.page_size if name != "slots" else ""}
                rows.append(row)
                if row["compiled"]:
                    log.warning("%s compiled %d programs during this timed pass (%s): its figures include XLA "
                                "compile time", srv.name, row["compiles"], ", ".join(row["compiled"]))
                log.info("%s %s #%d: %.1f output tok/s, mean TTFT %.0f ms, %.1f server CPU-s, failed %d %s", name,
                         pass_name, rep, row.get("output_tok_s", float("nan")), row.get("mean_ttft_ms", float("nan")),
                         row["server_cpu_s"], row["failed"], row["errors"])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()

    def on_term(signum, frame):  # stop the servers (and so the threads waiting for them to start), then exit
        stop_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    require_optimized("bench_serve_mixed")  # the jkv servers inherit this environment
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from models import load_model

    t0 = time.perf_counter()
    tokenizer = load_model(args.model).tokenizer
    plans = pass_plan(args, tokenizer)
    targets = start_targets(args, max(len(p) + mt for _, _, make, mt in plans for p in make(0)) + 16)
    log.info("%s up in %.0fs; machine %s", list(targets), time.perf_counter() - t0, machine_info())

    def bodies(name, prompts, max_tokens):
        if name == "transformers":
            return [hf_body(targets[name].model_id, tokenizer.decode(p), max_tokens) for p in prompts]
        return [jkv_body(p, max_tokens) for p in prompts]

    try:
        t_warm = time.perf_counter()
        warm_cpu = warm_up(targets, plans, bodies, args.timeout)
        t_timed = time.perf_counter()
        rows = timed_passes(args, targets, plans, bodies)
    finally:
        for name, srv in targets.items():
            srv.stop()
            if isinstance(srv, Server):  # its compile lines and warnings, for a row that looks wrong
                path = Path(tempfile.mkstemp(prefix=f"bench-serve-mixed-{name}-", suffix=".log")[1])
                path.write_text("".join(srv.log))
                log.info("%s's log: %s", srv.name, path)
    t_end = time.perf_counter()
    write_csv(out / args.csv, rows, fields=FIELDS)
    for pass_name, conc, _, _ in plans:
        print(f"\npass {pass_name}" + (f" ({conc} in flight)" if conc else " (mixed lengths, the longest sent last)"))
        print_table([r for r in rows if r["pass"] == pass_name], list(targets), admission=conc is None)
    # What the run cost, to size a run for a time budget: on a quiet box each server's phases run
    # at about its CPU seconds (one engine thread; start-ups overlap, one per core)
    print(f"\nwall s: start-up {t_warm - t0:.0f}, warm-up {t_timed - t_warm:.0f}, timed passes {t_end - t_timed:.0f}, "
          f"total {t_end - t0:.0f}")
    for name, srv in targets.items():
        timed = sum(r["server_cpu_s"] for r in rows if r["target"] == name)
        print(f"server CPU-s {name}: start-up {srv.start_cpu_s:.0f}, warm-up {warm_cpu[name]:.0f}, "
              f"timed passes {timed:.0f}")
    if not all(r["quiet"] for r in rows):
        print("the load average reached half the cores or more during a pass: these figures are not claims "
              "(quiet=False in the CSV)")
    print(f"wrote {out / args.csv}; load average now {os.getloadavg()}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
