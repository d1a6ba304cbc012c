"""Disaggregated prefill and decode workers connected by `transport/` (SmartGen §4)."""
from jkv.disagg.config import Disaggregation

__all__ = ["Disaggregation"]
