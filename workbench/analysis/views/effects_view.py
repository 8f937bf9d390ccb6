"""Reducer of the effects view: the trace's effects table as an attribution heat map.

Reads `effects.parquet` (`workbench.trace.effects_table`: written by `workbench demo`, notebook 09's
sweeps and the dashboard's "what if" panel) and lays it out as one grid per check: rows are the
memories switched off (op and segment, or op and experts), columns the layer each acted on ("all"
last). Each cell keeps the effect beside its same-size controls and its verdict
(`workbench.analysis.causal.verdict_of_summary`: the answer depends on it only when the effect is a
drop below every control, with enough controls); any other effect is one chance alone could give, or
one too few controls can judge (house rule), and the view marks it.
Re-read only when the file changed (its size and modification time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workbench.analysis.causal import ACTION_WORDS, DEPENDS, verdict_of_summary
from workbench.analysis.views.base import Reducer, ViewOptions
from workbench.analysis.views.side_file_data import side_file_data
from workbench.trace.effects_table import EFFECTS_FILE, read_effects

# a check's grid is drawn as an HTML table: more rows than this are a sweep far past what a reader scans
MAX_ROWS_PER_CHECK = 200
NO_TABLE = ("no effects table in this trace yet: `workbench demo` writes one, and so do `workbench.attribution` "
            "sweeps and the \"what if\" panel of drive mode")


@dataclass(frozen=True)
class EffectCell:
    """One intervention's effect (nats) beside its controls; `within_control`: the verdict is not "the
    answer depends on it" (chance alone could give it, or too few controls fitted to tell);
    `verdict`: the label (`workbench.analysis.causal`: depends / not distinguishable / no verdict) and
    `sentence` the verdict in words."""

    effect: float
    control_mean: float
    control_min: float
    control_max: float
    controls: int
    plain: float
    within_control: bool
    verdict: str = ""
    sentence: str = ""


@dataclass(frozen=True)
class EffectsGrid:
    """One check's grid: `cells[row][column]` (None where that row has no such layer)."""

    check: str
    target: str
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    cells: tuple[tuple[EffectCell | None, ...], ...]


@dataclass(frozen=True, eq=False)
class EffectsData:
    grids: tuple[EffectsGrid, ...] = ()  # one per check, in the table's order
    note: str = ""  # why there is nothing to show ("" when there is)


def as_float(value: Any) -> float:
    """A table value as a float (NaN when it is null or not a number)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def row_label(record: dict) -> str:
    """What a row switched off, in words: the op and its segment, heads or experts."""
    op = str(record.get("op") or "?")
    parts = [op]
    if isinstance(record.get("segment"), str) and record["segment"]:
        parts.append(record["segment"])
    if isinstance(record.get("heads"), str) and record["heads"]:
        parts.append(f"heads {record['heads']}")
    if isinstance(record.get("experts"), str) and record["experts"]:
        parts.append(f"experts {record['experts']}")
    return " · ".join(parts)


def _column_key(name: str) -> tuple[int, int, str]:
    return (1, 0, name) if name == "all" else (0, int(name), name) if name.lstrip("-").isdigit() else (0, 1 << 30, name)


def effect_cell(record: dict) -> EffectCell:
    effect = as_float(record.get("effect"))
    low, high = as_float(record.get("control_min")), as_float(record.get("control_max"))
    controls = as_float(record.get("controls"))
    count = int(controls) if math.isfinite(controls) else 0
    what = row_label(record).split(" · ", 1)[-1]
    moe = record.get("op") == "moe.ban"
    where = "" if moe or str(record.get("layer")) in ("all", "None") else f"from layer {record.get('layer')}"
    if moe:
        what += f" of layer {record.get('layer')}"
    found = verdict_of_summary(effect, low, high, count, what, where=where,
                               unit="set of experts" if moe else "span",
                               action=ACTION_WORDS.get(str(record.get("op")), "switching off"))
    return EffectCell(effect, as_float(record.get("control_mean")), low, high, count, as_float(record.get("plain")),
                      found.label != DEPENDS, found.label, found.sentence)


def effects_grids(table: Any) -> tuple[EffectsGrid, ...]:
    """The effects table (pandas, `read_effects`) as one grid per check."""
    grids = []
    for check in dict.fromkeys(table["check_name"].astype(str)):
        records = table[table["check_name"].astype(str) == check].to_dict("records")
        rows = list(dict.fromkeys(row_label(r) for r in records))[:MAX_ROWS_PER_CHECK]
        columns = sorted({str(r.get("layer")) for r in records}, key=_column_key)
        cells: dict[tuple[str, str], EffectCell] = {}
        for r in records:
            cells[(row_label(r), str(r.get("layer")))] = effect_cell(r)
        targets = {str(r.get("target")) for r in records if r.get("target") is not None}
        grids.append(EffectsGrid(check, " / ".join(sorted(targets)), tuple(rows), tuple(columns),
                                 tuple(tuple(cells.get((row, col)) for col in columns) for row in rows)))
    return tuple(grids)


class EffectsReducer(Reducer[EffectsData]):
    """trace -> `EffectsData` (its effects table, re-read when the file changed)."""

    data_type = EffectsData

    def reduce(self, trace: Any, options: ViewOptions, session: Any) -> EffectsData:
        grids, note = side_file_data(self, "effects", trace.path / EFFECTS_FILE, lambda: self._read(trace),
                                     lambda why: ((), why), NO_TABLE)
        return self.result(grids=grids, note=note)

    @staticmethod
    def _read(trace: Any) -> tuple[tuple[EffectsGrid, ...], str]:
        table = read_effects(trace.path)
        if table is None or not len(table):
            return (), "the effects table is empty"
        return effects_grids(table), ""
