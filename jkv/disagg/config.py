"""`Disaggregation`: how `LLM` splits prefill and decode across worker processes."""
from __future__ import annotations

import dataclasses

from jkv.selection.base import DEFAULT_MIN_BUDGET, check_min_budget
from jkv.transfer.plan import TransferConfig
from transport import parse_bandwidth

ON_FAILURE = ("fail", "recompute")


@dataclasses.dataclass(frozen=True)
class Disaggregation:
    """transfer: the block-transfer policy (mode full | partial | +profile | +parallel | smartgen,
    strategy, spec_ratio, max_blocks, kr_fraction, lookahead, ...; jkv.transfer.plan.TransferConfig);
    its bandwidth_bps is filled from `bandwidth` here, so leave it None;
    selector: a jkv.selection name; transport: tcp | shm | rdma; bandwidth: paced link of each prefill
    worker ("1gbit", None = unpaced) and the link estimate of Eq. 2; prefill_workers: local prefill
    processes to start (ignored when `addresses` lists running ones);
    profile: path of a `jkv profile` file (needed by strategy profile unless transfer.kr_fraction is set);
    on_failure: "fail" the requests of a dead prefill worker, or "recompute" their KV locally;
    lease_s: a prefill worker frees a request's KV after this long without decode activity;
    model_spec: how workers load the model when LLM was given a Model object;
    compression: "off" | "auto" | a pipeline id (KVServe, jkv.compression.policy), with
    compression_options {"profiles": [files], "workload", "q_min", "t_slo_s"};
    min_budget: the selection budget's floor in tokens, k = min(N, max(ceil(max_ratio*N), min_budget)),
    so requests of up to min_budget cached tokens decode densely (SelectorConfig.min_budget; 0: the
    bare ratio); prefill_prefix_cache_tokens: budget of each prefill worker's own prefix cache (a
    prompt that starts with cached pages is prefilled from its first uncached token,
    jkv/disagg/prefill_cache.py; 0: none; local workers get it where the decode side's prefix
    caching is on)."""

    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    selector: str = "infinigen"
    transport: str = "tcp"
    bandwidth: str | float | None = "1gbit"
    prefill_workers: int = 1
    profile: str | None = None
    on_failure: str = "fail"
    lease_s: float = 300.0
    timeout_s: float = 5.0
    selector_options: dict = dataclasses.field(default_factory=dict)
    model_spec: str | None = None
    addresses: tuple[str, ...] = ()
    secret: str | None = None
    compression: str = "off"
    compression_options: dict = dataclasses.field(default_factory=dict)
    min_budget: int = DEFAULT_MIN_BUDGET
    prefill_prefix_cache_tokens: int = 16384

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
        if not isinstance(self.prefill_prefix_cache_tokens, int) or self.prefill_prefix_cache_tokens < 0:
            raise ValueError(f"prefill_prefix_cache_tokens={self.prefill_prefix_cache_tokens!r} must be an int >= 0 "
                             "(tokens of KV; 0: no prefill prefix cache)")
        if "min_budget" in self.selector_options:
            raise ValueError(f"selector_options min_budget={self.selector_options['min_budget']!r}: set "
                             "Disaggregation(min_budget=...) instead (it applies to every selector)")
        self.compression_config()  # validates compression and its options
        if not isinstance(self.transfer, TransferConfig):
            raise TypeError(f"transfer={self.transfer!r} must be a jkv.transfer.plan.TransferConfig, e.g. "
                            "Disaggregation(transfer=TransferConfig(mode='smartgen', strategy='random'))")
        # One source for the link: `bandwidth` paces the local prefill workers and is the Tt of Eq. 2.
        if self.transfer.bandwidth_bps not in (None, self.bandwidth_bps):
            raise ValueError(f"transfer.bandwidth_bps={self.transfer.bandwidth_bps!r} disagrees with "
                             f"bandwidth={self.bandwidth!r}: set the link once, as Disaggregation(bandwidth=...), and "
                             "leave transfer.bandwidth_bps None (after dataclasses.replace(dis, bandwidth=...) pass "
                             "transfer=dataclasses.replace(dis.transfer, bandwidth_bps=None) too)")
        object.__setattr__(self, "transfer", dataclasses.replace(self.transfer, bandwidth_bps=self.bandwidth_bps))

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
