"""`workbench.record(session, ...)`: attach recorders to a session's probe points, write a trace.

    with workbench.record(session, trace="traces/run1", policy="default") as rec:
        session.append(document, name="report")
        for tok in session.generate(64):
            ...

Inside the block every enabled probe point of the model has a sink; leaving the block (normally or
by an exception) detaches all of them and closes the trace ("complete" or "failed"), so recording
costs nothing afterwards and nothing already recorded is lost. The trace is flushed every
`policy.flush_seconds` while the session runs (less often when flushes would take more than
`policy.flush_share` of the time), and `session.json` carries a live `progress` entry.

Under tensor/expert parallelism every rank attaches the same sinks (layers may gather signals with
collectives, which all ranks must enter); only rank 0 writes, so every signal is recorded once.
"""

from __future__ import annotations

import contextlib
import errno
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Collection, Iterator

import numpy as np
import torch

from engine.errors import InputError
from engine.probes import OPEN_END, SIGNALS, Emission, Marks, ProbePoint, ProbeRequest, cat_rows, probe_points
from engine.session import Segment, Session
from engine.vision.thumbnail import encode_thumbnail
from workbench.recorders import rows as pending_rows
from workbench.recorders.policy import RecordPolicy, load_policy
from workbench.signals import SignalFamily, registered
from workbench.trace import TraceError, TraceWriter

MODALITIES = ("text", "image")
DEFER_MAX_TOKENS = 16  # payloads this small (decode steps) are turned into rows in bulk at the flush
# a point's decode payloads held at most: beyond, they become (device) rows at once, which bounds what the
# `Deferred` integrity inputs of eager steps keep alive between flushes (the flush may wait many seconds)
DEFER_MAX_ITEMS = 256
# tables a family lets wait (`SignalFamily.may_wait`: the health tables) get a part at least this often, at once
# when their rows say so (a fault), and at the end; in between their rows stay buffered in the writer
HOLD_SECONDS = 10.0


