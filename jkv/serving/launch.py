"""`jkv serve`: parse flags/config, build the role's components, log what each bound to, run uvicorn.

Process model: one process per role. `--role all` loads the model, starts the engine thread
(`ContinuousBatcher`) and serves HTTP on uvicorn's event loop in the main thread; `--role router`
has no model and runs only the event loop. SIGINT/SIGTERM trigger uvicorn's graceful shutdown:
the listener closes, in-flight responses get `graceful_timeout` seconds to finish, then the
engine thread is stopped.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys

from .config import ServeConfig, add_serve_arguments, config_from_args

log = logging.getLogger("jkv.serve")


def add_serve(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching) or router",
                       description="Serve a model over an OpenAI-compatible HTTP API (--role all), or route "
                                   "requests across such servers (--role router). Every option can also be "
                                   "given in a --config YAML/TOML file; command-line flags win.")
    add_serve_arguments(p)


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


def build_all(cfg: ServeConfig):
    """Model + engine + app for --role all. Returns (app, engine)."""
    from models import load_model

    from .batcher import BatcherConfig, ContinuousBatcher
    from .metrics import ServerMetrics
    from .server import create_app

    model = load_model(cfg.model, dtype=cfg.dtype)
    ctx = model.cfg.max_position_embeddings
    max_len = cfg.max_model_len
    if max_len > ctx:
        log.warning("max_model_len %d exceeds %s's context length %d; using %d", max_len, cfg.model, ctx, ctx)
        max_len = ctx
    metrics = ServerMetrics("all")
    engine = ContinuousBatcher(model, BatcherConfig(cfg.max_slots, max_len), metrics)
    engine.warmup()
    engine.start()
    log.info("engine: %r, mode colocated continuous batching, %d decode slots x %d tokens of KV (N_max %d), "
             "one engine thread", model, cfg.max_slots, max_len, engine.n_max)
    app = create_app(engine, cfg.model_name, metrics, cfg.default_max_tokens, on_shutdown=engine.stop)
    return app, engine


def run_serve(args) -> int:
    import uvicorn

    cfg = config_from_args(args)
    _setup_logging(cfg.log_level)
    if cfg.role == "all":
        app, _ = build_all(cfg)
        what = f"OpenAI API for model {cfg.model_name!r}"
    else:
        from .router import create_router_app

        app = create_router_app(cfg)
        log.info("router: %d upstreams of kind 'all' %s, selector least in-flight tokens, /health every %.1fs",
                 len(cfg.upstream), list(cfg.upstream), cfg.health_interval)
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
