"""`jkv serve` configuration: frozen dataclasses, CLI flags, and the same keys from YAML/TOML.

`ServeConfig` holds the server's own options, in `batcher` the colocated engine's `BatcherConfig`,
and in `disagg` the `Disaggregation` of the SmartGen roles (which holds the `TransferConfig`): each
option lives in exactly one dataclass.
Flags and file keys stay flat (`--strategy`, `strategy:`); `FLAGS` maps each to its field
(`disagg.transfer.strategy`).

Precedence: built-in defaults < `--config FILE` < flags given on the command line. File keys
are the flag names with '_' or '-' (`max_slots` or `max-slots`); an unknown key is an error
naming the known ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import NamedTuple

from jkv.disagg.config import Disaggregation
from jkv.serving.admission import SCHEDULES
from jkv.serving.batcher import BatcherConfig
from jkv.serving.routing import ROUTING_POLICIES, RoutingConfig
from jkv.transfer.plan import TransferConfig
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
    tensor_parallel: int = 1
    default_max_tokens: int = 256
    max_request_bytes: int = 4 * 1024 * 1024
    upstream: tuple[str, ...] = ()
    health_interval: float = 2.0
    health_timeout: float = 1.0
    upstream_timeout: float = 600.0
    graceful_timeout: float = 30.0
    log_level: str = "info"
    # role all: run the disaggregated engine instead of the dense batcher (`--disaggregation MODE`,
    # which also sets disagg.transfer.mode; role decode always is)
    disaggregated: bool = False
    prefill_restarts: int = 5
    selector_file: str | None = None
    transport_listen: str | None = None
    transport_advertise: str | None = None
    worker_name: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    # the colocated engine's batch, KV cache and prefix-cache tiers (role all); the disaggregated decode
    # engine takes its max_slots, max_model_len and page pool from here too
    batcher: BatcherConfig = dataclasses.field(default_factory=BatcherConfig)
    # the router's choice of upstream: policy (--routing) and cache-aware routing's options
    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
    # the SmartGen roles' settings: the decode engine's (role decode, role all disaggregated) and
    # the prefill worker's (selector, transport, bandwidth, lease_s, timeout_s); the model comes
    # from `model`, the prefill worker addresses are disagg.addresses
    disagg: Disaggregation = dataclasses.field(default_factory=Disaggregation)
    # role all spanning processes (jkv/serving/replica.py); unset: the JKV_* variables, else one process
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        for name in ("upstream", "prefill", "decode"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        for name in ("default_max_tokens", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("health_interval", "health_timeout", "upstream_timeout", "graceful_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        self._check_roles()
        if self.uses_disaggregation and self.batcher.kv_layout != "paged":
            raise ValueError(f"--kv-layout {self.batcher.kv_layout} is for the colocated engine; the disaggregated "
                             "decode engine keeps its KV in the paged cache only (--page-size and --num-pages size "
                             "it): drop --kv-layout or pass --kv-layout paged")
        for u in self.upstream + self.prefill + self.decode:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"upstream {u!r} must be an http:// or https:// URL")
        dis = self.disagg
        if self.uses_disaggregation and dis.transfer.mode != "full" and dis.transfer.strategy in ("profile", "oracle") \
                and dis.profile is None:
            raise ValueError(f"--strategy {dis.transfer.strategy} (mode {dis.transfer.mode}) needs an importance "
                             "profile: pass --profile FILE from `jkv profile`, or use --strategy sequential / "
                             "streaming / random")
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
        if self.role == "decode" and not self.disagg.addresses:
            raise ValueError("role=decode needs at least one --prefill-worker ADDRESS (the transport address a "
                             "`jkv serve --role prefill` logs and reports on /health)")
        if self.role != "decode" and self.disagg.addresses:
            raise ValueError(f"--prefill-worker is only for --role decode, not role={self.role!r}")
        if self.transport_advertise is not None and self.role != "prefill":
            raise ValueError(f"--transport-advertise is only for --role prefill, not role={self.role!r}")
        if self.transport_advertise is not None and "|" not in self.transport_advertise:
            raise ValueError(f"--transport-advertise {self.transport_advertise!r} must be a main|bulk pair, e.g. "
                             "jkv-prefill-a:7100|jkv-prefill-a:7101")
        if self.disaggregated and self.role not in ("all", "decode"):
            raise ValueError(f"--disaggregation is for --role all or decode, not role={self.role!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} must be >= 1 (1: one device)")
        if self.tensor_parallel != 1 and self.role == "router":
            raise ValueError(f"--tensor-parallel {self.tensor_parallel} is for the roles that load a model (all, "
                             "prefill, decode), not --role router")
        if self.prefill_restarts < 0:
            raise ValueError(f"prefill_restarts={self.prefill_restarts} must be >= 0 (0: never restart)")
        if self.disagg.timeout_s <= 0:
            raise ValueError(f"transfer_timeout={self.disagg.timeout_s} must be > 0 seconds")

    def batcher_config(self, max_model_len: int) -> BatcherConfig:
        """The colocated engine's `BatcherConfig` (max_model_len: capped to the model's context)."""
        return dataclasses.replace(self.batcher, max_model_len=max_model_len)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def uses_disaggregation(self) -> bool:
        return self.role == "decode" or (self.role == "all" and self.disaggregated)


def on_off(value) -> bool:
    """A boolean option's value: true/false, on/off, yes/no, 1/0 (any case), or a YAML/TOML bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "on", "yes", "1"):
        return True
    if text in ("false", "off", "no", "0"):
        return False
    raise ValueError(f"{value!r} is not a boolean: use true or false")


