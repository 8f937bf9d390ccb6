"""What a signal family is to the workbench, and the registry the recorder, writer and reader read.

A `SignalFamily` holds everything one family of probe signals means end to end: the trace tables
its rows go to (`TableSpec`s, each citing its probe signal), what the recorder asks each probe point
for (`request`), how one probe point's emissions become rows (`to_rows`, run on the model's device),
the delta tables the reader keeps running sums of, and host-side conversions applied at a flush.
The recorder, the writer and the reader only loop over `registered()`: a new family is one module
that calls `register(...)` plus its probe declaration in `engine.probes`.

This module imports no torch: reading a trace loads the families' tables without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from engine.errors import InputError
from engine.probes import SIGNALS, Emission, Marks, ProbeRequest
from workbench.trace.schema import TABLES, TableSpec

if TYPE_CHECKING:
    import numpy as np
    import torch


class RecordingContext(Protocol):
    """What a family's `to_rows` may use of the recorder that calls it (`workbench.recorders.Recorder`)."""

    policy: Any  # the RecordPolicy
    config: Any  # the model's ModelConfig
    ep_world: int
    n_segments: int

    def pend(self, table: str, layer: int | None, rank: int, cols: dict | None,
             drop_zero: str | None = None) -> None: ...

    def rows(self, table: str, layer: int, rank: int, keep: "np.ndarray | None", steps: "torch.Tensor",
             fields: dict[str, "torch.Tensor"]) -> None: ...

    def keep_items(self, items: list[Emission], stride: int, *, decode_all: bool, last: bool = False,
                   window: tuple[int, int] | None = None) -> "np.ndarray": ...

    def position_maps(self, n: int, device: "torch.device") -> tuple["torch.Tensor", "torch.Tensor"]: ...


# (ctx, signal name, layer, rank, emissions, per-row steps, fields with the batch row dropped) -> None
RowsFn = Callable[[RecordingContext, str, int, int, list[Emission], "torch.Tensor", dict[str, "torch.Tensor"]], None]
# (signal name, policy, marks) -> ProbeRequest
RequestFn = Callable[[str, Any, Marks], ProbeRequest]


def plain_request(name: str, policy: Any, marks: Marks) -> ProbeRequest:
    """Every optional field of the signal, every position: for a family without policy fields."""
    return ProbeRequest(optional=SIGNALS[name].optional)


def raw_rows(ctx: RecordingContext, name: str, layer: int, rank: int, items: list[Emission],
             steps: "torch.Tensor", fields: dict[str, "torch.Tensor"]) -> None:
    """Every emitted row into each table recorded from signal `name` (columns tied by `Column.field`)."""
    for spec in TABLES.values():
        if spec.signal == name:
            ctx.rows(spec.name, layer, rank, None, steps, fields)


@dataclass(frozen=True)
class RunningSums:
    """A delta table the reader folds into dense sums: `groups` columns, a dense `index`, a `value`."""

    groups: tuple[str, ...]
    index: str
    value: str


@dataclass(frozen=True)
class SignalFamily:
    """One family of probe signals (`dsa`, `kda`, `moe`, ...) as the workbench records and reads it.

    Attributes:
        name: the family, the first part of its signals' names (`moe` of `moe.route`).
        tables: its trace tables, each with `signal=` naming the probe it is recorded from.
        request: what a probe point of the family is asked for under a policy and the current marks.
        to_rows: turns one probe point's emissions into pending rows (`RecordingContext.pend/rows`).
        follow_marks: signals whose request changes with the marked spans (re-requested on change).
        running_sums: delta tables the reader keeps dense running sums of, by table name.
        convert: host-side conversions of a table's merged columns at a flush (ids to names).
        may_wait: tables whose rows may wait for a later periodic flush (small tables read rarely: a part
            costs a file and an fsync), by name, with a test `(merged columns, known) -> bool` of a flush's
            rows that says they must not wait (news a reader should see now, such as a first fault);
            `known` is a set the test keeps across one recording's flushes. The recorder writes them at
            least every `workbench.recorders.recorder.HOLD_SECONDS` and always at the end.
        policy_fields: the `RecordPolicy` fields the family reads (documentation and checks).
        readers: what the family adds to a `Trace` by name: `trace.NAME(...)` calls `readers[NAME](trace, ...)`
            (`trace.dsa_heatmap(bins=512)`), so the trace store itself names no family.
    """

    name: str
    tables: tuple[TableSpec, ...]
    request: RequestFn = plain_request
    to_rows: RowsFn = raw_rows
    follow_marks: frozenset[str] = frozenset()
    running_sums: dict[str, RunningSums] = field(default_factory=dict)
    convert: dict[str, Callable[[dict], dict]] = field(default_factory=dict)
    may_wait: dict[str, Callable[[dict, set], bool]] = field(default_factory=dict)
    policy_fields: tuple[str, ...] = ()
    readers: dict[str, Callable[..., Any]] = field(default_factory=dict)

    @property
    def signals(self) -> tuple[str, ...]:
        """The probe signals of the family, as `engine.probes.SIGNALS` declares them."""
        return tuple(name for name, s in SIGNALS.items() if s.family == self.name)


_REGISTRY: dict[str, SignalFamily] = {}


def register(family: SignalFamily) -> SignalFamily:
    """Make a family known to the recorder, the writer and the reader; its tables join `TABLES`.

    Registering the same family again replaces it (a module reloaded in a notebook).
    """
    if not family.signals:
        raise ValueError(f"signal family {family.name!r} has no probe declared in engine.probes.SIGNALS")
    for spec in family.tables:
        if spec.signal not in family.signals:
            raise ValueError(f"table {spec.name}: signal {spec.signal!r} is not one of family {family.name!r}")
        owner = next((f.name for f in _REGISTRY.values() if f.name != family.name
                      and any(t.name == spec.name for t in f.tables)), None)
        if owner is not None or spec.name == "tokens":
            raise ValueError(f"table {spec.name} already belongs to {owner or 'the token table'}")
    old = _REGISTRY.pop(family.name, None)
    for spec in old.tables if old is not None else ():
        TABLES.pop(spec.name, None)
    _REGISTRY[family.name] = family
    for spec in family.tables:
        TABLES[spec.name] = spec
    return family


def unregister(name: str) -> None:
    """Forget a family registered earlier (its tables leave `TABLES`); for tests of a toy family."""
    old = _REGISTRY.pop(name, None)
    for spec in old.tables if old is not None else ():
        TABLES.pop(spec.name, None)


def registered() -> dict[str, SignalFamily]:
    """The registered families by name, in registration order: the one meaning of "the families"
    (every front door records these unless told otherwise; none keeps a list of its own)."""
    return dict(_REGISTRY)


def families_from_spec(spec: str) -> tuple[str, ...] | None:
    """A command line's family choice: `all` -> None (every registered family, as `record` reads None);
    `dsa,moe` -> those names, each checked against the registry (an InputError lists the known ones)."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    if names == ("all",):
        return None
    known = registered()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise InputError(f"signal families to record: a comma list of {', '.join(known)} (or all); got {spec!r:.80}")
    return names
