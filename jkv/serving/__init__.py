"""`jkv serve`: continuous-batching engine, OpenAI-compatible HTTP API, router, metrics (docs/serve.md).

    paged_batcher.PagedBatcher  engine thread on the paged KV cache, chunked prefill (--kv-layout paged)
    batcher.ContinuousBatcher   engine thread: decode slots, prefill + insert, per-row sampling (--kv-layout slots)
    server.create_app           FastAPI app for --role all
    router.create_router_app    FastAPI app for --role router (cache-aware or least-load routing, health checks)
    routing.RoutingConfig       --routing: prefix keys of a request's text, per-upstream records, thresholds
    config.ServeConfig          every option; CLI flags and YAML/TOML files
    launch.run_serve            the `jkv serve` entry point
"""
