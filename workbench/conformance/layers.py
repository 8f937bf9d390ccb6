"""The first divergent layer: an endpoint's routes and DSA selections against the reference's, beside its ties.

Per position (in order) and per layer (in order) a row of the endpoint is compared with the engine's:
- routes are compared as sets of experts (router order is not part of the computation's meaning);
  a differing route that the engine's router decided by a tie (`Reference.routes.tie`) is a `tie`;
- selections are compared as sets of key positions (-1 slots dropped); a differing selection is a
  `tie` when the engine's tie band at rank k cut keys (`tie_cut > 0`) and no more keys are swapped
  than it cut, or when every key of ours that the endpoint left out scores within `score_margin` of
  our k-th score (a near tie the running precision can flip).
Anything else is a divergence. The layer named is the LOWEST layer with a divergent row at any
position: a fault in layer L changes no layer below L at any position (each layer reads only the
layers below it, at this and earlier positions), so the fault is in that layer or in a layer before it
whose output no route or selection of its own shows (a dense layer, or a change too small to flip
one there). The position named is the earliest divergent row of any layer (a fault's effect can
surface in a later layer first: a small change that flips no route where it happens flips one
downstream); the detail gives both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.conformance.reference import LayerRows

DEFAULT_SCORE_MARGIN = 1e-4  # relative: fp32 accumulation-order noise is ~1e-6 of an indexer score


@dataclass
class LayerFinding:
    """What the captures said for one prompt."""

    compared: int = 0                          # (position, layer) rows compared
    ties: int = 0                              # rows that differ only inside a tie (not divergences)
    first_layer: int | None = None             # the lowest layer with a divergent row (any position)
    layer_position: int | None = None          # that layer's first divergent position
    first_position: int | None = None          # the earliest divergent row's position (any layer)
    divergent_rows: int = 0
    family: str | None = None                  # "moe" or "dsa": which signal diverged first
    detail: str = ""
    tie_rows: list[tuple[int, int, str]] = field(default_factory=list)  # (position, layer, family), the first few


def _selection_tie(ours: np.ndarray, theirs: np.ndarray, cut: int, scores: np.ndarray | None,
                   margin: float) -> bool:
    """Whether two selections differ only by keys swapped inside a tie: at most `cut` keys (the engine's
    tie band at rank k left that many keys of equal score out), or keys of ours scoring within `margin`
    (relative) of our k-th score."""
    a, b = set(ours[ours >= 0].tolist()), set(theirs[theirs >= 0].tolist())
    if len(a - b) != len(b - a):
        return False  # a different number of keys: no tie-break gives that
    if cut > 0 and len(a - b) <= cut:
        return True
    if scores is None or not a:
        return False
    kept = ours >= 0
    kth = float(np.nanmin(scores[kept]))
    dropped = [s for key, s in zip(ours.tolist(), scores.tolist()) if key >= 0 and key in (a - b)]
    return bool(dropped) and all(abs(s - kth) <= margin * max(1.0, abs(kth)) for s in dropped)


def compare_layers(routes: tuple[np.ndarray, int] | None, selections: tuple[np.ndarray, int] | None,
                   ref_routes: LayerRows | None, ref_selections: LayerRows | None, *,
                   score_margin: float = DEFAULT_SCORE_MARGIN, max_tie_rows: int = 20) -> LayerFinding:
    """`routes` / `selections`: the endpoint's [rows, layers, width] array and its first position."""
    out = LayerFinding()
    families = []
    if routes is not None and ref_routes is not None:
        families.append(("moe", routes, ref_routes))
    if selections is not None and ref_selections is not None:
        families.append(("dsa", selections, ref_selections))
    if not families:
        return out
    candidates: list[tuple[int, int, str]] = []
    for family, (arr, first), ref in families:
        stop = min(first + len(arr), len(ref.values))
        if stop <= first:
            continue
        theirs = np.sort(arr[: stop - first], -1)
        ours = np.sort(ref.values[first:stop], -1)
        differs = (theirs != ours).any(-1)  # [rows, layers]: as sets (ids are distinct within a row)
        layers = list(ref.layers)
        out.compared += (stop - first) * len(layers)
        for row, layer in np.argwhere(differs[:, layers]).tolist():
            candidates.append((first + row, layers[layer], family))
    by_family = {family: (arr, first, ref) for family, (arr, first), ref in families}
    first_of_layer: dict[int, tuple[int, str, np.ndarray, np.ndarray]] = {}  # layer -> its first divergence
    for pos, layer, family in sorted(candidates, key=lambda c: (c[0], c[1], c[2] != "moe")):
        arr, first, ref = by_family[family]
        theirs, ours = np.asarray(arr[pos - first, layer], np.int64), ref.values[pos, layer]
        if family == "moe":
            tie = bool(ref.tie[pos, layer])
        else:
            cut = int(ref.cut[pos, layer]) if ref.cut is not None else int(ref.tie[pos, layer])
            tie = _selection_tie(ours, theirs, cut, None if ref.scores is None else ref.scores[pos, layer],
                                 score_margin)
        if tie:
            out.ties += 1
            if len(out.tie_rows) < max_tie_rows:
                out.tie_rows.append((pos, layer, family))
            continue
        out.divergent_rows += 1
        if out.first_position is None:
            out.first_position = pos
        first_of_layer.setdefault(layer, (pos, family, theirs, ours))
    if first_of_layer:
        layer = min(first_of_layer)
        pos, family, theirs, ours = first_of_layer[layer]
        out.first_layer, out.family, out.layer_position = layer, family, pos
        if family == "moe":
            what, there, here = "experts", sorted(theirs.tolist()), sorted(ours.tolist())
        else:
            a, b = set(ours[ours >= 0].tolist()), set(theirs[theirs >= 0].tolist())
            what, there, here = "selected keys", f"{len(b - a)} keys not ours", f"{len(a - b)} of ours left out"
        out.detail = (f"lowest divergent layer {layer}, from position {pos}: {what} {there} there, {here} here "
                      f"(no tie at rank k); {out.divergent_rows} divergent rows, the earliest at position "
                      f"{out.first_position}")
    return out


__all__ = ["DEFAULT_SCORE_MARGIN", "LayerFinding", "compare_layers"]