on_off.__name__ = "bool"  # argparse and the file reader name the type in their errors


class Flag(NamedTuple):
    """One `jkv serve` flag / config file key: its value's type, its help, and the ServeConfig field
    it sets (a dotted path; None: the field named like the flag). `switch`: a bool field the flag
    also turns on when given a value (--disaggregation MODE both sets the mode and enables it)."""
    type: type
    help: str
    field: str | None = None
    switch: str | None = None


# flag -> (type, help[, field path[, switch]]), see `Flag`. Defaults come from ServeConfig; argparse
# defaults are SUPPRESSed so we can tell which flags the user actually gave (they override the file).
_TABLE = {
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
    "tensor_parallel": (int, "shard the weights and the KV cache over this many devices (attention heads, MLP "
                             "and vocabulary split over a (\"data\", \"tensor\") mesh; docs/scale.md); a prefill "
                             "and a decode role may run different degrees (the KV crosses per KV-head slice); "
                             "--role all --disaggregation starts its local prefill workers at the same degree"),
    "max_slots": (int, "decode slots = the continuous batch size; more requests queue", "batcher.max_slots"),
    "max_model_len": (int, "max prompt + generated tokens per request; sets the per-slot KV length",
                      "batcher.max_model_len"),
    "kv_layout": (str, "role all: paged = one paged KV cache shared by all requests (memory and decode "
                       "cost follow each request's own length) with chunked prefill; slots = one "
                       "max-model-len KV cache per slot, every decode step attends over all of it "
                       "(the previous engine, kept for comparison)", "batcher.kv_layout"),
    "page_size": (int, "paged (and the disaggregated decode engine): tokens per KV page", "batcher.page_size"),
    "num_pages": (int, "paged (and the disaggregated decode engine): KV pages in the pool, one of them the "
                       "reserved null page (default: max-slots x ceil(max-model-len / page-size) + 1, the slot "
                       "layout's KV memory); paged: a request waits in the queue until its prompt + max_tokens "
                       "fit the free pages; decode: a request that does not fit fails with the reason",
                       "batcher.num_pages"),
    "prefill_chunk": (int, "paged: prompt tokens prefilled per engine iteration; a longer prompt is "
                           "prefilled in chunks between decode steps of the running requests", "batcher.prefill_chunk"),
    "enable_prefix_caching": (on_off, "paged: automatic prefix caching: requests whose prompts share leading full "
                                      "KV pages (a system prompt, earlier turns) share those pages and skip their "
                                      "prefill; cached pages no request holds are evicted least recently used "
                                      "first when pages run short; the disaggregated decode role keeps finished "
                                      "prompts' pages and later requests move only their new KV (docs/kvcache.md). "
                                      "`--enable-prefix-caching false` turns it off",
                                      "batcher.enable_prefix_caching"),
    "prefix_cache_host_bytes": (int, "paged, with prefix caching: bytes of host memory for a second tier of the "
                                     "prefix cache; cached pages evicted from the device are kept there (LRU) and "
                                     "copied back on a hit instead of recomputed (0: no host tier)",
                                     "batcher.prefix_cache_host_bytes"),
    "prefix_cache_l3": (str, "paged, with prefix caching: a remote third tier shared by servers, redis://host:port[/db] "
                             "(Redis or Valkey) or jkvpool://ADDRESS (a `jkv pool` server; secret in $JKV_SECRET); "
                             "pages evicted from the device are written there in the background and a prompt's "
                             "pages missing in device and host memory are read from it; when it fails or is slow "
                             "requests recompute (jkv_prefix_cache_l3_errors_total) and it is retried later",
                             "batcher.prefix_cache_l3"),
    "prefix_cache_l3_timeout": (float, "seconds one L3 operation may take; a request never waits longer for L3",
                                "batcher.prefix_cache_l3_timeout"),
    "schedule": (str, "paged: which waiting request is admitted next (CALVO, docs/calvo.md): fifo, sjf (smallest "
                      "modelled prefix-load + prefill time), srpt (smallest remaining), edf (earliest SLO deadline: "
                      "body field slo_ms or header x-jkv-slo-ms) or lstf (least slack)", "batcher.schedule"),
    "cost_model": (str, "paged, --schedule sjf/srpt/lstf: cost model JSON (jkv.scheduling.CostModel.save) instead "
                        "of probing the engine at start-up; refitted from live measurements either way",
                   "batcher.cost_model"),
    "default_max_tokens": (int, "max_tokens for chat requests that do not set it (capped by the context)"),
    "max_request_bytes": (int, "largest HTTP request body accepted; a larger one gets 413 before it is parsed "
                               "(all roles, the router included)"),
    "upstream": (str, "router: URL of a `jkv serve --role all` server (repeatable)"),
    "routing": (str, "router: least-load (fewest in-flight tokens) or cache-aware (the upstream that holds the "
                     "longest prefix of the request's text, as the router remembers sending it, unless its load "
                     "exceeds the least loaded one's by --balance-abs-tokens and --balance-rel; docs/serve.md)",
                "routing.policy"),
    "routing_chunk_chars": (int, "router, cache-aware: characters per hashed chunk of a request's text (64: about one "
                                 "16-token KV page)", "routing.chunk_chars"),
    "routing_record_chunks": (int, "router, cache-aware: prefix chunks remembered per upstream, least recently used "
                                   "dropped first; about an instance's prefix-cache tokens x 4 / chunk chars",
                              "routing.record_chunks"),
    "routing_min_match": (float, "router, cache-aware: fraction of a request's chunks an upstream must hold for the "
                                 "prefix to choose it; below it a new prefix goes to the upstream with the smallest "
                                 "record", "routing.min_match"),
    "balance_abs_tokens": (int, "router, cache-aware: the prefix's upstream is skipped for the least loaded one "
                                "when its in-flight tokens exceed that one's by more than this ...",
                           "routing.balance_abs_tokens"),
    "balance_rel": (float, "router, cache-aware: ... and are more than this many times that one's",
                    "routing.balance_rel"),
    "health_interval": (float, "router: seconds between /health checks of each upstream"),
    "health_timeout": (float, "router: seconds before a /health check counts as failed"),
    "upstream_timeout": (float, "router: seconds an upstream may take to answer one request"),
    "graceful_timeout": (float, "on SIGTERM/SIGINT, seconds to let in-flight requests finish before exit"),
    "log_level": (str, "debug, info, warning or error"),
    "disaggregation": (str, "role all/decode: SmartGen transfer mode full, partial, +profile, +parallel or "
                            "smartgen (role decode default: smartgen). The disaggregated engine batches "
                            "continuously: a request joins the running decode batch once its prefill hand-off "
                            "arrives", "disagg.transfer.mode", "disaggregated"),
    "num_prefill_workers": (int, "role all --disaggregation: local prefill worker processes to start",
                            "disagg.prefill_workers"),
    "prefill_restarts": (int, "role all --disaggregation: a local prefill worker that dies is restarted with "
                              "backoff; give up after this many quick failures in a row (each within 60 s of its "
                              "start); 0: never restart"),
    "prefill_worker": (str, "role decode: transport address (main|bulk) of a prefill worker, as a "
                            "`--role prefill` server logs it and reports on /health (repeatable)", "disagg.addresses"),
    "selector": (str, "sparse-attention selector shared by prefill and decode (infinigen, quest, oracle, "
                      "streamingllm, ...); every role of one deployment must use the same one", "disagg.selector"),
    "selector_file": (str, "load the selector from this file (jkv.disagg.selectors.save_selector) instead "
                           "of building it from --selector"),
    "transport": (str, "KV transport between prefill and decode: tcp, shm or rdma", "disagg.transport"),
    "bandwidth": (str, "prefill: pace this worker's link (e.g. 1gbit); all/decode: the link estimate of "
                       "Eq. 2 and the pace of local prefill workers", "disagg.bandwidth"),
    "strategy": (str, "proactive choice: profile, sequential, random, streaming or oracle", "disagg.transfer.strategy"),
    "spec_ratio": (float, "speculative transfer cap: fraction of a request's blocks per decode step",
                   "disagg.transfer.spec_ratio"),
    "max_blocks": (int, "M, KV blocks per layer", "disagg.transfer.max_blocks"),
    "profile": (str, "`jkv profile` file (needed by strategy profile unless --kr-fraction is set)", "disagg.profile"),
    "kr_fraction": (float, "force Kr (proactive blocks) to this fraction of all blocks instead of Eq. 2",
                    "disagg.transfer.kr_fraction"),
    "on_failure": (str, "when a prefill worker dies: fail its requests (error event) or recompute their KV",
                   "disagg.on_failure"),
    "prefill_prefix_cache_tokens": (int, "prefill, and role all --disaggregation's local prefill workers (when "
                                         "--enable-prefix-caching is on): tokens of prompt KV the prefill worker's "
                                         "own prefix cache keeps (host memory, least recently used evicted); a "
                                         "prompt that starts with cached pages is prefilled from its first "
                                         "uncached token (jkv_prefill_computed_tokens_total); 0: off",
                                    "disagg.prefill_prefix_cache_tokens"),
    "lease_s": (float, "a prefill worker frees a request's KV after this long without decode activity",
                "disagg.lease_s"),
    "transfer_timeout": (float, "seconds before a silent transport peer counts as dead", "disagg.timeout_s"),
    "min_budget": (int, "sparse selection keeps at least this many tokens per request, "
                        "k = min(N, max(ceil(0.2 N), min_budget)), and requests of up to min_budget tokens "
                        "(prompt + generated) decode densely, exactly like the single-process server; "
                        "0 keeps the bare 20%% ratio", "disagg.min_budget"),
    "transport_listen": (str, "role prefill: host:port of the transport endpoint (default loopback, free port), or "
                              "main|bulk host:port pair (fixed ports, e.g. in a container)"),
    "transport_advertise": (str, "role prefill: the main|bulk address decode servers and the router reach this "
                                 "worker at when it differs from the bound one (a container behind a Service); "
                                 "reported on /health"),
    "worker_name": (str, "role prefill: the worker's transport name, unique per deployment (default "
                         "prefill-<pid>)"),
    "coordinator_address": (str, "role all across processes: rank 0's HOST:PORT for jax.distributed; every rank runs "
                                 "the same command, rank 0 serves HTTP and broadcasts each engine step, the others "
                                 "follow (env JKV_COORDINATOR_ADDRESS; docs/scale.md)"),
    "num_processes": (int, "role all across processes: ranks in the replica (env JKV_NUM_PROCESSES)"),
    "process_id": (int, "role all across processes: this process's rank, 0 serves HTTP (env JKV_PROCESS_ID)"),
    "prefill": (str, "router: URL of a `jkv serve --role prefill` server (repeatable)"),
    "decode": (str, "router: URL of a `jkv serve --role decode` server (repeatable)"),
}


