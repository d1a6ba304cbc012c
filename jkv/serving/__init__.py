"""`jkv serve`: continuous-batching engine, OpenAI-compatible HTTP API, router, metrics (docs/serve.md).

    batcher.ContinuousBatcher   engine thread: decode slots, prefill + insert, per-row sampling
    server.create_app           FastAPI app for --role all
    router.create_router_app    FastAPI app for --role router (least in-flight tokens, health checks)
    config.ServeConfig          every option; CLI flags and YAML/TOML files
    launch.run_serve            the `jkv serve` entry point
"""
