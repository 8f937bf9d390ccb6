"""Non-finite forwards: name the first layer whose output is not finite.

The model checks its logits once per forward (one reduction over [B, T, vocab]); only when they hold
NaN or inf does it call `nonfinite_error`, which finds the culprit: for a forward without a cache
(or the first chunk of one: the cache held nothing before it) it re-runs the same input without
state, keeping every layer's output, and names the first layer whose output is not finite. A forward
that continued a cache cannot be replayed without the cache as it was before, so the error says so.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.errors import NumericsError
from engine.probes import probe_points

from engine.cache import ModelState


def all_finite(t: torch.Tensor) -> bool:
    """True when `t` holds no NaN or inf. The sum is finite only if every value is (NaN and inf
    propagate through it), so one vectorised sum answers; only a non-finite sum (which finite values
    can also give, by overflow) pays for the exact elementwise test: an order of magnitude cheaper
    than `isfinite(t).all()` on a prefill's logits (docs/benchmarks.md)."""
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def first_nonfinite(outputs: Sequence[torch.Tensor]) -> int | None:
    """Index of the first tensor holding NaN or inf, or None when all are finite."""
    for i, t in enumerate(outputs):
        if not all_finite(t):
            return i
    return None


def nonfinite_error(model: torch.nn.Module, input_ids: torch.Tensor, logits: torch.Tensor,
                    state: ModelState | None) -> NumericsError:
    """The error to raise for non-finite `logits` of `model(input_ids, state)`, naming the first bad layer."""
    bad = int((~torch.isfinite(logits)).sum())
    head = f"non-finite logits ({bad} of {logits.numel()} values NaN/inf) for {input_ids.shape[-1]} token(s)"
    if state is not None and state.length > 0:
        return NumericsError(f"{head} after {state.length} cached tokens; the weights or the cached state are "
                             f"likely bad (run `workbench inspect` to check the checkpoint's values)")
    outputs: list[torch.Tensor] = []
    # the replay must not reach a recorder: detach every probe point's sink while it runs
    points = list(probe_points(model))
    sinks = [p.sink for p in points]
    for p in points:
        p.sink = None
    try:
        with torch.inference_mode():
            model.model(input_ids, None, outputs)
    finally:
        for p, sink in zip(points, sinks):
            p.sink = sink
    layer = first_nonfinite(outputs)
    config = model.config
    if layer is None:
        # the replay runs from an empty state with nothing attached: finite layers there mean either the
        # output head, or something the replay does not repeat (a hook, an intervention, a state edited mid-run)
        where = ("replayed from an empty state, every decoder layer's output is finite: the final norm or lm_head "
                 "produces them, or they came from outside the weights (a hook, an intervention, a changed state)")
    else:
        where = (f"the first layer whose output is not finite is layer {layer} ({config.layer_kind(layer)}"
                 f"{', MoE' if config.is_moe_layer(layer) else ''})")
    advice = ("`workbench inspect` checks the weights' values; then look at what was attached or set"
              if layer is None else "the checkpoint's weights are likely bad (`workbench inspect` checks their values)")
    return NumericsError(f"{head}: {where}; {advice}")
