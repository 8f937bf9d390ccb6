"""The demo's causal check: does the answer depend on what the reading DSA layers read?

After an answer, the demo reruns its question from the shared prefix (a fork of the session taken
just before the question, so the long context is prefilled once) with `workbench.effects`:

- the span (the needle, the picture) hidden from the layer that read it most;
- the span hidden from every DSA layer;
- the control: a random span of the same length, elsewhere in the documents, hidden from every DSA
  layer. An effect is only an effect beside what hiding any span of that size does.

Each row is the branch's answer and the log-probability of the expected value under it, both
computed on this run (nothing here is a stored figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine.interventions import DsaHide
from workbench.retrieval_text import answer_prefix, response_value

# fixed so that two runs of the demo hide the same control span
CONTROL_SEED = 0
# generated tokens per branch beyond the value's own (the response's `<|close|>` and a margin)
_EXTRA_TOKENS = 2


@dataclass(frozen=True)
class CheckRow:
    """One branch of the causal check."""

    label: str              # what was hidden, in words
    hidden: tuple[int, int] | None   # the positions hidden (None: the plain rerun)
    layers: str             # "all" or the layer id
    answer: str             # the response as the branch wrote it (prefix + generated, up to `<|close|>`)
    value: str              # the value in it
    logprob: float          # log-probability of the expected value's tokens (nats, summed)
    control: bool = False


@dataclass(frozen=True)
class CausalCheck:
    """The causal check of one answer: the plain rerun first, then the intervened branches."""

    subject: str            # "needle" / "picture"
    expected: str
    span: tuple[int, int]
    fork_at: int
    rows: list[CheckRow]


def question_continuation(question: str, prefix_ids: list[int]) -> Callable[[Any], None]:
    """The continuation each branch appends: the question as a user turn and the opened response,
    exactly as the demo asked it."""

    def append(branch: Any) -> None:
        branch.append(question, role="user", name="question")
        branch.append(ids=prefix_ids, name="answer prefix", kind="turn", role="assistant")

    return append


def control_span(length: int, region: tuple[int, int], avoid: tuple[int, int], seed: int = CONTROL_SEED,
                 ) -> tuple[int, int]:
    """A random span of `length` positions inside `region` that does not overlap `avoid` (anywhere in
    `region` when there is no such room)."""
    rng = np.random.default_rng(seed)
    starts = np.arange(region[0], max(region[0] + 1, region[1] - length + 1))
    free = starts[(starts + length <= avoid[0]) | (starts >= avoid[1])]
    start = int(rng.choice(free if len(free) else starts))
    return start, start + length


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
                 span: tuple[int, int], region: tuple[int, int], readers: Any) -> CausalCheck:
    """Rerun `question` from `base` (a session holding the shared prefix: left as it is, the branches
    are forks) plainly and with `span` hidden; see the module doc. `region`: where the control span
    may lie (the documents); `readers`: `layers_reading` rows of the answer, for the top reader."""
    import workbench

    tokenizer = base.tokenizer
    prefix = answer_prefix(style, key)
    prefix_ids = tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(prefix)
    continuation = question_continuation(question, prefix_ids)
    target = tokenizer.encode(expected)
    length = span[1] - span[0]
    control = control_span(length, region, span)
    plan: list[tuple[str, tuple[int, int], str, bool]] = []
    top = top_reader(readers)
    if top is not None:
        plan.append((f"hidden from layer {top} (top reader)", span, str(top), False))
    plan.append(("hidden from every DSA layer", span, "all", False))
    plan.append((f"control [{control[0]}, {control[1]}), every DSA layer", control, "all", True))

    def row(label: str, hidden: tuple[int, int] | None, layers: str, branch: Any, is_control: bool) -> CheckRow:
        response = prefix + branch.text.split("<|close|>", 1)[0]
        return CheckRow(label, hidden, layers, response, response_value(response, style),
                        float(branch.target_logprobs.sum()), is_control)

    rows: list[CheckRow] = []
    fork_at = len(base.tokens)
    for label, hidden, layers, is_control in plan:
        chosen = "all" if layers == "all" else [int(layers)]
        found = workbench.effects(base, DsaHide(hidden, chosen), continuation=continuation, target=target,
                                  max_new_tokens=len(target) + _EXTRA_TOKENS)
        fork_at = found.fork_at
        if not rows:  # the plain branch is the same for every intervention: shown once
            rows.append(row("nothing hidden", None, "", found.plain, False))
        rows.append(row(label, hidden, layers, found.intervened, is_control))
    return CausalCheck(subject, expected, span, fork_at, rows)


def check_lines(check: CausalCheck) -> list[str]:
    """The check as the demo prints it: each branch's answer and the expected value's log-probability,
    its change from the plain rerun beside it, and the control last."""
    plain = check.rows[0].logprob
    length = check.span[1] - check.span[0]
    lines = [f"causal check: the {check.subject} [{check.span[0]}, {check.span[1]}) hidden, rerun from the shared "
             f"{check.fork_at:,}-token prefix",
             f"  (log p: of {check.expected!r}, nats; control: a random {length}-token span of the documents hidden)"]
    width = max(len(r.label) for r in check.rows)
    for r in check.rows:
        verdict = ("right" if r.value == check.expected else "right value, response not ended there"
                   if r.value.startswith(check.expected) else "wrong")
        change = "" if r.hidden is None else f" ({r.logprob - plain:+.2f})"
        lines.append(f"  {r.label:<{width}}  {r.answer!r} - {verdict}, log p {r.logprob:.2f}{change}")
    return lines


def effects_rows(check: CausalCheck) -> list[dict]:
    """The check as rows of the trace's effects table (`workbench.trace.effects_table`): each
    switch-off's change of log p beside the control's."""
    from workbench.trace.effects_table import effect_row

    plain = check.rows[0].logprob
    controls = [r.logprob - plain for r in check.rows if r.control]
    return [effect_row(check.subject, check.expected, "dsa.hide", effect=r.logprob - plain, controls=controls,
                       plain=plain, segment=check.subject, span=r.hidden, layer=r.layers, fork_at=check.fork_at)
            for r in check.rows[1:] if not r.control]
