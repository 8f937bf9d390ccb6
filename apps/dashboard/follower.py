"""The dashboard's one data path: a follower thread reads a trace directory and hands the Panel side
small, screen-sized frames through a bounded queue.

    TraceFollower thread                    bounded queue (2)             Panel event loop
    trace.refresh(), then the view reducers -> DashboardFrame, oldest  -> periodic callback (>= 1 Hz):
    (session map first, the other three in      dropped                   DashboardState.frame = latest
     parallel threads; a frame per result)

Why this shape:
- the trace is read only while the follower polls: first `refresh()` and the session map's reducer,
  then the other views' reducers, in parallel threads where there are cores to spare (each reads its
  own tables, and Parquet decoding releases the GIL), else one after another, cheapest first; the next
  refresh waits for all of them, so nothing reads a trace while it is refreshed.
  Slow reads never block the Bokeh event loop; Bokeh models are only touched on the event loop;
- a frame is complete (not a delta), so dropping an old one when the queue is full loses nothing:
  memory stays bounded when a browser or the event loop falls behind. A frame is published as soon as
  the session map is known and again as each view's data arrives, so the first view does not wait for
  the slowest one;
- a frame is already reduced to the screen: heat maps are [layers, bins] with bins about the
  figure's pixel width, token lists are capped; 1M positions never leave the server;
- the views say what they need through `ViewOptions` (bins, KDA layer, expert filter, selected
  token); a change wakes the follower at once, so a click is answered within one poll.
- the trace and its reducers belong to the trace, not to the page (`shared_reducers`): every session
  of this server following the same trace polls the same folded state (one poll at a time), so a
  reload or a second viewer is answered from what the first one already read.

Following a trace written by this process (drive mode) or by another one (a torchrun job) is the
same code: drive mode only starts a recording thread and then follows its directory.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import param
from panel.io.document import hold

from workbench.analysis.views import shared_reducers
from workbench.analysis.views import (DSADiffData, DSAMapData, ExpertsData, KDAHealthData, KDAStateData,
                                     RecordingMapData, RecordingMapReducer, Reducer, ViewOptions)
from workbench.analysis.views.base import MAX_BINS, MIN_BINS, HeatMap, clamp_bins
from workbench.analysis.views.session_map import MAX_GENERATED
from workbench.trace import Trace, TraceError, open_trace

__all__ = ["MAX_BINS", "MAX_GENERATED", "MIN_BINS", "DashboardFrame", "DashboardState", "HeatMap", "TraceFollower",
           "ViewOptions"]


@dataclass(frozen=True)
class DashboardFrame:
    """What the views draw at one moment: one data object per view, each already screen-sized.

    A view's data keeps its identity between frames while nothing it depends on changed, so a view
    redraws only what changed (`ViewComponent` does the comparison).
    """

    seq: int = 0
    path: str = ""
    error: str | None = None
    problems: tuple[str, ...] = ()
    session: RecordingMapData = RecordingMapData()
    dsa: DSAMapData = DSAMapData()
    kda: KDAStateData = KDAStateData()
    experts: ExpertsData = ExpertsData()
    health: KDAHealthData = KDAHealthData()
    diff: DSADiffData = DSADiffData()  # filled only when the follower compares with a second trace
    more: Mapping[str, Any] = field(default_factory=dict)  # data of views registered beside the built-in ones

    def view(self, name: str) -> Any:
        """The data of the view registered as `name` (None before its first reduction)."""
        return getattr(self, name) if name in _FRAME_FIELDS else self.more.get(name)


_FRAME_FIELDS = {f.name for f in dataclasses.fields(DashboardFrame)} - {"more"}


def relative_to_root(text: str, root: str | Path | None) -> str:
    """`text` with every absolute path under `root` written relative to it."""
    if root is None:
        return text
    for base in dict.fromkeys((str(Path(root).resolve()), str(Path(root).absolute()))):
        text = text.replace(base + os.sep, "").replace(base, ".")
    return text


def capture_notes(session: dict) -> tuple[str, ...]:
    """What a trace imported from vLLM / SGLang responses does not hold (`workbench import`), as one
    warning: its empty views are then explained instead of looking like a recording that failed."""
    capture = session.get("capture")
    if not isinstance(capture, dict) or not isinstance(capture.get("absent"), dict) or not capture["absent"]:
        return ()
    absent = "; ".join(f"{what}: {why}" for what, why in capture["absent"].items())
    return (f"imported from {capture.get('engine', 'server')} responses; not in the capture ({absent})",)


def _one_line(exc: BaseException) -> str:
    """An exception as one line for the page; the project's own errors need no class name."""
    text = " ".join(str(exc).split()) or "(no message)"
    return text if isinstance(exc, (TraceError, OSError, ValueError)) else f"{type(exc).__name__}: {text}"[:500]


