"""The DSA family: which keys each sparse-attention layer's indexer selected (`dsa.topk`), and how much
of the dense attention mass the selection holds (`dsa.dense_mass`).

Recording: every query's selection is counted on the device (per key bin, log2 read distance,
segment, attention-sink hit); full index lists are kept only for the queries the policy samples
(`dsa_prefill_stride`, decode steps, marks). Reading: `heatmap` rebins the key-bin counts.

The device counts return tensors of fixed, data-independent shapes (a dense `bincount` with a
known `minlength`), so recording never synchronises the device inside the forward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from engine.probes import Emission, Marks, ProbeRequest, Sample
from workbench.analysis.chance import expected_key_selections
from workbench.analysis.dsa import queries_per_position, rebin_counts
from workbench.analysis.dsa_heatmap import DSAHeatmap, columns as heatmap_columns
from workbench.signals.family import RecordingContext, RunningSums, SignalFamily, register
from workbench.trace.aggregates import DenseSums
from workbench.trace.errors import TraceCorruptError, TraceError
from workbench.trace.schema import Column, TableSpec, signal_tags

if TYPE_CHECKING:
    import torch

DISTANCE_BINS = 64  # floor(log2(d + 1)) < 64 for any int64 distance
POLICY_FIELDS = ("dsa_bin_tokens", "sink_tokens", "dsa_prefill_stride", "dsa_decode_lists", "dsa_scores",
                 "dense_mass_stride", "dense_mass_decode_every", "dense_overlap")

TABLES = (
    TableSpec("dsa_topk", "full index list of one query on one DSA layer (decode steps, sampled prefill queries)", (
        *signal_tags(),
        Column("position", pa.int32(), "query position", encoding="delta", field="positions"),
        Column("selected", pa.list_(pa.int32()), "selected key positions, ascending", encoding="delta",
               field="indices"),
        Column("scores", pa.list_(pa.float32()), "indexer scores aligned with selected", True, "bss", "scores"),
    ), ragged_key="selected", ascending=True, cache=False, signal="dsa.topk"),
    TableSpec("dsa_key_counts", "how often keys in a position bin were selected (delta); bin width is "
              "policy.dsa_bin_tokens", (
        *signal_tags(),
        Column("key_bin", pa.int32(), "key position // policy.dsa_bin_tokens", encoding="delta"),
        Column("count", pa.int64(), "selections of keys in the bin (delta)", encoding="delta"),
    ), kind="delta", sums=("count",), maxes=("step",), cache=False, signal="dsa.topk"),
    TableSpec("dsa_distance_hist", "read distances d = query - key, log2 bins (delta)", (
        *signal_tags(),
        Column("log2_bin", pa.int8(), "b such that floor(log2(d + 1)) == b", encoding="dict"),
        Column("count", pa.int64(), "selections at that distance (delta)", encoding="delta"),
    ), kind="delta", sums=("count",), maxes=("step",), signal="dsa.topk"),
    TableSpec("dsa_segment_totals", "selections of keys inside each segment (delta)", (
        *signal_tags(),
        Column("segment", pa.int32(), "segment id of the selected keys", encoding="dict"),
        Column("count", pa.int64(), "selections (delta)", encoding="delta"),
    ), kind="delta", sums=("count",), maxes=("step",), signal="dsa.topk"),
    TableSpec("dsa_sink", "attention-sink hits: queries that selected one of the first policy.sink_tokens "
              "positions (delta)", (
        *signal_tags(),
        Column("position", pa.int32(), "last query position the delta covers", encoding="delta"),
        Column("queries", pa.int32(), "queries (delta)", encoding="delta"),
        Column("sink_hits", pa.int32(), "queries that selected at least one sink position (delta)",
               encoding="delta"),
    ), kind="delta", sums=("queries", "sink_hits"), maxes=("step", "position"), signal="dsa.topk"),
    TableSpec("dsa_dense_mass", "fraction of the dense softmax mass inside the selected set (sampled queries)", (
        *signal_tags(),
        Column("position", pa.int32(), "query position", encoding="delta", field="positions"),
        Column("mass", pa.float32(), "sum of dense attention probabilities over the selected keys", encoding="bss",
               field="mass"),
        Column("iou", pa.float32(), "IoU of the selection and the dense top-k (policy.dense_overlap)", True, "bss",
               "iou"),
        Column("recall", pa.float32(), "share of the dense top-k inside the selection", True, "bss", "recall"),
    ), signal="dsa.dense_mass"),
)


# ---- probe requests -------------------------------------------------------------------------------------
def request(name: str, policy: Any, marks: Marks) -> ProbeRequest:
    if name == "dsa.topk":
        return ProbeRequest(optional=frozenset({"scores"} if policy.dsa_scores else ()))
    return ProbeRequest(optional=frozenset({"iou", "recall"} if policy.dense_overlap else ()),
                        queries=Sample(stride=policy.dense_mass_stride, marks=marks),
                        decode_every=policy.dense_mass_decode_every)


# ---- device counts --------------------------------------------------------------------------------------
def key_counts(indices: "torch.Tensor", bin_tokens: int, n_bins: int) -> dict[str, "torch.Tensor"]:
    """indices [T, k] (-1 = empty) -> selections per key bin (dense over n_bins)."""
    import torch

    valid = indices >= 0
    bins = torch.div(indices.clamp_min(0), bin_tokens, rounding_mode="floor")
    counts = torch.bincount(bins.reshape(-1), weights=valid.reshape(-1).double(), minlength=n_bins)[:n_bins]
    return {"key_bin": torch.arange(n_bins, device=indices.device), "count": counts.long()}


def distance_hist(positions: "torch.Tensor", indices: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Read distance d = query - key in log2 bins b = floor(log2(d + 1)); positions [T] on the device."""
    import torch

    valid = indices >= 0
    d = (positions.unsqueeze(-1) - indices).clamp_min(0)
    b = torch.floor(torch.log2(d.double() + 1)).long()
    counts = torch.bincount(b.reshape(-1), weights=valid.reshape(-1).double(), minlength=DISTANCE_BINS)
    return {"log2_bin": torch.arange(DISTANCE_BINS, device=indices.device), "count": counts[:DISTANCE_BINS].long()}


