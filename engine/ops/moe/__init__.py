"""Routed-expert compute (spec section 5): the sum over each token's selected experts.

`routed_experts` is the public op: a gather + batched matmul for the few routes of a decode step
(only the selected experts' weights are read and dequantised), a sort + grouped GEMM for prefill.
`reference.routed_experts_reference` is the per-expert loop it is tested against. Expert stacks
are dense tensors or `MXFP4(packed, scale)`.
"""

from engine.ops.moe.grouped import gathered_experts, grouped_experts, routed_experts, sort_routes
from engine.ops.moe.weights import MXFP4, ExpertMatrix

__all__ = ["MXFP4", "ExpertMatrix", "gathered_experts", "grouped_experts", "routed_experts", "sort_routes"]
