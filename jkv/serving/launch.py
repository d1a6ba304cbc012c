"""`jkv serve`: parse flags/config, build the role's components, log what each bound to, run uvicorn.

Process model: one process per role. `--role all` loads the model, starts the engine thread
(`ContinuousBatcher`) and serves HTTP on uvicorn's event loop in the main thread; with
`--disaggregation MODE` the engine is instead a SmartGen decode worker (`DisaggBatcher`) fed by
`--num-prefill-workers` local prefill worker processes (`jkv.disagg.cluster`), each restarted
with backoff when it dies (`jkv.disagg.supervisor`, `--prefill-restarts`). `--role decode`
is the same engine connected to running `--role prefill` servers (`--prefill-worker ADDRESS`).
`--role prefill` runs a prefill worker (its "jkv-prefill-main" thread plus transport threads)
and a small /health + /metrics app. `--role router` has no model and runs only the event loop.
SIGINT/SIGTERM trigger uvicorn's graceful shutdown: the listener closes, in-flight responses
get `graceful_timeout` seconds to finish, then the engine (and any worker processes) stop.

The transport secret of the prefill and decode roles comes from the JKV_SECRET environment
variable (never a flag or a config file); `--role all --disaggregation` makes a random one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys

from ..xla_options import warn_if_unoptimized
from .config import ServeConfig, add_serve_arguments, config_from_args

log = logging.getLogger("jkv.serve")


def _add_serve_parser(sub, name: str, help_: str, description: str):
    add_serve_arguments(sub.add_parser(name, help=help_, description=description))


def add_serve(sub):
    _add_serve_parser(
        sub, "serve", "OpenAI-compatible HTTP server (continuous batching), disaggregated prefill/decode roles, "
        "or router",
        "Serve a model over an OpenAI-compatible HTTP API (--role all), run one role of a disaggregated SmartGen "
        "deployment (--role prefill / decode; JKV_SECRET must hold the shared transport secret), or route "
        "requests across servers (--role router). The disaggregated engine batches continuously: a request "
        "joins the running decode batch as soon as its prefill hand-off arrives. Every option can also be "
        "given in a --config YAML/TOML file; command-line flags win.")


def add_decode_worker(sub):
    _add_serve_parser(
        sub, "decode-worker", "a SmartGen decode worker serving the OpenAI API (= jkv serve --role decode); "
        "JKV_SECRET must be set",
        "Run the decode role of a disaggregated deployment: an OpenAI-compatible server whose engine is a "
        "SmartGen decode worker connected to the prefill workers given by --prefill-worker (their transport "
        "addresses). Requests are batched continuously: up to --max-slots in flight, a new one joins the running "
        "decode batch as soon as its prefill hand-off arrives. Same options as `jkv serve` (--role is fixed to "
        "decode).")


def run_decode_worker(args) -> int:
    if getattr(args, "role", "decode") != "decode":
        raise ValueError(f"jkv decode-worker always runs --role decode, not --role {args.role}")
    args.role = "decode"
    return run_serve(args)


def _setup_logging(level: str):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("jkv")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# the value deploy/k8s/secret.yaml ships: a known secret, so a deployment applying it unchanged is refused
PLACEHOLDER_SECRET = "replace-with-openssl-rand-hex-32"


def _secret() -> str:
    secret = os.environ.get("JKV_SECRET", "")
    if secret == PLACEHOLDER_SECRET:
        raise ValueError("JKV_SECRET is the placeholder of deploy/k8s/secret.yaml; create the Secret with a random "
                         "value: kubectl create secret generic jkv-transport --from-literal=JKV_SECRET=\"$(openssl "
                         "rand -hex 32)\"")
    if len(secret) < 8:
        raise ValueError("set JKV_SECRET to the deployment's shared transport secret (>= 8 bytes); every prefill "
                         "and decode role of one deployment must use the same one")
    return secret


def _load(cfg: ServeConfig):
    from models import load_model_spec

    model = load_model_spec(cfg.model, cfg.dtype, tensor_parallel=cfg.tensor_parallel)
    ctx = model.cfg.max_position_embeddings
    max_len = cfg.batcher.max_model_len
    if max_len > ctx:
        log.warning("max_model_len %d exceeds %s's context length %d; using %d", max_len, cfg.model, ctx, ctx)
        max_len = ctx
    return model, max_len


def _selector(cfg: ServeConfig, model):
    from jkv.disagg.selectors import build_selector, load_selector

    return load_selector(cfg.selector_file) if cfg.selector_file else build_selector(model, cfg.disagg.selector)


def build_disaggregated(cfg: ServeConfig):
    """--role decode, or --role all --disaggregation: a DecodeWorker engine. Returns (app, engine)."""
    from jkv.disagg.cluster import DisaggregatedEngine

    from .disagg_decode import DisaggBatcher
    from .metrics import ServerMetrics
    from .paged_batcher import page_config
    from .server import create_app

    model, max_len = _load(cfg)
    selector = _selector(cfg, model)
    remote = cfg.role == "decode"
    dis = dataclasses.replace(cfg.disagg, secret=_secret()) if remote else cfg.disagg
    # --role decode: several decode servers may share prefill workers, which key peers by name
    name = f"decode-{socket.gethostname()}-{os.getpid()}"[-200:] if remote else "decode-0"
    batcher_cfg = cfg.batcher_config(max_len)  # --page-size / --num-pages size the decode worker's pages
    cluster = DisaggregatedEngine(model, dis, model_spec=cfg.model, selector=selector, name=name,
                                  page_config=page_config(batcher_cfg),
                                  prefix_caching=batcher_cfg.enable_prefix_caching)
    addresses = list(dis.addresses) if remote else cluster.workers.addresses
    if not remote:
        for i, a in enumerate(addresses):
            log.info("prefill-worker: local process prefill-%d (pid %d) on transport %s %s, link %s", i,
                     cluster.workers.procs[i].pid, dis.transport, a, dis.bandwidth or "unpaced")
    metrics = ServerMetrics(cfg.role, kv_transfer=True)
    engine = DisaggBatcher(model, cluster.decode, batcher_cfg, metrics,
                           addresses=addresses, owners=list(cluster.decode.owners),
                           prefill_cache_stats=None if remote else cluster.prefill_cache_stats)
    try:
        engine.warmup()
    except BaseException:
        cluster.close()
        raise
    engine.start()
    log.info("engine: %r, mode disaggregated %s (selector %s, strategy %s, transport %s, link estimate %s), "
             "continuous batching of up to %d requests, paged KV cache of %d pages x %d tokens, prefill workers %s",
             model, dis.transfer.mode, selector.name, dis.transfer.strategy, dis.transport, dis.bandwidth or "unpaced",
             cfg.batcher.max_slots, cluster.decode.pages.cache.page_cfg.num_pages, cluster.decode.pages.page_size,
             dict(zip(cluster.decode.owners, addresses)))

    supervisor = None if remote else _supervise(cluster.workers, engine, metrics, cfg.prefill_restarts)

    def shutdown():
        if supervisor is not None:
            supervisor.stop()
        engine.stop()
        cluster.close()

    app = create_app(engine, cfg.model_name, metrics, cfg.default_max_tokens, on_shutdown=shutdown,
                     max_request_bytes=cfg.max_request_bytes)
    return app, engine


def _supervise(workers, engine, metrics, max_quick_failures: int):
    """--role all --disaggregation: restart local prefill workers that die (jkv/disagg/supervisor.py),
    counted in /metrics (jkv_prefill_worker_restarts_total) and listed with their state in /health."""
    from prometheus_client import Counter

    from jkv.disagg.supervisor import PrefillSupervisor

    restarts = Counter("jkv_prefill_worker_restarts", "local prefill worker processes restarted after they died",
                       ["worker"], registry=metrics.registry)

    def on_restart(i: int, old: str, new: str):
        restarts.labels(f"prefill-{i}").inc()
        engine.prefill_worker_moved(old, new)

    supervisor = PrefillSupervisor(workers, on_restart=on_restart, max_quick_failures=max_quick_failures)
    engine.supervisor = supervisor
    supervisor.start()
    return supervisor


def build_prefill(cfg: ServeConfig):
    """--role prefill: a SmartGen prefill worker and its /health + /metrics app. Returns (app, worker)."""
    import threading

    from .disagg_prefill import ServingPrefillWorker, create_prefill_app
    from .metrics import PrefillMetrics

    secret = _secret()
    model, _ = _load(cfg)
    selector = _selector(cfg, model)
    metrics = PrefillMetrics()
    name = cfg.worker_name or f"prefill-{os.getpid()}"
    dis = cfg.disagg
    worker = ServingPrefillWorker(model, selector, name, secret=secret, backend=dis.transport,
                                  bandwidth=dis.bandwidth, lease_s=dis.lease_s, timeout=dis.timeout_s,
                                  metrics=metrics, prefix_cache_tokens=dis.prefill_prefix_cache_tokens)
    bound = worker.listen(cfg.transport_listen)
    address = cfg.transport_advertise or bound  # what decode servers and the router are told
    runner = threading.Thread(target=worker.run, name="jkv-prefill-main", daemon=True)
    runner.start()
    log.info("prefill-worker: %s, %r, selector %s, transport %s listening on %s%s, link %s, lease %.0fs",
             name, model, selector.name, dis.transport, bound, f" (advertised as {address})" if address != bound else "",
             dis.bandwidth or "unpaced", dis.lease_s)
    info = {"transport_address": address, "transport": dis.transport, "selector": selector.name,
            "model": cfg.model_name, "bandwidth": dis.bandwidth}

    def shutdown():
        worker.close()
        runner.join(5)

    return create_prefill_app(worker, metrics, info, on_shutdown=shutdown,
                              max_request_bytes=cfg.max_request_bytes), worker


def _load_colocated(cfg: ServeConfig):
    """--role all's model (sharded over --tensor-parallel devices) and the engine's BatcherConfig."""
    from models import load_model

    model = load_model(cfg.model, dtype=cfg.dtype, tensor_parallel=cfg.tensor_parallel)
    if model.sharding is not None:
        log.info("model: %s over devices %s", model.sharding.layout.describe(),
                 [str(d) for d in model.sharding.mesh.devices.flat])
    ctx = model.cfg.max_position_embeddings
    max_len = cfg.batcher.max_model_len
    if max_len > ctx:
        log.warning("max_model_len %d exceeds %s's context length %d; using %d", max_len, cfg.model, ctx, ctx)
        max_len = ctx
    return model, cfg.batcher_config(max_len)


def warmup_enabled() -> bool:
    """False when the environment sets JKV_WARMUP=0: the colocated engine then compiles each program
    when a request first needs it instead of every (rows, width) decode program at start. For tests
    (a tiny-model server's start-up: ~38 -> ~8 CPU-s, cold XLA cache), never for serving: the first
    request of each shape stalls every stream for its compile. Any other value is refused."""
    value = os.environ.get("JKV_WARMUP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"JKV_WARMUP={value!r}: use 1 (compile every decode program at start, the default) "
                         "or 0 (compile on first use; for tests)")
    if value == "0":
        log.warning("JKV_WARMUP=0: warm-up skipped, programs compile when first needed (a test setting)")
    return value == "1"


def build_all(cfg: ServeConfig, multihost: bool = False):
    """Model + engine + app for --role all (multihost: rank 0 of a replica spanning processes,
    jkv/serving/replica.py). Returns (app, engine)."""
    from .batcher import create_batcher
    from .metrics import ServerMetrics
    from .server import create_app

    model, batcher_cfg = _load_colocated(cfg)
    max_len = batcher_cfg.max_model_len
    metrics = ServerMetrics("all")
    if multihost:
        from .replica import LeaderBatcher

        engine = LeaderBatcher(model, batcher_cfg, metrics)
    else:
        engine = create_batcher(model, batcher_cfg, metrics)
    if multihost or warmup_enabled():  # a replica's ranks compile in step: never skipped there
        engine.warmup()
    engine.start()
    if cfg.batcher.kv_layout == "paged":
        pc = engine.page_cfg
        log.info("engine: %r, mode colocated continuous batching of up to %d requests, paged KV cache of %d pages x "
                 "%d tokens (%d usable), prefill in chunks of %d tokens, prefix caching %s, one engine thread", model,
                 cfg.batcher.max_slots, pc.num_pages, pc.page_size, pc.usable_pages, cfg.batcher.prefill_chunk,
                 f"on ({engine.prefix_namespace.prefix})" if engine.prefix_namespace is not None else "off")
    else:
        log.info("engine: %r, mode colocated continuous batching, %d decode slots x %d tokens of KV (N_max %d), "
                 "one engine thread", model, cfg.batcher.max_slots, max_len, engine.n_max)
    app = create_app(engine, cfg.model_name, metrics, cfg.default_max_tokens, on_shutdown=engine.stop,
                     max_request_bytes=cfg.max_request_bytes)
    return app, engine


def _join_replica(cfg: ServeConfig):
    """The MultiHost of --coordinator-address etc. (or JKV_*) after joining it, or None (one process)."""
    from ..multihost import MultiHost, initialize
    from .replica import check_multihost_serve

    mh = MultiHost.from_values(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    if mh is None:
        return None
    check_multihost_serve(cfg, mh)  # before joining: a refused config must not leave its peers waiting
    initialize(mh)
    import jax

    check_multihost_serve(cfg, mh, jax.device_count())
    return mh


def run_follower(cfg: ServeConfig) -> int:
    """A rank > 0 of a --role all replica: the same model and engine, no HTTP; follows rank 0."""
    from .replica import FollowerBatcher

    model, batcher_cfg = _load_colocated(cfg)
    engine = FollowerBatcher(model, batcher_cfg)
    engine.warmup()
    log.info("multi-host: rank %d follows rank 0's engine steps (no HTTP on this rank)", engine.channel.rank)
    return engine.run()


def run_serve(args) -> int:
    import uvicorn

    cfg = config_from_args(args)
    _setup_logging(cfg.log_level)
    warn_if_unoptimized("jkv serve")
    mh = _join_replica(cfg)
    if mh is not None and mh.process_id != 0:
        return run_follower(cfg)
    if cfg.uses_disaggregation:
        app, _ = build_disaggregated(cfg)
        what = f"OpenAI API for model {cfg.model_name!r}, disaggregated {cfg.disagg.transfer.mode}"
    elif cfg.role == "all":
        app, _ = build_all(cfg, multihost=mh is not None)
        what = f"OpenAI API for model {cfg.model_name!r}" + (
            f", rank 0 of a {mh.num_processes}-process replica" if mh is not None else "")
    elif cfg.role == "prefill":
        app, _ = build_prefill(cfg)
        what = "prefill worker /health and /metrics"
    else:
        from .router import create_router_app

        app = create_router_app(cfg)
        rt = cfg.routing
        selector = "least in-flight tokens" if rt.policy == "least-load" else (
            f"cache-aware (prefix chunks of {rt.chunk_chars} characters, {rt.record_chunks} remembered per upstream, "
            f"min match {rt.min_match:g}, balance threshold {rt.balance_abs_tokens} tokens and {rt.balance_rel:g}x; "
            "else least in-flight tokens)")
        if cfg.upstream:
            log.info("router: %d upstreams of kind 'all' %s, selector %s, /health every %.1fs",
                     len(cfg.upstream), list(cfg.upstream), selector, cfg.health_interval)
        if cfg.decode:
            log.info("router: disaggregated pool, prefill %s, decode %s, selector %s in each, prefill choice sent as "
                     "header %s, /health every %.1fs", list(cfg.prefill), list(cfg.decode), selector,
                     "X-JKV-Prefill-Worker", cfg.health_interval)
        what = "router"
    sock = _bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    log.info("http: role %s listening on http://%s:%d (%s; /metrics Prometheus on the same listener)",
             cfg.role, host, port, what)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=cfg.graceful_timeout,
                                           access_log=False, lifespan="on"))
    # uvicorn installs its own handlers while serving and re-raises the signal afterwards; with
    # these no-op originals a graceful (drained) shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    log.info("http: shut down after draining in-flight requests")
    return 0
