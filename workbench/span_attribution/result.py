"""What `workbench.attribute` returns: `Attribution` (the answer, the surrogate's LDS, the times) and one
`SpanEffect` per span, ordered by effect (largest drop first), with its JSON form (the command line's
`--json` schema) and a one-screen summary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# how a span's effect was obtained (`SpanEffect.source`)
CHECKED = "checked"      # hidden alone and scored, beside same-size controls: exact
ESTIMATED = "estimated"  # the surrogate's weight: an estimate (trust it as far as the LDS says)
UNREAD = "unread"        # no DSA layer read it while answering: hiding it alone changes nothing (exact, not run)
UNVARIED = "unvaried"    # read, but among the least read beyond the masks' cap: kept in every mask (effect 0: unknown)


@dataclass
class SpanEffect:
    """One span of the context and what hiding it does to the answer.

    Attributes:
        start, end: token positions, end exclusive (as the trace numbers them).
        label: its segment's name (or the label it was given); kind: sentence, paragraph, segment,
            image patches or given.
        text: its text (cut to 400 characters).
        effect: change of the target's total log-probability with the span hidden, nats (negative: a
            drop); exact for `source` "checked" and "unread", the surrogate's estimate for "estimated".
        estimate: the surrogate's estimate of that change (-weight; 0 for unread spans).
        control_min, control_max, controls: the same change with each of `controls` disjoint random
            spans of the same length hidden instead (checked spans only; NaN and 0 otherwise).
        rank, p_value: the effect's rank among its controls and the empirical one-sided p-value.
        verdict: the sentence ("... the answer depends on ..."), or why there is none.
        label_verdict: `workbench.analysis.causal` label (depends / too small / chance / no verdict).
        reads: (DSA layer, query) selections of the answer that read a key of the span.
        source: CHECKED, ESTIMATED, UNREAD or UNVARIED (read, but kept in every mask: its 0 says nothing).
    """

    start: int
    end: int
    label: str
    kind: str
    text: str
    effect: float
    estimate: float
    control_min: float = math.nan
    control_max: float = math.nan
    controls: int = 0
    rank: int | None = None
    p_value: float | None = None
    verdict: str = ""
    label_verdict: str = ""
    reads: int = 0
    source: str = ESTIMATED

    def to_json(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return float(v) if v is not None and math.isfinite(v) else None

        return {"start": self.start, "end": self.end, "text": self.text, "effect": num(self.effect),
                "control_min": num(self.control_min), "control_max": num(self.control_max),
                "controls": self.controls, "verdict": self.verdict, "label": self.label, "kind": self.kind,
                "estimate": num(self.estimate), "rank": self.rank, "p_value": self.p_value,
                "reads": self.reads, "source": self.source}


@dataclass
class Attribution:
    """Which spans of the context the answer came from (`workbench.attribute`).

    Attributes:
        answer: the plain answer, generated greedily after the continuation (text).
        right: whether it holds the expected value (a task with one), else None.
        target: the scored target (text); target_ids: its token ids.
        target_logprob: its total log-probability without intervention, nats.
        lds: the surrogate's Spearman correlation of predicted and measured log-probabilities on the
            held-out masks (None when not measured or undefined: e.g. every mask scored the same).
        prefill_s: seconds of one prefill of the context, measured in this call (None when the session
            came already prefilled); attribution_s: seconds of everything else (reads, masks, surrogate,
            exact checks, answer).
        spans: every span, ordered by effect, largest drop first: the checked spans (exact) first, then
            the others by their estimated effect.
        masks, holdout: ablation masks measured (masks + holdout in all; each held out once for the LDS,
            all fitted for the ranking); candidates: spans the masks
            varied (read by some DSA layer, or all with `kda`); runs: continuations (and partial prefills)
            run in all.
        kda: whether KDA writes over hidden spans were suppressed too (each mask re-runs the context from
            its earliest hidden span); end: the context's length (the fork point).
        mask_matrix, mask_logprobs, mask_predictions: the masks (`[masks + holdout, candidates]` bool, True =
            kept), each mask's measured target log-probability and its held-out prediction (by a surrogate
            fitted without it: what the LDS correlates), for plots and comparison scripts;
            candidate_spans: the (start, end) of each mask column.
        notes: what a reader should know (pruned spans, capped candidates, a warning of the scoring).
    """

    answer: str
    right: bool | None
    target: str
    target_ids: list[int]
    target_logprob: float
    lds: float | None
    prefill_s: float | None
    attribution_s: float
    spans: list[SpanEffect]
    masks: int
    holdout: int
    candidates: int
    runs: int
    kda: bool
    end: int
    mask_matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    mask_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mask_predictions: np.ndarray = field(default_factory=lambda: np.zeros(0))
    candidate_spans: list[tuple[int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def checked(self) -> list[SpanEffect]:
        """The spans checked one by one (with controls and a verdict), largest drop first."""
        return [s for s in self.spans if s.source == CHECKED]

    def to_json(self) -> dict[str, Any]:
        """The `workbench attribute --json` object (documented in docs/attribution.md)."""
        return {"answer": self.answer, "right": self.right, "target": self.target,
                "target_logprob": float(self.target_logprob), "lds": self.lds,
                "prefill_s": self.prefill_s, "attribution_s": float(self.attribution_s),
                "masks": self.masks, "holdout": self.holdout, "candidates": self.candidates, "runs": self.runs,
                "kda": self.kda, "context_tokens": self.end, "notes": list(self.notes),
                "spans": [s.to_json() for s in self.spans]}

    def to_frame(self) -> Any:
        """One row per span (pandas), in the result's order."""
        import pandas as pd

        return pd.DataFrame([{k: v for k, v in s.to_json().items()} for s in self.spans])

    def summary(self, top: int = 8) -> str:
        """The answer, the LDS and the top spans with their effects, controls and verdicts, in lines."""
        lds = "not measured" if self.lds is None else f"{self.lds:.2f}"
        prefill = "" if self.prefill_s is None else f", one prefill of the context {self.prefill_s:.1f} s"
        lines = [f"answer: {self.answer!r}" + ("" if self.right is None else f" ({'right' if self.right else 'wrong'})"),
                 f"target {self.target!r}: log-probability {self.target_logprob:.3f} nats",
                 f"{len(self.spans)} spans, {self.candidates} varied by {self.masks + self.holdout} random masks: "
                 f"LDS {lds} (Spearman of the surrogate's prediction vs the measured log-probability on held-out "
                 f"masks, each predicted by a fit without it; 1 = ranks masks perfectly, 0 = no better than chance)",
                 f"attribution {self.attribution_s:.1f} s, {self.runs} runs{prefill}"]
        for s in self.spans[:top]:
            text = " ".join(s.text.split())
            text = text if len(text) <= 70 else text[:69] + "…"
            controls = (f"controls {s.control_min:+.3f}..{s.control_max:+.3f} ({s.controls})" if s.controls
                        else s.source)
            lines.append(f"  [{s.start}, {s.end}) {s.effect:+8.3f} nats  {controls}  {text!r}")
            if s.verdict:
                lines.append(f"      {s.verdict}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


__all__ = ["CHECKED", "ESTIMATED", "UNREAD", "UNVARIED", "SpanEffect", "Attribution"]
