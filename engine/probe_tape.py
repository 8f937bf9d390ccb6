"""The compiled decode step's probe payloads, kept per step and handed on in bulk.

Inside the decode step listening points collect their tensors (`ProbePoint.collecting`) and the
traced function returns all of them as one flat tuple with a layout, a constant of the compiled
graph naming whose fields each slice holds (`collected_payloads`). After the step the host keeps
that tuple whole, with the step's start position and tags: one list append per step whatever the
number of listening points (a per-point hand-on cost ~1.5 us per point per step, ~4% of a demo
decode step). Every `BACKLOG_STEPS` steps, before any other forward, when a generation ends, when a
listener detaches and at a recorder's flush, `ProbeTape.deliver` cuts the steps into one emission per
point, its rows tagged with their steps (`Emission.steps`), so each sink sees its point's emissions
in step order and none is lost.
"""

from __future__ import annotations

from itertools import groupby
from typing import Callable, NamedTuple, Sequence

import torch

from engine.probes import Emission, ProbePoint

BACKLOG_STEPS = 64  # decode steps the tape holds before handing them on as one emission per point

# (index of the point in the step's points, field names) for each collected payload, in the order
# of the flat tuple: a payload's tensors are consecutive
Layout = tuple[tuple[int, tuple[str, ...]], ...]
# a module's host-side completion of a collected payload: (point, fields, start, layer cache) -> None
Finish = Callable[[ProbePoint, dict[str, torch.Tensor], int, object], None]


def collected_payloads(points: Sequence[ProbePoint]) -> tuple[tuple[torch.Tensor, ...], Layout]:
    """Empty every point's `collected` into one flat tuple and its layout (runs inside the traced step,
    where the layout is a constant of the graph: the same object at every replay)."""
    flat: list[torch.Tensor] = []
    layout: list[tuple[int, tuple[str, ...]]] = []
    for i, point in enumerate(points):
        if not point.collected:
            continue
        for data in point.collected:
            layout.append((i, tuple(data)))
            flat.extend(data.values())
        point.collected.clear()
    return tuple(flat), tuple(layout)


class _Step(NamedTuple):
    start: int  # position of the step's token (one token per row)
    step: int
    phase: str
    rank: int
    flat: tuple[torch.Tensor, ...]
    layout: Layout
    points: tuple[ProbePoint, ...]  # the points the layout indexes (the step's listeners)


class ProbeTape:
    """Decode steps not yet delivered, for the probe points of one model.

    Args:
        points: every probe point of the model (each gets `point.tape`, so any of them can deliver).
        finishers: a point whose payload a module completes on the host at its own step (before the
            next step: it reads the context and the cache as they are then), e.g. MLA's dense mass.
    """

    def __init__(self, points: Sequence[ProbePoint], finishers: dict[ProbePoint, Finish] | None = None) -> None:
        self.points = tuple(points)
        self.finishers = dict(finishers or {})
        self.steps: list[_Step] = []
        # the finishers' slices of the last layout seen (a compiled step returns the same layout object
        # at every replay, so this is an identity check per step)
        self._layout: Layout | None = None
        self._layout_points: tuple[ProbePoint, ...] = ()
        self._finishing: list[tuple[int, ProbePoint, Finish, tuple[str, ...]]] = []
        for point in self.points:
            point.tape = self

    def __len__(self) -> int:
        return len(self.steps)

    def record(self, start: int, flat: tuple[torch.Tensor, ...], layout: Layout, points: tuple[ProbePoint, ...],
               layers: Sequence[object]) -> None:
        """Keep one step's payloads (`layout` indexes `points`); complete the finishers' payloads now;
        deliver when full."""
        if not layout:
            return
        for offset, point, finish, names in self._finishing_entries(layout, points):
            finish(point, dict(zip(names, flat[offset:offset + len(names)])), start, layers[point.layer])
        ctx = points[layout[0][0]].context
        self.steps.append(_Step(start, ctx.step, ctx.phase, ctx.rank, flat, layout, points))
        if len(self.steps) >= BACKLOG_STEPS:
            self.deliver()

    def _finishing_entries(self, layout: Layout,
                           points: tuple[ProbePoint, ...]) -> list[tuple[int, ProbePoint, Finish, tuple[str, ...]]]:
        if layout is not self._layout or points is not self._layout_points:
            found, offset = [], 0
            for i, names in layout:
                point = points[i]
                finish = self.finishers.get(point)
                if finish is not None:
                    found.append((offset, point, finish, names))
                offset += len(names)
            self._layout, self._layout_points, self._finishing = layout, points, found
        return self._finishing

    def deliver(self) -> None:
        """Hand every point its steps as one emission (fields concatenated along their `n` dimension)."""
        steps, self.steps = self.steps, []
        for _, group in groupby(steps, key=lambda s: (s.layout, s.points)):  # a new listener set: a new layout
            self._deliver(list(group))

    def _deliver(self, steps: list[_Step]) -> None:
        per_point: dict[int, list[tuple[int, tuple[str, ...]]]] = {}  # point index -> (offset, names) per payload
        offset = 0
        points = steps[0].points
        for i, names in steps[0].layout:
            if self.finishers.get(points[i]) is None:
                per_point.setdefault(i, []).append((offset, names))
            offset += len(names)
        for i, entries in per_point.items():
            point = points[i]
            sink = point.sink
            if sink is None:
                continue
            first = steps[0]
            rows = [(s, off, names) for s in steps for off, names in entries]
            if len(rows) == 1:
                s, off, names = rows[0]
                data = dict(zip(names, s.flat[off:off + len(names)]))
                sink(Emission(point, s.step, s.phase, s.rank, {"positions": torch.tensor([s.start]), **data}))
                continue
            names = rows[0][2]
            fields = {name: torch.cat([s.flat[off + j] for s, off, _ in rows], point.signal.field(name).dims.index("n"))
                      for j, name in enumerate(names)}
            positions = torch.tensor([s.start for s, _, _ in rows])
            tags = torch.tensor([s.step for s, _, _ in rows])
            sink(Emission(point, first.step, first.phase, first.rank, {"positions": positions, **fields}, tags))
