"""The lens view: at every layer and position of the last answer, the rank and probability of a target token.

Drive mode keeps the last session's context prefilled (`RerunBase.end`). "Lens" forks it, appends the
answer's opening (the assistant turn, a find-fact question's key) and the answer's own tokens, and
reads them with `workbench.logit_lens` (the AttnRes lens: the model's own output mix at every depth;
only those tokens run, never the context again). Each cell is one (layer, position): its text is the
target token's rank among the vocabulary (0 = the model's top token), its shade the target's
probability, its tooltip both. The target at a position is by default the token the answer actually
has next (so the last layer's row is the model's own confidence in what it wrote); a typed target
is the first token of that text, read at every position. The lens's last layer is the forward's own
computation: its row equals the model's next-token log-probabilities (docs/hooks.md).

The lens runs on the page's event loop under the server's model lock (only the answer's tokens run:
well under a second on the demo; `BackgroundJob.run_now`); while a session or a rerun holds the lock it
is refused in words, and a failure is a status line like a rerun's (a bug's names its exception type).
"""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import panel as pn
import param

from apps.dashboard.components.background import BackgroundJob
from apps.dashboard.components.panes import AlertText, HTMLText, show_message, html_table

# positions shown at most (the last ones of the opening and the answer)
MAX_LENS_POSITIONS = 64


@dataclass(frozen=True)
class LensGrid:
    """What the lens read. `ranks` / `probs` are [layers, positions]: the target's rank (0 = top token)
    and probability at each layer's output, at each position (absolute, as the trace numbers them)."""

    layers: list[int]
    positions: list[int]
    read: list[str]       # the token at each position (what the model had just read)
    targets: list[int]    # the target token id at each position
    target_text: list[str]
    ranks: np.ndarray
    probs: np.ndarray
    answer_start: int     # the first answer position (before it: the opening)


def lens_grid(base: Any, target: str | None = None) -> LensGrid:
    """The lens over the last answer of `base` (a `RerunBase`): `target` None reads, at each position, the
    answer's next token; a text reads its first token everywhere. ValueError when there is nothing to read."""
    import workbench
    from workbench.toolkit import target_rank

    if base is None or base.end is None:
        raise ValueError("drive a session first: the lens reads the last answer")
    ids = list(base.opening) + list(base.answer)
    if len(ids) < 2:
        raise ValueError("the last answer has fewer than two tokens: nothing to read")
    fork = base.end.fork()
    tokenizer = fork.tokenizer
    start = len(fork.tokens)
    fork.append(ids=ids, name="lens", kind="turn", role="assistant")
    # a position's target is the next token, so the answer's last token (whose next is unknown) is not read
    positions = list(range(start, start + len(ids) - 1))[-MAX_LENS_POSITIONS:]
    fixed: int | None = None
    if target is not None and target.strip():
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: a typed target cannot be encoded")
        encoded = tokenizer.encode(target)
        if not encoded:
            raise ValueError(f"the target {target!r:.40} encodes to no token")
        fixed = encoded[0]
    tokens = fork.tokens
    targets = [fixed if fixed is not None else tokens[p + 1] for p in positions]
    lens = workbench.logit_lens(fork, positions=positions)   # [layers, positions, vocab] log-probabilities
    ranks = np.zeros((lens.shape[0], len(positions)), dtype=np.int64)
    probs = np.zeros((lens.shape[0], len(positions)))
    for j, t in enumerate(targets):
        rank, prob = target_rank(lens[:, j:j + 1], t)
        ranks[:, j], probs[:, j] = rank[:, 0].numpy(), prob[:, 0].numpy()

    def piece(i: int) -> str:
        return tokenizer.piece(i) if tokenizer is not None else str(i)

    return LensGrid(layers=list(range(lens.shape[0])), positions=positions, read=[piece(tokens[p]) for p in positions],
                    targets=targets, target_text=[piece(t) for t in targets], ranks=ranks, probs=probs,
                    answer_start=start + len(base.opening))


