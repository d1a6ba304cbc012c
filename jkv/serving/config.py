"""`jkv serve` configuration: one frozen dataclass, CLI flags, and the same keys from YAML/TOML.

Precedence: built-in defaults < `--config FILE` < flags given on the command line. File keys
are the flag names with '_' or '-' (`max_slots` or `max-slots`); an unknown key is an error
naming the known ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jkv.selection.base import DEFAULT_MIN_BUDGET
from models import DEFAULT_MODEL

ROLES = ("all", "prefill", "decode", "router")
UPSTREAM_KINDS = ("all", "prefill", "decode")
LIST_OPTIONS = ("upstream", "prefill", "decode", "prefill_worker")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    role: str = "all"
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "float32"
    max_slots: int = 8
    max_model_len: int = 1024
    kv_layout: str = "paged"
    page_size: int = 16
    num_pages: int | None = None
    prefill_chunk: int = 512
    default_max_tokens: int = 256
    max_request_bytes: int = 4 * 1024 * 1024
    upstream: tuple[str, ...] = ()
    health_interval: float = 2.0
    health_timeout: float = 1.0
    upstream_timeout: float = 600.0
    graceful_timeout: float = 30.0
    log_level: str = "info"
    # disaggregated prefill/decode (SmartGen); field meanings as in jkv.disagg.Disaggregation
    disaggregation: str | None = None
    num_prefill_workers: int = 1
    prefill_worker: tuple[str, ...] = ()
    selector: str = "infinigen"
    selector_file: str | None = None
    transport: str = "tcp"
    bandwidth: str | None = "1gbit"
    strategy: str = "profile"
    spec_ratio: float = 0.10
    max_blocks: int = 1024
    profile: str | None = None
    kr_fraction: float | None = None
    on_failure: str = "fail"
    lease_s: float = 300.0
    transfer_timeout: float = 5.0
    min_budget: int = DEFAULT_MIN_BUDGET
    transport_listen: str | None = None
    worker_name: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def __post_init__(self):
        for name in LIST_OPTIONS:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        for name in ("max_slots", "max_model_len", "default_max_tokens", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("health_interval", "health_timeout", "upstream_timeout", "graceful_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        self._check_roles()
        self.batcher_config(self.max_model_len)  # validates kv_layout, page_size, num_pages, prefill_chunk
        for u in self.upstream + self.prefill + self.decode:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"upstream {u!r} must be an http:// or https:// URL")
        if self.uses_disaggregation:
            self.disaggregation_config()  # validates mode, selector transport, bandwidth, ... naming the value
            if self.mode != "full" and self.strategy in ("profile", "oracle") and self.profile is None:
                raise ValueError(f"--strategy {self.strategy} (mode {self.mode}) needs an importance profile: pass "
                                 "--profile FILE from `jkv profile`, or use --strategy sequential / streaming / "
                                 "random")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level={self.log_level!r} must be debug, info, warning or error")

    def _check_roles(self):
        router_only = [n for n in ("upstream", "prefill", "decode") if getattr(self, n)]
        if self.role == "router":
            if bool(self.prefill) != bool(self.decode):
                raise ValueError("a disaggregated router pool needs both --prefill URLs (`--role prefill`) and "
                                 "--decode URLs (`--role decode`)")
            if not self.upstream and not self.decode:
                raise ValueError("role=router needs at least one --upstream URL (a `jkv serve --role all` server), "
                                 "or --prefill and --decode URLs (a disaggregated pool)")
        elif router_only:
            raise ValueError(f"--{router_only[0]} is only for --role router, not role={self.role!r}")
        if self.role == "decode" and not self.prefill_worker:
            raise ValueError("role=decode needs at least one --prefill-worker ADDRESS (the transport address a "
                             "`jkv serve --role prefill` logs and reports on /health)")
        if self.role != "decode" and self.prefill_worker:
            raise ValueError(f"--prefill-worker is only for --role decode, not role={self.role!r}")
        if self.disaggregation is not None and self.role not in ("all", "decode"):
            raise ValueError(f"--disaggregation is for --role all or decode, not role={self.role!r}")
        if self.num_prefill_workers < 1:
            raise ValueError(f"num_prefill_workers={self.num_prefill_workers} must be >= 1")
        for name in ("lease_s", "transfer_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")

    def batcher_config(self, max_model_len: int):
        """The colocated engine's `BatcherConfig` (max_model_len: capped to the model's context)."""
        from .batcher import BatcherConfig

        return BatcherConfig(self.max_slots, max_model_len, kv_layout=self.kv_layout, page_size=self.page_size,
                             num_pages=self.num_pages, prefill_chunk=self.prefill_chunk)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def uses_disaggregation(self) -> bool:
        return self.role == "decode" or (self.role == "all" and self.disaggregation is not None)

    @property
    def mode(self) -> str:
        return self.disaggregation or "smartgen"

    def disaggregation_config(self, **overrides):
        """The `Disaggregation` of a decode (or --role all --disaggregation) server."""
        from jkv.disagg.config import Disaggregation

        kw = dict(mode=self.mode, selector=self.selector, transport=self.transport, bandwidth=self.bandwidth,
                  prefill_workers=self.num_prefill_workers, strategy=self.strategy, spec_ratio=self.spec_ratio,
                  max_blocks=self.max_blocks, profile=self.profile, kr_fraction=self.kr_fraction,
                  on_failure=self.on_failure, lease_s=self.lease_s, timeout_s=self.transfer_timeout,
                  model_spec=self.model, addresses=self.prefill_worker, min_budget=self.min_budget)
        kw.update(overrides)
        return Disaggregation(**kw)


# flag -> (type, help). Defaults come from ServeConfig; argparse defaults are SUPPRESSed so we
# can tell which flags the user actually gave (they override the config file).
_HELP = {
    "role": (str, "all: one process with the continuous-batching engine and the HTTP API (with "
                  "--disaggregation: a SmartGen decode worker fed by local prefill worker processes); "
                  "prefill: a SmartGen prefill worker (transport endpoint) with /health and /metrics; "
                  "decode: the OpenAI API over a SmartGen decode worker fed by --prefill-worker addresses; "
                  "router: a load-balancing proxy in front of --upstream servers or --prefill/--decode pools"),
    "host": (str, "address to listen on; the default is loopback only, use 0.0.0.0 to expose"),
    "port": (int, "TCP port to listen on; 0 picks a free one (the bound port is logged)"),
    "model": (str, "registered name, Hugging Face directory or .gguf file (role all)"),
    "served_model_name": (str, "the model id clients send and /v1/models lists (default: --model)"),
    "dtype": (str, "weights/activations dtype: float32, bfloat16 or float16"),
    "max_slots": (int, "decode slots = the continuous batch size; more requests queue"),
    "max_model_len": (int, "max prompt + generated tokens per request; sets the per-slot KV length"),
    "kv_layout": (str, "role all: paged = one paged KV cache shared by all requests (memory and decode "
                       "cost follow each request's own length) with chunked prefill; slots = one "
                       "max-model-len KV cache per slot, every decode step attends over all of it "
                       "(the previous engine, kept for comparison)"),
    "page_size": (int, "paged: tokens per KV page"),
    "num_pages": (int, "paged: KV pages in the pool, one of them the reserved null page (default: "
                       "max-slots x ceil(max-model-len / page-size) + 1, the slot layout's KV memory); a "
                       "request waits in the queue until its prompt + max_tokens fit the free pages"),
    "prefill_chunk": (int, "paged: prompt tokens prefilled per engine iteration; a longer prompt is "
                           "prefilled in chunks between decode steps of the running requests"),
    "default_max_tokens": (int, "max_tokens for chat requests that do not set it (capped by the context)"),
    "max_request_bytes": (int, "largest HTTP request body accepted; a larger one gets 413 before it is parsed "
                               "(all roles, the router included)"),
    "upstream": (str, "router: URL of a `jkv serve --role all` server (repeatable)"),
    "health_interval": (float, "router: seconds between /health checks of each upstream"),
    "health_timeout": (float, "router: seconds before a /health check counts as failed"),
    "upstream_timeout": (float, "router: seconds an upstream may take to answer one request"),
    "graceful_timeout": (float, "on SIGTERM/SIGINT, seconds to let in-flight requests finish before exit"),
    "log_level": (str, "debug, info, warning or error"),
    "disaggregation": (str, "role all/decode: SmartGen transfer mode full, partial, +profile, +parallel or "
                            "smartgen (role decode default: smartgen). The disaggregated engine batches "
                            "continuously: a request joins the running decode batch once its prefill hand-off "
                            "arrives"),
    "num_prefill_workers": (int, "role all --disaggregation: local prefill worker processes to start"),
    "prefill_worker": (str, "role decode: transport address (main|bulk) of a prefill worker, as a "
                            "`--role prefill` server logs it and reports on /health (repeatable)"),
    "selector": (str, "sparse-attention selector shared by prefill and decode (infinigen, quest, oracle, "
                      "streamingllm, ...); every role of one deployment must use the same one"),
    "selector_file": (str, "load the selector from this file (jkv.disagg.selectors.save_selector) instead "
                           "of building it from --selector"),
    "transport": (str, "KV transport between prefill and decode: tcp, shm or rdma"),
    "bandwidth": (str, "prefill: pace this worker's link (e.g. 1gbit); all/decode: the link estimate of "
                       "Eq. 2 and the pace of local prefill workers"),
    "strategy": (str, "proactive choice: profile, sequential, random, streaming or oracle"),
    "spec_ratio": (float, "speculative transfer cap: fraction of a request's blocks per decode step"),
    "max_blocks": (int, "M, KV blocks per layer"),
    "profile": (str, "`jkv profile` file (needed by strategy profile unless --kr-fraction is set)"),
    "kr_fraction": (float, "force Kr (proactive blocks) to this fraction of all blocks instead of Eq. 2"),
    "on_failure": (str, "when a prefill worker dies: fail its requests (error event) or recompute their KV"),
    "lease_s": (float, "a prefill worker frees a request's KV after this long without decode activity"),
    "transfer_timeout": (float, "seconds before a silent transport peer counts as dead"),
    "min_budget": (int, "sparse selection keeps at least this many tokens per request, "
                        "k = min(N, max(ceil(0.2 N), min_budget)), and requests of up to min_budget tokens "
                        "(prompt + generated) decode densely, exactly like the single-process server; "
                        "0 keeps the bare 20%% ratio"),
    "transport_listen": (str, "role prefill: host:port of the transport endpoint (default loopback, free port)"),
    "worker_name": (str, "role prefill: the worker's transport name, unique per deployment (default "
                         "prefill-<pid>)"),
    "prefill": (str, "router: URL of a `jkv serve --role prefill` server (repeatable)"),
    "decode": (str, "router: URL of a `jkv serve --role decode` server (repeatable)"),
}


def add_serve_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config", help="YAML (.yaml/.yml) or TOML (.toml) file with the options below "
                                    "(flags given on the command line win)")
    defaults = ServeConfig.__dataclass_fields__
    for name, (typ, help_) in _HELP.items():
        default = defaults[name].default
        shown = "" if default in (None, ()) else f" (default: {default})"
        kw = dict(type=typ, default=argparse.SUPPRESS, help=help_ + shown)
        if name in LIST_OPTIONS:
            kw["action"] = "append"
        if name == "role":
            kw["choices"] = ROLES
        p.add_argument("--" + name.replace("_", "-"), **kw)


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML ({e})") from None
    elif path.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML ({e})") from None
    else:
        raise ValueError(f"config file {path} must end in .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value, not {type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _HELP:
            raise ValueError(f"config file {path}: unknown option {key!r}; known: {', '.join(sorted(_HELP))}")
        if name in LIST_OPTIONS:
            value = [value] if isinstance(value, str) else list(value)
        elif value is None:
            pass  # an explicit null keeps the option unset
        else:
            typ = _HELP[name][0]
            try:
                value = typ(value)
            except (TypeError, ValueError):
                raise ValueError(f"config file {path}: {key}={value!r} must be a {typ.__name__}") from None
        out[name] = value
    return out


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    merged = read_config_file(args.config) if getattr(args, "config", None) else {}
    merged.update({k: v for k, v in vars(args).items() if k in _HELP})
    return ServeConfig(**merged)


def describe(cfg: ServeConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))
