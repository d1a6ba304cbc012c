"""Service-aware KV compression (KVServe): pipeline, Bayesian profiling, online controller.

See docs/compression.md. Public entry points:
    spec = PipelineSpec.parse("hadamard+kivi4g32+zstd3")
    data = Pipeline(spec, calibration).encode_block(x, layer=l, kind="k")   # x: [H_kv, Nb, D]
    x_hat = decode_block(data)                                               # jnp [H_kv, Nb, D]
    result = bayesian_search(space, evaluate, SearchConfig(acc_threshold=0.97), cr_prior=nominal_cr)
    ctl = Controller.from_profile_files([load_profile(path)]); d = ctl.decide(Context(...))
    blobs = encode_request(pipe, StreamingPlan.from_scores(scores, 0.25), kv16)  # streaming-head pruning
"""
from jkv.compression.bandwidth import BandwidthEstimator
from jkv.compression.container import ContainerError
from jkv.compression.controller import Context, Controller, ControllerConfig, Decision, Profile
from jkv.compression.pipeline import (BlockInfo, Calibration, Pipeline, PipelineReport, compression_ratio,
                                      decode_block, inspect_block, measure)
from jkv.compression.profiling import (FidelityObjective, SearchConfig, bayesian_search, build_profile,
                                       exhaustive_search, load_profile, nominal_cr, pareto_front, save_profile)
from jkv.compression.streaming import (MaskedDecoder, StreamingConfig, StreamingPlan, decode_request,
                                       encode_request)
from jkv.compression.spec import (UNCOMPRESSED, CodecSpec, PipelineSpec, QuantizerSpec, TransformSpec,
                                  enumerate_space)

__all__ = ["BandwidthEstimator", "BlockInfo", "Calibration", "CodecSpec", "ContainerError", "Context", "Controller",
           "ControllerConfig", "Decision", "FidelityObjective", "Pipeline", "PipelineReport", "PipelineSpec", "Profile",
           "QuantizerSpec", "SearchConfig", "TransformSpec", "UNCOMPRESSED", "bayesian_search", "build_profile",
           "compression_ratio", "decode_block", "enumerate_space", "exhaustive_search", "inspect_block",
           "load_profile", "measure", "nominal_cr", "pareto_front", "save_profile", "MaskedDecoder",
           "StreamingConfig", "StreamingPlan", "decode_request", "encode_request"]