def cell_html(rank: int, prob: float, title: str) -> str:
    shade = f"rgba(44,160,44,{min(1.0, max(0.0, prob)):.2f})"
    return (f"<div class='k3-lens-cell' style='background:{shade}' title='{html.escape(title, quote=True)}'>"
            f"{rank}</div>")


def grid_html(grid: LensGrid) -> str:
    """The grid as an escaped HTML table: a row per layer (the last, the model's own output, first), a column
    per position headed by the token read there and the target."""
    headers = ["layer"] + [f"{p}{' *' if p >= grid.answer_start else ''} {grid.read[j]!r} → {grid.target_text[j]!r}"
                           for j, p in enumerate(grid.positions)]
    rows = []
    last = grid.layers[-1] if grid.layers else -1
    for i in reversed(range(len(grid.layers))):
        label = f"{grid.layers[i]}{' (output)' if grid.layers[i] == last else ''}"
        cells = [cell_html(int(grid.ranks[i, j]), float(grid.probs[i, j]),
                           f"layer {grid.layers[i]}, position {p}: target {grid.target_text[j]!r} has rank "
                           f"{int(grid.ranks[i, j])} (0 = the top token), probability {float(grid.probs[i, j]):.4f}")
                 for j, p in enumerate(grid.positions)]
        rows.append([html.escape(label)] + cells)
    return html_table("k3-lens", headers, rows)


class LensView(pn.viewable.Viewer):
    """"Lens" on drive mode's last answer: a layer x position grid of a target token's rank and probability."""

    target = param.String(default="", doc="a token to follow at every position (blank: the answer's next token)")
    message = param.String(default="", doc="status or error of the last lens")

    def __init__(self, source: Callable[[], Any], lock: threading.Lock, **params: Any) -> None:
        super().__init__(**params)
        self._source = source   # -> the runner's kept base (RerunBase) or None
        # under the server's model lock: never two runs on the model at once
        self._job = BackgroundJob(lock, "lens", "lens failed")
        self.grid: LensGrid | None = None
        self.button = pn.widgets.Button(label="Lens", color="primary", width=100)
        self.button.on_click(lambda _: self.read())
        self.table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-lens-table"])
        self.alert = AlertText("", alert_type="info", visible=False, sizing_mode="stretch_width")

    def read(self) -> bool:
        """Run the lens on the last answer now (False with a message when it cannot)."""
        base = self._source()
        if base is None:
            self.message = "error: drive a session first: the lens reads the last answer"
            return False
        outcome = self._job.run_now(lambda: lens_grid(base, self.target or None))
        if outcome is None:
            self.message = "error: a session or a rerun is running on this server; read the lens when it has finished"
            return False
        if outcome.kind != "done":
            self.message = outcome.message
            return False
        self.grid = outcome.value
        self.table.object = grid_html(self.grid)
        what = f"the token {self.target!r}" if self.target.strip() else "the answer's next token"
        top = int((self.grid.ranks[-1] == 0).sum())
        self.message = (f"{what} at {len(self.grid.positions)} positions x {len(self.grid.layers)} layers; "
                        f"at the output it is the top token at {top} of them")
        return True

    @param.depends("message", watch=True)
    def _show_message(self) -> None:
        show_message(self.alert, self.message)

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Column(pn.pane.Markdown("### Lens"),
                         pn.pane.Markdown("Rank (cell text, 0 = top) and probability (shade) of a token at every "
                                          "layer and position of the last answer (AttnRes logit lens; * marks the "
                                          "answer's own positions).", margin=(0, 10)),
                         pn.Row(pn.widgets.TextInput.from_param(self.param.target, label="Target (blank: the answer)",
                                                                width=200), self.button),
                         self.alert, self.table, sizing_mode="stretch_width", css_classes=["k3-lens"])
