"""Pending rows: device tensors queued by the signal families, turned into numpy columns at a flush
(`PendingTables`), and which rows a family keeps in full (`keep_items`).

The families (`workbench.signals`) count on the model's device with fixed, data-independent shapes,
and which raw rows are kept is decided from positions on the CPU (`select_rows`), so recording never
forces a device synchronisation inside the forward pass; the recorder copies the pending results
out when it flushes (`to_columns`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from engine.probes import SIGNALS, Marks, Sample
from workbench.trace.schema import TABLES

Pending = dict[str, torch.Tensor]


def select_rows(keep: np.ndarray, **columns: torch.Tensor | None) -> Pending | None:
    """Rows `keep` (CPU indices) of every given [T, ...] tensor; None when nothing is kept."""
    if len(keep) == 0:
        return None
    out: Pending = {}
    for name, t in columns.items():
        if t is not None:
            out[name] = t[torch.as_tensor(keep, device=t.device)]
    return out


def to_columns(pending: Pending, drop_zero: str | None = None) -> dict:
    """Device tensors -> numpy columns (the copy happens here, at flush time); scalars stay scalars.
    With drop_zero, rows whose `drop_zero` column is 0 are dropped (dense counts -> sparse rows)."""
    cols = {name: t.detach().to("cpu").numpy() if isinstance(t, torch.Tensor) else t for name, t in pending.items()}
    if drop_zero is not None:
        nz = cols[drop_zero] != 0
        cols = {name: c[nz] if isinstance(c, np.ndarray) and c.ndim > 0 else c for name, c in cols.items()}
    return cols


def keep_items(items: list, stride: int, marks: Marks, *, decode_all: bool, last: bool = False,
               window: tuple[int, int] | None = None) -> np.ndarray:
    """Row indices (over the concatenated emissions `items`) a family keeps in full.

    Prefill rows: stride-sampled (and windows of `window[1]` tokens every `window[0]`), plus the marked
    positions and segments; decode rows: all of them with `decode_all`, else sampled like prefill rows
    (without windows). With `last`, a prefill emission's last row too (a state at the end of each
    forward call). One rule for the recorder and the capture importer, so an imported trace keeps the
    rows a recording would have kept."""
    keep, offset = [], 0
    for e in items:
        decode, positions = e.phase == "decode", e.data["positions"]
        n = len(positions)
        if decode and decode_all:
            rows = np.arange(n)
        else:
            every_n, tokens = window if (window is not None and not decode) else (0, 0)
            rows = Sample(stride=stride, window_every=every_n, window_tokens=tokens, marks=marks).rows(
                positions.numpy() if isinstance(positions, torch.Tensor) else np.asarray(positions))
        if last and not decode:
            rows = np.union1d(rows, [n - 1])
        keep.append(rows + offset)
        offset += n
    return np.concatenate(keep) if keep else np.zeros(0, np.int64)


class PendingTables:
    """What the families queue for the trace (`pend`, `rows`), written at `drain` with one append per
    table. The recorder and the capture importer share it, so both write a family's tables the one way
    the family's `to_rows` says."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, int | None, int, Pending, str | None]] = []
        # tables a family lets wait (`SignalFamily.may_wait`) whose drained rows said they must not, and
        # what each table's test has already been told (its `known` set)
        self.urgent: set[str] = set()
        self._known: dict[str, set] = defaultdict(set)

    def pend(self, table: str, layer: int | None, rank: int, cols: Pending | None, drop_zero: str | None = None) -> None:
        """Queue device tensors for `table` (with a `step` column or scalar); written at the next drain."""
        if cols is not None:
            self._pending.append((table, layer, rank, cols, drop_zero))

    def rows(self, table: str, layer: int, rank: int, keep: np.ndarray | None, steps: torch.Tensor,
             fields: dict[str, torch.Tensor]) -> None:
        """Queue raw rows of a signal table (all, or rows `keep`): the columns the schema ties to a
        payload field (`Column.field`)."""
        columns = {c.name: fields.get(c.field) for c in TABLES[table].columns if c.field is not None}
        if keep is None:
            self.pend(table, layer, rank, {"step": steps, **{k: v for k, v in columns.items() if v is not None}})
        else:
            self.pend(table, layer, rank, select_rows(keep, step=steps, **columns))

    def drain(self, writer: Any, families: dict[str, Any]) -> int:
        """Copy every pending result to the host (one device synchronisation) and hand each table's rows
        to `writer` in a single append (through the family's `convert`, if any). Returns rows written."""
        pending, self._pending = self._pending, []
        by_table: dict[str, list[dict]] = defaultdict(list)
        for table, layer, rank, cols, drop_zero in pending:
            columns = to_columns(cols, drop_zero)
            n = len(next(c for c in columns.values() if isinstance(c, np.ndarray) and c.ndim > 0))
            if n == 0:
                continue
            if layer is not None:
                columns["layer"], columns["rank"] = np.full(n, layer), np.full(n, rank)
            columns = {k: (np.full(n, v) if np.ndim(v) == 0 else v) for k, v in columns.items()}
            by_table[table].append(columns)
        written = 0
        for table, parts in by_table.items():
            merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            family = families[SIGNALS[TABLES[table].signal].family]
            convert = family.convert.get(table)
            if convert is not None:
                merged = convert(merged)
            must_not_wait = family.may_wait.get(table)
            if must_not_wait is not None and must_not_wait(merged, self._known[table]):
                self.urgent.add(table)
            written += writer.append(table, **merged)
        return written
