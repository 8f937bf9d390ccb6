"""What the first paint of a dashboard page builds: every Bokeh model in the served document is server time
to build and serialise and browser time to build, on every page open (benchmarks/bench_dashboard.py).

- the panes share one stylesheet model per CSS file (`page_bundle.share_stylesheets`);
- views that are empty until the user acts (effects, attribution: `ViewSpec.lazy`) show one line (their
  note) until they have data, then join the page;
- drive mode's what-if and attribute panels join the sidebar with the first driven answer.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from bokeh.document import Document
from bokeh.models import ImportedStyleSheet

from apps.dashboard.app import DashboardConfig, create_app
from apps.dashboard.components.base import PlacedWhenReady
from apps.dashboard.views import VIEWS
from workbench.analysis.views.attribution_view import Piece

# the served page of an 8K synthetic trace held 884 models before the changes above, 495 after (b207398: 517)
MODEL_BUDGET = 560


def served(trace: Path):
    page = create_app(DashboardConfig(trace=trace, root=trace.parent), session_args={})
    document = Document()
    page.server_doc(document)
    return page, document


def test_the_page_shares_stylesheets_and_stays_within_its_model_budget(small_trace: Path, monkeypatch) -> None:
    from apps.dashboard import page_bundle

    dropped = []
    share = page_bundle.share_stylesheets
    monkeypatch.setattr(page_bundle, "share_stylesheets", lambda doc: dropped.append(share(doc)) or dropped[-1])
    page, document = served(small_trace)
    try:
        # Panel's own per-document cache made them shared as they were built (the pass after finds few)
        assert dropped and dropped[0] <= 20, dropped
        models = list(document.models)
        sheets = Counter(m.url for m in models if type(m) is ImportedStyleSheet)
        assert sheets and max(sheets.values()) == 1, sheets.most_common(3)
        assert len(models) <= MODEL_BUDGET, len(models)
        # every pane still lists its stylesheets (the shared models)
        holders = [m for m in models if getattr(m, "stylesheets", None)]
        assert any(isinstance(s, ImportedStyleSheet) for m in holders for s in m.stylesheets)
    finally:
        page.dashboard.close()


def test_lazy_views_show_their_note_and_join_the_page_with_data(small_trace: Path) -> None:
    page, _ = served(small_trace)
    dash = page.dashboard
    try:
        frame = dash.state.sync()
        lazy = [name for name, spec in VIEWS.items() if spec.lazy]
        assert set(lazy) >= {"effects", "attribution"}
        places = {name: dash._placed(name) for name in lazy}
        for name, place in places.items():
            assert isinstance(place, PlacedWhenReady) and place.holder.objects == [place.note]
            assert frame.view(name).note and "trace yet" in place.note.object  # why it is empty, in one line
        # data arrives: the view takes its place, once; the other stays a note
        component = dash.view("attribution")
        piece = Piece(kind="heading", start=0, end=4, heading="report.pdf")
        filled = dataclasses.replace(frame.view("attribution"), pieces=(piece,), note="")
        assert component.has_data(filled, frame.session)
        dash.state.frame = dataclasses.replace(frame, more={**frame.more, "attribution": filled})
        shown = places["attribution"].holder.objects
        assert len(shown) == 1 and "k3-view-attribution" in shown[0].css_classes  # the view's own card
        assert places["effects"].holder.objects == [places["effects"].note]
    finally:
        dash.close()


def test_what_if_and_attribute_join_the_sidebar_with_the_first_answer(small_trace: Path, monkeypatch) -> None:
    page, _ = served(small_trace)
    dash = page.dashboard
    try:
        runner = dash.runner
        assert runner is not None and not runner.answer_tools.objects
        runner.poll()
        assert not runner.answer_tools.objects
        # what a driven session leaves once it generated an answer (the panels' own polls read it: not here)
        runner._rerun_base = (object(), None)
        monkeypatch.setattr(runner.what_if, "poll", lambda: None)
        monkeypatch.setattr(runner.attribution, "poll", lambda: None)
        runner.poll()
        shown = [set(o.css_classes) for o in runner.answer_tools.objects]  # the panels' own columns
        assert shown == [{"k3-what-if"}, {"k3-attribute"}], shown
    finally:
        runner._rerun_base = (None, None)
        dash.close()