FLAGS = {name: Flag(*row) for name, row in _TABLE.items()}


def field_path(flag: str) -> str:
    """The dotted ServeConfig field a flag (underscore spelling) sets, e.g. "disagg.transfer.strategy"."""
    return FLAGS[flag].field or flag


def field_value(cfg: ServeConfig, path: str):
    return functools.reduce(getattr, path.split("."), cfg)


def add_serve_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config", help="YAML (.yaml/.yml) or TOML (.toml) file with the options below "
                                    "(flags given on the command line win)")
    defaults = ServeConfig()
    for name, flag in FLAGS.items():
        default = None if flag.switch else field_value(defaults, field_path(name))
        shown = "" if default in (None, ()) else f" (default: {default})"
        kw = dict(type=flag.type, default=argparse.SUPPRESS, help=flag.help + shown)
        if name in LIST_OPTIONS:
            kw["action"] = "append"
        if flag.type is on_off:  # `--flag` alone turns it on; `--flag false` off
            kw.update(nargs="?", const=True, metavar="true|false")
        if name == "role":
            kw["choices"] = ROLES
        if name == "routing":
            kw["choices"] = ROUTING_POLICIES
        if name == "schedule":
            kw["choices"] = SCHEDULES
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
        if name not in FLAGS:
            raise ValueError(f"config file {path}: unknown option {key!r}; known: {', '.join(sorted(FLAGS))}")
        if name in LIST_OPTIONS:
            value = [value] if isinstance(value, str) else list(value)
        elif value is None:
            pass  # an explicit null keeps the option unset
        else:
            typ = FLAGS[name].type
            try:
                value = typ(value)
            except (TypeError, ValueError):
                raise ValueError(f"config file {path}: {key}={value!r} must be a {typ.__name__}") from None
        out[name] = value
    return out


