"""The effects table: what switching a memory off did to an answer, each effect beside its control.

One Parquet file in the trace directory, `effects.parquet`, written after the recording (the
interventions' branches are runs of their own, never rows of the recorded session's tables). Rows
come from `workbench.attribution(...)` frames (`rows_from_attribution`) or from single
`workbench.effects(...)` runs beside a control (`effect_row`, as the demo's causal check writes them).
pandas, polars and DuckDB read it with no project code; the schema metadata carries each column's
description as the recorded tables do (`SELECT * FROM parquet_kv_metadata('TRACE/effects.parquet')`):

    SELECT check_name, op, segment, layer, effect, control_mean FROM 'traces/demo/effects.parquet'
    ORDER BY effect

`write_effects` replaces only the rows of the checks it is given (another check's rows are kept) and
writes atomically, so a crash leaves the previous table whole. A new recording into the directory
deletes the file (`workbench.trace.target`), so effects never outlive the session they measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from workbench.trace.errors import TraceError
from workbench.trace.parquet_pages import PageBoundsError, check_pages, read_footer_checked
from workbench.trace.side_files import SideFile

EFFECTS_FILE = "effects.parquet"
# a sweep is S segments x L layers rows plus a few expert rows: far below this; anything larger is not one
MAX_EFFECTS_BYTES = 64 << 20
# what its pages may decompress to, by the footer (`parquet_pages` holds the pages to the footer)
MAX_EFFECTS_DECODED = 256 << 20
SIDE_FILE = SideFile(EFFECTS_FILE, "an effects table", MAX_EFFECTS_BYTES)

# (name, Arrow type, description)
_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("check_name", pa.string(), "which answer the row measures (e.g. 'needle', 'picture', a sweep's label)"),
    ("target", pa.string(), "the answer whose log-probability is measured (the expected value)"),
    ("op", pa.string(), "the intervention (engine.interventions op: dsa.hide, kda.suppress_writes, moe.ban, ...)"),
    ("segment", pa.string(), "the memory switched off: a segment name or span label (null for expert rows)"),
    ("start", pa.int64(), "first position switched off (null when the op names no positions)"),
    ("end", pa.int64(), "position after the last one switched off (end exclusive; null likewise)"),
    ("layer", pa.string(), "the layer id it acts on, or 'all'"),
    ("heads", pa.string(), "KDA heads as a JSON list or 'all' (null for other ops)"),
    ("experts", pa.string(), "banned experts as a JSON list (null for other ops)"),
    ("size", pa.int64(), "how much was switched off: positions (dsa, kda) or experts (moe)"),
    ("effect", pa.float64(), "change of the target's total log-probability with the intervention, nats"),
    ("control_mean", pa.float64(), "the same change with a random switch-off of the same size (mean over the controls), nats"),
    ("control_min", pa.float64(), "the smallest control change, nats"),
    ("control_max", pa.float64(), "the largest control change, nats"),
    ("controls", pa.int64(), "how many random same-size controls were run"),
    ("plain", pa.float64(), "the target's total log-probability with no intervention, nats"),
    ("fork_at", pa.int64(), "the shared prefix's length: the branches forked there (null when not known)"),
)
COLUMNS = tuple(name for name, _, _ in _COLUMNS)


def effects_schema() -> pa.Schema:
    """The table's Arrow schema: field descriptions in field metadata, and repeated in the file's
    key-value metadata (`k3wb.column.<name>`) for readers that only see that (DuckDB)."""
    fields = [pa.field(name, kind, nullable=True, metadata={b"description": doc.encode()}) for name, kind, doc in _COLUMNS]
    notes = {"k3wb.table": "effects", "k3wb.row": "one intervention's effect on a target answer's log-probability, "
             "beside random same-size controls (an effect is only told from noise beside its control)"}
    notes.update({f"k3wb.column.{name}": doc for name, _, doc in _COLUMNS})
    return pa.schema(fields, metadata={k.encode(): v.encode() for k, v in notes.items()})


def _ids_text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    if isinstance(value, str):
        return value
    return json.dumps([int(v) for v in value])


def effect_row(check_name: str, target: str, op: str, *, effect: float, controls: Sequence[float], plain: float,
               segment: str | None = None, span: tuple[int, int] | None = None, layer: str | int = "all",
               heads: Any = None, experts: Any = None, size: int | None = None,
               fork_at: int | None = None) -> dict[str, Any]:
    """One row: an intervention's `effect` (nats) beside its `controls` (nats; none when no control
    fitted: the row then holds null control figures and no verdict is given on it)."""
    c = [float(v) for v in controls]
    nan = float("nan")
    if size is None:
        size = span[1] - span[0] if span is not None else len(experts or [])
    return {"check_name": check_name, "target": target, "op": op, "segment": segment,
            "start": None if span is None else int(span[0]), "end": None if span is None else int(span[1]),
            "layer": str(layer), "heads": _ids_text(heads), "experts": _ids_text(experts), "size": int(size),
            "effect": float(effect), "control_mean": sum(c) / len(c) if c else nan,
            "control_min": min(c, default=nan), "control_max": max(c, default=nan),
            "controls": len(c), "plain": float(plain), "fork_at": fork_at}


def rows_from_attribution(frame: pd.DataFrame, check_name: str, target: str, *, controls: int,
                          spans: Mapping[str, tuple[int, int]] | None = None) -> pd.DataFrame:
    """An attribution frame (`workbench.attribution`) as effects rows; `spans`: each segment label's
    positions, when the rows should carry them."""
    spans = spans or {}
    rows = []
    for r in frame.to_dict("records"):
        span = spans.get(r["segment"]) if r.get("segment") else None
        rows.append({"check_name": check_name, "target": target, "op": r["op"], "segment": r.get("segment"),
                     "start": None if span is None else int(span[0]), "end": None if span is None else int(span[1]),
                     "layer": str(r["layer"]), "heads": _ids_text(r.get("heads")), "experts": _ids_text(r.get("experts")),
                     "size": int(r["size"]), "effect": float(r["effect"]), "control_mean": float(r["control_mean"]),
                     "control_min": float(r["control_min"]), "control_max": float(r["control_max"]),
                     "controls": int(r.get("controls", controls)), "plain": float(r["plain"]), "fork_at": None})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def read_effects(trace: Any) -> pd.DataFrame | None:
    """The effects table of a trace (a `Trace` from `open_trace`, or its directory); None when it has
    none. A file that is too large or not an effects table is a TraceError naming it."""
    path = SIDE_FILE.existing(trace)
    if path is None:
        return None
    try:
        meta = read_footer_checked(path)
        decoded = sum(max(meta.row_group(g).column(c).total_uncompressed_size, 0)
                      for g in range(meta.num_row_groups) for c in range(meta.num_columns))
        if decoded > MAX_EFFECTS_DECODED:
            raise TraceError(f"{path}: its footer claims {decoded:,} decompressed bytes, more than the "
                             f"{MAX_EFFECTS_DECODED:,} an effects table may hold")
        check_pages(path, meta)
        table = pq.read_table(path)
    except (OSError, pa.ArrowException, PageBoundsError) as exc:
        raise TraceError(f"{path}: not a readable Parquet effects table ({' '.join(str(exc).split())})") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise TraceError(f"{path}: not an effects table (missing columns {missing})")
    return table.select(list(COLUMNS)).to_pandas()


def write_effects(trace: Any, rows: pd.DataFrame | Iterable[Mapping[str, Any]]) -> Path:
    """Add `rows` to the trace's effects table, replacing the rows of the same checks (`check_name`)
    and keeping every other check's; written to a temporary file, fsynced, then renamed over the old one."""
    path = SIDE_FILE.target(trace).parent
    new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), columns=list(COLUMNS))
    missing = [c for c in COLUMNS if c not in new.columns]
    if missing:
        raise ValueError(f"effects rows lack columns {missing}")
    new = new[list(COLUMNS)]
    old = read_effects(path)
    if old is not None and len(old):
        kept = old[~old["check_name"].isin(set(new["check_name"]))]
        new = pd.concat([kept, new], ignore_index=True) if len(kept) else new
    table = pa.Table.from_pandas(new.reset_index(drop=True), schema=effects_schema(), preserve_index=False)
    return SIDE_FILE.write_parquet(path, table)
