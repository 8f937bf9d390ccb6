"""Which checkpoint tensor is split across tensor-parallel ranks, on which dim (data + pure functions).

`SHARD_DIM` maps the module (or parameter) name a tensor belongs to onto the dim it is split on:
0 = output rows (column-parallel: each rank computes a slice of heads / channels / vocabulary),
1 = input columns (row-parallel: partial sums, one all-reduce after). Anything not listed is
replicated: norms, the router, the low-rank MLA projections (`q_a_proj`, `kv_a_proj_with_mqa`,
whose latent every head reads), the DSA indexer (small; replicated so top-k is identical on every
rank), KDA's `f_a_proj`/`g_a_proj` (rank-128 bottlenecks), `routed_expert_down_proj` (every rank's
experts read the full latent) and the AttnRes projections. Routed experts are not split: expert
parallelism gives each rank whole experts (`engine.parallel.ep`).

`A_log` is split on its logical [num_heads] view (it is stored padded to 128 entries).
The range maths (`shard_range`) lives below, in `engine.parallel.mesh`, which the layers use too.
"""

from __future__ import annotations

import torch

from engine.parallel.mesh import shard_range
from engine.weights.names import TensorSpec, is_vision_tensor

SHARD_DIM: dict[str, int] = {
    # vocabulary
    "embed_tokens": 0, "lm_head": 0,
    # KDA: per-head projections, short convs, decay and gate parameters; o_proj row-parallel
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0,
    "f_b_proj": 0, "dt_bias": 0, "A_log": 0, "b_proj": 0, "g_proj": 0, "g_b_proj": 0, "o_proj": 1,
    # MLA: per-head up-projections (q_proj is Kimi-Linear's direct query)
    "q_b_proj": 0, "kv_b_proj": 0,
    # dense layer-0 MLP and shared experts
    "gate_proj": 0, "up_proj": 0, "down_proj": 1,
    # latent MoE: the up-projection reads this rank's slice of the reduced latent
    "routed_expert_up_proj": 1,
}


def module_name(tensor_name: str) -> str:
    """`...self_attn.q_proj.weight` -> `q_proj`; `...self_attn.dt_bias` -> `dt_bias`."""
    parts = tensor_name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def shard_dim(spec: TensorSpec) -> int | None:
    """Dim `spec` is split on across tensor-parallel ranks, or None (replicated or an expert)."""
    if spec.expert is not None or spec.target is None or is_vision_tensor(spec.name):
        return None  # the vision tower is replicated on every rank (see KimiForCausalLM.vision)
    return SHARD_DIM.get(module_name(spec.name))


def take_shard(full: torch.Tensor, spec: TensorSpec, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of a full tensor (a view); replicated tensors come back whole."""
    dim = shard_dim(spec)
    if dim is None or world == 1:
        return full
    start, stop = shard_range(full.shape[dim], rank, world)
    return full.narrow(dim, start, stop - start)
