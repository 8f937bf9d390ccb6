"""Drive mode's "what if" panel: rerun the last answer with one memory switched off, beside a control.

The session runner keeps, while it records a session, the branch points a rerun needs (`RerunBase`):
a fork of the session just before its answer (the context prefilled: every DSA and MoE rerun
continues from there, so the documents are never prefilled again) and forks at the first segments'
starts (suppressing a KDA head's writes over a segment changes the state from that segment on, so
such a rerun continues from the fork at its start: a partial prefill, never the whole document).

"Rerun last answer" runs, in a worker thread (the Bokeh event loop only applies the outcome, in
`poll()`), `workbench.effects` from that base: the last answer's tokens scored with and without the
intervention, both answers generated greedily, and the answer scored with each of eight random
same-size controls (`workbench.analysis.causal.control_spans`: spans of the context that overlap
neither the switched-off span, the recorded fact and its restatements, nor each other; or as many
random experts), so the change is shown beside what chance gives, with its verdict in words (none
when too few controls fit). What to switch off: a segment, a span the task template recorded (the
fact, its restatement), or any range of positions typed as START:END.
The result is written into the trace's effects table (`workbench.trace.effects_table`), where the
effects view shows it. The intervention's two branches (not the controls) are also recorded, DSA
selections only, into two small traces beside the session's trace (`what_if_traces`), and their DSA
difference (the side-by-side dashboard's view, on these two traces) is shown below the table.
"""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import panel as pn
import param

from apps.dashboard.components.dsa_diff import diff_summary, layers_table
from apps.dashboard.components.figures import HeatFigure
from apps.dashboard.components.panes import AlertText, HTMLText, alert_text, html_table, set_text, text_pane
from workbench.analysis.causal import DEFAULT_CONTROLS, Verdict, control_spans, verdict

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
    return {str(k): (int(v[0]), int(v[1])) for k, v in spans.items()
            if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) and 0 <= v[0] < v[1]}


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
    what = name + ("" if layer == "all" else f" in layer {layer}")
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


def run_rerun(base: RerunBase, rerun: Rerun) -> RerunResult:
    """Run the rerun and its controls from the kept forks (`workbench.effects`: plain and intervened;
    the intervention's branches recorded into `what_if_traces`)."""
    import workbench

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
        return workbench.effects(session, *spec, continuation=continuation, target=list(base.answer),
                                 max_new_tokens=min(len(base.answer), MAX_RERUN_TOKENS), record_to=record_to)

    def control(spec: list[dict]) -> float:
        """A control's change: only the answer scored (no answers generated, nothing recorded); a KDA
        control continues from the kept fork at or before its span (the float rounding of another
        prefill split is all that differs from the plain branch's)."""
        from workbench.causal_effects import target_logprobs

        session = base.end if rerun.op != "kda.suppress_writes" else base.base_for(_first_position(spec))[1]
        return float(target_logprobs(session, spec, continuation, list(base.answer)).sum()) - plain_total

    traces = what_if_traces(Path(base.trace))
    traces[0].parent.mkdir(parents=True, exist_ok=True)
    found = effects(rerun.spec, record_to=traces)
    plain_total = float(found.plain.target_logprobs.sum())
    controls = tuple(control(spec) for spec in rerun.controls)
    judged = verdict(found.target_logprob_change, controls, rerun.what or rerun.description, note=rerun.note,
                     unit="span" if rerun.span is not None else "set of experts")
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


def token_table(result: RerunResult) -> str:
    """Per answer token: log p without and with the intervention and their difference (escaped HTML)."""
    cells = [[str(i), html.escape(repr(tok)), f"{p:.3f}", f"{q:.3f}", f"{q - p:+.3f}"]
             for i, (tok, p, q) in enumerate(zip(result.tokens, result.plain, result.intervened))]
    total = [["total", "", f"{sum(result.plain):.3f}", f"{sum(result.intervened):.3f}", f"{result.change:+.3f}"]]
    return html_table("k3-what-if-tokens", ["step", "token", "log p plain", "log p intervened", "difference"],
                      cells + total)


