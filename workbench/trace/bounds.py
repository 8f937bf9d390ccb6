"""What a session could have produced: bounds that every size read from a trace is checked against.

A trace is input a user may receive from someone else, and the reader sizes dense arrays by values
it reads (the DSA heat map by the largest `key_bin`, the expert matrix by the largest `expert`). A
1.7 KB part claiming `key_bin = 400000000` must not make the reader allocate gigabytes, so:

- `check_session` validates the fields of session.json the reader computes with (types and ranges)
  and raises `TraceCorruptError` naming the file and field;
- `SessionBounds.of(session)` derives the largest position, layer, expert and key bin the recorded
  session could have produced (from its model summary and policy; type limits where a trace omits
  them), and `out_of_bounds` checks a part's columns against them: such a part is skipped with a
  problem naming it (or refused when the reader is strict), before anything is sized by it;
- `MAX_DENSE_CELLS` caps the running sums of one table whatever the bounds allow;
- `MAX_SESSION_BYTES` caps session.json; the writer holds what it writes to the same checks
  (`check_session_size`, `check_session`), so it never writes a session.json a reader refuses.

A live trace's `tokens` lags its newest parts by one flush, so positions are bounded by the model's
`max_position_embeddings`, not by the token count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from engine.session.segments import MAX_SEGMENTS
from workbench.trace.errors import TraceCorruptError

MAX_POSITIONS = 2 ** 31 - 1  # positions are int32 in every table
MAX_LAYERS = 32767  # layer is int16
MAX_EXPERTS = 32767  # expert is int16
MAX_DENSE_CELLS = 1 << 26  # int64 cells (512 MiB) the running sums of one table may hold at most
# session.json: a few KB, plus 100-350 bytes per segment (MAX_SEGMENTS of them); the reader reads it
# through this limit and the writer refuses to write more (`check_session_size`)
MAX_SESSION_BYTES = 16 << 20


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TraceCorruptError(f"{where}: expected an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def check_session_size(size: int, file: Path, limit: int = MAX_SESSION_BYTES) -> None:
    """Refuse a session.json of `size` bytes over `limit` (`TraceCorruptError` naming the file)."""
    if size > limit:
        raise TraceCorruptError(f"{file}: larger than the {limit:,} bytes allowed ({size:,} bytes)")


def check_session(session: dict, file: Path) -> None:
    """Validate the size and structure fields of a session.json dict (raises `TraceCorruptError`)."""
    if "tokens" in session:
        _int(session["tokens"], f"{file}: field `tokens`", 0, MAX_POSITIONS)
    parts = session.get("parts", {})
    if not isinstance(parts, dict):
        raise TraceCorruptError(f"{file}: field `parts` must be an object {{table: part count}}, "
                                f"got {type(parts).__name__}")
    for name, count in parts.items():
        # the key is the file's own text: one that is not a plain name is shown as repr (a newline or a
        # control character in it must not split the error)
        shown = f"parts.{name}" if name.isidentifier() else f"parts[{name!r:.60}]"
        _int(count, f"{file}: field `{shown}`", 0, 10 ** 9)
    policy = session.get("policy", {})
    if not isinstance(policy, dict):
        raise TraceCorruptError(f"{file}: field `policy` must be an object, got {type(policy).__name__}")
    if "dsa_bin_tokens" in policy:
        _int(policy["dsa_bin_tokens"], f"{file}: field `policy.dsa_bin_tokens`", 1, MAX_POSITIONS)
    if "sink_tokens" in policy:
        _int(policy["sink_tokens"], f"{file}: field `policy.sink_tokens`", 0, MAX_POSITIONS)
    model = session.get("model", {})
    if not isinstance(model, dict):
        raise TraceCorruptError(f"{file}: field `model` must be an object, got {type(model).__name__}")
    summary = model.get("summary", {})
    if not isinstance(summary, dict):
        raise TraceCorruptError(f"{file}: field `model.summary` must be an object, got {type(summary).__name__}")
    for prefix, facts in (("model", model), ("model.summary", summary)):
        for key, hi in (("layers", MAX_LAYERS), ("num_experts", MAX_EXPERTS),
                        ("max_position_embeddings", MAX_POSITIONS)):
            if facts.get(key) is not None:
                _int(facts[key], f"{file}: field `{prefix}.{key}`", 0, hi)
    segments = session.get("segments", [])
    if not isinstance(segments, list):
        raise TraceCorruptError(f"{file}: field `segments` must be a list, got {type(segments).__name__}")
    if len(segments) > MAX_SEGMENTS:
        raise TraceCorruptError(f"{file}: field `segments` holds {len(segments):,} segments, more than the "
                                f"{MAX_SEGMENTS:,} a session may have")
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise TraceCorruptError(f"{file}: segments[{i}] must be an object, got {type(seg).__name__}")
        missing = [k for k in ("id", "kind", "start", "end") if k not in seg]
        if missing:
            raise TraceCorruptError(f"{file}: segments[{i}] lacks {', '.join(missing)}")
        start = _int(seg["start"], f"{file}: segments[{i}].start", 0, MAX_POSITIONS)
        _int(seg["end"], f"{file}: segments[{i}].end", start, MAX_POSITIONS)
        _int(seg["id"], f"{file}: segments[{i}].id", 0, MAX_POSITIONS)


@dataclass(frozen=True)
class SessionBounds:
    """Exclusive upper bounds of the integer columns a session could have written."""

    positions: int = MAX_POSITIONS
    layers: int = MAX_LAYERS
    experts: int = MAX_EXPERTS
    key_bins: int = MAX_POSITIONS

    @classmethod
    def of(cls, session: dict) -> "SessionBounds":
        """Bounds of a session.json dict already passed through `check_session`."""
        # recorded sessions spread ModelConfig.summary() into `model`; synthetic ones nest it in `summary`
        model = {**session.get("model", {}).get("summary", {}), **session.get("model", {})}
        positions = min(int(model.get("max_position_embeddings") or MAX_POSITIONS), MAX_POSITIONS)
        positions = max(positions, int(session.get("tokens", 0)))
        width = int(session.get("policy", {}).get("dsa_bin_tokens", 256))
        return cls(positions=positions, layers=int(model.get("layers") or MAX_LAYERS),
                   experts=int(model.get("num_experts") or MAX_EXPERTS), key_bins=math.ceil(positions / width))

    def limits(self) -> dict[str, int]:
        """Column name -> exclusive upper bound (every bounded column is also >= 0)."""
        return {"position": self.positions, "layer": self.layers, "expert": self.experts,
                "key_bin": self.key_bins, "segment": self.positions, "image_id": self.positions}


def out_of_bounds(ranges: dict[str, tuple[int, int]], bounds: SessionBounds) -> str | None:
    """The first column whose (min, max) leaves its bound, described in one phrase; None when all fit."""
    for name, limit in bounds.limits().items():
        if name in ranges:
            lo, hi = ranges[name]
            if lo < 0 or hi >= limit:
                return f"column {name} spans {lo}..{hi}, outside 0..{limit - 1} that the session could produce"
    return None


def table_ranges(table: pa.Table, names: tuple[str, ...] | list[str] | None = None) -> dict[str, tuple[int, int]]:
    """(min, max) of the bounded integer columns present in `table` (non-empty columns only)."""
    out = {}
    for name in names or ("position", "layer", "expert", "key_bin", "segment", "image_id"):
        if name in table.column_names and table.num_rows:
            mm = pc.min_max(table[name])
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if lo is not None:
                out[name] = (int(lo), int(hi))
    return out
