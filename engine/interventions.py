"""Interventions as data: what a layer may not read, what a KDA head may not remember, which experts
a token may not use (issue 30).

One JSON list describes them (the command line's `--intervene SPEC.json`, the Python API, the trace):

    [{"op": "dsa.hide", "positions": [START, END], "layers": "all"},
     {"op": "kda.suppress_writes", "positions": [START, END], "layers": [4], "heads": [0, 3]},
     {"op": "kda.erase", "at": POS, "layers": "all"},
     {"op": "kda.scale", "at": POS, "factor": 0.5, "layers": [1], "heads": "all"},
     {"op": "moe.ban", "experts": [3, 7], "layers": "all", "positions": [START, END]},
     {"op": "moe.force", "experts": [1], "layers": [2]}]

Positions are token positions, end exclusive; `layers` are model layer ids (the kind must fit the op:
a DSA layer for `dsa.*`, a KDA layer for `kda.*`, an MoE layer for `moe.*`); `"all"` names every
layer (head, expert) of that kind. Segment names are resolved to positions by the caller (the
workbench); here a `"segment"` key is an error that says so.

Semantics (what the layers do with it, `InterventionPlan`):
- `dsa.hide`: keys in the range are excluded from the indexer's scores before the top-k (the layer
  reads its next-best keys instead) and masked out of dense attention. A query always keeps its own
  key, so no query is left with nothing to read.
- `dsa.pin`: visible keys in the range are always selected; the rest of the top-k is chosen as usual
  (their reported index score is +inf). Dense reads already read them: a no-op there.
- `kda.suppress_writes`: the delta-rule write strength beta is 0 for those tokens, for the chosen
  heads; the decay still runs (the short conv still sees them).
- `kda.erase` / `kda.scale`: the recurrent state of the chosen heads is multiplied by 0 / `factor`
  right after the token at `at` is consumed. Set on a session that has already consumed `at`, it
  applies once, to the state as it is then (`Session.set_interventions`).
- `moe.ban`: the router cannot pick those experts (their choice score is -inf before the top-k).
- `moe.force`: those experts are always picked (at most top-k of them); the remaining slots are
  chosen as usual; weights are the router's own scores of the chosen experts.

The plan holds small device tensors per layer (ranges padded to a fixed count), so a new
intervention of the same shape is new data for the compiled decode step, not a new graph; with
none set the layers pay one `is None` check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

import torch

from engine.config import ModelConfig
from engine.errors import InputError
from engine.io.files import parse_json

# "all", or the ids named
Selection = Union[str, tuple[int, ...]]
ALL = "all"

OPS = ("dsa.hide", "dsa.pin", "kda.erase", "kda.scale", "kda.suppress_writes", "moe.ban", "moe.force")


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


def _ids(value: Any, what: str, where: str) -> Selection:
    if value == ALL:
        return ALL
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(v) and v >= 0 for v in value):
        raise InputError(f"{where}: {what} must be \"all\" or a non-empty list of ids >= 0, got {value!r:.80}")
    return tuple(sorted(set(int(v) for v in value)))


def _range(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) for v in value)
            or not 0 <= value[0] < value[1]):
        raise InputError(f"{where}: positions must be [START, END] with 0 <= START < END (end exclusive), "
                         f"got {value!r}")
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
        if not _is_int(entry["at"]) or entry["at"] < 0:
            raise InputError(f"{where}: at must be a token position >= 0, got {entry['at']!r}")
        kwargs["at"] = int(entry["at"])
    if "factor" in entry:
        factor = entry["factor"]
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not abs(factor) < float("inf"):
            raise InputError(f"{where}: factor must be a finite number, got {factor!r}")
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
    return tuple(item if isinstance(item, tuple(_CLASSES.values())) else parse_entry(item, i)
                 for i, item in enumerate(spec))


def _layers_of(item: Intervention, config: ModelConfig, kind: str, where: str) -> tuple[int, ...]:
    test = {"dsa": config.is_dsa_layer, "kda": config.is_kda_layer, "moe": config.is_moe_layer}[kind]
    every = tuple(i for i in range(config.num_hidden_layers) if test(i))
    if not every:
        raise InputError(f"{where}: this model has no {kind.upper()} layer")
    if item.layers == ALL:
        return every
    bad = [i for i in item.layers if i not in every]
    if bad:
        raise InputError(f"{where}: layer(s) {bad} are not {kind.upper()} layers of this model; "
                         f"its {kind.upper()} layers are {list(every)}")
    return tuple(item.layers)


def check_interventions(items: Iterable[Intervention], config: ModelConfig) -> None:
    """InputError naming the first entry whose layers, heads, experts or positions the model lacks."""
    limit = config.max_position_embeddings
    for i, item in enumerate(items):
        where = f"intervention {i} ({item.op})"
        kind = item.op.split(".")[0]
        _layers_of(item, config, kind, where)
        heads = getattr(item, "heads", ALL)
        if heads != ALL and max(heads) >= config.kda_num_heads:
            raise InputError(f"{where}: head(s) {[h for h in heads if h >= config.kda_num_heads]} do not exist; "
                             f"KDA layers have {config.kda_num_heads} heads")
        experts = getattr(item, "experts", ())
        if experts and max(experts) >= config.num_experts:
            raise InputError(f"{where}: expert(s) {[e for e in experts if e >= config.num_experts]} do not exist; "
                             f"MoE layers have {config.num_experts} experts")
        if isinstance(item, MoeForce) and len(experts) > config.num_experts_per_token:
            raise InputError(f"{where}: {len(experts)} experts forced, but a token uses "
                             f"{config.num_experts_per_token}")
        span = getattr(item, "positions", None)
        at = getattr(item, "at", None)
        if (span is not None and span[0] >= limit) or (at is not None and at >= limit):
            raise InputError(f"{where}: position beyond the model's context limit {limit}")


def _padded(n: int) -> int:
    """Range tables are padded to a power of two (at least 4): an intervention of a similar size reuses
    the compiled decode step's graph."""
    return max(4, 1 << max(0, n - 1).bit_length())


