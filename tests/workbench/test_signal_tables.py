"""The trace schema cites the probe declarations (`engine.probes.SIGNALS`) it is recorded from.

- Every signal table names a declared signal; every column tied to a payload field names a field
  of that signal, with a matching kind (integer / float; a list column exactly when the field has
  a dimension beyond batch and rows), nullable when the field is optional and the recorder does
  not always ask for it.
- Every field of every signal is written by some table (nothing is declared and then dropped).
- Tables cannot be declared against a field the signal lacks (checked when the schema loads).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from engine.probes import SIGNALS
from workbench.signals import integrity
from workbench.trace.schema import TABLES, Column, TableSpec

ALWAYS_REQUESTED = {("moe.route", "entropy")}  # the recorder asks for these optional fields in every policy


def test_signal_tables_cite_declared_fields() -> None:
    written = set()
    for spec in TABLES.values():
        cited = [c for c in spec.columns if c.field is not None]
        if spec.signal is None:
            assert not cited, spec.name
            continue
        signal = SIGNALS[spec.signal]
        for column in cited:
            f = signal.field(column.field)
            written.add((signal.name, f.name))
            value = column.type.value_type if pa.types.is_list(column.type) else column.type
            assert pa.types.is_list(column.type) == (len([d for d in f.dims if d not in ("B", "n")]) > 0), column
            assert (pa.types.is_integer(value) if f.dtype.startswith("int") else pa.types.is_floating(value)), column
            if f.optional and (signal.name, f.name) not in ALWAYS_REQUESTED:
                assert column.nullable, f"{spec.name}.{column.name}: optional field {f.name} must be nullable"
    declared = {(s.name, f.name) for s in SIGNALS.values() for f in s.fields}
    # the integrity fields are reduced into the *_health tables' rows, never stored raw
    reduced = {(signal, name) for signal, names in integrity.FIELDS.items() for name in names}
    assert written == declared - reduced, declared - reduced - written


def test_table_citing_an_undeclared_field_is_refused() -> None:
    with pytest.raises(ValueError, match="does not declare"):
        TableSpec("bad", "a table", (Column("x", pa.int32(), "x", field="nope"),), signal="kda.state")
