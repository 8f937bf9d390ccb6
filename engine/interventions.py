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

import math
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

# What one spec may cost, whatever its bytes (issue 42 item 9): the number of entries, and the ids all its
# layers / heads / experts lists name together. Each entry adds a row to a table per layer it names, and
# every forward reads every row, so the entry count bounds the work and memory of each forward.
MAX_INTERVENTIONS = 1024
MAX_SPEC_IDS = 1 << 16
# a position must fit the int64 tables (an end past the context limit is clipped to it)
MAX_POSITION = (1 << 63) - 1


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
            finite = isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
        except OverflowError:
            finite = False
        if not finite:
            raise InputError(f"{where}: factor must be a finite number, got {_shown(factor)}")
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
    _check_routes(items, config)


def _check_routes(items: Sequence[Intervention], config: ModelConfig) -> None:
    """InputError when `moe.ban` / `moe.force` entries together leave a token of some MoE layer fewer experts
    to route to than it uses (a top-k over too few would pick banned experts), or force more than it uses.
    Bans and forces over overlapping positions add up; a forced expert is routable even when banned."""
    routed = [(i, item) for i, item in enumerate(items) if isinstance(item, (MoeBan, MoeForce))]
    if not routed:
        return
    far = config.max_position_embeddings
    every = tuple(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    by_layers: dict[tuple[int, ...], list[int]] = {}  # the entries acting on a layer -> those layers
    for layer in every:
        acting = tuple(n for n, (_, item) in enumerate(routed) if item.layers == ALL or layer in item.layers)
        if acting:
            by_layers.setdefault(acting, []).append(layer)
    for acting, layers in by_layers.items():
        # sweep the positions: at each start / end the counts of bans and forces per expert change
        events: dict[int, list[tuple[int, int]]] = {}
        for n in acting:
            start, end = routed[n][1].positions or (0, far)
            events.setdefault(start, []).append((n, 1))
            events.setdefault(min(end, far), []).append((n, -1))
        banned = [0] * config.num_experts
        forced = [0] * config.num_experts
        blocked = pinned = 0  # experts banned and not forced; experts forced (kept as the counts change)
        active: set[int] = set()
        for position in sorted(events):
            for n, step in events[position]:
                item = routed[n][1]
                counts = banned if isinstance(item, MoeBan) else forced
                for e in item.experts:
                    was_blocked, was_pinned = banned[e] > 0 and forced[e] == 0, forced[e] > 0
                    counts[e] += step
                    blocked += (banned[e] > 0 and forced[e] == 0) - was_blocked
                    pinned += (forced[e] > 0) - was_pinned
                (active.add if step > 0 else active.discard)(n)
            if position >= far or not active:
                continue
            tight = blocked > config.num_experts - config.num_experts_per_token or pinned > config.num_experts_per_token
            grouped = config.num_expert_group > 1 and config.topk_group < config.num_expert_group
            refused = _route_shortfall(banned, forced, config) if tight or grouped else None
            if refused:
                shown = sorted(active)
                names = ", ".join(f"{routed[n][0]} ({routed[n][1].op})" for n in shown[:4]) + \
                    (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
                raise InputError(f"intervention{'s' if len(shown) > 1 else ''} {names}: on MoE layer "
                                 f"{layers[0]}{' (and ' + str(len(layers) - 1) + ' more)' if len(layers) > 1 else ''}"
                                 f" from position {position}, {refused}")


def _route_shortfall(banned: Sequence[int], forced: Sequence[int], config: ModelConfig) -> str | None:
    """Why the router cannot pick `experts_per_token` experts with these per-expert ban / force counts
    (None when it can). With group-limited routing the worst groups the router could keep are counted."""
    k, total = config.num_experts_per_token, config.num_experts
    n_forced = sum(1 for f in forced if f > 0)
    if n_forced > k:
        return f"{n_forced} experts are forced but a token uses {k} (experts_per_token)"
    allowed = [b == 0 or f > 0 for b, f in zip(banned, forced)]
    left = sum(allowed)
    if left < k:
        return (f"{total - left} of its {total} experts are banned, leaving {left} to route to, but a token uses {k} "
                f"(experts_per_token): ban at most {total - k}")
    groups, keep = config.num_expert_group, config.topk_group
    if groups > 1 and keep < groups:
        size = total // groups
        counts = sorted(sum(allowed[g * size:(g + 1) * size]) for g in range(groups))
        live = [c for c in counts if c >= 2]  # a group's score is its best two experts: fewer is -inf
        dead = [c for c in counts if c < 2]
        worst = sum(live[:keep]) + sum(dead[:max(0, keep - len(live))])
        if worst < k:
            return (f"the bans leave {worst} routable experts in the {keep} of {groups} expert groups the router "
                    f"may keep, but a token uses {k} (experts_per_token)")
    return None


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
        return (~_any_hit(hit, rows)).float()

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
            out.append(_any_hit(in_ranges(positions, ranges), experts))
        return out[0], out[1]


def _any_hit(hit: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`[N, R]` bool ranges hit x `[R, W]` bool rows -> `[N, W]`: some hit range's row is set. A product of
    counts, not an `[N, R, W]` broadcast: its memory is that of the inputs and the result (counts of 0 / 1 up
    to R are exact in fp32 on every device)."""
    return (hit.float() @ rows.float()) > 0.5


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
        for i, item in _acting(self.items):
            where = f"intervention {i} ({item.op})"
            kind = item.op.split(".")[0]
            span = getattr(item, "positions", None) or (0, far)
            span = (span[0], min(span[1], far))  # no position reaches past the limit: the tables stay int64
            mask = (self._mask(item.heads, heads) if kind == "kda" else
                    self._mask(item.experts, experts) if kind == "moe" else None)
            for layer in _layers_of(item, config, kind, where):
                if isinstance(item, (DsaHide, DsaPin)):
                    (hide if isinstance(item, DsaHide) else pin).setdefault(layer, []).append(span)
                elif isinstance(item, KdaSuppressWrites):
                    suppress.setdefault(layer, []).append((span, mask))
                elif isinstance(item, (KdaErase, KdaScale)):
                    edits.setdefault(layer, []).append((item.at, item.factor, mask))
                else:
                    (ban if isinstance(item, MoeBan) else force).setdefault(layer, []).append((span, mask))
        hide, pin = ({k: _union(v) for k, v in d.items()} for d in (hide, pin))
        suppress, ban, force = ({k: _merged(v) for k, v in d.items()} for d in (suppress, ban, force))
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


def _acting(items: Sequence[Intervention]) -> list[tuple[int, Intervention]]:
    """The entries that change anything, with their indices: a state edit by a factor of 1 is left out (it
    would split a prefill at its position, which is not the same computation: issue 42 item 11), and a
    repeated read / write / route entry counts once (a repeated edit multiplies again, so it stays)."""
    seen: set[Intervention] = set()
    out = []
    for i, item in enumerate(items):
        if isinstance(item, KdaScale) and item.factor == 1.0:
            continue
        if not isinstance(item, (KdaErase, KdaScale)):
            if item in seen:
                continue
            seen.add(item)
        out.append((i, item))
    return out


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Key ranges as their sorted, disjoint union (hiding a key twice hides it once)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _merged(rows: list[tuple[tuple[int, int], torch.Tensor]]) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """(range, mask) rows with one row per range: the masks of one range are or-ed."""
    by_span: dict[tuple[int, int], torch.Tensor] = {}
    for span, mask in rows:
        by_span[span] = by_span[span] | mask if span in by_span else mask
    return list(by_span.items())


def _tables(rule: DsaRule | KdaRule | MoeRule) -> tuple[torch.Tensor | None, ...]:
    return tuple(v for v in vars(rule).values() if v is None or isinstance(v, torch.Tensor))
