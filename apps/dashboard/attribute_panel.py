"""Drive mode's "Attribute" action: which spans of the context the last answer came from.

After an answer, "Attribute" runs `workbench.attribute` on the session the runner kept (the fork just
before the answer, the context prefilled: only continuations run, never the documents again) in a
worker thread, never on the page's event loop, holding the server's one-model-at-a-time lock (as a
What-if rerun does). The continuation is the answer's opening as the session had it (the assistant
turn with a find-fact question's prefilled key); the target is the fact's value the template expects,
or the answer's own tokens for a free-form question. Spans are the context's sentences; the
recorded fact and its restatement are kept clear of every control. The result is written into the
trace (`workbench.trace.attribution_file`), where the attribution view shows it at once and after a
reload. A progress line counts the seconds; its length is set by the masks, top and controls asked
for, and the line says how many continuations that is before it starts. "Stop" ends it after the
continuation in progress (`should_stop`, asked between runs): the panel says after how many of them,
and the trace keeps the attribution it had (nothing is written; the file is only ever replaced whole).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import panel as pn
import param

from apps.dashboard.components.background import BackgroundJob
from apps.dashboard.components.panes import AlertText, show_message


def planned_runs(masks: int, holdout: int, top: int, controls: int) -> int:
    """Continuations an attribution runs at most: one plain (with the reads), each mask, each checked span
    with its controls, and the answer."""
    return 1 + masks + holdout + top * (1 + controls) + 1


def attribute_last_answer(base: Any, task: Any, *, masks: int, holdout: int, top: int, controls: int,
                          should_stop: Callable[[], bool] | None = None) -> tuple[Any, str]:
    """`workbench.attribute` of the runner's last answer from its kept base (`RerunBase`); returns the
    `Attribution` and what was attributed, in words (the file's `check`). `should_stop` is asked between
    continuations (True: `workbench.causal.stop.Cancelled`)."""
    import workbench

    opening = list(base.opening)

    def continuation(branch: Any) -> None:
        if opening:
            branch.append(ids=opening, name="assistant", kind="turn", role="assistant")

    expected = getattr(task, "expected", None) if getattr(task, "task", None) == "find-fact" else None
    target: Any = expected if expected else list(base.answer)
    if not target:
        raise ValueError("the last answer generated no token: nothing to attribute")
    check = (f"find-fact answer {getattr(task, 'prefix', '')}{expected}" if expected
             else "the last answer (its own tokens)")
    found = workbench.attribute(base.end.fork(), continuation=continuation, target=target, masks=masks,
                                holdout=holdout, top=top, controls=controls,
                                evidence=list((base.spans or {}).values()), should_stop=should_stop)
    return found, check


class AttributePanel(pn.viewable.Viewer):
    """"Attribute" with its counts: runs `workbench.attribute` on the last answer in a worker thread; "Stop"
    ends it between two continuations."""

    masks = param.Integer(default=64, bounds=(4, 1024), doc="random ablation masks the surrogate is fitted on")
    holdout = param.Integer(default=16, bounds=(0, 256), doc="further masks its LDS is measured on")
    top = param.Integer(default=8, bounds=(0, 64), doc="spans checked one by one beside controls")
    controls = param.Integer(default=8, bounds=(1, 64), doc="random same-size disjoint spans per checked span")
    running = param.Boolean(default=False)
    message = param.String(default="")

    def __init__(self, source: Callable[[], tuple[Any, Any]], lock: threading.Lock,
                 on_written: Callable[[], None] | None = None, **params: Any) -> None:
        super().__init__(**params)
        self._source = source   # -> (the runner's kept base or None, the last templated task or None)
        self._on_written = on_written  # told (event loop) once the trace holds the new attribution
        # under the runner's model lock: never two runs on the model at once
        self._job = BackgroundJob(lock, "attribute", "attribution failed")
        self._planned = ""
        self.button = pn.widgets.Button(label="Attribute", color="primary", width=120, disabled=True)
        self.button.on_click(lambda _: self.attribute())
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", width=90, disabled=True)
        self.stop_button.on_click(lambda _: self.stop())
        self.alert = AlertText("", alert_type="info", visible=False, sizing_mode="stretch_width",
                               css_classes=["k3-attribute-status"])

    def refresh(self) -> None:
        base, _ = self._source()
        self.button.disabled = base is None or self.running
        self.stop_button.disabled = not self.running or self._job.stopping

    def attribute(self) -> bool:
        """Start the attribution of the last answer in a worker thread (False with a message when it cannot)."""
        base, task = self._source()
        if base is None or self.running:
            self.message = "error: drive a session first" if base is None else "error: an attribution is running"
            return False
        counts = dict(masks=self.masks, holdout=self.holdout, top=self.top, controls=self.controls)

        def work(should_stop: Callable[[], bool]) -> str:
            from workbench.trace.attribution_file import write_attribution

            found, check = attribute_last_answer(base, task, **counts, should_stop=should_stop)
            write_attribution(base.trace, found, check)
            lds = "not measured" if found.lds is None else f"{found.lds:.2f}"
            return (f"attributed in {found.attribution_s:.1f} s ({found.runs} runs, LDS {lds}): "
                    "shown in the attribution view and kept in the trace (attribution.json)")

        if not self._job.start(work):
            self.message = "error: a session or a rerun is running on this server; attribute when it has finished"
            return False
        self.running = True
        self.refresh()
        self._planned = (f"up to {planned_runs(self.masks, self.holdout, self.top, self.controls):,} continuations: "
                         f"{self.masks} masks + {self.holdout} held out, {self.top} spans checked beside "
                         f"{self.controls} controls each; Stop ends it after the current one")
        self.message = f"attributing the last answer … ({self._planned})"
        return True

    def stop(self) -> bool:
        """Ask the running attribution to stop after its current continuation (False when none runs)."""
        if not self._job.cancel():
            return False
        self.refresh()
        self.message = f"stopping the attribution after its current continuation … {self._job.elapsed:.0f} s"
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running attribution's thread (tests, scripts)."""
        self._job.wait(timeout)

    def poll(self) -> None:
        """Apply what the worker left, or move the progress line on (event loop only)."""
        outcome = self._job.poll()
        if outcome is None:
            if self._job.stopping:
                self.message = f"stopping the attribution after its current continuation … {self._job.elapsed:.0f} s"
            elif self.running:
                self.message = f"attributing the last answer … {self._job.elapsed:.0f} s ({self._planned})"
            else:
                self.refresh()
            return
        self.running = False
        self.refresh()
        if outcome.kind == "done":
            self.message = outcome.value
            if self._on_written is not None:
                self._on_written()
        elif outcome.kind == "cancelled":
            self.message = f"{outcome.message}: nothing was written to the trace (attribution.json is as it was)"
        else:
            self.message = outcome.message

    @param.depends("message", watch=True)
    def _show_message(self) -> None:
        show_message(self.alert, self.message)

    def __panel__(self) -> pn.viewable.Viewable:
        counts = [pn.widgets.IntInput.from_param(self.param[name], label=label, width=70)
                  for name, label in (("masks", "Masks"), ("holdout", "Held out"), ("top", "Checked"),
                                      ("controls", "Controls"))]
        return pn.Column(pn.pane.Markdown("### Attribute"),
                         pn.pane.Markdown("Which sentences of the context the last answer came from "
                                          "(random masks hidden from DSA, a sparse surrogate, the top spans "
                                          "checked beside controls).", margin=(0, 10)),
                         pn.Row(*counts), pn.Row(self.button, self.stop_button), self.alert,
                         sizing_mode="stretch_width", css_classes=["k3-attribute"])
