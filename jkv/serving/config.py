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

from models import DEFAULT_MODEL

ROLES = ("all", "router")  # "prefill" / "decode" arrive with the disaggregated engine
UPSTREAM_KINDS = ("all", "prefill", "decode")


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
    default_max_tokens: int = 256
    upstream: tuple[str, ...] = ()
    health_interval: float = 2.0
    health_timeout: float = 1.0
    upstream_timeout: float = 600.0
    graceful_timeout: float = 30.0
    log_level: str = "info"

    def __post_init__(self):
        object.__setattr__(self, "upstream", tuple(self.upstream))
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {ROLES} (prefill/decode come with the "
                             "disaggregated engine)")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        for name in ("max_slots", "max_model_len", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("health_interval", "health_timeout", "upstream_timeout", "graceful_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.role == "router" and not self.upstream:
            raise ValueError("role=router needs at least one --upstream URL (a `jkv serve --role all` server)")
        if self.role != "router" and self.upstream:
            raise ValueError(f"--upstream is only for --role router, not role={self.role!r}")
        for u in self.upstream:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"upstream {u!r} must be an http:// or https:// URL")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level={self.log_level!r} must be debug, info, warning or error")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


# flag -> (type, help). Defaults come from ServeConfig; argparse defaults are SUPPRESSed so we
# can tell which flags the user actually gave (they override the config file).
_HELP = {
    "role": (str, "all: one process with the continuous-batching engine and the HTTP API; "
                  "router: a load-balancing proxy in front of --upstream servers"),
    "host": (str, "address to listen on; the default is loopback only, use 0.0.0.0 to expose"),
    "port": (int, "TCP port to listen on; 0 picks a free one (the bound port is logged)"),
    "model": (str, "registered name, Hugging Face directory or .gguf file (role all)"),
    "served_model_name": (str, "the model id clients send and /v1/models lists (default: --model)"),
    "dtype": (str, "weights/activations dtype: float32, bfloat16 or float16"),
    "max_slots": (int, "decode slots = the continuous batch size; more requests queue"),
    "max_model_len": (int, "max prompt + generated tokens per request; sets the per-slot KV length"),
    "default_max_tokens": (int, "max_tokens for chat requests that do not set it (capped by the context)"),
    "upstream": (str, "router: URL of a `jkv serve --role all` server (repeatable)"),
    "health_interval": (float, "router: seconds between /health checks of each upstream"),
    "health_timeout": (float, "router: seconds before a /health check counts as failed"),
    "upstream_timeout": (float, "router: seconds an upstream may take to answer one request"),
    "graceful_timeout": (float, "on SIGTERM/SIGINT, seconds to let in-flight requests finish before exit"),
    "log_level": (str, "debug, info, warning or error"),
}


def add_serve_arguments(p: argparse.ArgumentParser):
    p.add_argument("--config", help="YAML (.yaml/.yml) or TOML (.toml) file with the options below "
                                    "(flags given on the command line win)")
    defaults = ServeConfig.__dataclass_fields__
    for name, (typ, help_) in _HELP.items():
        default = defaults[name].default
        shown = "" if default in (None, ()) else f" (default: {default})"
        kw = dict(type=typ, default=argparse.SUPPRESS, help=help_ + shown)
        if name == "upstream":
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
        if name == "upstream":
            value = [value] if isinstance(value, str) else list(value)
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
