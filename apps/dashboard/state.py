"""The dashboard's one data path: a follower thread reads a trace directory and hands the Panel side
small, screen-sized snapshots through a bounded queue.

    TraceFollower thread              bounded queue (2)              Panel event loop
    trace.refresh() + reductions  ->  Snapshot, oldest dropped  ->  periodic callback (>= 1 Hz):
    (only this thread reads the trace)                              DashboardState.snapshot = latest

Why this shape:
- every read of the trace happens in the follower thread, so the reader (not thread-safe) never races
  itself and slow Parquet reads never block the Bokeh event loop; Bokeh models are only touched by
  the periodic callback, on the event loop;
- a snapshot is complete (not a delta), so dropping an old one when the queue is full loses nothing:
  memory stays bounded when a browser or the event loop falls behind;
- a snapshot is already reduced to the screen: heat maps are [layers, bins] with bins about the
  figure's pixel width, token lists are capped; 1M positions never leave the server;
- the views say what they need through `ViewOptions` (bins, KDA layer, expert filter, selected
  token); a change wakes the follower at once, so a click is answered within one poll.

Following a trace written by this process (drive mode) or by another one (a torchrun job) is the
same code: drive mode only starts a recording thread and then follows its directory.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import param

from apps.dashboard.aggregate import KDAStore, TokenText, bin_mean, carry_forward, reads_html, token_reads
from workbench.analysis import image_patch_reads
from workbench.trace import Trace, TraceError, open_trace

MAX_BINS = 2048
MIN_BINS = 64
MAX_GENERATED = 1000  # generated tokens sent to the browser (the newest ones)


@dataclass(frozen=True)
class ViewOptions:
    """What the views currently ask of the follower (changed from the event loop, read by the thread)."""

    bins: int = 800  # screen bins of position axes (about the figure's width in pixels)
    kda_layer: int | None = None  # layer of the per-head lines (None: the first KDA layer)
    kda_reduce: str = "mean"  # "mean" or "max" over heads in the KDA heat map
    moe_modality: str | None = None  # None, "text" or "image": filter of the expert heat map
    moe_segment: int | None = None  # segment id filter of the expert heat map
    moe_layer: int | None = None  # layer of the text-vs-image bars (None: all layers)
    position: int | None = None  # selected token (DSA read-out, routes)


@dataclass(frozen=True)
class HeatMap:
    """A [rows, cols] matrix ready to draw: rows are layers, columns cover [x0, x1)."""

    rows: tuple[int, ...]
    values: np.ndarray  # float32 [len(rows), cols]
    x0: float
    x1: float


@dataclass(frozen=True)
class Snapshot:
    """Everything the views draw, reduced to screen size. Unchanged fields keep their identity between
    snapshots, so a view redraws only what changed (`is` comparison)."""

    seq: int = 0
    path: str = ""
    status: str = "waiting"  # waiting | recording | complete | failed
    error: str | None = None
    problems: tuple[str, ...] = ()
    tokens: int = 0
    extent: int = 1  # right end of the position axes
    progress: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    segments: tuple[dict, ...] = ()
    marks: tuple[tuple[int, int, str], ...] = ()  # marked key ranges (start, end, label), e.g. a planted needle
    generated: tuple[tuple[int, str], ...] = ()
    dsa: HeatMap | None = None
    kda: HeatMap | None = None
    kda_heads: HeatMap | None = None  # rows are heads of `kda_head_layer`
    kda_head_layer: int | None = None
    moe: HeatMap | None = None  # rows are MoE layers, columns experts, values = share of the layer's slots
    moe_text: np.ndarray | None = None  # [experts] slots of text tokens (moe_layer or all layers)
    moe_image: np.ndarray | None = None
    rank_load: np.ndarray | None = None  # [ep ranks] routed slots over all layers
    rank_worst: tuple[int, float] | None = None  # (layer, max/mean) of the most imbalanced layer
    reads: dict | None = None  # DSA read-out of the selected token (see aggregate.token_reads)
    reads_html: str = ""
    patches: dict | None = None  # {"image": name, "grid": int [rows, cols]} read for the selected token
    routes: list[dict] | None = None  # [{"layer", "experts", "weights", "entropy"}] of the selected token


def _marks(session: dict) -> tuple[tuple[int, int, str], ...]:
    """Key ranges worth marking: a `"marks": [{"start", "end", "label"}]` list in session.json, plus the
    needle of `workbench demo` ("demo") or of a synthetic trace ("synthetic")."""
    found = []
    for mark in session.get("marks") or []:
        if isinstance(mark, dict) and {"start", "end"} <= set(mark):
            found.append((int(mark["start"]), int(mark["end"]), str(mark.get("label", "marked"))))
    for key in ("demo", "synthetic"):
        needle = (session.get(key) or {}).get("needle") if isinstance(session.get(key), dict) else None
        if isinstance(needle, (list, tuple)) and len(needle) == 2:
            found.append((int(needle[0]), int(needle[1]), "needle"))
    return tuple(found)


def _clamp_bins(bins: int) -> int:
    return int(min(max(int(bins), MIN_BINS), MAX_BINS))


class TraceFollower:
    """Background thread that follows one trace directory and publishes `Snapshot`s.

    Args:
        path (str | Path): the trace directory (it may not exist yet: the follower waits for it).
        interval (float): seconds between polls (default 0.5 s, so views refresh at least every second).
        maxsize (int): capacity of the snapshot queue; when full the oldest snapshot is dropped.
    """

    def __init__(self, path: str | Path, *, interval: float = 0.5, maxsize: int = 2) -> None:
        self.path = Path(path)
        self.interval = interval
        self.queue: queue.Queue[Snapshot] = queue.Queue(maxsize=maxsize)
        self._options = ViewOptions()
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._trace: Trace | None = None
        self._kda = KDAStore()
        self._tokens = TokenText()
        self._last = Snapshot(path=str(self.path))
        self._computed: dict[str, Any] = {}  # cache keys of the derived fields
        self.dropped = 0  # snapshots dropped because the queue was full

    # ---- control (any thread) -----------------------------------------------------------------
    @property
    def options(self) -> ViewOptions:
        return self._options

    def set_options(self, **changes: Any) -> None:
        """Replace view options (atomic swap of a frozen dataclass) and wake the thread."""
        if "bins" in changes:
            changes["bins"] = _clamp_bins(changes["bins"])
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

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt.is_set():
            self.publish(self.compute())
            if self._last.status in ("complete", "failed") and self._settled():
                # a finished trace changes no more: sleep until a view asks for something new
                self._wake.wait()
            else:
                self._wake.wait(self.interval)
            self._wake.clear()

    def _settled(self) -> bool:
        return self._computed.get("options") == self._options

    def publish(self, snap: Snapshot) -> None:
        """Put a snapshot on the queue, dropping the oldest one when it is full."""
        while True:
            try:
                self.queue.put_nowait(snap)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def compute(self) -> Snapshot:
        """One poll: refresh the trace and rebuild what changed (runs in the follower thread)."""
        opts = self._options
        try:
            if self._trace is None:
                self._trace = open_trace(self.path)
                changed = {"session", "tokens", "dsa_key_counts", "kda_norms", "moe_counts", "moe_rank_load",
                           "dsa_topk", "moe_routes"}
            else:
                changed = self._trace.refresh()
        except TraceError as exc:
            # missing or corrupt trace: report it and keep polling (it may appear or be repaired)
            self._trace = None
            snap = dataclasses.replace(self._last, seq=self._last.seq + 1, error=str(exc),
                                       status="waiting" if "does not exist" in str(exc) else "failed")
            self._last = snap
            return snap
        try:
            snap = self._build(self._trace, changed, opts)
        except (TraceError, OSError, ValueError) as exc:
            snap = dataclasses.replace(self._last, seq=self._last.seq + 1, error=f"could not read {self.path}: {exc}")
        self._last = snap
        self._computed["options"] = opts
        return snap

    def _stale(self, key: str, *deps: Any) -> bool:
        """Whether a derived field must be recomputed: true when its dependencies changed since last time."""
        if self._computed.get(key) == deps:
            return False
        self._computed[key] = deps
        return True

    def _build(self, trace: Trace, changed: set[str], opts: ViewOptions) -> Snapshot:
        last = self._last
        s = trace.session
        segments = tuple({k: seg.get(k) for k in ("id", "kind", "name", "start", "end", "modality")}
                         | {"image": seg.get("image")} for seg in s.get("segments", []))
        progress = dict(s.get("progress") or {})
        marks = _marks(s)
        tokens = int(s.get("tokens", 0))
        total = int(progress.get("total") or 0) if progress.get("phase") == "prefill" else 0
        extent = max(tokens, total, max((int(g["end"]) for g in segments), default=0), 1)
        bins = opts.bins
        fields: dict[str, Any] = {}
        if "tokens" in changed or not len(self._tokens):
            self._tokens = TokenText(trace.table("tokens", columns=["position", "piece", "segment"]))
            fields["generated"] = self._generated(segments)
        elif segments != last.segments:
            fields["generated"] = self._generated(segments)
        if self._stale("dsa", trace.parts("dsa_key_counts").__len__(), extent, bins):
            layers = trace.layers("dsa_key_counts")
            heat = trace.dsa_heatmap(layers, bins=bins, end=extent) if layers else np.zeros((0, bins))
            values = np.log1p(heat).astype(np.float32)
            # bins past the furthest one ever read are "not reached yet", not "never read": draw nothing
            read = np.flatnonzero(heat.sum(axis=0) > 0)
            values[:, (read[-1] + 1 if len(read) else 0):] = np.nan
            fields["dsa"] = HeatMap(tuple(layers), values, 0.0, float(extent))
        if self._kda.update(trace) | self._stale("kda", extent, bins, opts.kda_reduce):
            fields["kda"] = self._kda_heat(extent, bins, opts.kda_reduce)
        kda_layers = sorted(self._kda.layers)
        head_layer = opts.kda_layer if opts.kda_layer in self._kda.layers else (kda_layers[0] if kda_layers else None)
        if head_layer is not None and self._stale("kda_heads", len(trace.parts("kda_norms")), head_layer, extent,
                                                  bins):
            pos, vals = self._kda.heads(trace, head_layer)
            lines = bin_mean(pos, vals, bins, extent) if len(pos) else np.zeros((0, bins), np.float32)
            fields["kda_heads"] = HeatMap(tuple(range(len(lines))), lines, 0.0, float(extent))
            fields["kda_head_layer"] = head_layer
        if self._stale("moe", len(trace.parts("moe_counts")), opts.moe_modality, opts.moe_segment, opts.moe_layer):
            fields.update(self._moe(trace, opts))
        if self._stale("rank", len(trace.parts("moe_rank_load"))):
            fields.update(self._rank_load(trace))
        if opts.position is not None and self._stale("reads", opts.position, len(trace.parts("dsa_topk")),
                                                      len(trace.parts("moe_routes")), extent, bins, len(self._tokens)):
            fields.update(self._detail(trace, opts.position, list(segments), bins, extent, marks))
        elif opts.position is None and last.reads is not None:
            fields.update(reads=None, reads_html="", routes=None, patches=None)
        status = trace.status
        return dataclasses.replace(
            last, seq=last.seq + 1, path=str(self.path), status=status, error=None,
            problems=tuple(trace.problems + self._kda.problems), tokens=tokens, extent=extent, progress=progress,
            timings=dict(s.get("timings") or {}), segments=segments, marks=marks, **fields)

    def _generated(self, segments: tuple[dict, ...]) -> tuple[tuple[int, str], ...]:
        spans = [(int(g["start"]), int(g["end"])) for g in segments if g["kind"] == "generated"]
        if not spans:
            return ()
        out: list[tuple[int, str]] = []
        for start, end in spans:
            out.extend(self._tokens.span(start, max(end, start)))
        # the recorder may write a generated token before session.json's segment end catches up
        last_end = spans[-1][1]
        out.extend(self._tokens.span(last_end, 1 << 62))
        return tuple(out[-MAX_GENERATED:])

    def _kda_heat(self, extent: int, bins: int, reduce: str) -> HeatMap:
        rows, values = [], []
        for layer in sorted(self._kda.layers):
            pos, mean, peak = self._kda.layers[layer].arrays()
            rows.append(layer)
            values.append(carry_forward(bin_mean(pos, peak if reduce == "max" else mean, bins, extent)))
        matrix = np.stack(values) if values else np.zeros((0, bins), np.float32)
        return HeatMap(tuple(rows), matrix, 0.0, float(extent))

    def _moe(self, trace: Trace, opts: ViewOptions) -> dict[str, Any]:
        layers = trace.layers("moe_counts")
        if not layers:
            return {"moe": None, "moe_text": None, "moe_image": None}
        segs = None if opts.moe_segment is None else [opts.moe_segment]
        counts = trace.moe_counts_matrix(opts.moe_modality, segs, layers).astype(np.float64)
        totals = counts.sum(axis=1, keepdims=True)
        share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0).astype(np.float32)
        pick = layers if opts.moe_layer not in layers else [opts.moe_layer]
        text = trace.moe_counts_matrix("text", segs, pick).sum(axis=0)
        image = trace.moe_counts_matrix("image", segs, pick).sum(axis=0)
        # expert i is centred on x = i, like the bars and the routes below it
        return {"moe": HeatMap(tuple(layers), share, -0.5, counts.shape[1] - 0.5), "moe_text": text,
                "moe_image": image}

    def _rank_load(self, trace: Trace) -> dict[str, Any]:
        table = trace.table("moe_rank_load", columns=["layer", "ep_rank", "tokens"])
        if table.num_rows == 0:
            return {"rank_load": None, "rank_worst": None}
        layer = table["layer"].to_numpy().astype(np.int64)
        rank = table["ep_rank"].to_numpy().astype(np.int64)
        load = table["tokens"].to_numpy().astype(np.float64)
        n_ranks = int(rank.max()) + 1
        ids, inv = np.unique(layer, return_inverse=True)
        per = np.bincount(inv * n_ranks + rank, weights=load, minlength=len(ids) * n_ranks).reshape(len(ids), n_ranks)
        mean = per.mean(axis=1)
        ratio = np.divide(per.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
        worst = int(ratio.argmax())
        return {"rank_load": per.sum(axis=0), "rank_worst": (int(ids[worst]), float(ratio[worst]))}

    def _detail(self, trace: Trace, position: int, segments: list[dict], bins: int, extent: int,
                marks: tuple[tuple[int, int, str], ...]) -> dict[str, Any]:
        rows = trace.topk_for(position)
        reads = token_reads(position, rows, self._tokens, segments, bins, extent, marks=marks)
        routes_table = trace.routes_for(position)
        routes = []
        if routes_table.num_rows:
            for r in sorted(routes_table.to_pylist(), key=lambda r: r["layer"]):
                routes.append({"layer": int(r["layer"]), "experts": [int(e) for e in r["experts"]],
                               "weights": [float(w) for w in r["weights"]], "entropy": float(r["entropy"])})
        patches = None
        image = next((g for g in segments if g["kind"] == "image" and g.get("image")), None)
        if image is not None and rows.num_rows:
            grid = (int(image["image"]["grid_rows"]), int(image["image"]["grid_cols"]))
            tok = trace.tokens(["position", "image_id", "patch_row", "patch_col"])
            tok = tok[tok["image_id"] == image["id"]]
            if len(tok):
                patches = {"image": str(image.get("name") or "image"),
                           "grid": image_patch_reads(rows, tok, int(image["id"]), grid)}
        return {"reads": reads, "reads_html": reads_html(reads), "routes": routes, "patches": patches}


class DashboardState(param.Parameterized):
    """What every view watches: the latest snapshot, the shared token selection and the source.

    The Panel side calls `poll()` from a periodic callback (on the event loop); tests call `sync()`
    to compute and apply one snapshot in the calling thread.
    """

    snapshot = param.ClassSelector(class_=Snapshot, default=Snapshot(), doc="latest snapshot from the follower")
    position = param.Integer(default=None, allow_None=True, bounds=(0, None),
                             doc="selected token position (DSA read-out and expert routes follow it)")
    trace_path = param.String(default="", doc="trace directory being followed")
    message = param.String(default="", doc="an error about the source (bad URL parameter, missing trace)")
    bins = param.Integer(default=800, bounds=(MIN_BINS, MAX_BINS), doc="screen bins of the position axes")

    def __init__(self, path: str | Path | None = None, *, interval: float = 0.5, **params: Any) -> None:
        super().__init__(**params)
        self.interval = interval
        self.follower: TraceFollower | None = None
        if path is not None:
            self.follow(path)

    def follow(self, path: str | Path) -> None:
        """Follow another trace directory (stops the previous follower)."""
        if self.follower is not None:
            self.follower.stop(timeout=0)
        self.follower = TraceFollower(path, interval=self.interval)
        self.follower.set_options(bins=self.bins, position=self.position)
        self.trace_path = str(path)
        self.position = None
        self.snapshot = Snapshot(path=str(path))

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
        """Apply the newest queued snapshot (event loop only); returns whether one was applied."""
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
        self.snapshot = latest
        return True

    def sync(self) -> Snapshot:
        """Compute one snapshot in this thread and apply it (tests, first paint, notebooks)."""
        if self.follower is None:
            raise RuntimeError("no trace to follow")
        if self.follower.alive:
            # the follower owns the trace; wait for its next snapshot instead of reading concurrently
            self.follower._wake.set()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not self.poll():
                time.sleep(0.02)
            return self.snapshot
        self.follower.publish(self.follower.compute())
        self.poll()
        return self.snapshot

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop(timeout=1)
