"""Did the answer use this span? `check_span(...)`: one span hidden beside random same-size controls.

    task = fact_task([("notes.txt", text)], "garage door", "7142")
    found = ask(session, task)                     # records where the fact is: found.spans
    check = workbench.check_span(session_before_answer, found.spans["the fact"], continuation=task,
                                 evidence=list(found.spans.values()), what="the fact")
    print(check.verdict.sentence)

From one shared prefix (the context, prefilled once) the answer's target is scored by teacher forcing
after the continuation: as the model is, with the span hidden from the DSA layers, and with each of
`controls` random spans of the same length hidden from the same layers (`control_spans`: never
overlapping the span, the answer's evidence or each other). Every branch is a continuation only: a
span hidden from DSA reads needs no re-prefill. The verdict (`workbench.analysis.causal.verdict`)
ranks the effect among the controls and says in one sentence whether the answer depends on the span;
where too few controls fit, it says so and gives none.

The demo's causal check (`workbench.causal.demo_check`) uses this function.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from engine.errors import InputError
from engine.interventions import DsaHide
from workbench.analysis.causal import DEFAULT_CONTROLS, Verdict, control_spans, verdict
from workbench.causal_effects import (Continuation, ScoringWarning, _continue, _ids, _scaffold_warning,
                                      target_logprobs, task_scoring)
from workbench.interventions import _segment_span, check_positions, check_seed
from workbench.task_templates import TaskPrompt, recorded_spans

Span = tuple[int, int]


@dataclass(frozen=True)
class SpanCheck:
    """One span's check.

    Attributes:
        span: the positions hidden [start, end). what: the span in words.
        layers: the DSA layers it was hidden from ("all" or ids).
        fork_at: the shared prefix's length (every branch continues from there).
        plain: the target's total log-probability as the model is, nats.
        effect: its change with the span hidden, nats.
        controls: the control spans; control_effects: the change with each, nats.
        note: why fewer controls than asked fitted ("" when all did).
        verdict: the effect among its controls, with its sentence.
        warnings: e.g. a text continuation after which the model writes chat tags, not the answer.
    """

    span: Span
    what: str
    layers: Any
    fork_at: int
    plain: float
    effect: float
    controls: tuple[Span, ...]
    control_effects: tuple[float, ...]
    note: str
    verdict: Verdict
    warnings: tuple[str, ...] = ()  # why the scores may not mean what they seem (`ScoringWarning`)


def check_span(session: Any, span: Sequence[int] | str, *, continuation: Continuation | TaskPrompt | str | Sequence[int],
               target: str | Sequence[int] | None = None, what: str | None = None, layers: Any = "all",
               evidence: Sequence[Sequence[int]] = (), region: Sequence[int] | None = None,
               controls: int = DEFAULT_CONTROLS, seed: int = 0, role: str = "user") -> SpanCheck:
    """Hide `span` from the DSA `layers` and from each random same-size control; see the module doc.

    Args:
        session: holds the shared context (appended; prefilled here, left as it is: the branches are forks).
        span: (start, end) token positions to hide, end exclusive, or the name of a span a task template
            recorded ("the fact": then the other recorded spans, its restatements, are evidence too) or of
            a segment.
        continuation, target, role: as `workbench.effects` (a `TaskPrompt` scores its expected value where
            the model answers).
        what: the span in words for the verdict (default "[start, end)").
        evidence: spans of the answer's own evidence (the fact, its restatements) no control may touch.
        region: where controls may lie (default: the whole context).
        controls, seed: how many controls, and their seed (the same draw every run).
    """
    continuation, target = task_scoring(continuation, target)
    target_ids = _ids(session, target)
    if target_ids is None:
        raise InputError("check_span needs a target answer to score (target=, or a task with an expected value)")
    end = len(session.tokens)
    if isinstance(span, str):
        named = recorded_spans(session)
        if span in named:
            what = what or span
            evidence = [*evidence, *(v for k, v in named.items() if k != span)]
            span = named[span]
        else:
            what = what or span
            span = _segment_span(session, span, f"the span to hide ({span!r})")
    span = check_positions(span, "the span to hide", limit=end, bound="the context")
    avoid = [span] + [check_positions(e, "an evidence span", limit=end, bound="the context") for e in evidence]
    region = (0, end) if region is None else check_positions(region, "the controls' region", limit=end,
                                                             bound="the context")
    chosen = "all" if layers == "all" else tuple(int(v) for v in layers)
    draw = control_spans(span[1] - span[0], region, avoid, controls, check_seed(seed))
    session.prefill()

    def score(hidden: Span | None) -> float:
        spec = [] if hidden is None else [DsaHide(hidden, chosen)]
        return float(target_logprobs(session, spec, continuation, target_ids, role).sum())

    notes = tuple(w for w in [_scaffold_note(session, continuation, target_ids, role)] if w)
    for note in notes:
        warnings.warn(note, ScoringWarning, stacklevel=2)
    plain = score(None)
    effect = score(span) - plain
    control_effects = tuple(score(c) - plain for c in draw.spans)
    label = what or f"[{span[0]}, {span[1]})"
    where = "" if chosen == "all" else f"from DSA layer{'s' if len(chosen) > 1 else ''} {', '.join(map(str, chosen))}"
    found = verdict(effect, control_effects, label, where=where, note=draw.note)
    return SpanCheck(span, label, chosen, end, plain, effect, draw.spans, control_effects, draw.note, found, notes)


def _scaffold_note(session: Any, continuation: Any, target: list[int], role: str) -> str:
    """After a text continuation, the model's first greedy token: a warning when it is a chat tag the
    target does not start with (one continuation more, only for text continuations)."""
    if not isinstance(continuation, str) or session.tokenizer is None:
        return ""
    branch = session.fork()
    branch.progress = False
    _continue(branch, continuation, role)
    first = branch.prefill()
    return "" if first is None else _scaffold_warning(session.tokenizer, [int(first.argmax())], target)


__all__ = ["SpanCheck", "check_span"]