def _range_table(spans: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[R, 2] int64 (start, end) rows, padded with empty (0, 0) ranges."""
    table = torch.zeros(_padded(len(spans)), 2, dtype=torch.long)
    if spans:
        table[: len(spans)] = torch.tensor(spans, dtype=torch.long)
    return table.to(device)


def _row_table(rows: Sequence[torch.Tensor], width: int, fill: float | bool, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    table = torch.full((_padded(len(rows)), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        table[i] = row
    return table.to(device)


def in_ranges(positions: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """positions `[...]` int64, ranges `[R, 2]` -> `[..., R]` bool: position inside range r."""
    p = positions.unsqueeze(-1)
    return (p >= ranges[:, 0]) & (p < ranges[:, 1])


@dataclass
class DsaRule:
    """One DSA layer's reads: key ranges hidden from / pinned into its selection (`[R, 2]` or None)."""

    hide: torch.Tensor | None
    pin: torch.Tensor | None

    def key_masks(self, q_pos: torch.Tensor, key_pos: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`[Tq, Tk]` bool masks (hidden, pinned) of the keys `key_pos` for the queries `q_pos`. A query
        keeps its own key; a pinned key must be visible (at or before the query)."""
        before = key_pos.view(1, -1) < q_pos.view(-1, 1)
        hidden = pinned = None
        if self.hide is not None:
            hidden = in_ranges(key_pos, self.hide).any(-1).view(1, -1) & before
        if self.pin is not None:
            pinned = in_ranges(key_pos, self.pin).any(-1).view(1, -1) & (before | (key_pos.view(1, -1) == q_pos.view(-1, 1)))
        return hidden, pinned


@dataclass
class KdaRule:
    """One KDA layer's memory: write suppression ranges with their head masks, and state edits at positions."""

    suppress: torch.Tensor | None  # [R, 2]
    suppress_heads: torch.Tensor | None  # [R, H] bool (global heads)
    edit_at: torch.Tensor | None  # [R2] int64 (-1 = unused)
    edit_factor: torch.Tensor | None  # [R2, H] fp32 (1 = head untouched)
    edit_positions: tuple[int, ...] = ()  # the same positions on the host (a prefill splits there)

    def write_keep(self, positions: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor | None:
        """`[T, h]` fp32: 0 where this rank's heads `heads` (a range) may not write at `positions`, else 1."""
        if self.suppress is None:
            return None
        hit = in_ranges(positions, self.suppress)  # [T, R]
        rows = self.suppress_heads[:, heads[0]: heads[1]]  # type: ignore[index]
        blocked = (hit.unsqueeze(-1) & rows).any(1)  # [T, h]
        return (~blocked).float()

    def state_factor(self, position: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor | None:
        """`[h]` fp32: what the state of this rank's heads is multiplied by after the token at `position`
        (a 0-d tensor) is consumed (1 for untouched heads)."""
        if self.edit_at is None:
            return None
        factors = self.edit_factor[:, heads[0]: heads[1]]  # type: ignore[index]
        hit = (self.edit_at == position).unsqueeze(-1)  # [R2, 1]
        return torch.where(hit, factors, torch.ones_like(factors)).prod(0)


@dataclass
class MoeRule:
    """One MoE layer's routes: banned and forced experts over position ranges."""

    ban: torch.Tensor | None  # [R, 2]
    ban_experts: torch.Tensor | None  # [R, E] bool
    force: torch.Tensor | None
    force_experts: torch.Tensor | None

    def masks(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`[N, E]` bool (banned, forced) for tokens at `positions` `[N]`."""
        out = []
        for ranges, experts in ((self.ban, self.ban_experts), (self.force, self.force_experts)):
            if ranges is None:
                out.append(None)
                continue
            hit = in_ranges(positions, ranges)  # [N, R]
            out.append((hit.unsqueeze(-1) & experts).any(1))
        return out[0], out[1]


class InterventionPlan:
    """The interventions active on one session, as per-layer rules the layers read at each forward
    (`model.runtime.interventions`, set by the session around its forward calls).

    Attributes:
        items: the interventions, checked against the config.
        dsa, kda, moe: per layer id, its rule or None (tuples indexed by layer).
        signature: what the compiled decode step's graph depends on (which rules exist and their table
            sizes), never the positions or factors themselves.
    """

    def __init__(self, items: Sequence[Intervention], config: ModelConfig, device: torch.device | str = "cpu") -> None:
        check_interventions(items, config)
        device = torch.device(device)
        self.items = tuple(items)
        n, heads, experts = config.num_hidden_layers, config.kda_num_heads, config.num_experts
        hide: dict[int, list] = {}
        pin: dict[int, list] = {}
        suppress: dict[int, list] = {}
        edits: dict[int, list] = {}
        ban: dict[int, list] = {}
        force: dict[int, list] = {}
        far = config.max_position_embeddings
        for i, item in enumerate(self.items):
            where = f"intervention {i} ({item.op})"
            kind = item.op.split(".")[0]
            for layer in _layers_of(item, config, kind, where):
                if isinstance(item, (DsaHide, DsaPin)):
                    (hide if isinstance(item, DsaHide) else pin).setdefault(layer, []).append(item.positions)
                elif isinstance(item, KdaSuppressWrites):
                    suppress.setdefault(layer, []).append((item.positions, self._mask(item.heads, heads)))
                elif isinstance(item, (KdaErase, KdaScale)):
                    edits.setdefault(layer, []).append((item.at, item.factor, self._mask(item.heads, heads)))
                else:
                    span = item.positions or (0, far)
                    (ban if isinstance(item, MoeBan) else force).setdefault(layer, []).append(
                        (span, self._mask(item.experts, experts)))
        self.dsa: tuple[DsaRule | None, ...] = tuple(
            DsaRule(_range_table(hide[i], device) if i in hide else None,
                    _range_table(pin[i], device) if i in pin else None) if (i in hide or i in pin) else None
            for i in range(n))
        kda: list[KdaRule | None] = []
        for i in range(n):
            if i not in suppress and i not in edits:
                kda.append(None)
                continue
            s, e = suppress.get(i, []), edits.get(i, [])
            factor_rows = [torch.where(mask, torch.tensor(f, dtype=torch.float32), torch.tensor(1.0))
                           for _, f, mask in e]
            at = torch.full((_padded(len(e)),), -1, dtype=torch.long)
            at[: len(e)] = torch.tensor([a for a, _, _ in e], dtype=torch.long) if e else at[:0]
            kda.append(KdaRule(
                suppress=_range_table([span for span, _ in s], device) if s else None,
                suppress_heads=_row_table([m for _, m in s], heads, False, torch.bool, device) if s else None,
                edit_at=at.to(device) if e else None,
                edit_factor=_row_table(factor_rows, heads, 1.0, torch.float32, device) if e else None,
                edit_positions=tuple(sorted({a for a, _, _ in e}))))
        self.kda = tuple(kda)
        self.moe: tuple[MoeRule | None, ...] = tuple(
            MoeRule(_range_table([s for s, _ in ban[i]], device) if i in ban else None,
                    _row_table([m for _, m in ban[i]], experts, False, torch.bool, device) if i in ban else None,
                    _range_table([s for s, _ in force[i]], device) if i in force else None,
                    _row_table([m for _, m in force[i]], experts, False, torch.bool, device) if i in force else None)
            if (i in ban or i in force) else None for i in range(n))
        self.signature = tuple(
            (i, tuple(None if t is None else tuple(t.shape) for t in _tables(rule)))
            for i, rule in enumerate(self.dsa + self.kda + self.moe) if rule is not None)

    @staticmethod
    def _mask(ids: Selection, size: int) -> torch.Tensor:
        mask = torch.zeros(size, dtype=torch.bool)
        if ids == ALL:
            mask[:] = True
        else:
            mask[list(ids)] = True
        return mask

    def __bool__(self) -> bool:
        return bool(self.items)

    def to_json(self) -> list[dict[str, Any]]:
        return [to_json(item) for item in self.items]


def _tables(rule: DsaRule | KdaRule | MoeRule) -> tuple[torch.Tensor | None, ...]:
    return tuple(v for v in vars(rule).values() if v is None or isinstance(v, torch.Tensor))
