"""Drive mode's "what if" reruns, without widgets: the branch points kept while a session is recorded,
the plan of one rerun (what to switch off and its same-size controls), running it, and its rows of
the trace's effects table. `apps.dashboard.what_if` holds only the panel's widgets.

The session runner keeps, while it records a session, the branch points a rerun needs (`RerunBase`):
a fork of the session just before its answer (the context prefilled: every DSA and MoE rerun
continues from there, so the documents are never prefilled again) and forks at the first segments'
starts (suppressing a KDA head's writes over a segment changes the state from that segment on, so
such a rerun continues from the fork at its start: a partial prefill, never the whole document).

`run_rerun` runs `workbench.effects` from that base: the last answer's tokens scored with and without
the intervention, both answers generated greedily, and the answer scored with each of eight random
same-size controls (`workbench.analysis.causal.control_spans`: spans of the context that overlap
neither the switched-off span, the recorded fact and its restatements, nor each other; or as many
random experts), so the change is shown beside what chance gives, with its verdict in words (none
when too few controls fit). What to switch off: a segment, a span the task template recorded (the
fact, its restatement), or any range of positions typed as START:END. The intervention's two
branches (not the controls) are also recorded, DSA selections only, into two small traces beside
the session's trace (`what_if_traces`), for their DSA difference (`branch_diff`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workbench.analysis.causal import ACTION_WORDS, DEFAULT_CONTROLS, Verdict, control_spans, verdict
from workbench.causal.stop import ShouldStop, stop_if_asked

HIDE_DSA = "hide it from DSA layers"
SUPPRESS_KDA = "suppress KDA heads' writes over it"
BAN_EXPERTS = "ban experts (MoE layer)"
ACTIONS = [HIDE_DSA, SUPPRESS_KDA, BAN_EXPERTS]
# forks kept at segment starts for KDA reruns: each holds the state up to its start, so they are capped
MAX_SEGMENT_FORKS = 8
# the segment-start forks together hold at most this much model state (each is a full copy of the
# state at its point: at long contexts or full model sizes only the first few fit); the fork before
# the answer is always kept
FORK_BUDGET_BYTES = 1 << 30
CONTROLS = DEFAULT_CONTROLS  # random same-size controls per rerun (seeded: a rerun is deterministic)
CONTROL_SEED = 0
# the selector's entry for a range of positions typed in the "positions" box
RANGE = "a range of positions (type START:END)"
# generated tokens per rerun branch, at most: the answer is scored in full whatever its length
MAX_RERUN_TOKENS = 64
# position bins of the branches' DSA difference heat map (a rerun covers only the answer's few queries)
DIFF_BINS = 200


@dataclass
class RerunBase:
    """What the runner keeps of its last session for reruns (the forks are independent sessions)."""

    trace: Path
    end: Any = None  # fork just before the answer, context prefilled
    starts: dict[int, Any] = field(default_factory=dict)  # segment start -> fork there (rest pending)
    segments: tuple[Any, ...] = ()  # the context's segments (engine Segment)
    opening: tuple[int, ...] = ()  # ids between the context and the answer (the assistant turn opened)
    answer: tuple[int, ...] = ()  # the last answer's generated ids
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # recorded spans (the fact, restatements)

    def base_for(self, position: int) -> tuple[int, Any]:
        """The latest kept fork at or before `position` (a KDA rerun from a segment continues from it)."""
        kept = [p for p in self.starts if p <= position]
        if not kept:
            raise ValueError(f"no branch point kept at or before position {position}; KDA reruns are offered for "
                             f"the first {MAX_SEGMENT_FORKS} segments whose forks fit in "
                             f"{FORK_BUDGET_BYTES >> 20} MiB of state")
        at = max(kept)
        return at, self.starts[at]



def state_bytes(session: Any) -> int:
    """Bytes of model state a fork of `session` copies (its caches' rows in use)."""
    return sum(t.numel() * t.element_size() for t in session.state.to_tensors().values())


def keep_branch_points(session: Any, trace: Path) -> RerunBase:
    """Prefill `session` (recorded as usual) segment by segment, keeping a fork at each of the first
    segments' starts and one at the end: the branch points of later reruns."""
    base = RerunBase(trace=trace, segments=tuple(session.segments))
    kept_bytes = 0
    for seg in list(session.segments)[:MAX_SEGMENT_FORKS]:
        if seg.start >= session.length:
            session.prefill(until=seg.start)
            cost = state_bytes(session)
            if kept_bytes + cost > FORK_BUDGET_BYTES:
                break
            base.starts[seg.start] = session.fork()
            kept_bytes += cost
    session.prefill()
    base.end = session.fork()
    base.starts.setdefault(len(session.tokens), base.end)
    return base


def segment_label(seg: Any) -> str:
    return f"{seg.name} [{seg.start}, {seg.end})"


def recorded_spans(trace: Path) -> dict[str, tuple[int, int]]:
    """The spans a task template recorded in the trace (session.json `task.spans`: the fact, its
    restatements), by label; {} when it recorded none."""
    from workbench.trace import open_trace

    task = open_trace(trace).session.get("task")
    spans = task.get("spans") if isinstance(task, dict) else None
    if not isinstance(spans, dict):
        return {}
    return {str(k)[:80]: (int(v[0]), int(v[1])) for k, v in list(spans.items())[:16]
            if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            and 0 <= v[0] < v[1]}


def span_label(label: str, span: tuple[int, int]) -> str:
    return f"{label} [{span[0]}, {span[1]})"


def parse_range(text: str, end: int) -> tuple[int, int]:
    """'120:180' -> (120, 180), inside the context's `end` positions; ValueError naming what is wrong."""
    try:
        start, stop = (int(v) for v in text.replace(",", ":").split(":"))
    except ValueError:
        raise ValueError(f"positions: {text[:40]!r} is not START:END (token positions, end exclusive)") from None
    if not 0 <= start < stop <= end:
        raise ValueError(f"positions: need 0 <= START < END <= {end} (the context), got {text[:40]!r}")
    return start, stop


def parse_experts(text: str, num_experts: int) -> list[int]:
    """'3, 5' -> [3, 5]; ValueError naming what is wrong."""
    try:
        ids = sorted({int(t) for t in text.replace(",", " ").split()})
    except ValueError:
        raise ValueError(f"experts: {text!r} is not a list of expert numbers (e.g. 0, 3)") from None
    if not ids or any(not 0 <= e < num_experts for e in ids):
        raise ValueError(f"experts: give one or more expert numbers in 0..{num_experts - 1}, got {text!r}")
    return ids


@dataclass(frozen=True)
class Rerun:
    """One rerun's plan: the intervention, its controls, and the fork each continues from."""

    description: str
    op: str
    spec: list[dict]
    controls: list[list[dict]]
    segment: str | None
    span: tuple[int, int] | None
    layer: str
    heads: Any
    experts: list[int] | None
    size: int
    note: str = ""  # why fewer controls than CONTROLS fitted ("" when all did)
    what: str = ""  # what is switched off, in words (for the verdict)


def plan_rerun(base: RerunBase, config: Any, action: str, segment: str, layer: str, experts: str,
               positions: str = "") -> Rerun:
    """The rerun the panel's choices describe (ValueError naming a bad choice, before anything runs).
    `segment`: a segment's label, a recorded span's label (the fact), or RANGE with `positions` typed.
    Controls: `workbench.analysis.causal.control_spans`, never overlapping the span, the recorded
    evidence (the fact and its restatements) or each other."""
    rng = np.random.default_rng(CONTROL_SEED)
    end = len(base.end.tokens)
    layers: Any = "all" if layer == "all" else [int(layer)]
    if action == BAN_EXPERTS:
        if layer == "all":
            raise ValueError("ban experts: pick one MoE layer")
        banned = parse_experts(experts, config.num_experts)
        others = [e for e in range(config.num_experts) if e not in banned]
        if len(others) < len(banned):
            raise ValueError("ban experts: a control needs as many other experts as are banned")
        positions = [end, 1 << 40]  # the answer's tokens: the context's routes were already taken
        spec = [{"op": "moe.ban", "experts": banned, "layers": layers, "positions": positions}]
        controls = [[{"op": "moe.ban", "experts": sorted(rng.choice(others, len(banned), replace=False).tolist()),
                      "layers": layers, "positions": positions}] for _ in range(CONTROLS)]
        return Rerun(f"ban experts {banned} in layer {layer}", "moe.ban", spec, controls, None, None, layer, None,
                     banned, len(banned), what=f"experts {banned} of layer {layer}")
    name, span = _chosen_span(base, segment, positions, end)
    if action == HIDE_DSA:
        op, extra, lowest = "dsa.hide", {}, 0
    elif action == SUPPRESS_KDA:
        op, extra, lowest = "kda.suppress_writes", {"heads": "all"}, span[0]
        base.base_for(span[0])  # a fork at or before the span's start must be kept
    else:
        raise ValueError(f"unknown action {action!r}")

    def spec_for(s: tuple[int, int]) -> list[dict]:
        return [{"op": op, "positions": list(s), "layers": layers, **extra}]

    avoid = [span, *base.spans.values()]
    draw = control_spans(span[1] - span[0], (lowest, end), avoid, CONTROLS, CONTROL_SEED)
    if not draw.enough and lowest:  # KDA controls after the span re-run less; anywhere when too few fit there
        draw = control_spans(span[1] - span[0], (0, end), avoid, CONTROLS, CONTROL_SEED)
    where = "every layer" if layer == "all" else f"layer {layer}"
    verb = "hidden from DSA" if op == "dsa.hide" else "KDA writes suppressed in"
    what = name
    return Rerun(f"{name} {verb} {where}", op, spec_for(span), [spec_for(c) for c in draw.spans], name, span, layer,
                 "all" if op == "kda.suppress_writes" else None, None, span[1] - span[0], draw.note, what)


def _chosen_span(base: RerunBase, choice: str, positions: str, end: int) -> tuple[str, tuple[int, int]]:
    """(name, span) of the selector's choice: a segment, a recorded span, or a typed range."""
    if choice == RANGE:
        span = parse_range(positions, end)
        return f"positions [{span[0]}, {span[1]})", span
    seg = next((s for s in base.segments if segment_label(s) == choice or s.name == choice), None)
    if seg is not None:
        return seg.name, (int(seg.start), int(seg.end))
    for label, span in base.spans.items():
        if choice in (label, span_label(label, span)):
            if span[1] > end:
                raise ValueError(f"{label} [{span[0]}, {span[1]}) lies past the context's {end} tokens")
            return label, span
    raise ValueError(f"pick a segment or recorded span of the session (got {choice!r})")


def _first_position(spec: list[dict]) -> int:
    return min(int(s["positions"][0]) for s in spec)


@dataclass(frozen=True)
class RerunResult:
    rerun: Rerun
    plain_text: str
    intervened_text: str
    tokens: tuple[str, ...]
    plain: tuple[float, ...]  # the last answer's per-token log-probabilities, nats
    intervened: tuple[float, ...]
    control_changes: tuple[float, ...]  # each control's change of the total, nats
    fork_at: int
    dsa_traces: tuple[Path, Path] | None = None  # the branches' DSA recordings (plain, intervened)
    verdict: Verdict | None = None  # the change among the controls' (`workbench.analysis.causal.verdict`)

    @property
    def change(self) -> float:
        return float(sum(self.intervened) - sum(self.plain))


def answer_text(tokenizer: Any, context: list[int], ids: list[int]) -> str:
    """An answer's text as the runner shows it: the response the chat tags delimit (as `generate_answer`
    reads it), or the plain decoding without a tokenizer."""
    from engine.session.answer import read_answer

    return read_answer(tokenizer, context, ids)


def what_if_traces(trace: Path) -> tuple[Path, Path]:
    """Where a rerun records its plain and intervened branches: beside the session's trace, not inside it,
    so rewriting or replacing the session's trace never touches them (each rerun replaces them)."""
    folder = trace.parent / f"{trace.name}.what-if"
    return folder / "plain", folder / "intervened"


def run_rerun(base: RerunBase, rerun: Rerun, should_stop: ShouldStop | None = None) -> RerunResult:
    """Run the rerun and its controls from the kept forks (`workbench.effects`: plain and intervened;
    the intervention's branches recorded into `what_if_traces`). `should_stop` is asked before each
    control (the dashboard's Stop): True raises `workbench.causal.stop.Cancelled` there, with nothing
    returned (the two branches' DSA traces already recorded stay until the next rerun replaces them)."""
    from workbench.causal_effects import effects as measure, target_logprobs

    tokenizer = base.end.tokenizer
    opening = list(base.opening)

    def continuation(branch: Any) -> None:
        if opening:
            branch.append(ids=opening, name="assistant", kind="turn", role="assistant")

    def effects(spec: list[dict], record_to: tuple[Path, Path] | None = None) -> Any:
        session = base.end
        if rerun.op == "kda.suppress_writes":
            # effects() prefills its session up to the first suppressed position: a fork of the kept
            # branch point does that, so the kept one stays at its segment's start for later reruns
            session = base.base_for(_first_position(spec))[1].fork()
        return measure(session, *spec, continuation=continuation, target=list(base.answer),
                                 max_new_tokens=min(len(base.answer), MAX_RERUN_TOKENS), record_to=record_to)

    def control(spec: list[dict]) -> float:
        """A control's change: only the answer scored (no answers generated, nothing recorded); a KDA
        control continues from the kept fork at or before its span (the float rounding of another
        prefill split is all that differs from the plain branch's)."""
        session = base.end if rerun.op != "kda.suppress_writes" else base.base_for(_first_position(spec))[1]
        return float(target_logprobs(session, spec, continuation, list(base.answer)).sum()) - plain_total

    traces = what_if_traces(Path(base.trace))
    traces[0].parent.mkdir(parents=True, exist_ok=True)
    found = effects(rerun.spec, record_to=traces)
    plain_total = float(found.plain.target_logprobs.sum())
    planned = 2 + len(rerun.controls)  # the plain and intervened branches, then one continuation per control
    changes = []
    for spec in rerun.controls:
        stop_if_asked(should_stop, "what-if rerun", 2 + len(changes), planned)
        changes.append(control(spec))
    controls = tuple(changes)
    where = "" if rerun.op == "moe.ban" or rerun.layer == "all" else f"in layer {rerun.layer}"
    judged = verdict(found.target_logprob_change, controls, rerun.what or rerun.description, where=where,
                     note=rerun.note, unit="span" if rerun.span is not None else "set of experts",
                     action=ACTION_WORDS[rerun.op])
    text = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
    context = list(base.end.tokens) + opening
    return RerunResult(rerun, answer_text(tokenizer, context, found.plain.answer),
                       answer_text(tokenizer, context, found.intervened.answer),
                       tuple(text([t]) for t in base.answer), tuple(map(float, found.plain.target_logprobs)),
                       tuple(map(float, found.intervened.target_logprobs)), controls, found.fork_at, traces, judged)


def branch_diff(result: RerunResult, extent: int) -> Any:
    """The DSA difference of the rerun's two recorded branches (`DSADiffData`: A = plain, B = intervened),
    or None when the rerun recorded none."""
    from workbench.analysis.views import DSADiffReducer, RecordingMapData, ViewOptions
    from workbench.trace import open_trace

    if result.dsa_traces is None:
        return None
    plain, intervened = result.dsa_traces
    reducer = DSADiffReducer(intervened, shown_as="intervened branch")
    return reducer.reduce(open_trace(plain), ViewOptions(bins=DIFF_BINS), RecordingMapData(extent=max(1, extent)))


def effect_rows(base: RerunBase, result: RerunResult) -> list[dict]:
    """The rerun as a row of the trace's effects table (its check: this rerun's description)."""
    from workbench.trace.effects_table import effect_row

    r = result.rerun
    return [effect_row(f"what if: {r.description}", result.plain_text, r.op, effect=result.change,
                       controls=list(result.control_changes), plain=float(sum(result.plain)), segment=r.segment,
                       span=r.span, layer=r.layer, heads=r.heads, experts=r.experts, size=r.size,
                       fork_at=result.fork_at)]