def config_from_flags(values: dict) -> ServeConfig:
    """ServeConfig from flag name (underscore spelling) -> value, each value put at its flag's field."""
    kwargs = {"": {}, "batcher": {}, "disagg": {}, "disagg.transfer": {}, "routing": {}}  # keyword arguments of each nested dataclass
    for name, value in values.items():
        flag = FLAGS[name]
        if flag.switch:
            if value is None:  # an explicit null leaves the switch off and the field at its default
                continue
            kwargs[""][flag.switch] = True
        if name in LIST_OPTIONS:
            value = tuple(value)
        parent, _, leaf = field_path(name).rpartition(".")
        kwargs[parent][leaf] = value
    try:
        disagg = Disaggregation(transfer=TransferConfig(**kwargs["disagg.transfer"]), **kwargs["disagg"])
    except ValueError as e:  # the nested configs name their fields; say which flag set a renamed one
        renamed = [f"{leaf} is --{name.replace('_', '-')}" for name in values
                   if (leaf := field_path(name).rpartition(".")[2]) != name and f"{leaf}=" in str(e)]
        if not renamed:
            raise
        raise ValueError(f"{e} ({'; '.join(renamed)})") from None
    return ServeConfig(**kwargs[""], batcher=BatcherConfig(**kwargs["batcher"]), disagg=disagg,
                       routing=RoutingConfig(**kwargs["routing"]))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    merged = read_config_file(args.config) if getattr(args, "config", None) else {}
    merged.update({k: v for k, v in vars(args).items() if k in FLAGS})
    return config_from_flags(merged)


def describe(cfg: ServeConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))
