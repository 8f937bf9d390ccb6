"""The MoE family: the experts each token was routed to (`moe.route`).

Recording: every token's slots are counted on the device by (segment, modality, expert) and by
expert-parallel rank; full routes (experts, combine weights, router entropy) are kept for decode
tokens, sampled prefill windows and marks. Reading: `counts_matrix` sums expert usage per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from engine.probes import Emission, Marks, ProbeRequest
from workbench.signals.family import RecordingContext, RunningSums, SignalFamily, register
from workbench.trace.schema import MODALITIES, MODALITY_TYPE, Column, TableSpec, signal_tags

if TYPE_CHECKING:
    import torch

POLICY_FIELDS = ("moe_decode_routes", "moe_window_every", "moe_window_tokens")

TABLES = (
    TableSpec("moe_routes", "routing of one token on one MoE layer (decode steps, sampled windows)", (
        *signal_tags(),
        Column("position", pa.int32(), "token position", encoding="delta", field="positions"),
        Column("experts", pa.list_(pa.int16()), "logical expert ids, router order", field="experts"),
        Column("weights", pa.list_(pa.float16()), "combine weights aligned with experts", encoding="bss",
               field="weights"),
        Column("entropy", pa.float32(), "entropy (nats) of the router distribution over all experts",
               encoding="bss", field="entropy"),
    ), ragged_key="experts", cache=False, signal="moe.route"),
    TableSpec("moe_counts", "token slots routed to each expert, by segment and modality (delta)", (
        *signal_tags(),
        Column("segment", pa.int32(), "segment id of the routed tokens", encoding="dict"),
        Column("modality", MODALITY_TYPE, "text or image", encoding="dict"),
        Column("expert", pa.int16(), "logical expert id", encoding="delta"),
        Column("count", pa.int64(), "token slots (delta)", encoding="delta"),
    ), kind="delta", sums=("count",), maxes=("step",), cache=False, signal="moe.route"),
    TableSpec("moe_rank_load", "routed token slots handled by each expert-parallel rank (delta)", (
        *signal_tags(),
        Column("ep_rank", pa.int16(), "expert-parallel rank that owns the experts", encoding="dict"),
        Column("tokens", pa.int64(), "token slots (delta)", encoding="delta"),
    ), kind="delta", sums=("tokens",), maxes=("step",), signal="moe.route"),
)


def request(name: str, policy: Any, marks: Marks) -> ProbeRequest:
    return ProbeRequest(optional=frozenset({"entropy"}))


def expert_counts(experts: "torch.Tensor", segment_ids: "torch.Tensor", modality_ids: "torch.Tensor",
                  num_experts: int, n_segments: int, n_modalities: int) -> dict[str, "torch.Tensor"]:
    """Token slots per (segment, modality, expert), dense. experts [T, k]; segment/modality ids [T]."""
    import torch

    k = experts.shape[-1]
    key = ((segment_ids * n_modalities + modality_ids).unsqueeze(-1).expand(-1, k) * num_experts + experts)
    size = n_segments * n_modalities * num_experts
    counts = torch.bincount(key.reshape(-1), minlength=size)[:size]
    flat = torch.arange(size, device=experts.device)
    rest = torch.div(flat, num_experts, rounding_mode="floor")
    return {"segment": torch.div(rest, n_modalities, rounding_mode="floor"), "modality": rest % n_modalities,
            "expert": flat % num_experts, "count": counts}


def rank_load(experts: "torch.Tensor", num_experts: int, ep_world: int) -> dict[str, "torch.Tensor"]:
    """Token slots handled by each expert-parallel rank (contiguous expert ranges)."""
    import torch

    per_rank = -(-num_experts // ep_world)
    counts = torch.bincount(torch.div(experts, per_rank, rounding_mode="floor").reshape(-1), minlength=ep_world)
    return {"ep_rank": torch.arange(ep_world, device=experts.device), "tokens": counts[:ep_world]}


def to_rows(ctx: RecordingContext, name: str, layer: int, rank: int, items: list[Emission],
            steps: "torch.Tensor", fields: dict[str, "torch.Tensor"]) -> None:
    p = ctx.policy
    experts, pos = fields["experts"], fields["positions"]
    step = int(steps.max())
    seg_of, modality_of = ctx.position_maps(int(pos.max()) + 1, experts.device)
    at = pos.to(experts.device)
    num_experts = ctx.config.num_experts
    ctx.pend("moe_counts", layer, rank, {"step": step, **expert_counts(
        experts, seg_of[at], modality_of[at], num_experts, ctx.n_segments, len(MODALITIES))}, "count")
    ctx.pend("moe_rank_load", layer, rank, {"step": step, **rank_load(experts, num_experts, ctx.ep_world)}, "tokens")
    keep = ctx.keep_items(items, 0, decode_all=p.moe_decode_routes, window=(p.moe_window_every, p.moe_window_tokens))
    ctx.rows("moe_routes", layer, rank, keep, steps, fields)


def _modality_names(cols: dict) -> dict:
    cols["modality"] = np.asarray(MODALITIES, dtype=object)[cols["modality"]]
    return cols


def counts_matrix(trace: Any, modality: str | None = None, segments: Sequence[int] | None = None,
                  layers: Sequence[int] | None = None) -> np.ndarray:
    """Expert usage: int64 [len(layers), experts] of routed token slots, summed over the selection.

    Rows follow `layers` (default `trace.layers("moe_counts")`); `modality` is "text", "image" or
    None for both; `segments` restricts to segment ids.
    """
    select: dict = {"segment": None if segments is None else list(segments),
                    "modality": None if modality is None else [MODALITIES.index(modality)]}
    per_layer = trace.folded_sums("moe_counts").total(select, by="layer")
    rows = sorted(trace.layers("moe_counts")) if layers is None else list(layers)
    width = max([len(v) for v in per_layer.values()] + [int(trace.session.get("model", {}).get("summary", {})
                                                             .get("num_experts", 0))])
    out = np.zeros((len(rows), width), np.int64)
    for i, layer in enumerate(rows):
        vec = per_layer.get(layer)
        if vec is not None:
            out[i, :len(vec)] = vec
    return out


def routes_for(trace: Any, position: int, layers: Sequence[int] | None = None) -> pa.Table:
    """The experts each MoE layer chose for the token at `position` (rows of moe_routes)."""
    return trace.table("moe_routes", layers, positions=(position, position))


FAMILY = register(SignalFamily(
    "moe", TABLES, request, to_rows,
    running_sums={"moe_counts": RunningSums(("segment", "modality", "layer"), "expert", "count")},
    convert={"moe_counts": _modality_names}, policy_fields=POLICY_FIELDS,
    readers={"moe_counts_matrix": counts_matrix, "routes_for": routes_for}))