class TraceFollower:
    """Background thread that follows one trace directory and publishes `DashboardFrame`s.

    Args:
        path (str | Path): the trace directory (it may not exist yet: the follower waits for it).
        interval (float): seconds between polls (default 0.5 s, so views refresh at least every second).
        maxsize (int): capacity of the frame queue; when full the oldest frame is dropped.
        root (str | Path, Optional): the dashboard's `--root`; paths on the page are shown relative
            to it (the server's directory layout is not the visitor's business).
        compare (str | Path, Optional): a second trace of the same input; its DSA reads are compared
            with this one's in the frame's `diff` (side-by-side mode).
    """

    def __init__(self, path: str | Path, *, interval: float = 0.5, maxsize: int = 2,
                 root: str | Path | None = None, compare: str | Path | None = None,
                 reducers: Mapping[str, type[Reducer]] | None = None,
                 view_options: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.root = root
        self.interval = interval
        self.queue: queue.Queue[DashboardFrame] = queue.Queue(maxsize=maxsize)
        self._options = ViewOptions(extra=dict(view_options or {}))
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        # the trace and its reducers are shared with the other sessions following it (`shared_reducers`)
        self._shared = shared_reducers.acquire(self.path, compare,
                                               relative_to_root(str(compare), root) if compare is not None else None,
                                               reducers)
        self._released = False
        # on two cores, reducer threads would only take the GIL from the server's event loop while it sends
        # the page: there the views are reduced one after another (each still published as it is ready)
        workers = min(len(self._shared.views), max(1, (os.cpu_count() or 1) - 1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"view-reducer:{self.path.name}") \
            if workers > 1 else None
        self._last = DashboardFrame(path=str(self.path))
        self._computed_options: ViewOptions | None = None
        self.dropped = 0  # frames dropped because the queue was full
        self.completed = 0  # seq of the last complete frame (the end of a poll)
        # polls of the thread begun and finished, in order: a poll begun after a caller's question reads the
        # trace as it was then (one in flight may have read it before)
        self.polls_begun = 0
        self.polls_done = 0

    # ---- control (any thread) -----------------------------------------------------------------
    @property
    def _session(self) -> RecordingMapReducer:
        """The session map's reducer (shared with the other followers of this trace; tests patch it)."""
        return self._shared.session

    @property
    def options(self) -> ViewOptions:
        return self._options

    def set_options(self, **changes: Any) -> None:
        """Replace view options (atomic swap of a frozen dataclass) and wake the thread."""
        if "bins" in changes:
            changes["bins"] = clamp_bins(changes["bins"])
        extra = {k: changes.pop(k) for k in list(changes) if k in self._options.extra}
        if extra:
            changes["extra"] = {**self._options.extra, **extra}
        self._options = dataclasses.replace(self._options, **changes)
        self._wake.set()

    def start(self) -> "TraceFollower":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"trace-follower:{self.path.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._halt.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._released:
            self._released = True
            shared_reducers.release(self._shared)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Poll now instead of at the next interval."""
        self._wake.set()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt.is_set():
            self.polls_begun += 1
            # intermediate frames as each view is ready, then the complete one
            try:
                self.publish(self.compute(self.publish))
            except Exception as exc:  # noqa: BLE001 - the follower must outlive any bad trace: show it, retry
                self._shared.trace = None
                frame = self._next(error=f"could not read {self.path}: {_one_line(exc)}")
                self.completed = frame.seq
                self.publish(frame)
            self.polls_done += 1
            if self._last.session.status in ("complete", "failed") and self._settled():
                # a finished trace changes no more: sleep until a view asks for something new
                self._wake.wait()
            else:
                self._wake.wait(self.interval)
            self._wake.clear()

    def _settled(self) -> bool:
        return self._computed_options == self._options

    def publish(self, frame: DashboardFrame) -> None:
        """Put a frame on the queue, dropping the oldest one when it is full."""
        while True:
            try:
                self.queue.put_nowait(frame)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def _next(self, **changes: Any) -> DashboardFrame:
        for key in ("error", "path"):
            if isinstance(changes.get(key), str):
                changes[key] = relative_to_root(changes[key], self.root)
        if "problems" in changes:
            changes["problems"] = tuple(relative_to_root(p, self.root) for p in changes["problems"])
        more = {k: changes.pop(k) for k in list(changes) if k not in _FRAME_FIELDS}
        if more:
            changes["more"] = {**self._last.more, **more}
        self._last = dataclasses.replace(self._last, seq=self._last.seq + 1, **changes)
        return self._last

    def compute(self, partial: Callable[[DashboardFrame], None] | None = None) -> DashboardFrame:
        """One poll: refresh the trace and rebuild what changed; returns the complete frame.

        With `partial`, every intermediate frame whose data changed (the session map, then each view as
        its reducer finishes) is handed to it as well, so a fast view is shown before a slow one.
        The poll holds the shared reducers' lock: another session's poll of the same trace waits.
        """
        with self._shared.lock:
            return self._compute(partial)

    def _compute(self, partial: Callable[[DashboardFrame], None] | None) -> DashboardFrame:
        opts = self._options
        shared = self._shared
        try:
            if shared.trace is None:
                shared.trace = open_trace(self.path)
            else:
                shared.trace.refresh()
        except TraceError as exc:
            # missing or corrupt trace: report it and keep polling (it may appear or be repaired)
            shared.trace = None
            status = "waiting" if "does not exist" in str(exc) else "failed"
            frame = self._next(error=str(exc), session=dataclasses.replace(self._last.session, status=status))
            self.completed = frame.seq
            return frame
        trace = shared.trace
        try:
            session = shared.session.reduce(trace, opts, None)
            if partial is not None and session is not self._last.session:
                partial(self._next(path=str(self.path), error=None, session=session))
            self._reduce_views(trace, opts, session, partial)
            frame = self._next(path=str(self.path), error=None, session=session,
                               problems=tuple(trace.problems) + capture_notes(trace.session))
        except Exception as exc:  # noqa: BLE001 - e.g. a session.json field of the wrong shape: shown, retried
            shared.trace = None if not isinstance(exc, (TraceError, OSError, ValueError)) else shared.trace
            frame = self._next(error=f"could not read {self.path}: {_one_line(exc)}")
        self._computed_options = opts
        self.completed = frame.seq
        return frame

    def _reduce_views(self, trace: Trace, opts: ViewOptions, session: RecordingMapData,
                      partial: Callable[[DashboardFrame], None] | None) -> None:
        views = self._shared.views
        if self._pool is None:
            names = list(views)
            for i, name in enumerate(names):
                data = views[name].reduce(trace, opts, session)
                if data is not self._last.view(name):
                    frame = self._next(**{name: data})
                    if partial is not None and i < len(names) - 1:
                        partial(frame)
            return
        futures: dict[Future, str] = {self._pool.submit(r.reduce, trace, opts, session): name
                                      for name, r in views.items()}
        failure: BaseException | None = None
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    try:
                        data = future.result()
                    except Exception as exc:  # noqa: BLE001 - re-raised below, after every read has ended
                        failure = failure or exc
                        continue
                    name = futures[future]
                    if data is not self._last.view(name):
                        frame = self._next(**{name: data})
                        if partial is not None and pending:
                            partial(frame)
        finally:
            wait(pending)  # the next refresh must not overlap a read
        if failure is not None:
            raise failure


class DashboardState(param.Parameterized):
    """What every view watches: the latest frame, the shared token selection and the source.

    The Panel side calls `poll()` from a periodic callback (on the event loop); tests call `sync()`
    to compute and apply one frame in the calling thread.
    """

    frame = param.ClassSelector(class_=DashboardFrame, default=DashboardFrame(), doc="latest frame from the follower")
    position = param.Integer(default=None, allow_None=True, bounds=(0, None),
                             doc="selected token position (DSA read-out and expert routes follow it)")
    trace_path = param.String(default="", doc="trace directory being followed")
    message = param.String(default="", doc="an error about the source (bad URL parameter, missing trace)")
    bins = param.Integer(default=800, bounds=(MIN_BINS, MAX_BINS), doc="screen bins of the position axes")

    def __init__(self, path: str | Path | None = None, *, interval: float = 0.5, root: str | Path | None = None,
                 compare: str | Path | None = None, reducers: Mapping[str, type[Reducer]] | None = None,
                 view_options: Mapping[str, Any] | None = None, **params: Any) -> None:
        super().__init__(**params)
        self.reducers = reducers  # the views the follower reduces (None: the built-in ones)
        self.view_options = view_options
        self.interval = interval
        self.root = root
        self.compare = compare  # a second trace whose DSA reads the follower compares (frame.diff)
        self.follower: TraceFollower | None = None
        if path is not None:
            self.follow(path)

    def follow(self, path: str | Path) -> None:
        """Follow another trace directory (stops the previous follower)."""
        if self.follower is not None:
            self.follower.stop(timeout=0)
        self.follower = TraceFollower(path, interval=self.interval, root=self.root, compare=self.compare,
                                      reducers=self.reducers, view_options=self.view_options)
        self.follower.set_options(bins=self.bins, position=self.position)
        self.trace_path = relative_to_root(str(path), self.root)
        self.position = None
        self.frame = DashboardFrame(path=str(path))

    def start(self) -> None:
        if self.follower is not None:
            self.follower.start()

    def set_options(self, **changes: Any) -> None:
        if self.follower is not None:
            self.follower.set_options(**changes)

    @param.depends("position", watch=True)
    def _position_changed(self) -> None:
        self.set_options(position=self.position)

    @param.depends("bins", watch=True)
    def _bins_changed(self) -> None:
        self.set_options(bins=self.bins)

    def poll(self) -> bool:
        """Apply the newest queued frame (event loop only); returns whether one was applied."""
        if self.follower is None:
            return False
        latest = None
        while True:
            try:
                latest = self.follower.queue.get_nowait()
            except queue.Empty:
                break
        if latest is None:
            return False
        # every view redraws in one Bokeh message per frame instead of one per changed property
        with hold():
            self.frame = latest
        return True

    def sync(self) -> DashboardFrame:
        """Compute one complete frame in this thread and apply it (tests, first paint, notebooks)."""
        if self.follower is None:
            raise RuntimeError("no trace to follow")
        if self.follower.alive:
            # the follower owns the trace; wait for a complete frame of a poll begun after this call (one in
            # flight now may have read the trace before what the caller just wrote) instead of reading
            # concurrently
            ticket = self.follower.polls_begun + 1
            self.follower.wake()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.poll()
                if self.follower.polls_done >= ticket and self.frame.seq >= self.follower.completed:
                    break
                self.follower.wake()  # the poll in flight may have cleared the wake-up meant for the next
                time.sleep(0.02)
            return self.frame
        self.follower.publish(self.follower.compute())
        self.poll()
        return self.frame

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop(timeout=1)
