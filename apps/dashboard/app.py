"""Composition of the dashboard: the views, the source/drive sidebar, the server entry point.

    Dashboard(config)               one per browser session (or notebook cell): state + views + runner
    side_by_side(config, a, b)      two traces side by side plus the DSA difference view (`side_by_side.py`)
    create_app(config)              what the server calls per session: access checks, then the template
    serve(config)                   `workbench dashboard`: pn.serve on 127.0.0.1 unless told otherwise

Layout only; the views live in `components/`, the data path in `follower.py`, drive mode in
`session_runner.py`, access rules in `security.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import quote

import panel as pn
import param
from panel.io.state import set_curdoc

from apps.dashboard import host_guard, page_bundle
from apps.dashboard.components.base import PlacedWhenReady
from apps.dashboard.components.dsa_diff import DSADiffView
from apps.dashboard.components.dsa_map import DSAMemoryMap
from apps.dashboard.components.experts import ExpertsView
from apps.dashboard.components.kda_health import KDAHealthView
from apps.dashboard.components.kda_state import KDAStateView
from apps.dashboard.components.lens import LensView
from apps.dashboard.components.seen import ShownWhenSeen
from apps.dashboard.components.session_map import SessionMap
from apps.dashboard.components.panes import AlertText, alert_text, set_text, text_pane
from apps.dashboard.components.token_strip import WidthProbe
from apps.dashboard.host_guard import HostPolicy
from apps.dashboard.page_gate import PageGate
from apps.dashboard.security import AccessError, is_local, new_token, resolve_trace, token_ok
from apps.dashboard.session_runner import SessionRunner, find_models
from apps.dashboard.side_by_side import SideBySide
from apps.dashboard.spare import SpareDashboard
from apps.dashboard.follower import MAX_BINS, MIN_BINS, DashboardFrame, DashboardState
from apps.dashboard.views import VIEWS, view_options, view_reducers

# pixels taken by a heat map's axis, colour bar and card padding: the rest is what bins map onto
FIGURE_CHROME_PX = 140

# bins the last page of this process measured: a new page (a reload, the next tab) starts with them, so
# its first frame is already binned to the screen instead of being reduced and sent again once the
# page reports its width (`Dashboard._width`)
_screen_bins: list[int] = []


@dataclass
class DashboardConfig:
    """How a dashboard is served.

    Attributes:
        trace: trace directory followed at start (None: wait for a URL parameter or a driven session).
        compare: a second trace shown beside `trace` (same layout) with a DSA difference view; drive
            mode is off then.
        model: model offered first in drive mode (checkpoint directory, builtin:NAME or preset:NAME; default
            the shipped builtin:demo when installed).
        root: the only directory tree the `trace` URL parameter may point into; drive-mode runs are
            recorded under it.
        host, port: where the server listens (127.0.0.1 by default; any other host needs a token).
        allow_hosts: names besides the loopback names and `host` that requests may carry in `Host` /
            `Origin` (`--allow-host`); any other name is refused (DNS rebinding, `host_guard`).
        token: access token required as `?token=...` (generated when serving on a non-local host).
        drive: show the drive-mode controls (model, prompt, upload, generate/stop).
        interval: seconds between the follower's polls of the trace.
        refresh_ms: period of the periodic callback that applies frames (<= 1000 for >= 1 Hz).
        max_upload_bytes: largest document accepted by the upload box.
        new_tokens: tokens a driven session generates unless changed in the browser.
        model_search: directories searched for checkpoints (`*/config.json`) for the model picker.
    """

    trace: Path | None = None
    compare: Path | None = None
    model: str | None = None
    root: Path = Path("traces")
    host: str = "127.0.0.1"
    port: int = 5006
    allow_hosts: tuple[str, ...] = ()
    token: str | None = None
    drive: bool = True
    interval: float = 0.5
    refresh_ms: int = 300
    max_upload_bytes: int = 4 << 20
    new_tokens: int = 48
    model_search: list[Path] = field(default_factory=lambda: [Path("checkpoints")])


class DashboardTemplate(pn.template.BootstrapTemplate):
    """The Bootstrap template, attached to its document with the document's model graph frozen.

    Attaching adds one root per template area and Panel's helpers walk the whole graph for each
    (remove from an earlier document, add, recompute the document's model index): frozen, the
    index is recomputed once at the end instead of once per root (about a third of the page build).
    The served page is bundled without MathJax (`page_bundle`: no pane of the dashboard renders TeX), and its
    panes share one stylesheet model per CSS file (`page_bundle.cache_stylesheets`, `share_stylesheets`).
    """

    def server_doc(self, doc: Any = None, title: str | None = None, location: Any = True) -> Any:
        document = doc if doc is not None else pn.state.curdoc
        if document is None:
            return super().server_doc(doc, title, location)
        page_bundle.without_mathjax(document)
        page_bundle.cache_stylesheets(document)
        with set_curdoc(document), document.models.freeze():
            served = super().server_doc(document, title, location)
        # once the index is current (after that freeze), in a freeze of its own: one re-index for all the sets
        with document.models.freeze():
            page_bundle.share_stylesheets(document)
        return served


class Dashboard(pn.viewable.Viewer):
    """The whole dashboard bound to one `DashboardState`: sidebar (source, drive controls) and four views.

    In a notebook: `pn.extension(); Dashboard(DashboardConfig(trace=path))` shows it inline and live.
    """

    state = param.ClassSelector(class_=DashboardState, doc="the state every view follows")
    message = param.String(default="", doc="an error about the request (bad URL parameter); shown on top")

    def __init__(self, config: DashboardConfig | None = None, *, trace: str | Path | None = None,
                 compare: str | Path | None = None, **params: Any) -> None:
        config = config or DashboardConfig()
        path = trace if trace is not None else config.trace
        bins = {"bins": _screen_bins[-1]} if _screen_bins else {}
        super().__init__(state=DashboardState(path, interval=config.interval, root=config.root, compare=compare,
                                              reducers=view_reducers(), view_options=view_options(), **bins),
                         **params)
        self._views: dict[str, Any] = {}
        # lazy views' places on the page (`views.ViewSpec.lazy`), and those of views shown when scrolled near
        self._places: dict[str, PlacedWhenReady | ShownWhenSeen] = {}
        # the places below the first screen (the views' and the DSA image panel's), shown as one when any is seen
        self.shown_together: list[ShownWhenSeen] = []
        self.config = config
        self.session_map = SessionMap(state=self.state)
        self.runner: SessionRunner | None = None
        if config.drive:
            models = find_models([config.model] if config.model else [], config.model_search)
            self.runner = SessionRunner(state=self.state, runs_dir=str(config.root), max_upload_bytes=config.max_upload_bytes,
                                        max_new_tokens=config.new_tokens)
            self.runner.param.model.objects = models
            self.runner.model = models[0]
        runner = self.runner
        # the lens reads drive mode's last answer (components/lens.py); like the what-if and attribute panels it
        # joins the sidebar with the first answer, so the first paint carries none of its models
        self.lens = LensView(lambda: runner.kept_base, runner.model_lock) if runner is not None else None
        self.lens_place = pn.Column(sizing_mode="stretch_width", margin=0, css_classes=["k3-lens-place"])
        self.probe = WidthProbe(sizing_mode="stretch_width", height=1, margin=0)
        self.probe.param.watch(self._width, "px")
        self.alert = AlertText("", alert_type="danger", visible=False, sizing_mode="stretch_width",
                                   css_classes=["k3-alert"])
        self.source = text_pane("", sizing_mode="stretch_width", css_classes=["k3-source"])
        self._callback = None
        self._gate: PageGate | None = None
        self._show_status()

    def view(self, name: str) -> Any:
        """The component of the view registered as `name` (`views.VIEWS`), built on first use: a notebook
        cell showing only the session map never builds the others."""
        if name not in self._views:
            self._views[name] = VIEWS[name].component(self)
        return self._views[name]

    def built_views(self) -> list[str]:
        """Names of the views whose components were built so far."""
        return list(self._views)

    @property
    def dsa(self) -> DSAMemoryMap:
        return self.view("dsa")

    @property
    def kda(self) -> KDAStateView:
        return self.view("kda")

    @property
    def experts(self) -> ExpertsView:
        return self.view("experts")

    @property
    def health(self) -> KDAHealthView:
        return self.view("health")

    @cached_property
    def diff(self) -> DSADiffView:
        """The DSA difference view (meaningful when this dashboard follows its trace with `compare`)."""
        return DSADiffView(state=self.state)

    def _width(self, event: param.parameterized.Event) -> None:
        self.state.bins = int(min(max(event.new - FIGURE_CHROME_PX, MIN_BINS), MAX_BINS))
        _screen_bins[:] = [self.state.bins]

    @param.depends("message", "state.frame", "state.trace_path", watch=True)
    def _show_status(self) -> None:
        frame: DashboardFrame = self.state.frame
        errors = [m for m in (self.message, frame.error) if m]
        warnings = list(frame.problems[:3])
        self.alert.object = alert_text("\n\n".join(errors + warnings))
        self.alert.alert_type = "danger" if errors else "warning"
        self.alert.visible = bool(errors or warnings)
        path = self.state.trace_path or "(none yet: drive a session or open ?trace=NAME)"
        set_text(self.source, f"trace: {path}\nstatus: {frame.session.status}, {frame.session.tokens:,} tokens")

    def start(self, sync: bool = False) -> None:
        """Start following live: the follower thread and the periodic callback that applies its frames.

        With `sync`, the first frame is computed here before returning (notebooks: the first
        display has data). The server does not wait: the follower computes while the page loads.
        """
        if self._callback is not None:
            return
        if self.state.follower is not None:
            if sync:
                self.state.sync()
            self.state.start()
        self._gate = PageGate(on_open=self._tick)
        self._callback = pn.state.add_periodic_callback(self._tick, period=self.config.refresh_ms)

    def _tick(self) -> None:
        if self._gate is not None and not self._gate.open():
            return  # the browser is pulling and drawing the page: an update now could be lost (page_gate.py)
        self.state.poll()
        if self.runner is not None:
            self.runner.poll()
            self.place_lens()

    def place_lens(self) -> None:
        """Put the lens in the sidebar once drive mode has an answer to read."""
        if self.lens is not None and not self.lens_place.objects and self.runner.kept_base is not None:
            self.lens_place.objects = [self.lens]

    def close(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None
        self.state.close()

    def sidebar(self) -> list:
        items: list = [pn.pane.Markdown("### Source"), self.source]
        if self.runner is not None:
            items.append(self.runner)
        if self.lens is not None:
            items.append(self.lens_place)
        return items

    def views(self, until_seen: bool = False) -> list:
        """The main column: the session map and the other views.

        The server builds the first screen's views into the page it sends: the browser then lays the
        page out once, with whatever data the follower has reduced while the page's scripts loaded,
        and the rest arrives as one websocket message per frame. Panel's deferred loading (each view
        built and sent after the page loaded) costs a round trip and several separate property
        messages per view, and a relayout of the whole page for each (benchmarks/bench_dashboard.py).
        With `until_seen` (the served page), the views registered `until_seen` (below the first screen)
        take their place when the reader scrolls near them (`components.seen.ShownWhenSeen`); their
        components are built now and follow the state all along.
        """
        lower = [self._placed(n, until_seen) for n in VIEWS if n != "integrity"]
        return [self.probe, self.alert, self.view("integrity"), self.session_map, *lower]

    def _placed(self, name: str, until_seen: bool = False) -> Any:
        """The view `name`; for a lazy view without content yet its empty place (`PlacedWhenReady`); with
        `until_seen`, for a view registered `until_seen` its place until seen (`ShownWhenSeen`)."""
        component = self.view(name)
        spec = VIEWS[name]
        if until_seen and spec.until_seen and not spec.lazy:
            place = self._places.get(name)
            if not isinstance(place, ShownWhenSeen):
                place = self._places[name] = ShownWhenSeen(component, name, spec.height_px, spec.title,
                                                            together=self.shown_together)
            return place
        frame = self.state.frame
        data = frame.view(name)
        if not VIEWS[name].lazy or (data is not None and component.has_data(data, frame.session)):
            return component
        if name not in self._places:
            self._places[name] = PlacedWhenReady(component, name, self.state)
        return self._places[name]

    def __panel__(self) -> pn.viewable.Viewable:
        self.start(sync=True)
        return pn.Row(pn.Column(*self.sidebar(), width=320), pn.Column(*self.views(), sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")


def _arg(args: dict, name: str) -> str | None:
    values = args.get(name)
    if not values:
        return None
    value = values[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def compare_request(config: DashboardConfig, args: dict, trace: Path | None) -> tuple[Path | None, str]:
    """The trace to show beside `trace` (from `?compare=` or `config.compare`) and an error message ("" if none).

    `?compare=` is resolved inside the root like `?trace=`; asking to compare without a trace, or a
    trace with itself, gives a message and the single-trace dashboard."""
    compare, requested = config.compare, _arg(args, "compare")
    if requested is not None:
        try:
            compare = resolve_trace(requested, config.root)
        except AccessError as exc:
            return None, f"error: compare: {exc}"
    if compare is None:
        return None, ""
    if trace is None:
        return None, "error: compare needs a trace to compare with: open ?trace=A&compare=B"
    if Path(compare).resolve() == Path(trace).resolve():
        return None, "error: compare names the same trace as trace; pick two different traces"
    return Path(compare), ""


def side_by_side(config: DashboardConfig, trace_a: str | Path, trace_b: str | Path, message: str = "") -> SideBySide:
    """Dashboards of traces A and B (no drive controls) in two columns under the DSA difference view."""
    follow_only = dataclasses.replace(config, drive=False, trace=None, compare=None)
    return SideBySide(Dashboard(follow_only, trace=trace_a, compare=trace_b, message=message),
                      Dashboard(follow_only, trace=trace_b))


def create_app(config: DashboardConfig, session_args: dict | None = None,
               spare: SpareDashboard | None = None) -> pn.viewable.Viewable:
    """The dashboard for one browser session: checks the token and the `trace` / `compare` URL parameters first.

    Bad input never stops the server: a wrong token gets only an error page; a bad `trace` or `compare`
    parameter or an unreadable trace shows an error above the (still working) dashboard. With a
    `compare` trace, the two traces are shown side by side (`side_by_side.SideBySide`). A request for
    the server's own trace takes `spare`'s dashboard when one is built (`spare.py`).
    """
    args = pn.state.session_args if session_args is None else session_args
    if not token_ok(_arg(args, "token"), config.token):
        return pn.pane.Alert("Access token missing or wrong: open the URL printed by `workbench dashboard`.",
                             alert_type="danger", css_classes=["k3-denied"])
    trace, message = config.trace, ""
    requested = _arg(args, "trace")
    if requested is not None:
        try:
            trace = resolve_trace(requested, config.root)
        except AccessError as exc:
            message = f"error: {exc}"
    compare, problem = compare_request(config, args, trace)
    message = "\n\n".join(m for m in (message, problem) if m)
    try:
        if compare is not None:
            dash: Any = side_by_side(config, trace, compare, message=message)
            title = "K3 Workbench · A vs B"
        else:
            own = spare is not None and requested is None and not message
            dash = (spare.take() if own else None) or Dashboard(config, trace=trace, message=message)
            if _screen_bins and dash.state.bins != _screen_bins[-1]:
                # built before the last page measured its width: bin to that width from the first frame
                dash.state.bins = _screen_bins[-1]
            title = "K3 Workbench · memory inspector"
    except Exception as exc:  # keep serving other sessions; show what went wrong in this one
        return pn.pane.Alert(alert_text(f"The dashboard could not start: {type(exc).__name__}: {exc}"),
                             alert_type="danger")
    dash.start()
    if pn.state.curdoc is not None:
        pn.state.on_session_destroyed(lambda _ctx: dash.close())
        if spare is not None:
            # the next one is built once this page has loaded, never while it is being sent or drawn
            pn.state.onload(spare.fill)
    # a single trace's page places the views below its first screen when scrolled near (`Dashboard.views`)
    views = dash.views(until_seen=True) if isinstance(dash, Dashboard) else dash.views()
    # each view is a root of the document (a template area item each): BokehJS lays out and restyles a whole root
    # whenever anything in it changes size or content (`LayoutDOMView.invalidate_layout` walks up to the root),
    # so a view joining the page or a live update of one view no longer re-lays out the others, nor restyles the
    # thousands of spans of the token strips (scrolling to the views below the first screen: 1.2x faster,
    # docs/benchmarks.md). The document's model index is recomputed once for all roots (`DashboardTemplate`)
    template = DashboardTemplate(
        title=title, sidebar=[pn.Column(*dash.sidebar(), sizing_mode="stretch_width")],
        main=list(views), sidebar_width=340)
    template.dashboard = dash  # reachable from tests and notebooks
    return template


def serve(config: DashboardConfig, *, show: bool = False, threaded: bool = False, start: bool = True) -> Any:
    """Serve the dashboard (blocking unless `threaded`); a non-local host gets an access token if it has none."""
    if not is_local(config.host) and config.token is None:
        config.token = new_token()
    page_bundle.install()
    # Bokeh's own websocket allow-list; `host_guard` checks every request (HTTP too) beyond it
    # (an IPv6 name is bracketed there, as the browser writes it in `Origin`)
    origins = [f"[{h}]:{config.port}" if ":" in h else f"{h}:{config.port}"
               for h in ("localhost", "127.0.0.1", "::1", *config.allow_hosts)] if is_local(config.host) else ["*"]
    spare = None
    if config.trace is not None and config.compare is None:
        first = [True]

        def build() -> Dashboard:
            # the first page of a fresh server finds its trace reduced, like a reload (see build_dashboard)
            follow = bool(first)
            first.clear()
            return build_dashboard(config, follow=follow)

        spare = SpareDashboard(build)
        spare.fill()

    def app() -> pn.viewable.Viewable:  # Panel calls a plain function once per browser session
        return create_app(config, spare=spare)

    # every request's Host and Origin are checked before Bokeh routes it (DNS rebinding)
    guarded = host_guard.install({}, HostPolicy.for_server(config.host, config.allow_hosts))
    return pn.serve({"/": app}, port=config.port, address=config.host, show=show,
                    title="K3 Workbench", websocket_origin=origins, threaded=threaded, start=start,
                    # bounded uploads: the browser may not push more than this in one message
                    websocket_max_message_size=max(config.max_upload_bytes * 2, 8 << 20), **guarded)


def build_dashboard(config: DashboardConfig, follow: bool = False) -> Dashboard:
    """A dashboard of `config.trace` with every view built (what a page request for it would build).

    With `follow`, its follower starts reducing the trace now, before any page holds it: the server
    does this for its first spare, so the first page's periodic callback finds frames waiting and
    sends them in the page itself instead of after it has loaded (a fresh server's first page opens
    as fast as a reload: docs/benchmarks.md). Later spares do not
    start following until a page takes them (a live trace would be polled for nobody).
    """
    dash = Dashboard(config)
    dash.views(until_seen=True)
    if follow:
        dash.state.start()
    return dash


def url(config: DashboardConfig, trace: str | None = None, compare: str | None = None) -> str:
    """The URL to open (with the token and the trace / compare parameters when given)."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    host = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    params = [f"token={config.token}"] if config.token else []
    if trace:
        params.append(f"trace={quote(trace)}")
    if compare:
        params.append(f"compare={quote(compare)}")
    return f"http://{host}:{config.port}/" + ("?" + "&".join(params) if params else "")
