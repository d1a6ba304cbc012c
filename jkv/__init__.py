"""jkv: disaggregated LLM inference on thin networks (JAX/Pallas)."""
from .api import LLM
from .disagg.config import Disaggregation
from .outputs import RequestMetrics, RequestOutput
from .sampling import SamplingParams
from .transfer.plan import TransferConfig

__all__ = ["Disaggregation", "LLM", "RequestMetrics", "RequestOutput", "SamplingParams", "TransferConfig"]
