"""Per-GPU memory plan of a tensor + expert-parallel deployment (behind `workbench plan`).

Every buffer a rank holds is budgeted, under the layout `engine.parallel` runs:
- weights by dtype: 1/world of the routed experts (MXFP4 packed + scales, uint8), 1/world of
  every split tensor (`engine.weights.shard`), all of the replicated ones, floats in the compute
  dtype (the engine converts fp32-stored tensors too);
- per-sequence state at `context` x `batch`: KDA state for this GPU's heads (constant in length),
  the MLA latent cache and the DSA indexer keys (replicated: every head reads the shared latent);
- activations of one prefill chunk (the session prefills in chunks, so a 1M prompt never exists
  as one [1M, hidden] tensor) and the workspaces of the blockwise kernels, including the
  indexer's fp32 score buffer: an unbudgeted [chunk, context] fp32 buffer is what ran other
  engines out of memory near 800K tokens (spec section 12);
- a runtime reserve: CUDA context, NCCL buffers and allocator fragmentation.

`plan_memory` returns a `MemoryPlan`; `format_plan` renders it with the verdict and, when it does
not fit, the smallest GPU count that would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

from engine.cache import KDAState, state_bytes
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.parallel.mesh import check_divisible
from engine.weights.names import checkpoint_tensors
from engine.weights.shard import shard_dim

GiB = 1024 ** 3
# blockwise kernels keep one fp32 block of at most this many elements live (indexer scores,
# MLA score/gather blocks), as engine.ops' references do
BLOCK_ELEMENTS = 16 * 1024 * 1024
RESERVE_FIXED = 4 * GiB  # CUDA context (~1 GiB) + NCCL channels and buffers (~1-2 GiB) + slack
RESERVE_FRACTION = 0.05  # allocator fragmentation, on top of everything else


@dataclass
class Item:
    name: str
    nbytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """Bytes per GPU, itemised; `total` against `gpu_mem` gives the verdict."""

    gpus: int
    gpu_mem: int
    context: int
    batch: int
    chunk: int
    dtype: str
    weights: list[Item]
    weights_by_dtype: dict[str, int]
    state: list[Item]
    activations: list[Item]
    reserve: Item = field(default_factory=lambda: Item("runtime reserve", 0))

    @property
    def weight_bytes(self) -> int:
        return sum(i.nbytes for i in self.weights)

    @property
    def total(self) -> int:
        return self.weight_bytes + sum(i.nbytes for i in self.state + self.activations) + self.reserve.nbytes

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_mem

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(total=self.total, fits=self.fits, free=self.gpu_mem - self.total)
        return out


@lru_cache(maxsize=4)  # one pass over K3.1 Pro's 497K tensor specs takes seconds
def _weight_totals(config: ModelConfig, dtype: torch.dtype) -> dict[tuple[str, str], int]:
    """Whole-model bytes in memory by (placement, dtype): placement = experts | split | replicated
    (the vision tower is replicated on every rank: 0.9 GB in bf16 at K3.1 Pro size)."""
    totals: dict[tuple[str, str], int] = {}
    for spec in checkpoint_tensors(config):
        # A_log is stored padded to 128 entries; the engine keeps its num_heads values
        numel = config.kda_num_heads if spec.init == "a_log" else spec.numel
        if spec.kind == "float":
            key_dtype, nbytes = str(dtype).removeprefix("torch."), numel * dtype.itemsize
        else:
            key_dtype, nbytes = "uint8", numel
        if spec.expert is not None:
            place = "experts"
        elif shard_dim(spec) is not None:
            place = "split"
        else:
            place = "replicated"
        totals[(place, key_dtype)] = totals.get((place, key_dtype), 0) + nbytes
    return totals


def _weights(config: ModelConfig, world: int, totals: dict[tuple[str, str], int]) -> tuple[list[Item], dict[str, int]]:
    share = {"experts": world, "split": world, "replicated": 1}
    by_place: dict[str, int] = {}
    by_dtype: dict[str, int] = {}
    for (place, dt), nbytes in totals.items():
        local = nbytes // share[place]
        by_place[place] = by_place.get(place, 0) + local
        by_dtype[dt] = by_dtype.get(dt, 0) + local
    e = config.num_experts
    items = [Item("routed experts", by_place.get("experts", 0), f"{e // world} of {e} per GPU, {config.expert_format}"),
             Item("split tensors", by_place.get("split", 0), f"1/{world}: heads, MLP widths, vocabulary"),
             Item("replicated tensors", by_place.get("replicated", 0),
                  "router, latent down-projection, MLA low-rank, indexer, norms, vision tower")]
    return items, by_dtype


def _state(config: ModelConfig, world: int, context: int, batch: int, dtype: torch.dtype) -> list[Item]:
    kda_layers, mla_layers = len(config.kda_layers), len(config.mla_layers)
    heads = config.kda_num_heads // world
    kda = sum(_numel(shape) * dt.itemsize for shape, dt in KDAState.shapes(config, batch, heads).values())
    cache = state_bytes(config, batch, context, dtype)
    return [Item("KDA state", kda * kda_layers, f"{heads} of {config.kda_num_heads} heads x {kda_layers} layers"),
            Item("MLA latent cache", cache["mla_latent"], f"replicated, {mla_layers} layers"),
            Item("DSA indexer keys", cache["indexer_keys"], "replicated")]


def _activations(config: ModelConfig, world: int, context: int, batch: int, chunk: int,
                 dtype: torch.dtype) -> list[Item]:
    c, a, f32 = config, dtype.itemsize, 4
    n = batch * chunk  # tokens in flight
    h = c.hidden_size
    blocks = c.num_attn_res_blocks
    # prefix, mixer input, FFN input and the block list, plus AttnRes' fp32 values and keys
    residual = (3 + blocks) * n * h * a + (2 * (blocks + 1) * n * h * f32 if c.attn_res_block_size else 0)
    kda = 8 * n * (c.kda_dim // world) * f32  # q, k, v, g, gate, output and the chunk-form factors
    heads = c.num_attention_heads // world
    mla = (n * heads * (c.qk_head_dim + 2 * c.kv_lora_rank) * f32  # q, absorbed q and latent output
           + batch * context * (c.kv_lora_rank + c.qk_rope_head_dim) * f32  # fp32 copy of the cache read
           + BLOCK_ELEMENTS * f32)  # one score / gathered-rows block
    latent = c.expert_in_dim
    moe = (n * (c.num_experts * f32 + 3 * latent * f32 + 3 * c.moe_intermediate_size * a)
           + 3 * c.moe_intermediate_size * latent * a)  # router scores, latents, one dequantized expert
    dense = 3 * n * (c.intermediate_size // world) * a if c.first_k_dense_replace else 0
    layers = {"KDA": kda, "MLA (with an fp32 read of the latent cache)": mla, "MoE": moe, "dense MLP": dense}
    largest = max(layers, key=layers.__getitem__)
    items = [Item("residual stream + AttnRes blocks", residual, f"{chunk}-token prefill chunk x batch {batch}"),
             Item("largest layer intermediates", layers[largest], largest)]
    if c.dsa is not None:
        topk = min(c.dsa.topk, context)
        one_shot = n * context * f32
        items.append(Item("DSA indexer scores + top-k", BLOCK_ELEMENTS * f32 + n * topk * (8 + f32),
                          f"blockwise fp32 scores; a one-shot [chunk, context] buffer would be "
                          f"{one_shot / GiB:.1f} GiB"))
    mla_layer = (c.kv_lora_rank + c.qk_rope_head_dim + (c.dsa.head_dim if c.dsa else 0)) * context * batch * a
    items.append(Item("cache growth transient", mla_layer // 2, "one layer's cache copied when it doubles"))
    items.append(Item("logits (last position)", batch * c.vocab_size * f32 * 2, "local shard + all-gathered row"))
    return items


def plan_memory(config: ModelConfig, *, gpus: int, gpu_mem: int, context: int, batch: int = 1,
                chunk: int = 2048, dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """Bytes per GPU of `config` split over `gpus` GPUs of `gpu_mem` bytes each."""
    if gpus < 1 or context < 1 or batch < 1 or chunk < 1:
        raise ConfigError("gpus, context, batch and chunk must be positive")
    if context > config.max_position_embeddings:
        raise ConfigError(f"context {context} exceeds the model's max_position_embeddings "
                          f"{config.max_position_embeddings}")
    check_divisible(config, gpus)
    weights, by_dtype = _weights(config, gpus, _weight_totals(config, dtype))
    plan = MemoryPlan(gpus=gpus, gpu_mem=gpu_mem, context=context, batch=batch, chunk=min(chunk, context),
                      dtype=str(dtype).removeprefix("torch."), weights=weights, weights_by_dtype=by_dtype,
                      state=_state(config, gpus, context, batch, dtype),
                      activations=_activations(config, gpus, context, batch, min(chunk, context), dtype))
    used = plan.total
    plan.reserve = Item("runtime reserve", int(RESERVE_FIXED + RESERVE_FRACTION * used),
                        "CUDA context, NCCL buffers, 5% fragmentation")
    return plan


def smallest_fitting(config: ModelConfig, plan: MemoryPlan, limit: int = 1024) -> int | None:
    """Fewest GPUs of the same size (a valid split, more than `plan.gpus`) on which it fits."""
    for gpus in range(plan.gpus + 1, limit + 1):
        try:
            candidate = plan_memory(config, gpus=gpus, gpu_mem=plan.gpu_mem, context=plan.context, batch=plan.batch,
                                    chunk=plan.chunk, dtype=getattr(torch, plan.dtype))
        except ConfigError:
            continue
        if candidate.fits:
            return gpus
    return None


def format_plan(plan: MemoryPlan, title: str, hint_gpus: int | None = None) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:9.2f}"

    where = f"{plan.gpus} x {plan.gpu_mem / 1e9:.0f} GB ({plan.gpu_mem / GiB:.1f} GiB)"
    lines = [f"{title} on {where}: context {plan.context:,} tokens x batch {plan.batch}, weights and caches in "
             f"{plan.dtype}",
             f"{'per GPU':44s} {'GiB':>9s}",
             f"{'weights':44s} {gib(plan.weight_bytes)}"]
    lines += [f"  {i.name:42s} {gib(i.nbytes)}  {i.note}" for i in plan.weights]
    lines.append("  by dtype: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sorted(plan.weights_by_dtype.items())))
    for group, items in (("sequence state", plan.state), ("activations and workspace", plan.activations)):
        lines.append(f"{group:44s} {gib(sum(i.nbytes for i in items))}")
        lines += [f"  {i.name:42s} {gib(i.nbytes)}  {i.note}" for i in items]
    lines.append(f"{plan.reserve.name:44s} {gib(plan.reserve.nbytes)}  {plan.reserve.note}")
    lines.append(f"{'total':44s} {gib(plan.total)}")
    if plan.fits:
        lines.append(f"verdict: FITS on {where}: {plan.total / GiB:.1f} GiB of {plan.gpu_mem / GiB:.1f} GiB per GPU "
                     f"({(plan.gpu_mem - plan.total) / GiB:.1f} GiB free)")
    else:
        lines.append(f"verdict: DOES NOT FIT on {where}: needs {plan.total / GiB:.1f} GiB per GPU, "
                     f"{plan.gpu_mem / GiB:.1f} GiB "
                     f"available: short by {(plan.total - plan.gpu_mem) / GiB:.1f} GiB per GPU "
                     f"(weights alone: {plan.weight_bytes / GiB:.1f} GiB)")
        if hint_gpus is not None:
            lines.append(f"  the smallest split that fits at this context and batch: {hint_gpus} GPUs of this size")
    return "\n".join(lines)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
