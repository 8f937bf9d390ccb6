"""Verdicts that hold: same-size control spans and the plain-words verdict of an effect.

An intervention's effect (the change of the answer's log-probability, nats) means something only
beside what a random intervention of the same size does. Two pure functions make that comparison the
same everywhere an effect is shown (the API, `workbench questions`, the demo, the dashboard, notebook 09):

- `control_spans(length, region, avoid, count, seed)`: seeded random spans of `length` positions
  inside `region` that overlap neither the intervened span, the answer's own evidence (the fact and
  its restatements, when known) nor each other. When fewer than `count` fit, the draw says so
  (`ControlDraw.note`) and holds the ones that fit: it never falls back to an overlapping span.
- `verdict(effect, controls, what)`: the effect's rank among the controls (an empirical one-sided
  p-value: a random span of the same size lowers the answer as much with probability at most p) and
  one sentence: "hiding X lowered the answer's log-probability by 12.3 nats; 8 random spans of the
  same size changed it by -0.1 to +0.2: the answer depends on X". With fewer than `MIN_CONTROLS`
  controls there is no verdict, and the sentence says why.

The rule: the answer depends on X when the effect is a drop below every control (rank 1 of n + 1,
p = 1 / (n + 1)) by at least `MIN_EFFECT_NATS` beyond the lowest control; a drop below every control
by less is said to be too small to matter; anything else is not distinguishable from a random span
of the same size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.errors import InputError

# controls drawn by default, and the fewest a verdict is given on (1 / (8 + 1) = 0.11 is the smallest
# p-value 8 controls can show; fewer cannot tell a drop from a lucky draw)
DEFAULT_CONTROLS = 8
MIN_CONTROLS = 8
# a drop below every control but by less than this (nats, beyond the controls' lowest) is not one a
# reader should act on: a tenth of a nat is a 10% change of the answer's probability
MIN_EFFECT_NATS = 0.1
DEPENDS = "depends"
# what each op does to a memory, as a verdict sentence says it
ACTION_WORDS = {"dsa.hide": "hiding", "dsa.pin": "pinning", "kda.suppress_writes": "suppressing the KDA writes over",
                "moe.ban": "banning"}
CHANCE = "not distinguishable from chance"
SMALL = "below every control, too small to matter"
NO_VERDICT = "no verdict"

Span = tuple[int, int]


@dataclass(frozen=True)
class ControlDraw:
    """Control spans drawn for one intervened span.

    Attributes:
        spans: the controls, each `length` positions, disjoint from each other and from everything avoided.
        wanted: how many were asked for.
        note: "" when all `wanted` fit; else why fewer did (the room left outside what is avoided).
    """

    spans: tuple[Span, ...]
    wanted: int
    note: str = ""

    @property
    def enough(self) -> bool:
        return len(self.spans) >= self.wanted


def _merged(spans: Sequence[Span]) -> list[Span]:
    out: list[list[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in spans if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def free_gaps(region: Span, avoid: Sequence[Span]) -> list[Span]:
    """The parts of `region` [start, end) outside every span of `avoid`, in order."""
    gaps, at = [], int(region[0])
    for start, end in _merged(avoid):
        if start > at:
            gaps.append((at, min(start, int(region[1]))))
        at = max(at, end)
    if at < region[1]:
        gaps.append((at, int(region[1])))
    return [(s, e) for s, e in gaps if e > s]


def control_spans(length: int, region: Span, avoid: Sequence[Span] = (), count: int = DEFAULT_CONTROLS,
                  seed: int = 0) -> ControlDraw:
    """`count` random spans of `length` positions inside `region`, disjoint from `avoid` (the intervened
    span, the answer's evidence) and from each other; seeded (the same draw every run).

    Each control is drawn uniformly among the starts still free; a gap of the region holds at most
    `len // length` controls, so when the free room cannot hold `count` disjoint ones the draw
    holds as many as fit and its `note` says why. InputError for a length or region that is no span.
    """
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise InputError(f"a control span's length must be a positive number of positions, got {length!r}")
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise InputError(f"the number of controls must be a non-negative integer, got {count!r}")
    if len(region) != 2 or not 0 <= region[0] <= region[1]:
        raise InputError(f"the controls' region must be (start, end) positions with start <= end, got {region!r}")
    length, count = int(length), int(count)
    rng = np.random.default_rng(seed)
    taken = list(avoid)
    capacity = sum((e - s) // length for s, e in free_gaps(region, taken))
    chosen: list[Span] = []
    for _ in range(min(count, capacity)):
        # a start leaves room for the controls still to come only when the gaps left can hold them:
        # drawing from the starts that keep the rest placeable never strands the draw short of `capacity`
        gaps = free_gaps(region, taken)
        left = min(count, capacity) - len(chosen) - 1
        holds = [(e - s) // length for s, e in gaps]
        parts = []
        for (s, e), held in zip(gaps, holds):
            first = np.arange(s, e - length + 1)
            keeps = (first - s) // length + (e - first - length) // length + sum(holds) - held
            parts.append(first[keeps >= left])
        starts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if not len(starts):
            break
        start = int(rng.choice(starts))
        chosen.append((start, start + length))
        taken.append((start, start + length))
    note = ""
    if len(chosen) < count:
        room = sum(e - s for s, e in free_gaps(region, list(avoid)))
        fit = f"only {len(chosen)} random span(s)" if chosen else "no random span"
        note = (f"{fit} of {length:,} tokens fit outside the intervened span and the answer's evidence "
                f"({room:,} free tokens of {region[1] - region[0]:,}; {count} wanted)")
    return ControlDraw(tuple(sorted(chosen)), count, note)


@dataclass(frozen=True)
class Verdict:
    """An effect beside its controls, in figures and in words.

    Attributes:
        effect: change of the answer's log-probability with the intervention, nats.
        controls: the same change with each control, nats.
        rank: 1 + how many controls lowered it at least as much (1: the largest drop of all); None without controls.
        p_value: rank / (n + 1): the chance a random span of the same size lowers it as much (one-sided).
        label: DEPENDS, SMALL (below every control by less than MIN_EFFECT_NATS), CHANCE or NO_VERDICT.
        sentence: the verdict in plain words (what every surface prints).
    """

    effect: float
    controls: tuple[float, ...]
    rank: int | None
    p_value: float | None
    label: str
    sentence: str

    @property
    def decided(self) -> bool:
        return self.label != NO_VERDICT

    @property
    def odds(self) -> str:
        """The effect's rank among the controls and its p-value in words ("" when neither is known)."""
        if self.rank is None or self.p_value is None:
            return ""
        n = len(self.controls) if self.controls else round(self.rank / self.p_value) - 1
        return f"rank {self.rank} of {n + 1}, p = {self.p_value:.2f}"


def _signed(value: float, digits: int) -> str:
    """`value` with a sign, a rounded -0 shown as +0."""
    return f"{round(value, digits) + 0.0:+.{digits}f}"


def _change(effect: float, what: str, action: str) -> str:
    if not math.isfinite(effect):
        return f"{action} {what} gave no finite change of the answer's log-probability"
    verb = "lowered" if effect < 0 else "raised"
    return f"{action} {what} {verb} the answer's log-probability by {abs(effect):.{_digits(effect)}f} nats"


def _digits(value: float) -> int:
    return 1 if abs(value) >= 1 else 2 if abs(value) >= 0.01 else 4


def _plural(unit: str, n: int) -> str:
    """"span" -> "spans", "set of experts" -> "sets of experts" (n != 1)."""
    if n == 1:
        return unit
    head, _, rest = unit.partition(" ")
    return f"{head}s" + (f" {rest}" if rest else "")


def _control_words(n: int, low: float, high: float, unit: str) -> str:
    digits = _digits(max(abs(low), abs(high)))
    return (f"{n} random {_plural(unit, n)} of the same size changed it by {_signed(low, digits)} to "
            f"{_signed(high, digits)}")


def _judged(effect: float, low: float, rank: int | None, what: str, unit: str) -> tuple[str, str]:
    """(label, conclusion) of a decided verdict: depends, below every control but by too little, or chance."""
    if rank == 1 and effect <= low - MIN_EFFECT_NATS:
        return DEPENDS, f": the answer depends on {what}"
    if rank == 1 and effect < low:
        return SMALL, (f": below every random {unit}, but by less than {MIN_EFFECT_NATS} nats: too small to say "
                       f"the answer depends on {what}")
    return CHANCE, f": not distinguishable from a random {unit} of the same size"


def verdict(effect: float, controls: Sequence[float], what: str, *, where: str = "", note: str = "",
            min_controls: int = MIN_CONTROLS, unit: str = "span", action: str = "hiding") -> Verdict:
    """The verdict on `effect` (nats) beside `controls` (nats): see the module doc.

    Args:
        what: what was switched off, in words ("the fact", "report.txt", "experts [3, 5] of layer 2").
        where: from where, said after `what` in the first half only ("from DSA layer 5").
        note: why fewer controls than wanted were drawn (`ControlDraw.note`), said in a no-verdict sentence.
        min_controls: the fewest controls a verdict is given on.
        unit: what a control is ("span", "set of experts"), for the sentence.
        action: what was done to it ("hiding", "banning", "suppressing the KDA writes over").
    """
    c = tuple(float(v) for v in controls if math.isfinite(float(v)))
    effect = float(effect)
    head = _change(effect, f"{what} {where}" if where else what, action)
    if not c:
        reason = note or "no control was run"
        return Verdict(effect, c, None, None, NO_VERDICT, f"{head}; no verdict: {reason}")
    rank = 1 + sum(v <= effect for v in c)
    p_value = rank / (len(c) + 1)
    beside = _control_words(len(c), min(c), max(c), unit)
    if len(c) < min_controls or not math.isfinite(effect):
        reason = note or f"{len(c)} control(s) cannot tell a drop from a lucky draw ({min_controls} needed)"
        return Verdict(effect, c, rank, p_value, NO_VERDICT, f"{head}; {beside}; no verdict: {reason}")
    label, conclusion = _judged(effect, min(c), rank, what, unit)
    return Verdict(effect, c, rank, p_value, label, f"{head}; {beside}{conclusion}")


def verdict_of_summary(effect: float, control_min: float, control_max: float, controls: int, what: str, *,
                       where: str = "", min_controls: int = MIN_CONTROLS, unit: str = "span",
                       action: str = "hiding") -> Verdict:
    """The verdict from a stored summary of the controls (the effects table keeps their count, min and
    max): decided exactly as `verdict` decides, since a drop below every control needs only the minimum.
    The rank is known only when the effect lies below every control (1) or above every one (n + 1)."""
    n = int(controls) if controls == controls else 0  # NaN: no controls
    effect = float(effect)
    head = _change(effect, f"{what} {where}" if where else what, action)
    if n < 1 or not (math.isfinite(control_min) and math.isfinite(control_max)):
        return Verdict(effect, (), None, None, NO_VERDICT, f"{head}; no verdict: no control fitted")
    beside = _control_words(n, control_min, control_max, unit)
    rank = 1 if effect < control_min else n + 1 if effect > control_max else None
    p_value = None if rank is None else rank / (n + 1)
    if n < min_controls or not math.isfinite(effect):
        return Verdict(effect, (), rank, p_value, NO_VERDICT,
                       f"{head}; {beside}; no verdict: {n} control(s) cannot tell a drop from a lucky draw "
                       f"({min_controls} needed)")
    label, conclusion = _judged(effect, control_min, rank, what, unit)
    return Verdict(effect, (), rank, p_value, label, f"{head}; {beside}{conclusion}")


__all__ = ["ACTION_WORDS", "DEFAULT_CONTROLS", "MIN_CONTROLS", "MIN_EFFECT_NATS", "DEPENDS", "CHANCE", "SMALL",
           "NO_VERDICT", "ControlDraw",
           "control_spans", "free_gaps", "Verdict", "verdict", "verdict_of_summary"]
