"""Service-aware KV compression (KVServe): pipeline, Bayesian profiling, online controller.

See docs/compression.md. Public entry points:
    PipelineSpec.parse("hadamard+kivi4g32+zstd3"), Pipeline(spec, calibration).encode_block(x, layer=, kind=)
    decode_block(bytes) -> jnp [H_kv, Nb, D]; measure(pipeline, blocks) -> PipelineReport
"""
from jkv.compression.container import ContainerError
from jkv.compression.pipeline import (BlockInfo, Calibration, Pipeline, PipelineReport, compression_ratio,
                                      decode_block, inspect_block, measure)
from jkv.compression.spec import (UNCOMPRESSED, CodecSpec, PipelineSpec, QuantizerSpec, TransformSpec,
                                  enumerate_space)

__all__ = ["BlockInfo", "Calibration", "CodecSpec", "ContainerError", "Pipeline", "PipelineReport",
           "PipelineSpec", "QuantizerSpec", "TransformSpec", "UNCOMPRESSED", "compression_ratio",
           "decode_block", "enumerate_space", "inspect_block", "measure"]
