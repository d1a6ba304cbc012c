"""jkv: disaggregated LLM inference on thin networks (JAX/Pallas)."""
from .api import LLM
from .outputs import RequestMetrics, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