def segment_totals(indices: "torch.Tensor", segment_of: "torch.Tensor", n_segments: int) -> dict[str, "torch.Tensor"]:
    """Selections of keys inside each segment; segment_of maps position -> segment id."""
    import torch

    valid = indices >= 0
    seg = segment_of[indices.clamp_min(0)]
    counts = torch.bincount(seg.reshape(-1), weights=valid.reshape(-1).double(), minlength=n_segments)
    return {"segment": torch.arange(n_segments, device=indices.device), "count": counts[:n_segments].long()}


def sink(last_position: int, indices: "torch.Tensor", sink_tokens: int) -> dict[str, "torch.Tensor"]:
    import torch

    hits = ((indices >= 0) & (indices < sink_tokens)).any(-1)
    return {"position": torch.tensor([last_position]), "queries": torch.tensor([indices.shape[0]]),
            "sink_hits": hits.sum().reshape(1)}


def to_rows(ctx: RecordingContext, name: str, layer: int, rank: int, items: list[Emission],
            steps: "torch.Tensor", fields: dict[str, "torch.Tensor"]) -> None:
    if name == "dsa.dense_mass":
        ctx.rows("dsa_dense_mass", layer, rank, None, steps, fields)
        return
    p = ctx.policy
    idx, pos = fields["indices"], fields["positions"]
    step, last = int(steps.max()), int(pos.max())
    n_bins = last // p.dsa_bin_tokens + 1
    ctx.pend("dsa_key_counts", layer, rank, {"step": step, **key_counts(idx, p.dsa_bin_tokens, n_bins)}, "count")
    ctx.pend("dsa_distance_hist", layer, rank, {"step": step, **distance_hist(pos.to(idx.device), idx)}, "count")
    seg = ctx.position_maps(last + 1, idx.device)[0]
    ctx.pend("dsa_segment_totals", layer, rank, {"step": step, **segment_totals(idx, seg, ctx.n_segments)}, "count")
    ctx.pend("dsa_sink", layer, rank, {"step": step, **sink(last, idx, p.sink_tokens)})
    keep = ctx.keep_items(items, p.dsa_prefill_stride, decode_all=p.dsa_decode_lists)
    ctx.rows("dsa_topk", layer, rank, keep, steps, fields)


