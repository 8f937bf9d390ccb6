"""The plan: the interventions active on a session as small per-layer device tables the layers read at
each forward (`engine.interventions` documents what each op does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.config import ModelConfig
from engine.interventions.checks import _layers_of, check_interventions
from engine.interventions.spec import (ALL, DsaHide, DsaPin, Intervention, KdaErase, KdaScale, KdaSuppressWrites,
                                       MoeBan, Selection, parse_interventions, to_json)

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


def in_any_range(positions: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """positions `[N]` int64, ascending -> `[N]` bool: inside some range of `ranges` `[R, 2]` (any order,
    overlaps and empty padding rows allowed).

    Each range's ends are looked up among the positions (binary search: O(R log N)) and marked +1 / -1 in
    a difference array whose running sum counts the ranges covering each position (O(N)). The `[N, R]`
    table `in_ranges` builds grows with R, and an attribution mask hides hundreds of ranges at once
    (figures: `bench_interventions.py --only masks`, docs/benchmarks.md)."""
    n = positions.shape[0]
    lo = torch.searchsorted(positions, ranges[:, 0].contiguous())  # first position >= start
    hi = torch.searchsorted(positions, ranges[:, 1].contiguous())  # first position >= end
    step = torch.ones_like(lo, dtype=torch.int32)
    delta = torch.zeros(n + 1, dtype=torch.int32, device=positions.device)
    delta = delta.index_add(0, lo, step).index_add(0, hi, -step)
    return delta.cumsum(0)[:n] > 0


@dataclass
class DsaRule:
    """One DSA layer's reads: key ranges hidden from / pinned into its selection (`[R, 2]` or None)."""

    hide: torch.Tensor | None
    pin: torch.Tensor | None

    def key_masks(self, q_pos: torch.Tensor, key_pos: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`[Tq, Tk]` bool masks (hidden, pinned) of the keys `key_pos` (ascending, as every caller lays the
        keys out) for the queries `q_pos`. A query keeps its own key; a pinned key must be visible (at or
        before the query)."""
        before = key_pos.view(1, -1) < q_pos.view(-1, 1)
        hidden = pinned = None
        if self.hide is not None:
            hidden = in_any_range(key_pos, self.hide).view(1, -1) & before
        if self.pin is not None:
            pinned = in_any_range(key_pos, self.pin).view(1, -1) & (before | (key_pos.view(1, -1) == q_pos.view(-1, 1)))
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
        items = parse_interventions(items)  # dataclasses built by hand pass the spec's checks too
        check_interventions(items, config)
        device = torch.device(device)
        self.items = items
        n, heads, experts = config.num_hidden_layers, config.kda_num_heads, config.num_experts
        hide: dict[int, list] = {}
        pin: dict[int, list] = {}
        suppress: dict[int, list] = {}
        edits: dict[int, list] = {}
        ban: dict[int, list] = {}
        force: dict[int, list] = {}
        far = config.max_position_embeddings
        self.reach = _reach(self.items, far)
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

    def acts_on(self, start: int, stop: int) -> bool:
        """Whether any rule can change the forward of positions [start, stop) (host ints): the session
        hands the layers no plan at all for a call none reaches, so an intervention that is set but not
        reached (suppressed writes later in the context, an edit already applied) costs a decode step two
        integer compares, not a rule check per layer (4.5% of a demo decode token)."""
        return stop > self.reach[0] and start < self.reach[1]

    def to_json(self) -> list[dict[str, Any]]:
        return [to_json(item) for item in self.items]


def _acting(items: Sequence[Intervention]) -> list[tuple[int, Intervention]]:
    """The entries that change anything, with their indices: a state edit by a factor of 1 is left out (it
    would split a prefill at its position, which is not the same computation), and a
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


def _reach(items: Sequence[Intervention], far: int) -> tuple[int, int]:
    """[first, last) positions whose forward some acting entry can change. A DSA read rule acts on every
    query after its range's start (the keys stay in the cache), so it reaches to the end; a KDA write or
    route rule acts over its range; a state edit at its position."""
    first, last = far, 0
    for _, item in _acting(items):
        if isinstance(item, (KdaErase, KdaScale)):
            lo, hi = item.at, item.at + 1
        else:
            span = getattr(item, "positions", None)
            lo, hi = span if span is not None else (0, far)
            if isinstance(item, (DsaHide, DsaPin)):
                hi = far
        first, last = min(first, lo), max(last, hi)
    return first, last


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
