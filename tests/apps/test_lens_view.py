"""The lens view without a browser: on a builtin:demo find-fact answer kept as drive mode keeps it
(`RerunBase`: the context prefilled, the answer's opening and tokens), "Lens" reads the answer's next
token at every layer and position; the output row equals the model's own ranks (the answer was
greedy: rank 0 at every answer position), a typed target is followed everywhere, the grid's text is
escaped, and a busy model lock or no session is a message. The dashboard puts the view in drive mode's
sidebar with the first answer."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.dashboard.app import Dashboard, DashboardConfig
from apps.dashboard.components.lens import MAX_LENS_POSITIONS, LensView, grid_html, lens_grid
from engine.builtin import ROOT as BUILTIN_ROOT
from engine.session import Session
from workbench.causal.reruns import RerunBase
from workbench.sessions import load_with_tokenizer
from workbench.task_templates import append_task, fact_task
from workbench.text import haystack

needs_demo = pytest.mark.skipif(not (BUILTIN_ROOT / "demo" / "config.json").is_file(),
                                reason="builtin:demo not installed")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> RerunBase:
    model, tokenizer = load_with_tokenizer("builtin:demo")
    task = fact_task([("notes.txt", haystack(400, tokenizer, seed=2))], "greenhouse alarm", "3-8-2-5", depth=0.5)
    session = Session(model, tokenizer)
    append_task(session, task)
    session.prefill()
    end = session.fork()  # as drive mode keeps it: the context prefilled, before the answer's opening
    opening = tokenizer.chat_prompt([], add_generation_prompt=True) + tokenizer.response_prefix(task.prefix)
    session.append(ids=opening, name="assistant", kind="turn", role="assistant")
    answer = [t.id for t in session.generate(8, temperature=0)]
    assert tokenizer.decode(answer).startswith("3-8-2-5")
    return RerunBase(trace=tmp_path_factory.mktemp("lens"), end=end, opening=tuple(opening), answer=tuple(answer))


@needs_demo
def test_the_output_row_is_the_models_own_answer(base: RerunBase) -> None:
    grid = lens_grid(base)
    n = min(MAX_LENS_POSITIONS, len(base.opening) + len(base.answer) - 1)  # the last ones
    assert grid.ranks.shape == grid.probs.shape == (6, n) and len(grid.positions) == n
    answer = [j for j, p in enumerate(grid.positions) if p >= grid.answer_start]
    assert answer and (grid.ranks[-1, answer] == 0).all()  # greedy: the top token at the output
    assert (grid.probs >= 0).all() and (grid.probs <= 1).all()
    start = len(base.end.tokens)
    fork = base.end.fork()
    fork.append(ids=list(base.opening) + list(base.answer))
    logits = fork.prefill(return_logits=True)
    own = torch.log_softmax(logits[grid.positions[-1] - start], -1)
    target = grid.targets[-1]
    assert int((own > own[target]).sum()) == grid.ranks[-1, -1]
    assert abs(float(own[target].exp()) - grid.probs[-1, -1]) < 1e-4


@needs_demo
def test_a_typed_target_and_the_component(base: RerunBase) -> None:
    lock = threading.Lock()
    view = LensView(lambda: base, lock, target="3")
    assert view.read(), view.message
    assert set(view.grid.targets) == {base.end.tokenizer.encode("3")[0]}
    assert "positions x 6 layers" in view.message and "k3-lens-cell" in view.table.object
    with lock:
        assert not view.read() and "running on this server" in view.message
    assert not LensView(lambda: None, lock).read()


def test_grid_text_is_escaped() -> None:
    from apps.dashboard.components.lens import LensGrid

    grid = LensGrid(layers=[0, 1], positions=[5, 6], read=["<b>", "'x'"], targets=[1, 2],
                    target_text=["<script>", "&"], ranks=np.array([[3, 0], [1, 2]]),
                    probs=np.array([[0.1, 0.9], [0.5, 0.2]]), answer_start=6)
    out = grid_html(grid)
    assert "<script>" not in out and "<b>" not in out and "&lt;script&gt;" in out


def test_drive_mode_has_the_lens(tmp_path: Path) -> None:
    dash = Dashboard(DashboardConfig(root=tmp_path, drive=True, model="preset:tiny"))
    assert isinstance(dash.lens, LensView) and dash.lens_place in dash.sidebar()
    assert not dash.lens.read() and "drive a session first" in dash.lens.message
    dash.place_lens()
    assert not dash.lens_place.objects  # no answer yet: not on the page
    dash.runner._rerun_base = (object(), None)  # what the runner publishes after an answer
    dash.place_lens()
    assert [o.css_classes for o in dash.lens_place.objects] == [["k3-lens"]]
    dash.close()
    plain = Dashboard(DashboardConfig(root=tmp_path, drive=False))
    assert plain.lens is None
    plain.close()
