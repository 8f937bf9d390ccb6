"""The intervention spec: its dataclasses, how a JSON entry is read into one (and written back), and what
one spec may cost (`engine.interventions` documents the ops)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from engine.errors import InputError
from engine.io.files import parse_json

# "all", or the ids named
Selection = Union[str, tuple[int, ...]]
ALL = "all"

OPS = ("dsa.hide", "dsa.pin", "kda.erase", "kda.scale", "kda.suppress_writes", "moe.ban", "moe.force")

# What one spec may cost, whatever its bytes: the number of entries, and the ids all its
# layers / heads / experts lists name together. Each entry adds a row to a table per layer it names, and
# every forward reads every row, so the entry count bounds the work and memory of each forward.
MAX_INTERVENTIONS = 1024
MAX_SPEC_IDS = 1 << 16
# a position must fit the int64 tables (an end past the context limit is clipped to it)
MAX_POSITION = (1 << 63) - 1
# a state scaled past this overflows the layers downstream: the forward would fail as if the weights were bad
MAX_FACTOR = 1e6


@dataclass(frozen=True)
class DsaHide:
    positions: tuple[int, int]
    layers: Selection = ALL
    op: str = field(default="dsa.hide", init=False)


@dataclass(frozen=True)
class DsaPin:
    positions: tuple[int, int]
    layers: Selection = ALL
    op: str = field(default="dsa.pin", init=False)


@dataclass(frozen=True)
class KdaSuppressWrites:
    positions: tuple[int, int]
    layers: Selection = ALL
    heads: Selection = ALL
    op: str = field(default="kda.suppress_writes", init=False)


@dataclass(frozen=True)
class KdaErase:
    at: int
    layers: Selection = ALL
    heads: Selection = ALL
    op: str = field(default="kda.erase", init=False)

    @property
    def factor(self) -> float:
        return 0.0


@dataclass(frozen=True)
class KdaScale:
    at: int
    factor: float
    layers: Selection = ALL
    heads: Selection = ALL
    op: str = field(default="kda.scale", init=False)


@dataclass(frozen=True)
class MoeBan:
    experts: tuple[int, ...]
    layers: Selection = ALL
    positions: tuple[int, int] | None = None  # None: every position
    op: str = field(default="moe.ban", init=False)


@dataclass(frozen=True)
class MoeForce:
    experts: tuple[int, ...]
    layers: Selection = ALL
    positions: tuple[int, int] | None = None
    op: str = field(default="moe.force", init=False)


Intervention = Union[DsaHide, DsaPin, KdaSuppressWrites, KdaErase, KdaScale, MoeBan, MoeForce]
_CLASSES = {c.__dataclass_fields__["op"].default: c
            for c in (DsaHide, DsaPin, KdaSuppressWrites, KdaErase, KdaScale, MoeBan, MoeForce)}
# the keys each op takes, beside "op"
_KEYS = {"dsa.hide": {"positions", "layers"}, "dsa.pin": {"positions", "layers"},
         "kda.suppress_writes": {"positions", "layers", "heads"}, "kda.erase": {"at", "layers", "heads"},
         "kda.scale": {"at", "factor", "layers", "heads"}, "moe.ban": {"experts", "layers", "positions"},
         "moe.force": {"experts", "layers", "positions"}}
_REQUIRED = {"dsa.hide": {"positions"}, "dsa.pin": {"positions"}, "kda.suppress_writes": {"positions"},
             "kda.erase": {"at"}, "kda.scale": {"at", "factor"}, "moe.ban": {"experts"}, "moe.force": {"experts"}}


def to_json(item: Intervention) -> dict[str, Any]:
    """The spec entry of `item` (what `parse_interventions` reads back)."""
    out: dict[str, Any] = {"op": item.op}
    for name in _KEYS[item.op]:
        value = getattr(item, name)
        if value is None:
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shown(value: Any) -> str:
    """`value` for a one-line message: its repr cut short (a spec may hold a list of a million ids)."""
    text = repr(value) if not isinstance(value, (list, tuple)) or len(value) <= 8 else \
        f"{list(value[:8])!r:.120}... ({len(value)} items)"
    return text if len(text) <= 160 else text[:157] + "..."


def _ids(value: Any, what: str, where: str) -> Selection:
    if isinstance(value, str) and value == ALL:
        return ALL
    if (not isinstance(value, (list, tuple)) or not value or len(value) > MAX_SPEC_IDS
            or not all(_is_int(v) and 0 <= v <= MAX_POSITION for v in value)):
        raise InputError(f"{where}: {what} must be \"all\" or a non-empty list of ids >= 0 "
                         f"(at most {MAX_SPEC_IDS}), got {_shown(value)}")
    return tuple(sorted(set(int(v) for v in value)))


def _range(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) for v in value)
            or not 0 <= value[0] < value[1] <= MAX_POSITION):
        raise InputError(f"{where}: positions must be [START, END] with 0 <= START < END < 2**63 (end exclusive), "
                         f"got {_shown(value)}")
    return int(value[0]), int(value[1])


def parse_entry(entry: Any, index: int = 0) -> Intervention:
    """One spec object -> its dataclass; InputError naming the entry and the bad key."""
    where = f"intervention {index}"
    if not isinstance(entry, Mapping):
        raise InputError(f"{where}: must be a JSON object, got {type(entry).__name__}")
    op = entry.get("op")
    if op not in _CLASSES:
        raise InputError(f"{where}: unknown op {op!r}; known: {', '.join(OPS)}")
    where = f"intervention {index} ({op})"
    if "segment" in entry:
        raise InputError(f"{where}: \"segment\" must be resolved to positions first "
                         "(workbench.intervene and `workbench run --intervene` resolve segment names; a bare token "
                         "sequence has none)")
    unknown = set(entry) - _KEYS[op] - {"op"}
    if unknown:
        raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; {op} takes {sorted(_KEYS[op])}")
    missing = _REQUIRED[op] - set(entry)
    if missing:
        raise InputError(f"{where}: missing {sorted(missing)}")
    kwargs: dict[str, Any] = {}
    if "layers" in entry:
        kwargs["layers"] = _ids(entry["layers"], "layers", where)
    if "heads" in entry:
        kwargs["heads"] = _ids(entry["heads"], "heads", where)
    if "positions" in entry:
        kwargs["positions"] = _range(entry["positions"], where)
    if "at" in entry:
        if not _is_int(entry["at"]) or not 0 <= entry["at"] <= MAX_POSITION:
            raise InputError(f"{where}: at must be a token position >= 0, got {_shown(entry['at'])}")
        kwargs["at"] = int(entry["at"])
    if "factor" in entry:
        factor = entry["factor"]
        try:  # an int too large for a float is an OverflowError, not a factor
            finite = (isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
                      and abs(factor) <= MAX_FACTOR)
        except OverflowError:
            finite = False
        if not finite:
            raise InputError(f"{where}: factor must be a finite number in [-{MAX_FACTOR:g}, {MAX_FACTOR:g}], "
                             f"got {_shown(factor)}")
        kwargs["factor"] = float(factor)
    if "experts" in entry:
        experts = _ids(entry["experts"], "experts", where)
        if experts == ALL:
            raise InputError(f"{where}: experts must list expert ids")
        kwargs["experts"] = experts
    return _CLASSES[op](**kwargs)


def parse_interventions(spec: Any) -> tuple[Intervention, ...]:
    """A spec (JSON text, a list of objects, or dataclasses already) -> dataclasses; [] -> ()."""
    if isinstance(spec, (str, bytes)):
        spec = parse_json(spec, "intervention spec", InputError)
    if isinstance(spec, Mapping) or not isinstance(spec, (list, tuple)):
        raise InputError(f"an intervention spec is a JSON list of objects, got {type(spec).__name__}")
    if len(spec) > MAX_INTERVENTIONS:
        raise InputError(f"an intervention spec holds {len(spec)} entries; at most {MAX_INTERVENTIONS} "
                         "(name several layers, heads or experts in one entry instead)")
    # dataclasses built by hand pass the same checks as their spec (a negative expert id would name the last)
    items = tuple(parse_entry(to_json(item) if isinstance(item, tuple(_CLASSES.values())) else item, i)
                  for i, item in enumerate(spec))
    named = sum(len(v) for item in items for v in (getattr(item, k, ALL) for k in ("layers", "heads", "experts"))
                if not isinstance(v, str))
    if named > MAX_SPEC_IDS:
        raise InputError(f"an intervention spec names {named} layer, head and expert ids in all; at most "
                         f"{MAX_SPEC_IDS}")
    return items
