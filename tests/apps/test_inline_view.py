"""`workbench.show`: the dashboard's views inline, without a browser (the JupyterLab page: test_jupyterlab.py).

- the entry point the dashboard registers is found, and `show(path)` builds only the views asked for;
- `show(session)` follows the trace a real tiny-preset session is being recorded into, and the view's
  frame grows with the session (live), then reads complete;
- what cannot be shown gets an error that names the problem (unrecorded session, unknown view, no provider).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench
from workbench.inline import ENTRY_POINT_GROUP, ShowError, trace_path, view_providers


def test_dashboard_registers_its_inline_view() -> None:
    providers = view_providers()
    assert providers["dashboard"].value == "apps.dashboard.notebook:inline_view", providers


def test_show_a_trace_directory_builds_the_views_asked_for(small_trace: Path) -> None:
    view = workbench.show(small_trace, views=["session", "kda"])
    try:
        layout = view.__panel__()
        classes = {c for obj in layout.objects for c in (getattr(obj, "css_classes", None) or [])}
        assert view.state.frame.session.tokens == 8192 and view.state.frame.session.status == "complete"
        assert view.state.frame.kda is not None
        # only the two views asked for were built (the others stay lazy)
        assert set(view.dashboard.built_views()) == {"kda"} and "k3-alert" in classes
    finally:
        view.close()


def test_show_follows_a_session_recorded_in_this_kernel(tmp_path: Path) -> None:
    from workbench.sessions import recorded_session

    with recorded_session("preset:tiny", tmp_path / "live", prefill_chunk=128, progress=False) as run:
        session = run.session
        session.append(workbench.haystack(400, session.tokenizer, seed=1), name="doc")
        run.recorder.writer.flush()
        assert trace_path(session) == trace_path(run) == tmp_path / "live"
        view = workbench.show(session, views=["session"], interval=0.05)
        try:
            view.__panel__()
            first = view.state.sync().session.tokens
            session.append("What happened at the pier?", role="user")
            list(session.generate(6, temperature=0.0))
            run.recorder.writer.flush()
            later = view.state.sync().session.tokens
            assert 0 < first < later, (first, later)
        finally:
            view.close()
    final = workbench.show(tmp_path / "live", views=["session"])
    try:
        final.__panel__()
        assert final.state.frame.session.status == "complete"
    finally:
        final.close()


def test_what_cannot_be_shown_is_named(small_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Unrecorded:
        observers: list = []

    with pytest.raises(ShowError, match="not being recorded"):
        trace_path(Unrecorded())
    with pytest.raises(ShowError, match="cannot show a int"):
        trace_path(3)
    with pytest.raises(ValueError, match="views must be"):
        workbench.show(small_trace, views=["session", "heatmap"])
    monkeypatch.setattr("workbench.inline.entry_points", lambda group: [])
    with pytest.raises(ShowError, match=ENTRY_POINT_GROUP):
        workbench.show(small_trace)


def test_the_page_gets_panel_inline_only_in_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a kernel, show() sends Panel's/Bokeh's JS inline (from a CDN an offline JupyterLab page never
    draws: the cause of the empty view in test_jupyterlab.py); outside one it leaves Panel's config alone."""
    from apps.dashboard import notebook

    calls: list[dict] = []
    monkeypatch.setattr(notebook.pn, "extension", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(notebook, "_in_kernel", lambda: False)
    notebook._load_extension()
    assert calls == []
    monkeypatch.setattr(notebook, "_in_kernel", lambda: True)
    notebook._load_extension()
    assert calls == [{"inline": True}]


def test_each_view_cell_loads_bokeh_from_the_jupyter_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once Panel is set up in a kernel, every later show() still displays a small loader of its own (so a
    reloaded tab finds one in any view's cell), fetching BokehJS and Panel from the Jupyter server: no CDN,
    no 3 MB inline bundle in the saved notebook (the JupyterLab page: test_jupyterlab.py)."""
    import IPython.display

    from apps.dashboard import notebook

    shown: list[dict] = []
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data, *a, **k: shown.append(data))
    monkeypatch.setattr(notebook, "_in_kernel", lambda: True)
    monkeypatch.setattr(notebook.pn.extension, "_loaded", True, raising=False)
    monkeypatch.setattr(notebook.pn.config, "inline", True)
    notebook._load_extension()
    sizes = [len(v) for data in shown for v in data.values()]
    assert shown and max(sizes) < 30_000, sizes
    loader = next(data["application/javascript"] for data in shown if "k3wbServed" in data.get(
        "application/javascript", ""))
    assert '"static/js/bokeh.min.js"' in loader and "panel.min.js" in loader and "].map(k3wbServed)" in loader
    assert "jupyter-config-data" in loader and notebook.SERVED_AT in loader
