"""Replay a finished trace into a new directory as if a session were recording it now.

`TraceReplay(source, target, seconds=60).start()` copies the source's rows step by step with
`TraceWriter`, flushing every `interval` seconds and keeping session.json's segments, status and
"progress" entry ({"phase", "done", "total", "tokens_per_s", "eta_s"}) up to date, exactly what the
recorder writes. The dashboard cannot tell it from a live session, which makes it the producer for
browser tests, the memory benchmark and demos without a model (e.g. of a 1M-token synthetic trace).

Only the public trace API is used: `open_trace(...).table(name, steps=...)` and `TraceWriter.append`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from workbench.trace import TABLES, TraceWriter, open_trace

_MANAGED = ("schema", "schema_version", "created", "updated", "status", "tokens", "parts", "segments", "progress")


def _step_ends(trace, steps_max: int) -> np.ndarray:
    """Last position covered by each step (cumulative max over the position-tagged tables)."""
    ends = np.full(steps_max + 1, -1, np.int64)
    for name in ("dsa_sink", "kda_norms", "dsa_topk", "moe_routes"):
        table = trace.table(name, columns=["step", "position"])
        if table.num_rows:
            np.maximum.at(ends, table["step"].to_numpy().astype(np.int64), table["position"].to_numpy())
    return np.maximum.accumulate(ends)


def _fill_nulls(table: pa.Table) -> pa.Table:
    """Rows as the writer takes them: nullable ints as -1 (its per-row null), all-null columns left out."""
    for name in table.column_names:
        column = table[name]
        if not column.null_count:
            continue
        if column.null_count == len(column):
            table = table.drop_columns([name])
        elif pa.types.is_integer(column.type):
            table = table.set_column(table.column_names.index(name), name, pc.fill_null(column, -1))
    return table


class TraceReplay:
    """A background thread that re-records `source` into `target` over about `seconds` seconds.

    Args:
        source (str | Path): a finished trace.
        target (str | Path): the trace directory to write (replaced if it holds a trace).
        seconds (float): wall time of the prefill (the prompt advances at a constant token rate, so a
            long prompt shows a long progress bar).
        decode_rate (float, Optional): generated tokens per second after the prefill (default: the
            prefill's rate).
        interval (float): seconds between flushes (the recorder flushes at least once a second).
    """

    def __init__(self, source: str | Path, target: str | Path, *, seconds: float = 30.0,
                 decode_rate: float | None = None, interval: float = 0.5) -> None:
        self.source = open_trace(source)
        self.target = Path(target)
        self.seconds = seconds
        self.decode_rate = decode_rate
        self.interval = interval
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        segs = self.source.session.get("segments", [])
        self.total = max([int(self.source.session.get("tokens", 0))] + [int(g["end"]) for g in segs])
        gen = [g for g in segs if g["kind"] == "generated"]
        self.prompt = int(gen[0]["start"]) if gen else self.total
        steps_max = 0
        for name in ("dsa_sink", "kda_norms", "moe_rank_load"):
            t = self.source.table(name, columns=["step"])
            if t.num_rows:
                steps_max = max(steps_max, int(pc.max(t["step"]).as_py()))
        self.ends = _step_ends(self.source, steps_max)
        base = {k: v for k, v in self.source.session.items() if k not in _MANAGED}
        base["segments"] = []
        base["progress"] = {"phase": "prefill", "done": 0, "total": self.prompt, "tokens_per_s": 0.0, "eta_s": None}
        self.writer = TraceWriter.create(self.target, base, overwrite=True, fsync=False)
        self._tokens = self.source.table("tokens")

    def start(self) -> "TraceReplay":
        self._thread = threading.Thread(target=self._run, name="trace-replay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._replay()
        except BaseException as exc:  # recorded for the caller; the trace is closed as failed
            self.error = exc
            if not self.writer.closed:
                self.writer.close("failed")

    def _replay(self) -> None:
        rate = max(self.prompt, 1) / max(self.seconds, 1e-3)
        decode_rate = self.decode_rate or rate
        started = time.monotonic()
        step, position = -1, 0
        while position < self.total and not self._halt.is_set():
            time.sleep(self.interval)
            elapsed = time.monotonic() - started
            if elapsed < self.seconds:
                target = int(elapsed * rate) + 1
            else:
                target = self.prompt + int((elapsed - self.seconds) * decode_rate) + 1
            target = min(self.total, target)
            # the last step whose rows end before the target position
            new_step = int(np.searchsorted(self.ends, target - 1, side="right")) - 1
            if new_step <= step and target < self.total:
                continue
            if target >= self.total:
                new_step = len(self.ends) - 1
            reached = self.total if target >= self.total else int(self.ends[new_step]) + 1
            self._copy_steps(step + 1, new_step, position, reached)
            step, position = new_step, reached
            self._update_session(position, rate if position < self.prompt else decode_rate)
            self.writer.flush()
        self.writer.close("complete" if position >= self.total else "failed")

    def _copy_steps(self, first: int, last: int, start: int, end: int) -> None:
        mask = pc.and_(pc.greater_equal(self._tokens["position"], start), pc.less(self._tokens["position"], end))
        self.writer.append("tokens", _fill_nulls(self._tokens.filter(mask)))
        if last < first:
            return
        for name in TABLES:
            if name == "tokens":
                continue
            rows = self.source.table(name, steps=(first, last))
            if rows.num_rows:
                self.writer.append(name, _fill_nulls(rows))

    def _update_session(self, position: int, tokens_per_s: float) -> None:
        segments = []
        for seg in self.source.session.get("segments", []):
            if int(seg["start"]) < position or (seg["kind"] == "generated" and int(seg["start"]) <= position):
                segments.append({**seg, "end": min(int(seg["end"]), position)})
        if position < self.prompt:
            progress = {"phase": "prefill", "done": position, "total": self.prompt,
                        "tokens_per_s": round(tokens_per_s, 1),
                        "eta_s": round((self.prompt - position) / tokens_per_s, 1) if tokens_per_s > 0 else None}
        elif position < self.total:
            progress = {"phase": "decode", "done": position - self.prompt, "total": self.total - self.prompt,
                        "tokens_per_s": round(tokens_per_s, 1), "eta_s": None}
        else:
            progress = {"phase": "idle", "done": self.total - self.prompt, "total": self.total - self.prompt,
                        "tokens_per_s": round(tokens_per_s, 1), "eta_s": 0.0}
        self.writer.update_session(segments=segments, progress=progress)
