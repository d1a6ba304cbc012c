"""TTFT metrics of a run: mean / p50 / p99 TTFT and SLO attainment (CALVO §4.2)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TTFTSummary:
    """Seconds; slo_attainment is the fraction of requests whose TTFT met their SLO
    (None when no SLOs were given)."""

    count: int
    mean_s: float
    p50_s: float
    p99_s: float
    slo_attainment: float | None

    def as_row(self) -> dict:
        return dataclasses.asdict(self)


def summarize(ttft_s: Sequence[float], slo_s: Sequence[float] | None = None) -> TTFTSummary:
    """ttft_s: f[n] per-request TTFT; slo_s: f[n] per-request TTFT budgets (same order)."""
    ttft = np.asarray(ttft_s, dtype=np.float64)
    if ttft.ndim != 1 or ttft.size == 0:
        raise ValueError(f"need a non-empty 1-D list of TTFTs, got shape {ttft.shape}")
    if np.isnan(ttft).any() or (ttft < 0).any():
        raise ValueError("TTFTs must be finite-or-inf and >= 0; a NaN means a request was lost")
    attainment = None
    if slo_s is not None:
        slo = np.asarray(slo_s, dtype=np.float64)
        if slo.shape != ttft.shape:
            raise ValueError(f"{slo.shape=} must match {ttft.shape=}")
        attainment = float(np.mean(ttft <= slo))
    return TTFTSummary(count=int(ttft.size), mean_s=float(ttft.mean()),
                       p50_s=float(np.percentile(ttft, 50)), p99_s=float(np.percentile(ttft, 99)),
                       slo_attainment=attainment)
