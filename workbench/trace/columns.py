"""Turn what a recorder hands the writer (numpy arrays, lists, scalars, Arrow arrays) into table rows.

Accepted per column (n = number of rows, taken from the first non-scalar column):
- scalars (and 0-d arrays) broadcast to n rows: `append("dsa_topk", layer=3, step=7, rank=0, ...)`;
- 1-D arrays / sequences of length n for plain columns; strings for `piece` and `modality`;
- list columns: a 2-D array [n, k], a sequence of n 1-D arrays (ragged), or an Arrow list array;
  in a table with a `ragged_key` (dsa_topk.selected, moe_routes.experts) negative key entries are
  padding and the same slots are dropped from every list column of the row;
- nullable columns: None (all null), or negative integers / NaN meaning null per row.
Integers are range-checked against the column type, so an overflow is an error, never a silent wrap.

Appends are validated at once (`prepare`, so a mistake fails at the call site) but kept as numpy
arrays; `to_table` converts all of a flush's batches to Arrow in one go. That keeps an append at a
few tens of microseconds, which matters when every layer appends on every decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from workbench.trace.errors import TraceError
from workbench.trace.schema import MODALITIES, MODALITY_TYPE, TableSpec

_INT_LIMITS: dict[np.dtype, tuple[int, int]] = {}


def _int_limits(dtype: np.dtype) -> tuple[int, int]:
    limits = _INT_LIMITS.get(dtype)
    if limits is None:
        info = np.iinfo(dtype)
        limits = _INT_LIMITS[dtype] = (int(info.min), int(info.max))
    return limits


@dataclass
class Batch:
    """One validated append: n rows; plain columns as arrays or scalars (broadcast later), nullable
    columns possibly None, list columns as (flat values, lengths [n])."""

    n: int
    cols: dict[str, Any]
    nbytes: int


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, np.generic)) or (isinstance(value, np.ndarray) and value.ndim == 0)


def _scalar(value: Any, kind: str, dtype: np.dtype, where: str) -> np.generic:
    """A broadcast value as a numpy scalar of the column's dtype (the common tag case: layer=3, step=7)."""
    v = value.item() if isinstance(value, (np.generic, np.ndarray)) else value
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise TraceError(f"{where}: expected an integer, got {v!r}")
        lo, hi = _int_limits(dtype)
        if not lo <= v <= hi:
            raise TraceError(f"{where}: value {v} does not fit {dtype.name}")
    elif not isinstance(v, (int, float)) or isinstance(v, bool):
        raise TraceError(f"{where}: expected a number, got {v!r}")
    return dtype.type(v)


def _plain_numpy(value: Any) -> np.ndarray:
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value.to_numpy(zero_copy_only=False)
    return np.asarray(value)


def _numeric(arr: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """`arr` as `dtype`, refusing integer overflow, non-integral values for ints and non-numbers."""
    if arr.dtype == dtype:
        return arr
    if dtype.kind in "iu":
        if arr.size and arr.dtype.kind not in "iub":
            raise TraceError(f"{where}: expected integers, got {arr.dtype}")
        if arr.size and not np.can_cast(arr.dtype, dtype):
            lo, hi = _int_limits(dtype)
            a_lo, a_hi = int(arr.min()), int(arr.max())
            if a_lo < lo or a_hi > hi:
                raise TraceError(f"{where}: values [{a_lo}, {a_hi}] do not fit {dtype.name}")
    elif arr.size and arr.dtype.kind not in "iubf":
        raise TraceError(f"{where}: expected numbers, got {arr.dtype}")
    return arr.astype(dtype)


def _list_parts(value: Any, n: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, lengths [n]) of a list column given as 2-D array, ragged sequence or Arrow list array."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        lengths = pc.list_value_length(value).fill_null(0).to_numpy(zero_copy_only=False)
        return pc.list_flatten(value).to_numpy(zero_copy_only=False), lengths.astype(np.int64)
    if isinstance(value, np.ndarray) and value.ndim == 2:
        return value.reshape(-1), np.full(value.shape[0], value.shape[1], dtype=np.int64)
    rows = [np.asarray(r).reshape(-1) for r in value]
    if len(rows) != n:
        raise TraceError(f"{where}: {len(rows)} lists for {n} rows")
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n)
    flat = np.concatenate(rows) if rows else np.zeros(0)
    return flat, lengths


