"""CALVO loading-aware scheduling: pipelined L3 -> L2 -> L1 loading, cost model, policies."""
from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage, Task
from jkv.scheduling.cost_model import CostModel
from jkv.scheduling.pipeline import (LoadingPipeline, PipelineConfig, PipelineResult,
                                     StageFunctions, run_serialized)
from jkv.scheduling.policies import POLICY_NAMES, Policy, RequestInfo, make_policy

__all__ = ["CostModel", "LoadingPipeline", "POLICY_NAMES", "PipelineConfig", "PipelineCore",
           "PipelineRequest", "PipelineResult", "Policy", "RequestInfo", "Stage",
           "StageFunctions", "Task", "make_policy", "run_serialized"]
