"""`Disaggregation`: how `LLM` splits prefill and decode across worker processes."""
from __future__ import annotations

import dataclasses

from jkv.selection.base import DEFAULT_MIN_BUDGET, check_min_budget
from jkv.transfer.plan import TransferConfig
from transport import parse_bandwidth

ON_FAILURE = ("fail", "recompute")


@dataclasses.dataclass(frozen=True)
class Disaggregation:
    """mode: full | partial | +profile | +parallel | smartgen; selector: a jkv.selection name;
    transport: tcp | shm; bandwidth: paced link of each prefill worker ("1gbit", None = unpaced);
    prefill_workers: local prefill processes to start (ignored when `addresses` lists running
    ones); strategy: proactive choice (profile, sequential, random, streaming, oracle);
    profile: path of a `jkv profile` file (needed by strategy profile unless kr_fraction is set);
    kr_fraction: force Kr as a fraction of all blocks (else Eq. 2 from profile Tp and bandwidth);
    on_failure: "fail" the requests of a dead prefill worker, or "recompute" their KV locally;
    lease_s: a prefill worker frees a request's KV after this long without decode activity;
    model_spec: how workers load the model when LLM was given a Model object;
    compression: "off" | "auto" | a pipeline id (KVServe, jkv.compression.policy), with
    compression_options {"profiles": [files], "workload", "q_min", "t_slo_s"}; lookahead: layer
    lookahead of on-demand fetches (None: on in smartgen mode; jkv/disagg/lookahead.py);
    min_budget: the selection budget's floor in tokens, k = min(N, max(ceil(max_ratio*N), min_budget)),
    so requests of up to min_budget cached tokens decode densely (SelectorConfig.min_budget; 0: the
    bare ratio)."""

    mode: str = "smartgen"
    selector: str = "infinigen"
    transport: str = "tcp"
    bandwidth: str | float | None = "1gbit"
    prefill_workers: int = 1
    strategy: str = "profile"
    spec_ratio: float = 0.10
    max_blocks: int = 1024
    profile: str | None = None
    kr_fraction: float | None = None
    on_failure: str = "fail"
    lease_s: float = 300.0
    timeout_s: float = 5.0
    selector_options: dict = dataclasses.field(default_factory=dict)
    model_spec: str | None = None
    addresses: tuple[str, ...] = ()
    secret: str | None = None
    compression: str = "off"
    compression_options: dict = dataclasses.field(default_factory=dict)
    lookahead: bool | None = None
    min_budget: int = DEFAULT_MIN_BUDGET

    def __post_init__(self):
        if self.transport not in ("tcp", "shm", "rdma"):
            raise ValueError(f"transport={self.transport!r} must be tcp, shm or rdma")
        if not isinstance(self.prefill_workers, int) or self.prefill_workers < 1:
            raise ValueError(f"prefill_workers={self.prefill_workers!r} must be an int >= 1")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure={self.on_failure!r} must be one of {ON_FAILURE}")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s={self.lease_s!r} must be > 0 seconds")
        if self.bandwidth is not None:
            parse_bandwidth(self.bandwidth)  # raises naming the value
        check_min_budget(self.min_budget)
        if "min_budget" in self.selector_options:
            raise ValueError(f"selector_options min_budget={self.selector_options['min_budget']!r}: set "
                             "Disaggregation(min_budget=...) instead (it applies to every selector)")
        self.compression_config()  # validates compression and its options
        self.transfer_config()  # validates mode, strategy, spec_ratio, max_blocks, kr_fraction

    @property
    def bandwidth_bps(self) -> float | None:
        return None if self.bandwidth is None else parse_bandwidth(self.bandwidth)

    def compression_config(self):
        from jkv.compression.policy import CompressionConfig
        return CompressionConfig.from_options(self.compression, self.compression_options)

    def compression_policy(self):
        """The decode worker's per-request chooser (None when off); B starts at the paced rate."""
        if self.compression == "off":
            return None
        from jkv.compression.policy import CompressionPolicy
        return CompressionPolicy(self.compression_config(), bandwidth_bps=self.bandwidth_bps)

    def transfer_config(self, **overrides) -> TransferConfig:
        kw = dict(mode=self.mode, strategy=self.strategy, spec_ratio=self.spec_ratio, max_blocks=self.max_blocks,
                  kr_fraction=self.kr_fraction, bandwidth_bps=self.bandwidth_bps, lookahead=self.lookahead)
        kw.update(overrides)
        return TransferConfig(**kw)
