"""Drive mode's "what if" panel: pick what to switch off, rerun the last answer, see it beside its controls.

The plan and the run live in `workbench.causal.reruns` (the branch points kept while recording, the
rerun's controls and verdict, its effects-table rows); this module holds the widgets only. "Rerun last
answer" runs `run_rerun` in a worker thread (the Bokeh event loop only applies the outcome, in
`poll()`), writes the result into the trace's effects table (where the effects view shows it at once:
the panel tells the runner, which wakes the follower) and draws the answers, the per-token
log-probabilities, the verdict and the branches' DSA difference below the table. "Stop" ends a rerun
before its next control (`run_rerun`'s `should_stop`): nothing is written to the effects table.
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable

import numpy as np
import panel as pn
import param

from apps.dashboard.components.background import BackgroundJob
from apps.dashboard.components.dsa_diff import diff_summary, layers_table
from apps.dashboard.components.figures import HeatFigure
from apps.dashboard.components.panes import AlertText, HTMLText, show_message, html_table, set_text, text_pane
from workbench.causal.reruns import (ACTIONS, BAN_EXPERTS, HIDE_DSA, RANGE, SUPPRESS_KDA, Rerun, RerunBase,
                                     RerunResult,
                                     branch_diff, effect_rows, keep_branch_points, plan_rerun, recorded_spans,
                                     run_rerun, segment_label, span_label, what_if_traces)

# the names the session runner and tests take from here (the plan itself is workbench's)
__all__ = ["ACTIONS", "BAN_EXPERTS", "HIDE_DSA", "RANGE", "SUPPRESS_KDA", "RerunBase", "WhatIfPanel",
           "keep_branch_points", "what_if_traces", "token_table", "result_text"]


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
        odds = f" ({result.verdict.odds})" if result.verdict.odds else ""
        lines.append(f"verdict: {result.verdict.sentence}{odds}")
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
                 on_written: Callable[[], None] | None = None, selected: Callable[[], int | None] | None = None,
                 **params: Any) -> None:
        super().__init__(**params)
        self._on_written = on_written  # told (event loop) when a rerun wrote the effects table: views re-read it
        self._selected = selected  # the token picked on the session map or the DSA map (None: none picked)
        self.start_button = pn.widgets.Button(label="Range starts at the selected token", width=250)
        self.end_button = pn.widgets.Button(label="Range ends at the selected token", width=250)
        self.start_button.on_click(lambda _: self.pick(start=True))
        self.end_button.on_click(lambda _: self.pick(start=False))
        self._base_source = base_source  # -> (the runner's kept base or None, the model config)
        # under the runner's model lock: a rerun and a recording never share the model at once
        self._job = BackgroundJob(lock, "what-if", "rerun failed")
        self._base: RerunBase | None = None
        self._config: Any = None
        self.button = pn.widgets.Button(label="Rerun last answer", color="primary", width=160, disabled=True)
        self.button.on_click(lambda _: self.rerun())
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", width=90, disabled=True)
        self.stop_button.on_click(lambda _: self.stop())
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

    def pick(self, start: bool) -> bool:
        """Set one end of the typed range to the token selected on the session map or the DSA map (the
        other end kept when it still makes a range; else the one token)."""
        position = self._selected() if self._selected is not None else None
        if position is None:
            self.message = "error: click a token on the session map or the DSA map first"
            return False
        low, high = position, position + 1
        parts = self.positions.split(":")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            old_low, old_high = int(parts[0]), int(parts[1])
            if start and old_high > position:
                high = old_high
            if not start and old_low <= position:
                low = old_low
        self.positions = f"{low}:{high}"
        if RANGE in self.param.segment.objects:
            self.segment = RANGE
        self.message = ""
        return True

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
        show_message(self.alert, self.message)

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
        if not self._job.start(lambda should_stop: self._work(base, rerun, should_stop)):
            self.message = "error: a session is running on this server; rerun when it has finished"
            return False
        self.running = True
        self.button.disabled = True
        self.stop_button.disabled = False
        self.message = f"rerunning: {rerun.description} …"
        return True

    @staticmethod
    def _work(base: RerunBase, rerun: Rerun, should_stop: Callable[[], bool]) -> tuple[RerunResult, Any]:
        from workbench.trace.effects_table import write_effects

        result = run_rerun(base, rerun, should_stop=should_stop)
        write_effects(base.trace, effect_rows(base, result))
        return result, branch_diff(result, len(base.end.tokens) + len(base.opening) + len(base.answer))

    def stop(self) -> bool:
        """Ask the running rerun to stop before its next control (False when none runs)."""
        if not self._job.cancel():
            return False
        self.stop_button.disabled = True
        self.message = "stopping the rerun before its next control …"
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running rerun's thread (tests, scripts)."""
        self._job.wait(timeout)

    def poll(self) -> None:
        """Apply what the worker left (event loop only)."""
        if not self.running:
            self.refresh()
        outcome = self._job.poll()
        if outcome is None:
            return
        self.running = False
        self.button.disabled = self._base is None
        self.stop_button.disabled = True
        if outcome.kind == "done":
            value, diff = outcome.value
            self.last, self.last_diff = value, diff
            set_text(self.answers, result_text(value))
            self.tokens.object = token_table(value)
            self._show_diff(diff)
            self.message = f"written to {value.rerun.description!r} in the trace's effects table"
            if self._on_written is not None:
                self._on_written()
        elif outcome.kind == "cancelled":
            self.message = f"{outcome.message}: nothing was written to the effects table"
        else:
            self.message = outcome.message

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
            pn.Row(self.start_button, self.end_button),
            pn.widgets.Select.from_param(self.param.action, label="Switch off"),
            pn.widgets.Select.from_param(self.param.layer, label="Layer"),
            pn.widgets.TextInput.from_param(self.param.experts, label="Experts to ban"),
            pn.Row(self.button, self.stop_button), self.alert, self.answers, self.tokens,
            pn.pane.Markdown("#### DSA reads: plain vs intervened"), self.diff_summary, self.diff_heat.figure,
            self.diff_table,
            sizing_mode="stretch_width", css_classes=["k3-what-if"])
