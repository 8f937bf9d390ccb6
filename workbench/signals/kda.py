"""The KDA family: per-head statistics of each KDA layer's recurrent state S (`kda.state`).

Recording: the layer measures the state at chunk boundaries and decode tokens; the recorder keeps
one row every `kda_every_tokens` prefill tokens, the last state of every forward call and every
decode token. Optional measures (max |S|, decay, write strength, decay timescales, effective rank)
are asked for only when the policy turns them on, since each costs the layer extra work.
Reading: `norm_matrix` lines one statistic of one layer up over positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.probes import Emission, Marks, ProbeRequest, Sample
from workbench.signals.family import RecordingContext, SignalFamily, register
from workbench.trace.errors import TraceCorruptError, TraceError
from workbench.trace.schema import Column, TableSpec, signal_tags

if TYPE_CHECKING:
    import torch

POLICY_FIELDS = ("kda_every_tokens", "kda_extras", "kda_rank_every")
STATISTICS = ("norm", "max_abs", "mean_decay", "mean_beta", "eff_rank", "half_life", "global_share")
_LIST_F16 = pa.list_(pa.float16())

TABLES = (
    TableSpec("kda_norms", "per-head KDA state statistics after a position (chunk boundaries, decode tokens)", (
        *signal_tags(),
        Column("position", pa.int32(), "position after which the state was measured", encoding="delta",
               field="positions"),
        Column("norm", _LIST_F16, "Frobenius norm of S, one per head", encoding="bss", field="norm"),
        Column("max_abs", _LIST_F16, "max |S| per head", True, "bss", "max_abs"),
        Column("mean_decay", _LIST_F16, "mean exp(g) per head over the interval", True, "bss", "mean_decay"),
        Column("mean_beta", _LIST_F16, "mean beta per head over the interval", True, "bss", "mean_beta"),
        Column("eff_rank", pa.list_(pa.float32()), "effective rank of S per head (policy.kda_rank_every; NaN "
               "where not sampled)", True, "bss", "eff_rank"),
        Column("half_life", pa.list_(pa.float32()), "median channel half-life ln2/-mean(g) per head (tokens)", True,
               "bss", "half_life"),
        Column("global_share", pa.list_(pa.float32()), "share of channels whose half-life exceeds the context",
               True, "bss", "global_share"),
    ), signal="kda.state"),
)


def request(name: str, policy: Any, marks: Marks) -> ProbeRequest:
    extras = ("max_abs", "mean_decay", "mean_beta", "half_life", "global_share") if policy.kda_extras else ()
    rank = ("eff_rank",) if policy.kda_rank_every > 0 else ()
    return ProbeRequest(optional=frozenset(extras + rank), queries=Sample(stride=policy.kda_rank_every))


def to_rows(ctx: RecordingContext, name: str, layer: int, rank: int, items: list[Emission],
            steps: "torch.Tensor", fields: dict[str, "torch.Tensor"]) -> None:
    keep = ctx.keep_items(items, ctx.policy.kda_every_tokens, decode_all=True, last=True)
    ctx.rows("kda_norms", layer, rank, keep, steps, fields)


def norm_matrix(trace: Any, layer: int, stat: str = "norm") -> tuple[np.ndarray, np.ndarray]:
    """KDA state statistic of one layer over positions: (positions int64 [P], values float32 [P, H]).

    `stat` is norm, max_abs, mean_decay, mean_beta, eff_rank, half_life or global_share. Rows are sorted by position; when a position
    was measured twice the later record wins.
    """
    if stat not in STATISTICS:
        raise TraceError(f"unknown KDA statistic {stat!r}; statistics are {', '.join(STATISTICS)}")
    table = trace.table("kda_norms", [layer], ["position", stat])
    table = table.filter(pc.is_valid(table[stat]))
    positions = table["position"].to_numpy().astype(np.int64)
    if len(positions) == 0:
        return positions, np.zeros((0, 0), np.float32)
    lists = table[stat].combine_chunks()
    lengths = pc.list_value_length(lists).to_numpy()
    if (lengths != lengths[0]).any():
        raise TraceCorruptError(f"{trace.path}: kda_norms.{stat} of layer {layer} has varying head counts")
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float32)
    values = values.reshape(len(positions), int(lengths[0]))
    # stable sort, then keep the last record of each position
    order = np.argsort(positions, kind="stable")
    positions, values = positions[order], values[order]
    last = np.append(positions[1:] != positions[:-1], True)
    return positions[last], values[last]


FAMILY = register(SignalFamily("kda", TABLES, request, to_rows, policy_fields=POLICY_FIELDS,
                               readers={"kda_norm_matrix": norm_matrix}))
