"""Parameter and byte counts of a config or checkpoint, computed from the tensor table alone.

Works at true K3.1 Pro dimensions without allocating anything: counts come from
`engine.weights.names.checkpoint_tensors`. "Active per token" follows the model card: every tensor
except the input embedding, with routed experts weighted by top_k / num_experts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.weights.names import TensorSpec, checkpoint_tensors
from engine.weights.random_init import storage_dtype
from engine.weights.safetensors_io import CheckpointFiles


def _component(spec: TensorSpec, config: ModelConfig) -> str:
    name = spec.name
    if name.startswith(("vision_tower.", "mm_projector.")):
        return "vision"
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith(config.weight_prefix + "lm_head"):
        return "lm_head"
    if ".experts." in name:
        return "routed_experts"
    if ".shared_experts." in name:
        return "shared_experts"
    if "block_sparse_moe." in name:
        return "moe_router_and_latent"
    if ".mlp." in name:
        return "dense_mlp"
    if ".self_attn." in name:
        layer = int(name.split("model.layers.")[1].split(".")[0])
        if ".indexer." in name:
            return "dsa_indexer"
        return "kda" if config.is_kda_layer(layer) else "mla"
    return "norms_and_attn_res"


def _params(spec: TensorSpec, config: ModelConfig) -> int:
    """Logical parameters (an MXFP4 byte holds two; scales and A_log's padding are not parameters)."""
    if spec.init == "a_log":
        return config.kda_num_heads
    if spec.kind == "packed":
        return spec.numel * 2
    if spec.kind == "scale":
        return 0
    return spec.numel


@dataclass
class Census:
    total: int = 0
    active: int = 0
    vision: int = 0
    by_component: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_by_dtype: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())


def census(config: ModelConfig, files: CheckpointFiles | None = None,
           float_dtype: torch.dtype = torch.bfloat16) -> Census:
    """Counts for `config`; bytes from the files' headers when given, else from the storage layout."""
    out = Census()
    expert_fraction = config.num_experts_per_token / config.num_experts if config.num_experts else 0.0
    for spec in checkpoint_tensors(config):
        n = _params(spec, config)
        comp = _component(spec, config)
        out.by_component[comp] += n
        if comp == "vision":
            out.vision += n
        else:
            out.total += n
            if comp == "routed_experts":
                out.active += n * expert_fraction
            elif comp != "embedding":
                out.active += n
        if files is None:
            dt = storage_dtype(spec, float_dtype)
            out.bytes_by_dtype[str(dt).removeprefix("torch.")] += spec.numel * dt.itemsize
    if files is not None:
        for info in files.tensors.values():
            out.bytes_by_dtype[info.dtype] += info.nbytes
    out.active = int(round(out.active))
    return out


def human(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def human_bytes(n: float) -> str:
    for suffix, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"