def _list_columns(spec: TableSpec, data: Mapping[str, Any], n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Validate every list column of an append: padding removal and ascending order of the key."""
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in spec.list_columns:
        if data.get(name) is not None:
            parts[name] = _list_parts(data[name], n, f"{spec.name}.{name}")
    key = spec.ragged_key
    if key is not None and key in parts:
        key_flat, key_len = parts[key]
        for name, (flat, lengths) in parts.items():
            if name != key and not np.array_equal(lengths, key_len):
                raise TraceError(f"{spec.name}.{name}: list lengths differ from {key}'s on the same rows")
        keep = key_flat >= 0
        all_kept = bool(keep.all())
        row = None
        if not all_kept:
            row = np.repeat(np.arange(n), key_len)[keep]
            key_len = np.bincount(row, minlength=n).astype(np.int64)
        order = None
        if spec.ascending:
            kept = key_flat if all_kept else key_flat[keep]
            step = np.diff(kept)
            if (step < 0).any():
                # a drop is fine only where a new row starts
                row = np.repeat(np.arange(n), key_len) if row is None else row
                if ((step < 0) & (row[1:] == row[:-1])).any():
                    order = np.lexsort((kept, row))
        for name, (flat, _) in list(parts.items()):
            flat = flat if all_kept else flat[keep]
            parts[name] = (flat if order is None else flat[order], key_len)
    for name, (flat, lengths) in parts.items():
        parts[name] = (_numeric(np.asarray(flat), spec.meta[name][1], f"{spec.name}.{name}"), lengths)
    return parts


def _check_modalities(values: Any, where: str) -> None:
    bad = [v for v in np.unique(np.asarray(values, dtype=str)) if v not in MODALITIES]
    if bad:
        raise TraceError(f"{where}: modality must be one of {MODALITIES}, got {bad[0]!r}")


def prepare(spec: TableSpec, data: Mapping[str, Any]) -> Batch:
    """Validate one append and keep it as numpy arrays (see the module docstring for accepted shapes)."""
    unknown = data.keys() - spec.meta.keys()
    if unknown:
        raise TraceError(f"table {spec.name} has no column(s) {', '.join(sorted(unknown))}; columns are: "
                         f"{', '.join(spec.names)}")
    lengths = {}
    for name, value in data.items():
        if value is None or _is_scalar(value):
            continue
        lengths[name] = value.shape[0] if isinstance(value, np.ndarray) else len(value)
    n = next(iter(lengths.values()), 1)
    if any(v != n for v in lengths.values()):
        raise TraceError(f"table {spec.name}: columns have different lengths {lengths}")
    cols: dict[str, Any] = _list_columns(spec, data, n)
    nbytes = sum(f.nbytes + l.nbytes for f, l in cols.values())
    for col in spec.columns:
        if col.name in cols:
            continue
        kind, dtype = spec.meta[col.name]
        value = data.get(col.name)
        where = f"{spec.name}.{col.name}"
        if value is None:
            if not col.nullable:
                raise TraceError(f"{where} is required")
            cols[col.name] = None
            continue
        if kind == "string":
            if _is_scalar(value):
                cols[col.name] = str(value)
            else:
                arr = _plain_numpy(value)
                cols[col.name] = arr if arr.dtype.kind == "U" else np.asarray(arr, dtype=str)
                nbytes += cols[col.name].nbytes
            if col.type == MODALITY_TYPE:
                _check_modalities(cols[col.name], where)
            continue
        if col.nullable and isinstance(value, (list, tuple)) and any(v is None for v in value):
            value = [(-1 if kind == "int" else np.nan) if v is None else v for v in value]
        if _is_scalar(value):
            cols[col.name] = _scalar(value, kind, dtype, where)
            continue
        arr = _plain_numpy(value)
        if col.nullable and arr.size and kind == "int" and arr.dtype.kind == "f":
            # pandas turns nullable integer columns into floats with NaN: accept integral values
            missing = np.isnan(arr)
            if not np.array_equal(arr[~missing], np.floor(arr[~missing])):
                raise TraceError(f"{where}: expected integers, got non-integral floats")
            arr = np.where(missing, -1, arr).astype(np.int64)
        if col.nullable and arr.size and arr.dtype.kind in "if":
            # keep the null markers (negative ints, NaN) for to_table; the other values must fit
            valid = arr >= 0 if arr.dtype.kind == "i" else ~np.isnan(arr)
            _numeric(arr[valid], dtype, where)
        else:
            arr = _numeric(arr, dtype, where)
        cols[col.name] = arr
        nbytes += arr.nbytes
    return Batch(n, cols, nbytes)


def _column(spec: TableSpec, name: str, batches: list[Batch]) -> pa.Array:
    col = spec.column(name)
    kind, dtype = spec.meta[name]
    if kind == "list":
        flat = np.concatenate([b.cols[name][0] if b.cols.get(name) is not None else np.zeros(0, dtype)
                               for b in batches])
        lengths = np.concatenate([b.cols[name][1] if b.cols.get(name) is not None else np.zeros(b.n, np.int64)
                                  for b in batches])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] > np.iinfo(np.int32).max:
            raise TraceError(f"{spec.name}.{name}: more than 2**31 list values in one part; flush more often")
        null = np.concatenate([np.full(b.n, b.cols.get(name) is None) for b in batches])
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat.astype(dtype)),
                                        type=col.type, mask=pa.array(null) if null.any() else None)
    if kind == "string":
        strings = np.concatenate([np.full(b.n, v) if isinstance(v, str) else
                                  (np.full(b.n, "") if v is None else v) for b in batches
                                  for v in [b.cols[name]]])
        arr = pa.array(strings, type=pa.string())
        return arr.dictionary_encode().cast(col.type) if col.type == MODALITY_TYPE else arr
    cells = [b.cols[name] for b in batches]
    counts = [b.n for b in batches]
    if all(isinstance(v, np.generic) for v in cells):
        # the usual tag column (layer=3, step=7): one repeat instead of a broadcast per append
        flat = np.repeat(np.array(cells, dtype=dtype), counts)
    else:
        flat = np.concatenate([np.zeros(n, dtype) if v is None else np.broadcast_to(v, (n,)) if v.ndim == 0 else v
                               for v, n in zip(cells, counts)])
    if col.nullable:
        missing = np.repeat(np.array([v is None for v in cells]), counts)
        marked = flat < 0 if flat.dtype.kind == "i" else np.isnan(flat) if flat.dtype.kind == "f" else False
        mask = missing | marked
        if mask.any():
            return pa.array(np.where(mask, 0, flat).astype(dtype), mask=mask)
    return pa.array(flat.astype(dtype, copy=False))


def to_table(spec: TableSpec, batches: list[Batch]) -> pa.Table:
    """All buffered appends of a table as one Arrow table with exactly the spec's schema."""
    return pa.Table.from_arrays([_column(spec, c.name, batches) for c in spec.columns], schema=spec.arrow_schema)


def coalesce(spec: TableSpec, table: pa.Table) -> pa.Table:
    """Merge delta rows with equal keys (sums add up, `step`/`position` take the max), sorted by key."""
    if spec.kind != "delta" or table.num_rows == 0:
        return table
    keys = spec.keys
    aggs = [(c, "sum") for c in spec.sums] + [(c, "max") for c in spec.maxes]
    grouped = table.group_by(keys, use_threads=False).aggregate(aggs)
    arrays = []
    for col in spec.columns:
        name = col.name if col.name in keys else f"{col.name}_{'sum' if col.name in spec.sums else 'max'}"
        arrays.append(grouped[name].cast(col.type))
    merged = pa.Table.from_arrays(arrays, schema=spec.arrow_schema)
    return merged.sort_by([(k, "ascending") for k in keys if not pa.types.is_dictionary(spec.column(k).type)])
