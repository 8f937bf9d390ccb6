"""One registry of views: a view registered from this test (one reducer + one component + one
`register_view` line, no other edit) is reduced by the follower, placed on the page a dashboard
server builds for a trace, and shown by `workbench.show`; its own option reaches its reducer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

import workbench
from apps.dashboard.app import DashboardConfig, create_app
from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.panes import HTMLText
from apps.dashboard.views import VIEWS, ViewSpec, register_view, unregister_view
from workbench.analysis.views import Reducer, ViewOptions
from workbench.analysis.views import shared_reducers


@dataclass(frozen=True)
class MoELayersData:
    layers: tuple[int, ...] = ()
    scaled_tokens: int = 0


class MoELayersReducer(Reducer[MoELayersData]):
    """The MoE layers of the trace, and the session's tokens times the view's own option."""

    data_type = MoELayersData

    def reduce(self, trace: Any, options: ViewOptions, session: Any) -> MoELayersData:
        return self.result(layers=tuple(trace.layers("moe_counts")),
                           scaled_tokens=session.tokens * options.get("moe_layers_scale"))


class MoELayersView(ViewComponent):
    view = "moe_layers"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.text = HTMLText("", css_classes=["k3-view-moe_layers"])

    def draw(self, data: MoELayersData, session: Any, changed: set[str]) -> None:
        self.text.object = f"{len(data.layers)} MoE layers, {data.scaled_tokens} scaled tokens"

    def has_data(self, data: MoELayersData, session: Any) -> bool:
        return bool(data.layers)

    def __panel__(self) -> Any:
        return self.text


@pytest.fixture
def toy_view() -> Iterator[ViewSpec]:
    spec = register_view(ViewSpec("moe_layers", MoELayersReducer, lambda dash: MoELayersView(state=dash.state),
                                  options={"moe_layers_scale": 1}))
    shared_reducers.forget_all()
    try:
        yield spec
    finally:
        unregister_view("moe_layers")
        shared_reducers.forget_all()


def test_a_registered_view_is_served(toy_view: ViewSpec, small_trace: Path) -> None:
    page = create_app(DashboardConfig(trace=small_trace, root=small_trace.parent), session_args={})
    dash = page.dashboard
    try:
        frame = dash.state.sync()
        data = frame.view("moe_layers")
        assert data.layers and data.scaled_tokens == frame.session.tokens == 8192
        component = dash.view("moe_layers")
        assert component in dash.views() and "MoE layers, 8192 scaled tokens" in component.text.object
        dash.state.set_options(moe_layers_scale=3)
        assert dash.state.sync().view("moe_layers").scaled_tokens == 3 * 8192
        assert dash.state.frame.dsa.heat is not None  # the built-in views still reduce beside it
    finally:
        dash.close()


def test_a_registered_view_is_shown_in_a_notebook(toy_view: ViewSpec, small_trace: Path) -> None:
    view = workbench.show(small_trace, views=["session", "moe_layers"])
    try:
        layout = view.__panel__()
        classes = {c for obj in layout.objects for c in (getattr(obj, "css_classes", None) or [])}
        assert view.state.frame.view("moe_layers").layers
        assert set(view.dashboard.built_views()) == {"moe_layers"}, classes
    finally:
        view.close()


def test_a_view_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="taken"):
        register_view(ViewSpec("dsa", MoELayersReducer, lambda dash: None))
    with pytest.raises(ValueError, match="taken"):
        register_view(ViewSpec("session", MoELayersReducer, lambda dash: None))
    assert list(VIEWS)[:4] == ["dsa", "kda", "health", "experts"]