def result_text(result: RerunResult) -> str:
    c = result.control_changes
    controls = (f"controls ({len(c)} random same-size, disjoint): mean {np.mean(c):+.3f}, range [{min(c):+.3f}, "
                f"{max(c):+.3f}]" if c else "no control fitted")
    lines = [f"{result.rerun.description} (rerun from the {result.fork_at:,}-token prefix)",
             f"answer, plain:       {result.plain_text!r}",
             f"answer, intervened:  {result.intervened_text!r}",
             f"last answer's log p: {sum(result.plain):.3f} -> {sum(result.intervened):.3f} nats ({result.change:+.3f}); "
             + controls]
    if result.verdict is not None:
        lines.append(f"verdict: {result.verdict.sentence}")
    return "\n".join(lines)


class WhatIfPanel(pn.viewable.Viewer):
    """Pick a segment and what to switch off; "Rerun last answer" reruns it from the kept prefix."""

    segment = param.Selector(default=None, objects=[], doc="segment of the session to switch off")
    action = param.Selector(default=HIDE_DSA, objects=ACTIONS, doc="what to switch off")
    layer = param.Selector(default="all", objects=["all"], doc="layer it applies to ('all' or a layer id)")
    experts = param.String(default="0", doc="experts to ban, e.g. '0, 3' (ban experts only)")
    positions = param.String(default="", doc=f"START:END token positions to switch off (with '{RANGE}')")
    running = param.Boolean(default=False)
    message = param.String(default="")

    def __init__(self, base_source: Callable[[], tuple[RerunBase | None, Any]], lock: threading.Lock,
                 on_written: Callable[[], None] | None = None, **params: Any) -> None:
        super().__init__(**params)
        self._on_written = on_written  # told (event loop) when a rerun wrote the effects table: views re-read it
        self._base_source = base_source  # -> (the runner's kept base or None, the model config)
        self._lock = lock  # the runner's model lock: a rerun and a recording never share the model at once
        self._base: RerunBase | None = None
        self._config: Any = None
        self._outcome: tuple[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self.button = pn.widgets.Button(label="Rerun last answer", color="primary", width=160, disabled=True)
        self.button.on_click(lambda _: self.rerun())
        self.alert = AlertText("", alert_type="info", visible=False, sizing_mode="stretch_width")
        self.answers = text_pane("", sizing_mode="stretch_width", css_classes=["k3-what-if-answers"])
        self.tokens = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-what-if-tokens"])
        self.last: RerunResult | None = None
        # the branches' DSA difference, drawn as the side-by-side dashboard draws two traces'
        self.last_diff: Any = None
        self.diff_summary = text_pane("", sizing_mode="stretch_width", css_classes=["k3-what-if-dsa-diff-summary"])
        self.diff_heat = HeatFigure("Queries whose DSA reads changed", "query position",
                                    "DSA layer", "share changed", palette="inferno", height=200)
        self.diff_heat.mapper.update(low=0.0, high=1.0)
        self.diff_heat.figure.visible = False  # shown with the first rerun's difference, not as an empty plot
        self.diff_table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-what-if-dsa-diff"])

    def refresh(self) -> None:
        """Offer the segments and layers of the runner's last session (event loop)."""
        base, config = self._base_source()
        if base is self._base:
            return
        self._base, self._config = base, config
        labels = [segment_label(s) for s in base.segments] if base is not None else []
        if base is not None:
            try:
                base.spans = base.spans or recorded_spans(base.trace)
            except Exception:  # noqa: BLE001 - an unreadable trace only loses the recorded spans' entries
                base.spans = {}
            labels = [span_label(k, v) for k, v in base.spans.items()] + labels + [RANGE]
        self.param.segment.objects = labels
        self.segment = labels[0] if labels else None
        self._layers()
        self.button.disabled = base is None or self.running

    @param.depends("action", watch=True)
    def _layers(self) -> None:
        config = self._config
        if config is None:
            return
        ids = range(config.num_hidden_layers)
        if self.action == HIDE_DSA:
            options = ["all"] + [str(i) for i in ids if config.is_dsa_layer(i)]
        elif self.action == SUPPRESS_KDA:
            options = ["all"] + [str(i) for i in ids if config.is_kda_layer(i)]
        else:
            options = [str(i) for i in ids if config.is_moe_layer(i)]
        self.param.layer.objects = options
        self.layer = options[0] if options else "all"

    @param.depends("message", watch=True)
    def _show_message(self) -> None:
        self.alert.object = alert_text(self.message)
        self.alert.alert_type = "danger" if self.message.startswith("error:") else "info"
        self.alert.visible = bool(self.message)

    def rerun(self) -> bool:
        """Plan the rerun (a bad choice is an error message here) and start it in a worker thread."""
        base, config = self._base, self._config
        if base is None or self.running:
            self.message = "error: drive a session first" if base is None else "error: a rerun is running"
            return False
        try:
            rerun = plan_rerun(base, config, self.action, self.segment or "", self.layer, self.experts, self.positions)
        except ValueError as exc:
            self.message = f"error: {exc}"
            return False
        if not self._lock.acquire(blocking=False):
            self.message = "error: a session is running on this server; rerun when it has finished"
            return False
        self.running = True
        self.button.disabled = True
        self.message = f"rerunning: {rerun.description} …"
        self._thread = threading.Thread(target=self._work, args=(base, rerun), name="what-if", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._lock.release()
            raise
        return True

    def _work(self, base: RerunBase, rerun: Rerun) -> None:
        from engine import EngineError
        from workbench.trace import TraceError
        from workbench.trace.effects_table import write_effects

        try:
            result = run_rerun(base, rerun)
            write_effects(base.trace, effect_rows(base, result))
            diff = branch_diff(result, len(base.end.tokens) + len(base.opening) + len(base.answer))
            self._outcome = ("done", (result, diff))
        except (EngineError, TraceError, OSError, ValueError) as exc:
            self._outcome = ("error", f"error: {exc}")
        except Exception as exc:  # a bug: still tell the user, and keep the server alive
            self._outcome = ("error", f"error: rerun failed: {type(exc).__name__}: {exc}")
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running rerun's thread (tests, scripts)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def poll(self) -> None:
        """Apply what the worker left (event loop only)."""
        if not self.running:
            self.refresh()
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            return
        kind, value = outcome
        self.running = False
        self.button.disabled = self._base is None
        if kind == "done":
            value, diff = value
            self.last, self.last_diff = value, diff
            set_text(self.answers, result_text(value))
            self.tokens.object = token_table(value)
            self._show_diff(diff)
            self.message = f"written to {value.rerun.description!r} in the trace's effects table"
            if self._on_written is not None:
                self._on_written()
        else:
            self.message = value

    def _show_diff(self, diff: Any) -> None:
        if diff is None:
            return
        plain = self.last.dsa_traces[0] if self.last is not None and self.last.dsa_traces else ""
        set_text(self.diff_summary, diff_summary(diff, f"plain branch ({plain})"))
        self.diff_heat.update(diff.heat)
        self.diff_heat.figure.visible = True
        self.diff_table.object = layers_table(diff.layers) if diff.layers else ""

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Column(
            pn.pane.Markdown("### What if"),
            pn.widgets.Select.from_param(self.param.segment, label="Segment or recorded span"),
            pn.widgets.TextInput.from_param(self.param.positions, label="Positions (START:END, with a range)"),
            pn.widgets.Select.from_param(self.param.action, label="Switch off"),
            pn.widgets.Select.from_param(self.param.layer, label="Layer"),
            pn.widgets.TextInput.from_param(self.param.experts, label="Experts to ban"),
            self.button, self.alert, self.answers, self.tokens,
            pn.pane.Markdown("#### DSA reads: plain vs intervened"), self.diff_summary, self.diff_heat.figure,
            self.diff_table,
            sizing_mode="stretch_width", css_classes=["k3-what-if"])
