"""The answer's DSA reads: which context keys the DSA layers selected for the answer's query rows (the
continuation's tokens and the target's, teacher forced), recorded on the plain scoring run itself.

Why they prune exactly: hiding keys from a DSA layer changes what it reads only if some query had
selected one of them (the top-k of the remaining keys is the same set otherwise: the kept keys keep
their scores and an earliest-first tie-break among them is unchanged). If no query of the plain run
selected a key of a span, hiding that span alone leaves every selection, and so every later hidden
state, exactly as it was: its effect through DSA hiding is zero, without running it. (In a mask
hiding several spans at once an unread span can become read once others are hidden; the surrogate
therefore fits only the read spans and keeps every unread span in every mask.)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.probes import probe_points
from workbench.causal_effects import _continue, _forced_logprobs


def score_with_reads(base: Any, continuation: Any, target: Sequence[int], role: str, end: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(per-token log-probabilities of `target` `[len(target)]`, reads `[end]` int64: how many (DSA layer,
    query) selections of the continuation and target rows read each context position), from one plain
    run on a fork of `base` (left as it is)."""
    counts = np.zeros(end, dtype=np.int64)

    def sink(emission: Any) -> None:
        picked = emission.data["indices"].reshape(-1).cpu().numpy()
        picked = picked[(picked >= 0) & (picked < end)]
        np.add.at(counts, picked, 1)

    points = [p for p in probe_points(base.model) if p.name == "dsa.topk"]
    branch = base.fork()
    branch.progress = False
    for p in points:
        p.attach(sink)
    try:
        _continue(branch, continuation, role)
        branch.prefill()
        scores = _forced_logprobs(branch, list(target), keep=False)
        for p in points:
            p.deliver()
    finally:
        for p in points:
            p.detach(sink)
    logprobs = scores[np.arange(len(target)), list(target)].cpu().numpy()
    return logprobs, counts


def reads_in(counts: np.ndarray, start: int, end: int) -> int:
    """Selections that read a key in [start, end)."""
    return int(counts[start:end].sum())


__all__ = ["score_with_reads", "reads_in"]
