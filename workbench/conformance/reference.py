"""What this engine computes for the tokens an endpoint reports: the teacher-forced reference.

`reference_run(model, ids, prompt_tokens)` feeds every token but the last (the last was never fed
forward by the endpoint either) through the exact engine, `chunk` tokens per call so a long context
keeps bounded memory, and keeps:
- the log-probabilities at the positions that predict the generated tokens (one row per generated token);
- when asked, every MoE layer's routed experts per position, with whether a tie decided the route
  (the k-th chosen expert's score equals, within `route_margin`, the best score left out: section 1's
  MoE tie check, read from the router's own integrity fields);
- when asked, every DSA layer's selected keys per position, with the tie band at rank k (`tie_cut > 0`:
  keys sharing the k-th score were left out by the tie-break) and the selected keys' scores (a key of
  ours the endpoint left out is a near tie when its score is within `score_margin` of the k-th).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from engine.probes import ProbeRequest, probe_points

REFERENCE_CHUNK = 2048  # tokens per forward call (the serve default's prefill chunk)
ROUTE_OPTIONAL = frozenset({"logit_sum", "kth_choice", "runner_up"})
SELECTION_OPTIONAL = frozenset({"tie_band", "tie_cut", "scores"})


@dataclass
class LayerRows:
    """One family's rows of the reference, [positions, layers, width], with per-row tie facts."""

    values: np.ndarray                       # int32: expert ids (routes) or key positions (selections, -1 empty)
    tie: np.ndarray                          # bool [positions, layers]: a tie decided the row
    margin: np.ndarray                       # float32 [positions, layers]: kth - runner-up (routes); NaN otherwise
    scores: np.ndarray | None = None         # float32 [positions, layers, width] (selections)
    layers: tuple[int, ...] = ()             # the layers that hold the signal
    cut: np.ndarray | None = None            # int32 [positions, layers]: keys of the tie band left out (selections)


@dataclass
class Reference:
    logprobs: torch.Tensor                   # [generated, vocab] fp32 log-softmax predicting each generated token
    routes: LayerRows | None = None
    selections: LayerRows | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _Collector:
    def __init__(self, n: int, layers: int, width: int, fill: int, with_scores: bool) -> None:
        self.values = np.full((n, layers, width), fill, np.int32)  # int32: ids and positions fit; half the memory at long contexts
        self.tie = np.zeros((n, layers), bool)
        self.margin = np.full((n, layers), np.nan, np.float32)
        self.scores = np.full((n, layers, width), np.nan, np.float32) if with_scores else None
        self.cut = np.zeros((n, layers), np.int32) if with_scores else None
        self.seen: set[int] = set()

    def rows(self) -> LayerRows:
        return LayerRows(self.values, self.tie, self.margin, self.scores, tuple(sorted(self.seen)), self.cut)


def _route_sink(store: _Collector, margin: float):
    def sink(emission: Any) -> None:
        d, layer = emission.data, emission.point.layer
        pos = d["positions"].numpy()
        store.seen.add(layer)
        store.values[pos, layer, :] = d["experts"][0].cpu().numpy()
        if "kth_choice" in d:
            gap = (d["kth_choice"][0] - d["runner_up"][0]).float().cpu().numpy()
            store.margin[pos, layer] = gap
            store.tie[pos, layer] = ~(gap > margin)  # NaN (a non-finite router) counts as undecided too
    return sink


def _selection_sink(store: _Collector):
    def sink(emission: Any) -> None:
        d, layer = emission.data, emission.point.layer
        pos = d["positions"].numpy()
        store.seen.add(layer)
        idx = d["indices"][0].cpu().numpy()
        store.values[pos, layer, : idx.shape[-1]] = idx
        if "tie_cut" in d:
            cut = d["tie_cut"][0].cpu().numpy()
            store.tie[pos, layer] = cut > 0
            if store.cut is not None:
                store.cut[pos, layer] = cut
        if store.scores is not None and "scores" in d:
            store.scores[pos, layer, : idx.shape[-1]] = d["scores"][0].float().cpu().numpy()
    return sink


def reference_run(model: Any, ids: Sequence[int], prompt_tokens: int, *, routes: bool = False,
                  selections: bool = False, route_margin: float = 0.0, chunk: int = REFERENCE_CHUNK) -> Reference:
    """The engine's computation over `ids` (prompt then generated tokens); see the module docstring."""
    config = model.config
    fed = list(ids[:-1]) if len(ids) > prompt_tokens else list(ids)
    n = len(fed)
    attached: list[tuple[Any, Any]] = []
    route_rows = sel_rows = None
    if routes:
        route_rows = _Collector(n, config.num_hidden_layers, config.num_experts_per_token, 0, False)
    if selections and config.dsa is not None:
        sel_rows = _Collector(n, config.num_hidden_layers, config.dsa.topk, -1, True)
    for point in probe_points(model):
        if point.name == "moe.route" and route_rows is not None:
            sink = _route_sink(route_rows, route_margin)
            point.attach(sink, ProbeRequest(optional=ROUTE_OPTIONAL))
            attached.append((point, sink))
        elif point.name == "dsa.topk" and sel_rows is not None:
            sink = _selection_sink(sel_rows)
            point.attach(sink, ProbeRequest(optional=SELECTION_OPTIONAL))
            attached.append((point, sink))
    device = model.lm_head.weight.device
    wanted: list[torch.Tensor] = []  # logits of positions [prompt_tokens - 1, n)
    try:
        state = model.empty_state(device=device)
        with torch.inference_mode():
            for start in range(0, n, chunk):
                piece = fed[start: start + chunk]
                model.probe_context.begin(step=start // chunk, phase="prefill")
                try:
                    logits = model(torch.tensor([piece], device=device), state)[0]
                finally:
                    model.probe_context.end()
                state.length += len(piece)
                lo = max(prompt_tokens - 1 - start, 0)
                if lo < len(piece):
                    wanted.append(torch.log_softmax(logits[lo:].float(), -1).cpu())
    finally:
        for point, sink in attached:
            point.detach(sink)
    generated = len(ids) - prompt_tokens
    logprobs = torch.cat(wanted)[:generated] if wanted and generated > 0 else torch.zeros(0, config.vocab_size)
    return Reference(logprobs, route_rows.rows() if route_rows is not None else None,
                     sel_rows.rows() if sel_rows is not None else None)


__all__ = ["Reference", "LayerRows", "reference_run", "REFERENCE_CHUNK"]