class Recorder:
    """Turns probe payloads and session events into trace rows (one per session, per trace)."""

    def __init__(self, session: Session, writer: TraceWriter | None, policy: RecordPolicy,
                 families: "set[str] | list[SignalFamily]") -> None:
        self.session = session
        self.model = session.model
        self.config = session.config
        self.writer = writer
        self.policy = policy
        # the registered families to record (by name; a family object is used as given)
        known = registered()
        self.families = {f.name: f for f in (known[f] if isinstance(f, str) else f for f in families)}
        self.ep_world = int(getattr(getattr(self.model, "parallel", None), "world", 1))
        self._points: list[ProbePoint] = []
        self._segment_of = torch.zeros(0, dtype=torch.long)
        self._modality_of = torch.zeros(0, dtype=torch.long)
        self._segment_dev: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._segments_seen = -1
        self._marks = Marks(tuple(policy.mark_positions))
        self._marks_seen = -1  # segment count the marks (and the requests that carry them) were built for
        self._tables = pending_rows.PendingTables()
        self._deferred: dict[ProbePoint, list[Emission]] = defaultdict(list)
        self._thumbnails: dict[int, str] = {}  # segment id -> thumbnail path in the trace
        self._generated_rows: list[tuple[int, int, int]] = []  # (position, token id, segment) since the last flush
        self._last_flush = time.monotonic()
        self._flush_cost = 0.0  # seconds of the last periodic flush: main thread, and the writer's thread after it
        self._may_wait = frozenset(t for fam in self.families.values() for t in fam.may_wait)
        self._waiting_since = time.monotonic()  # when the tables that may wait were last written
        self._progress: dict = {"phase": "idle", "done": 0, "total": 0, "tokens_per_s": None, "eta_s": None}
        self._generated = 0
        self.rows_written = 0

    # ---- wiring ----------------------------------------------------------------------------------
    def attach(self) -> None:
        self._attach_sinks()
        for seg in self.session.segments:  # context appended before recording started (already in session.json)
            self._on_segment(seg, announce=False)
        if self._thumbnails:  # their thumbnails were written just now: name them
            self.writer.update_session(segments=[self._segment_json(s) for s in self.session.segments])
        if self.writer is not None and self.session.annotations:  # said about the run before recording began
            self.writer.update_session(**self.session.annotations)

    def pause(self) -> None:
        """Write what was recorded and let go of the model, keeping the trace open: a server records one
        conversation per trace while other conversations run on the same model in between."""
        self.flush()
        self.detach()

    def resume(self) -> None:
        """Listen again after `pause()`; what the trace holds already is not written twice."""
        self._attach_sinks()

    def _attach_sinks(self) -> None:
        wanted = {name for fam in self.families.values() for name in fam.signals}
        self._update_marks()
        for point in probe_points(self.model):
            if point.name not in wanted:
                continue
            # other listeners (an intervention's measurement, a user's sink) may watch beside a recording
            if any(isinstance(getattr(sink, "__self__", None), Recorder) for sink in point.listeners):
                raise RuntimeError(f"{point} is already being recorded (nested record() on one model?)")
            point.attach(self._on_probe, self._request(point.name))
            self._points.append(point)
        self.session.observers.append(self._on_event)

    def detach(self) -> None:
        for point in self._points:
            point.detach(self._on_probe)
        self._points.clear()
        if self._on_event in self.session.observers:
            self.session.observers.remove(self._on_event)

    def _request(self, signal: str) -> ProbeRequest:
        """What the probe points of `signal` are asked for (its family's request under the policy)."""
        return self.families[SIGNALS[signal].family].request(signal, self.policy, self._marks)

    def _update_marks(self) -> None:
        """Rebuild the marked spans when segments were added, and hand layers the new requests.

        Runs on every session event (on every rank: all ranks must pick the same dense-mass queries,
        which enter a collective), so the requests are current before the next forward: each
        forward follows an append ("segment") or a sampled token ("token").
        """
        segments = self.session.segments
        if self._marks_seen == len(segments):
            return
        self._marks_seen = len(segments)
        names = self.policy.mark_segments
        if not names:
            return
        last = segments[-1] if segments else None
        # the answer grows past its recorded end while decoding: its span stays open while it is last
        spans = tuple((s.start, OPEN_END if s is last and s.kind == "generated" else s.end)
                      for s in segments if s.name in names)
        self._marks = Marks(tuple(self.policy.mark_positions), spans)
        for point in self._points:
            if point.name in self.families[point.signal.family].follow_marks:
                point.update_request(self._on_probe, self._request(point.name))

    # ---- helpers -------------------------------------------------------------------------------------
    @property
    def n_segments(self) -> int:
        """Segments of the session so far (at least 1: dense per-segment counts need a row)."""
        return len(self.session.segments) or 1

    def position_maps(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """position -> segment id, and position -> index in MODALITIES (1 at the image positions of
        image segments), for positions [0, n) on `device` (cached until segments change)."""
        if n > len(self._segment_of) or self._segments_seen != len(self.session.segments):
            n = max(n, len(self.session.tokens))
            seg = torch.zeros(n, dtype=torch.long)
            modality = torch.zeros(n, dtype=torch.long)
            for s in self.session.segments:
                seg[s.start: min(s.end, n)] = s.id
                if s.image is not None:
                    modality[s.image["token_start"]: min(s.image["token_end"], n)] = MODALITIES.index("image")
            last = self.session.segments[-1] if self.session.segments else None
            if last is not None and last.kind == "generated":
                seg[last.start:] = last.id  # the answer grows past its recorded end while decoding
            self._segment_of, self._modality_of, self._segments_seen = seg, modality, len(self.session.segments)
            self._segment_dev = {}
        if device not in self._segment_dev:
            self._segment_dev[device] = (self._segment_of.to(device), self._modality_of.to(device))
        return self._segment_dev[device]

    def pend(self, table: str, layer: int | None, rank: int, cols: dict | None, drop_zero: str | None = None) -> None:
        """Queue device tensors for `table` (with a `step` column or scalar); written at the next flush."""
        self._tables.pend(table, layer, rank, cols, drop_zero)

    def rows(self, table: str, layer: int, rank: int, keep: np.ndarray | None, steps: torch.Tensor,
             fields: dict[str, torch.Tensor]) -> None:
        """Queue raw rows of a signal table (all, or rows `keep`)."""
        self._tables.rows(table, layer, rank, keep, steps, fields)

    def _drain(self) -> None:
        """Turn deferred decode payloads into rows, copy every pending result to the host (one device
        synchronisation), and hand each table's rows to the writer in a single append."""
        for point, items in self._deferred.items():
            self._to_rows(point, items)
        self._deferred.clear()
        self.rows_written += self._tables.drain(self.writer, self.families)

    # ---- probe payloads -----------------------------------------------------------------------------
    def _on_probe(self, emission: Emission) -> None:
        if self.writer is None:
            return  # other ranks run the same collectives but do not write
        if emission.phase == "decode" or len(emission.data["positions"]) <= DEFER_MAX_TOKENS:
            # decode payloads (the decode step's tape, several steps, or one eager step) are turned into
            # rows in bulk at the flush: per-token Python work stays tiny
            held = self._deferred[emission.point]
            held.append(emission)
            if len(held) >= DEFER_MAX_ITEMS:
                self._to_rows(emission.point, held)
                del self._deferred[emission.point]
        else:
            self._to_rows(emission.point, [emission])

    _on_probe.takes_deferred = True  # type: ignore[attr-defined]  # engine.probes.Deferred: see _to_rows

    def _to_rows(self, point: ProbePoint, items: list[Emission]) -> None:
        """Turn emissions of one probe point (one prefill call, or many decode steps) into rows.

        The signal's declaration says how to line the emissions up: each field's rows (the `n` axis)
        are concatenated, and the batch row (one sequence per trace) is dropped.
        """
        steps = torch.cat([e.row_steps() for e in items])
        fields = {}
        for f in point.signal.fields:
            if f.name in items[0].data:
                parts = [e.data[f.name] for e in items]
                # integrity fields of eager decode steps come as Deferred: computed here once for all of them
                fields[f.name] = cat_rows(parts, 1)[0] if f.dims[0] == "B" else cat_rows(parts, 0)
        family = self.families[point.signal.family]
        family.to_rows(self, point.name, point.layer, items[0].rank, items, steps, fields)

    def keep_items(self, items: list[Emission], stride: int, *, decode_all: bool, last: bool = False,
                   window: tuple[int, int] | None = None) -> np.ndarray:
        """Row indices (over the concatenated items) to keep in full (`workbench.recorders.rows.keep_items`)."""
        self._update_marks()  # segments as they are now (a flush may follow a change no event announced)
        return pending_rows.keep_items(items, stride, self._marks, decode_all=decode_all, last=last, window=window)

    # ---- session events --------------------------------------------------------------------------------
    def _on_event(self, event: str, payload: dict) -> None:
        self._update_marks()
        if self.writer is None:
            return
        if event == "segment":
            self._on_segment(payload["segment"])
        elif event == "annotations":  # what the caller said about the run (a task and its fact's spans)
            self.writer.update_session(**payload["fields"])
        elif event == "interventions":  # the session's record of its interventions, as session.json shows it
            self.writer.update_session(interventions=list(payload["log"]))
        elif event == "token":
            tok = payload["token"]
            self._generated += 1
            self._generated_rows.append((tok.position, tok.id, self.session.segments[-1].id))  # written at flush
            self._progress = {**self._progress, "phase": "decode", "generated": self._generated}
        elif event == "prefill_progress":
            done, total, elapsed = payload["done"], payload["total"], payload["elapsed"]
            rate = done / elapsed if elapsed > 0 else None
            self._progress = {"phase": "prefill" if done < total else "idle", "done": done, "total": total,
                              "tokens_per_s": rate, "eta_s": (total - done) / rate if rate else None}
            if done >= total:
                # the prefill's last rows are written before the first generated token, so turning them
                # into rows on this thread does not land in a decode step; the periodic spacing is not
                # changed by it (`_flush_cost` measures decode-time flushes)
                self.flush(wait=False)
        elif event == "step":
            # every flush_seconds, but never more than flush_share of the time (see RecordPolicy)
            wait = max(self.policy.flush_seconds, self._flush_cost / self.policy.flush_share)
            if time.monotonic() - self._last_flush >= wait:
                t0 = time.perf_counter()
                self.flush(wait=False)
                # the writer's encoding runs beside the engine but takes a core from it on a CPU: the last
                # completed one counts (this flush's own is still running)
                self._flush_cost = time.perf_counter() - t0 + self.writer.last_write_cpu_s

    def _on_segment(self, seg: Segment, announce: bool = True) -> None:
        if self.writer is None:
            return
        thumb = self.session.image_thumbnails.get(seg.id) if seg.image is not None else None
        if thumb is not None and seg.id not in self._thumbnails:
            # the file first, then the segment that names it: a follower never sees a missing thumbnail
            self._thumbnails[seg.id] = self.writer.write_image(seg.id, encode_thumbnail(thumb))
        if announce:
            self.writer.add_segment(self._segment_json(seg))
        if seg.kind != "generated" and seg.end > seg.start:
            self._token_rows(range(seg.start, seg.end), self.session.tokens[seg.start:seg.end], seg.id, seg.image)

    def _segment_json(self, seg: Segment) -> dict:
        out = _segment_json(seg)
        if seg.id in self._thumbnails:
            out["thumbnail"] = self._thumbnails[seg.id]
        return out

    def _token_rows(self, positions, ids, segment: "int | np.ndarray", image: dict | None = None) -> None:
        tok = self.session.tokenizer
        ids = list(ids)
        positions = np.asarray(list(positions), np.int32)
        pieces = [tok.piece(i) for i in ids] if tok is not None else [str(i) for i in ids]
        n = len(ids)
        modality = np.full(n, "text", dtype=object)
        image_id, row, col = np.full(n, -1, np.int32), np.full(n, -1, np.int16), np.full(n, -1, np.int16)
        if image is not None:  # one row per merged patch, row-major over (grid_rows, grid_cols)
            cell = positions.astype(np.int64) - int(image["token_start"])
            inside = (cell >= 0) & (cell < int(image["token_end"]) - int(image["token_start"]))
            modality[inside] = "image"
            image_id[inside] = int(np.asarray(segment).flat[0])
            row[inside], col[inside] = np.divmod(cell[inside], int(image["grid_cols"]))
        self.rows_written += self.writer.append(
            "tokens", position=positions, token_id=np.asarray(ids, np.int32),
            piece=np.asarray(pieces, dtype=object), segment=np.broadcast_to(np.asarray(segment, np.int32), n),
            modality=modality, image_id=image_id, patch_row=row, patch_col=col)

    def flush(self, wait: bool = True) -> None:
        """Write what was recorded so far; periodic flushes (wait=False) encode and fsync the Parquet
        parts on the writer's background thread while the engine runs on."""
        if self.writer is None:
            return
        for point in self._points:  # decode steps the engine still holds for this recorder
            point.deliver()
        if self._generated_rows:
            positions, ids, segments = zip(*self._generated_rows)
            self._generated_rows.clear()
            self._token_rows(positions, ids, np.asarray(segments, np.int32))
        self._drain()
        self.writer.flush(wait=wait, hold=self._held(periodic=not wait))
        self.writer.update_session(segments=[self._segment_json(s) for s in self.session.segments],
                                   progress=self._progress, timings=_timings(self.session))
        self._last_flush = time.monotonic()

    def _held(self, periodic: bool) -> frozenset[str]:
        """The tables this flush leaves buffered: those that may wait, on a periodic flush, until
        HOLD_SECONDS have passed or their rows must be seen now."""
        now = time.monotonic()
        if not periodic or self._tables.urgent or now - self._waiting_since >= HOLD_SECONDS:
            self._tables.urgent.clear()
            self._waiting_since = now
            return frozenset()
        return self._may_wait


def _segment_json(seg: Segment) -> dict:
    """A segment of session.json; image segments carry `image` (width/height in pixels, patch_rows/
    patch_cols, grid_rows/grid_cols of the merged token grid, token_start/token_end, sha256, ...)."""
    return {"id": seg.id, "kind": seg.kind, "name": seg.name, "start": seg.start, "end": seg.end,
            "modality": seg.modality, **({"role": seg.role} if seg.role else {}),
            **({"image": dict(seg.image)} if seg.image is not None else {})}


def _timings(session: Session) -> dict:
    r = session.deployment.to_json()
    return {k: r[k] for k in ("ttft_s", "tpot_s", "tokens_per_s", "prefill_tokens_per_s", "prompt_tokens",
                              "output_tokens", "peak_memory_bytes")}


def _session_meta(session: Session, policy: RecordPolicy) -> dict:
    model = session.model
    parallel = getattr(model, "parallel", None)
    return {
        "model": {**session.config.summary(), "checkpoint": session.deployment.model},
        "engine": {"dtype": str(session.dtype).removeprefix("torch."), "device": str(session.device),
                   "prefill_chunk": session.prefill_chunk, "world_size": int(getattr(parallel, "world", 1)),
                   "dsa_force_dense": model.runtime.dsa_force_dense,
                   "mxfp8_activations": model.runtime.mxfp8_activations},
        "policy": policy.to_json(),
        "segments": [_segment_json(s) for s in session.segments],
    }


@contextlib.contextmanager
def record(session: Session, *, trace: str | Path, signals: Collection[str] | None = None,
           policy: "str | RecordPolicy | dict | None" = "default", overwrite: bool = False,
           dsa: bool | None = None, kda: bool | None = None, moe: bool | None = None) -> Iterator[Recorder]:
    """Record the session's probe signals (DSA selections, KDA state norms, expert routes, ...) into a
    trace directory.

    Args:
        session: the running `engine.session.Session`.
        trace: the trace directory (created; an existing trace is replaced only with overwrite=True).
        signals: the signal families to record (`workbench.signals.registered()` names); default: all.
        policy: "default", "all", a `RecordPolicy`, a dict of fields or a JSON file (see `policy.py`).
        dsa / kda / moe: deprecated alias of `signals`: False leaves that family out (kept for one release).

    Yields:
        the `Recorder` (its `writer`, `policy`, `rows_written`).
    """
    pol = load_policy(policy)
    families = signal_families(signals, {"dsa": dsa, "kda": kda, "moe": moe})
    rank = int(getattr(getattr(session.model, "parallel", None), "rank", 0))
    writer = TraceWriter.create(trace, _session_meta(session, pol), overwrite=overwrite) if rank == 0 else None
    rec = Recorder(session, writer, pol, families)
    status = "failed"
    try:
        rec.attach()
        yield rec
        status = "complete"
    except OSError as exc:
        if exc.errno != errno.ENOSPC or writer is None:
            raise
        raise _disk_full(trace, writer, exc) from None
    finally:
        rec.detach()
        if writer is not None:
            try:
                try:
                    rec.flush()
                finally:
                    writer.close(status)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise _disk_full(trace, writer, exc) from None


def signal_families(signals: Collection[str] | None, flags: dict[str, bool | None] | None = None) -> list[str]:
    """The registered families `signals` names (all of them for None), less those a deprecated boolean
    flag turns off; an InputError names what is unknown. An empty choice records the token table only."""
    known = registered()
    if isinstance(signals, str):
        signals = [signals]
    chosen = list(known) if signals is None else list(dict.fromkeys(signals))
    unknown = [name for name in chosen if not isinstance(name, str) or name not in known]
    if unknown:
        raise InputError(f"unknown signal famil{'y' if len(unknown) == 1 else 'ies'} {unknown} to record; "
                         f"families are: {', '.join(known)}")
    if any(on is not None for on in (flags or {}).values()):
        warnings.warn("record(dsa=, kda=, moe=) is deprecated: pass signals=[...] (the families to record)",
                      DeprecationWarning, stacklevel=4)
    off = {name for name, on in (flags or {}).items() if on is not None and not on}
    return [name for name in chosen if name not in off]


def _disk_full(trace: str | Path, writer: TraceWriter, exc: OSError) -> TraceError:
    """Disk full while recording: one line saying what the trace still holds (its flushed parts)."""
    parts = sum(int(n) for n in writer.session.get("parts", {}).values())
    return TraceError(f"cannot write the trace {trace}: {exc.strerror or exc}; kept: the {parts} part(s) flushed "
                      f"before ({writer.session.get('tokens', 0)} tokens), which still open")