# ---- reading ---------------------------------------------------------------------------------------------
def heatmap(trace: Any, layer: int | Sequence[int] | None = None, bins: int = 512, start: int = 0,
            end: int | None = None, steps: tuple[int, int] | None = None, *, spread: bool = False) -> DSAHeatmap:
    """How often each context range was selected, per DSA layer: a float64 [len(layers), columns]
    array, labelled (`workbench.analysis.dsa_heatmap.DSAHeatmap`: `.layers`, `.edges`, `.chance`,
    `.ratio`, `.to_frame()`; the chance row is the DSA map's: what random top-k picks would select).

    Rows follow `layer` (an int or a list) or, when None, `trace.layers("dsa_key_counts")`.
    Columns are `bins` equal ranges of [start, end) (end defaults to the session's tokens), but
    never finer than the recording's bins (width policy.dsa_bin_tokens): a short session gets
    fewer columns, and a count is split only where a column boundary cuts a stored bin. `steps`
    (inclusive) restricts to deltas of those steps, e.g. the decode phase; without it the running
    sums are used, which cost only the parts added since the last call.

    `spread` (the dashboard's screen columns): exactly `bins` equal columns, a stored bin's count
    spread over the finer ones, and no chance row (the view computes its own).
    """
    _check_heatmap_request(bins, start, end)
    if steps is None:
        sums = trace.folded_sums("dsa_key_counts").total(by="layer")
    else:
        sums = DenseSums(("layer",), "key_bin", "count")
        try:
            sums.add("steps", trace.table("dsa_key_counts", steps=steps, columns=["layer", "key_bin", "count"]))
        except ValueError as exc:
            raise TraceCorruptError(f"{trace.path}: dsa_key_counts of steps {steps}: {exc}") from None
        sums = sums.total(by="layer")
    rows = sorted(sums) if layer is None else ([layer] if isinstance(layer, (int, np.integer)) else list(layer))
    width = int(trace.policy["dsa_bin_tokens"])
    if end is None:
        longest = max((len(v) for v in sums.values()), default=0) * width
        end = max(int(trace.session.get("tokens", 0)), longest, start + 1)
    n = bins if spread else heatmap_columns(start, end, bins, width)
    edges = np.linspace(start, end, n + 1)
    counts = np.stack([rebin_counts(sums.get(int(l), np.zeros(0, np.int64)), width, edges) for l in rows]) \
        if rows else np.zeros((0, n))
    return DSAHeatmap(counts, tuple(rows), edges, width, None if spread else _chance(trace, edges, steps))


MAX_HEATMAP_BINS = 1 << 20
MAX_POSITION = 2 ** 31 - 1  # positions are int32 in traces


def _check_heatmap_request(bins: Any, start: Any, end: Any) -> None:
    """One line naming the argument, before anything is read or allocated."""
    def whole(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if not whole(bins) or not 1 <= bins <= MAX_HEATMAP_BINS:
        raise TraceError(f"dsa_heatmap: bins must be a whole number from 1 to {MAX_HEATMAP_BINS:,}, got {bins!r:.40}")
    if not whole(start) or not 0 <= start < MAX_POSITION:
        raise TraceError(f"dsa_heatmap: start must be a token position from 0 to {MAX_POSITION - 1:,}, got {start!r:.40}")
    if end is not None and (not whole(end) or not start < end <= MAX_POSITION):
        raise TraceError(f"dsa_heatmap: end must be a token position after start ({start}) and at most "
                         f"{MAX_POSITION:,}, got {end!r:.40}")


def _chance(trace: Any, edges: np.ndarray, steps: tuple[int, int] | None) -> np.ndarray | None:
    """Per column, the selections uniformly random picks of the recorded top-k would make for the queries
    the trace counted (of `steps` when given): the DSA map's chance row. None without a recorded top-k.
    Queries are counted up to the last recorded one, never over a range the caller chose (end may be 2^31)."""
    topk = trace.settings.get("topk")
    if not topk or not len(edges):
        return None
    sink = trace.table("dsa_sink", steps=steps, columns=["layer", "rank", "position", "queries"])
    positions = sink.column("position").to_numpy() if sink.num_rows else np.zeros(0, np.int64)
    extent = min(int(np.ceil(edges[-1])), int(positions.max()) + 1 if len(positions) else 0)
    if extent <= 0:
        return np.zeros(len(edges) - 1)
    return expected_key_selections(queries_per_position(sink, extent), int(topk), edges)


def topk_for(trace: Any, position: int, layers: Sequence[int] | None = None) -> pa.Table:
    """What each DSA layer read for the query at `position` (rows of dsa_topk, one per layer/record)."""
    return trace.table("dsa_topk", layers, positions=(position, position))


FAMILY = register(SignalFamily(
    "dsa", TABLES, request, to_rows, follow_marks=frozenset({"dsa.dense_mass"}),
    running_sums={"dsa_key_counts": RunningSums(("layer",), "key_bin", "count")}, policy_fields=POLICY_FIELDS,
    readers={"dsa_heatmap": heatmap, "topk_for": topk_for}))
