"""`workbench.show(trace_or_session)`: the dashboard's live views inline in a notebook cell (`workbench.inline`).

    view = workbench.show("traces/run1")              # a trace directory (finished, or being written)
    view = workbench.show(session)                    # a Session recorded in this kernel (`workbench.record`)
    view = workbench.show(trace, views=["session", "kda"])

- `trace_path(obj)`: the trace directory behind a path, a `Trace`, a `RecordedSession`, a `Recorder` or a
  recorded `engine.session.Session`; an error naming the problem for anything else.
- `view_providers()`: the installed view packages (entry points of group `k3_workbench.views`).
- `show(obj, views=None, provider="dashboard", **options)`: the provider's inline view of that trace.

Why an entry point, not an import: the views are the dashboard's (`apps.dashboard`: the components,
the reducers and the follower thread that tails a trace), one floor above `workbench`, and imports
only point down. Moving them below `workbench` would make the recorder/analysis library carry Panel,
Bokeh and the follower threads at its core and split the dashboard in two. Instead the dashboard
registers its inline view under the entry point group `k3_workbench.views` (pyproject.toml:
`dashboard = "apps.dashboard.notebook:inline_view"`) and `show` loads it by name at call time,
the way pandas finds its plotting backends: `workbench` names no module of `apps`, any other view
package can register the same way, and importing `workbench` still imports no Panel.

A provider is `provider(trace: Path, *, views: Sequence[str] | None, **options) -> displayable`.
Live updates need the kernel's event loop: a view follows a trace written by another process (or
by a thread of this kernel) while cells are idle; a session run in the foreground of a cell shows
its progress when that cell finishes (run it in a `threading.Thread` to watch it live).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Sequence

ENTRY_POINT_GROUP = "k3_workbench.views"
DEFAULT_PROVIDER = "dashboard"


class ShowError(ValueError):
    """`show` was given something it cannot show, or no view package is installed."""


def trace_path(obj: Any) -> Path:
    """The trace directory behind `obj`.

    Args:
        obj: a path (str or Path), a `workbench.Trace`, a `RecordedSession` (from `recorded_session`),
            a `Recorder` (from `workbench.record`) or an `engine.session.Session` being recorded.
    """
    if isinstance(obj, (str, Path)):
        return Path(obj)
    path = getattr(obj, "path", None)  # a Trace (reader) or a TraceWriter
    if isinstance(path, Path):
        return path
    recorder = getattr(obj, "recorder", None)  # a RecordedSession
    if recorder is not None:
        return trace_path(recorder)
    writer = getattr(obj, "writer", None)  # a Recorder
    if writer is not None:
        return trace_path(writer)
    observers = getattr(obj, "observers", None)  # a Session: its recorders observe it
    if isinstance(observers, list):
        from workbench.recorders import Recorder

        # a Recorder observes through a bound method (`Recorder._on_event`): its owner is the recorder
        owners = {id(o): o for o in (getattr(ob, "__self__", ob) for ob in observers)}.values()
        recorders = [o for o in owners if isinstance(o, Recorder) and o.writer is not None]
        if len(recorders) == 1:
            return recorders[0].writer.path
        if not recorders:
            raise ShowError("this session is not being recorded: open it inside `workbench.record(session, "
                            "trace=DIR)` (or pass the trace directory)")
        raise ShowError(f"this session is recorded into {len(recorders)} traces: pass the trace directory")
    if getattr(obj, "recorder", 1) is None:
        raise ShowError("this RecordedSession records nothing (trace=None): nothing to show")
    raise ShowError(f"cannot show a {type(obj).__name__}: pass a trace directory, a Trace, or a recorded "
                    "Session / RecordedSession")


def view_providers() -> dict[str, EntryPoint]:
    """The installed view packages by name (entry point group `k3_workbench.views`)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def show(obj: Any, *, views: Sequence[str] | None = None, provider: str = DEFAULT_PROVIDER, **options: Any) -> Any:
    """The live views of the trace behind `obj`, for a notebook cell to display.

    Args:
        obj: what `trace_path` accepts (trace directory, Trace, recorded Session, RecordedSession, Recorder).
        views (Sequence[str], Optional): which views, in order (the dashboard's: "session", "dsa", "kda",
            "experts"); default all of them.
        provider (str): the view package (an entry point name of group `k3_workbench.views`).
        options: passed to the provider (the dashboard's: `refresh_ms`, `interval`).

    Returns: the provider's view object (Panel for the dashboard); it follows the trace live and has
    `close()` to stop following.
    """
    path = trace_path(obj)
    providers = view_providers()
    if provider not in providers:
        have = ", ".join(sorted(providers)) or "none"
        raise ShowError(f"no view package {provider!r} is installed (installed: {have}); the dashboard registers "
                        f"itself under entry point group {ENTRY_POINT_GROUP!r}: reinstall the project "
                        "(`pip install -e .` or `./dev setup`)")
    return providers[provider].load()(path, views=views, **options)
