"""The demo's causal check (`workbench demo`): does the answer depend on what the reading DSA layers read?

After an answer, the demo reruns its question from the shared prefix (a fork of the session taken
just before the question, so the long context is prefilled once):

- the span (the needle, the picture) hidden from the layer that read it most;
- the span hidden from every DSA layer;
- beside each, the controls: `workbench.analysis.causal.DEFAULT_CONTROLS` random spans of the same
  length in the documents, never overlapping the span or each other, hidden from the same layers
  (`workbench.causal.check.check_span`). An effect is only an effect beside what hiding any span of that size
  does; each row ends with the verdict in plain words, or "no verdict" when too few controls fit.

Each row is the branch's answer and the log-probability of the expected value under it, both
computed on this run (nothing here is a stored figure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.interventions import DsaHide
from workbench.analysis.causal import DEFAULT_CONTROLS
from workbench.retrieval_text import answer_prefix, response_value

# generated tokens per branch beyond the value's own (the response's `<|close|>` and a margin)
_EXTRA_TOKENS = 2


@dataclass(frozen=True)
class CheckRow:
    """One branch of the causal check (with its controls and verdict when something was hidden)."""

    label: str              # what was hidden, in words
    hidden: tuple[int, int] | None   # the positions hidden (None: the plain rerun)
    layers: str             # "all" or the layer id
    answer: str             # the response as the branch wrote it (prefix + generated, up to `<|close|>`)
    value: str              # the value in it
    logprob: float          # log-probability of the expected value's tokens (nats, summed)
    controls: tuple[float, ...] = ()   # each control's change of log p (nats)
    verdict: str = ""       # the verdict sentence (`workbench.analysis.causal.verdict`)
    odds: str = ""          # the effect's rank among the controls and its p-value ("rank 1 of 9, p = 0.11")


@dataclass(frozen=True)
class CausalCheck:
    """The causal check of one answer: the plain rerun first, then the intervened branches."""

    subject: str            # "needle" / "picture"
    expected: str
    span: tuple[int, int]
    fork_at: int
    rows: list[CheckRow]
    control_spans: tuple[tuple[int, int], ...] = field(default=())


def question_continuation(question: str, prefix_ids: list[int]) -> Callable[[Any], None]:
    """The continuation each branch appends: the question as a user turn and the opened response,
    exactly as the demo asked it."""

    def append(branch: Any) -> None:
        branch.append(question, role="user", name="question")
        branch.append(ids=prefix_ids, name="answer prefix", kind="turn", role="assistant")

    return append


def top_reader(readers: Any) -> int | None:
    """The DSA layer that read the span for the most answer tokens (ties: the higher ratio to
    chance); None when no layer read it at all."""
    if readers is None or not len(readers):
        return None
    reading = readers[readers["read_share"] > 0]
    if not len(reading):
        return None
    best = reading.sort_values(["read_share", "ratio"], ascending=False, na_position="last").iloc[0]
    return int(best["layer"])


def causal_check(base: Any, *, subject: str, question: str, key: str, style: str, expected: str,
                 span: tuple[int, int], region: tuple[int, int], readers: Any,
                 controls: int = DEFAULT_CONTROLS) -> CausalCheck:
    """Rerun `question` from `base` (a session holding the shared prefix: left as it is, the branches
    are forks) plainly and with `span` hidden; see the module doc. `region`: where the control spans
    may lie (the documents); `readers`: `layers_reading` rows of the answer, for the top reader."""
    from workbench.causal.check import check_span
    from workbench.causal_effects import effects

    tokenizer = base.tokenizer
    prefix = answer_prefix(style, key)
    prefix_ids = tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(prefix)
    continuation = question_continuation(question, prefix_ids)
    target = tokenizer.encode(expected)
    plan: list[tuple[str, str]] = []
    top = top_reader(readers)
    if top is not None:
        plan.append((f"hidden from layer {top} (top reader)", str(top)))
    plan.append(("hidden from every DSA layer", "all"))

    def row(label: str, hidden: tuple[int, int] | None, layers: str, branch: Any, controls: tuple[float, ...] = (),
            verdict: str = "", odds: str = "") -> CheckRow:
        response = prefix + branch.text.split("<|close|>", 1)[0]
        return CheckRow(label, hidden, layers, response, response_value(response, style),
                        float(branch.target_logprobs.sum()), controls, verdict, odds)

    rows: list[CheckRow] = []
    fork_at = len(base.tokens)
    spans: tuple[tuple[int, int], ...] = ()
    for label, layers in plan:
        chosen = "all" if layers == "all" else (int(layers),)
        found = effects(base, DsaHide(span, chosen), continuation=continuation, target=target,
                                  max_new_tokens=len(target) + _EXTRA_TOKENS)
        checked = check_span(base, span, continuation=continuation, target=target, what=f"the {subject}",
                                       layers=chosen, region=region, controls=controls)
        fork_at, spans = found.fork_at, checked.controls
        if not rows:  # the plain branch is the same for every intervention: shown once
            rows.append(row("nothing hidden", None, "", found.plain))
        rows.append(row(label, span, layers, found.intervened, checked.control_effects, checked.verdict.sentence,
                        checked.verdict.odds))
    return CausalCheck(subject, expected, span, fork_at, rows, spans)


def check_lines(check: CausalCheck) -> list[str]:
    """The check as the demo prints it: each branch's answer and the expected value's log-probability,
    its change from the plain rerun beside it, then its verdict beside the controls."""
    plain = check.rows[0].logprob
    length = check.span[1] - check.span[0]
    n = len(check.control_spans)
    lines = [f"causal check: the {check.subject} [{check.span[0]}, {check.span[1]}) hidden, rerun from the shared "
             f"{check.fork_at:,}-token prefix",
             f"  (log p: of {check.expected!r}, nats; controls: {n} random {length}-token spans of the documents, "
             "none overlapping it or each other, hidden from the same layers)"]
    width = max(len(r.label) for r in check.rows)
    for r in check.rows:
        verdict = ("right" if r.value == check.expected else "right value, response not ended there"
                   if r.value.startswith(check.expected) else "wrong")
        change = "" if r.hidden is None else f" ({r.logprob - plain:+.2f})"
        lines.append(f"  {r.label:<{width}}  {r.answer!r} - {verdict}, log p {r.logprob:.2f}{change}")
        if r.verdict:
            lines.append(f"    {r.verdict}" + (f" ({r.odds})" if r.odds else ""))
    return lines


def effects_rows(check: CausalCheck) -> list[dict]:
    """The check as rows of the trace's effects table (`workbench.trace.effects_table`): each
    switch-off's change of log p beside its own controls'."""
    from workbench.trace.effects_table import effect_row

    plain = check.rows[0].logprob
    return [effect_row(check.subject, check.expected, "dsa.hide", effect=r.logprob - plain, controls=list(r.controls),
                       plain=plain, segment=check.subject, span=r.hidden, layer=r.layers, fork_at=check.fork_at)
            for r in check.rows[1:]]
