"""The compiled decode step's probe payloads, kept per step and handed on in bulk.

Inside the decode step listening points collect their tensors (`ProbePoint.collecting`), and the
traced function packs all of them into one buffer per dtype (`collected_payloads`, one concatenation
in the graph), with a layout that is a constant of the compiled graph (the same object at every
replay) naming where each field lies. After the step the host keeps the one or two buffers with the
step's start position and tags: one list append per step whatever the number of listening points
(`benchmarks/bench_probe_tape.py`: with K3.1 Pro's 185 points, about an eighth of the host time of a
backlog kept per point; docs/benchmarks.md). Every `BACKLOG_STEPS` steps, before any
other forward, when a generation ends, when a listener detaches and at a recorder's flush,
`ProbeTape.deliver` stacks the steps' buffers and cuts them into one emission per point (views of
the stacked block), its rows tagged with their steps (`Emission.steps`), so each sink sees its
point's emissions in step order and none is lost.
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from engine.probes import Emission, ProbePoint

BACKLOG_STEPS = 64  # decode steps the tape holds before handing them on as one emission per point

# where a field lies among a step's buffers: (buffer, offset, shape); offset -1: the whole buffer is the
# field (a tensor with a symbolic dimension is passed as it is, not packed)
Slot = tuple[int, int, tuple[int, ...]]
# (index of the point in the step's points, ((field name, slot), ...)) for each collected payload
Layout = tuple[tuple[int, tuple[tuple[str, Slot], ...]], ...]
# a module's host-side completion of a collected payload: (point, fields, start, layer cache) -> None
Finish = Callable[[ProbePoint, Mapping[str, torch.Tensor], int, object], None]


def collected_payloads(points: Sequence[ProbePoint]) -> tuple[tuple[torch.Tensor, ...], Layout]:
    """Empty every point's `collected` into one flat buffer per dtype and the layout of their fields
    (runs inside the traced step, where the layout is a constant of the graph)."""
    packed: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    whole: list[torch.Tensor] = []
    entries = []
    for i, point in enumerate(points):
        for data in point.collected:
            fields = []
            for name, t in data.items():
                shape = tuple(t.shape)
                if all(type(d) is int for d in shape):
                    offset = sizes.get(t.dtype, 0)
                    packed.setdefault(t.dtype, []).append(t.reshape(-1))
                    sizes[t.dtype] = offset + math.prod(shape)
                    fields.append((name, (t.dtype, offset, shape)))
                else:
                    fields.append((name, (None, len(whole), ())))
                    whole.append(t)
            entries.append((i, fields))
        point.collected.clear()
    dtypes = list(packed)
    buffers = tuple(torch.cat(packed[d]) for d in dtypes) + tuple(whole)
    layout = tuple((i, tuple((name, (dtypes.index(d), offset, shape) if d is not None else (len(dtypes) + offset, -1, ()))
                             for name, (d, offset, shape) in fields)) for i, fields in entries)
    return buffers, layout


def _field(buffers: tuple[torch.Tensor, ...], slot: Slot) -> torch.Tensor:
    buffer, offset, shape = slot
    if offset < 0:
        return buffers[buffer]
    return buffers[buffer][offset:offset + math.prod(shape)].view(shape)


class _Fields(Mapping):
    """One payload's fields, sliced from the step's buffers when asked for (a finisher usually reads
    none: its listener skips most steps)."""

    def __init__(self, buffers: tuple[torch.Tensor, ...], fields: tuple[tuple[str, Slot], ...]) -> None:
        self._buffers, self._slots = buffers, dict(fields)

    def __getitem__(self, name: str) -> torch.Tensor:
        return _field(self._buffers, self._slots[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)


class _Step(NamedTuple):
    start: int  # position of the step's token (one token per row)
    step: int
    phase: str
    rank: int
    buffers: tuple[torch.Tensor, ...]
    layout: Layout
    points: tuple[ProbePoint, ...]  # the points the layout indexes (the step's listeners)


class ProbeTape:
    """Decode steps not yet delivered, for the probe points of one model.

    Args:
        points: every probe point of the model (each gets `point.tape`, so any of them can deliver).
        finishers: a point whose payload a module completes on the host at its own step (before the
            next step: it reads the context and the cache as they are then), e.g. MLA's dense mass;
            called at the steps its listener's request measures (`ProbeRequest.measures_step`).
    """

    def __init__(self, points: Sequence[ProbePoint], finishers: dict[ProbePoint, Finish] | None = None) -> None:
        self.finishers = dict(finishers or {})
        self.steps: list[_Step] = []
        # the finishers' slices of the last layout seen (a compiled step returns the same layout object
        # at every replay, so this is an identity check per step)
        self._layout: Layout | None = None
        self._layout_points: tuple[ProbePoint, ...] = ()
        self._finishing: list[tuple[ProbePoint, Finish, tuple[tuple[str, Slot], ...]]] = []
        for point in points:
            point.tape = self

    def __len__(self) -> int:
        return len(self.steps)

    def record(self, start: int, buffers: tuple[torch.Tensor, ...], layout: Layout, points: tuple[ProbePoint, ...],
               layers: Sequence[object]) -> None:
        """Keep one step's payloads (`layout` indexes `points`); complete the finishers' payloads now;
        deliver when full."""
        if not layout:
            return
        ctx = points[layout[0][0]].context
        for point, finish, fields in self._finishing_entries(layout, points):
            # a finisher measures the steps its listener samples (`ProbeRequest.decode_every`): asked
            # first, so the other steps cost one check per point instead of a measurement
            if point.request.measures_step(ctx.step):
                finish(point, _Fields(buffers, fields), start, layers[point.layer])
        self.steps.append(_Step(start, ctx.step, ctx.phase, ctx.rank, buffers, layout, points))
        if len(self.steps) >= BACKLOG_STEPS:
            self.deliver()

    def _finishing_entries(self, layout: Layout, points: tuple[ProbePoint, ...]
                           ) -> list[tuple[ProbePoint, Finish, tuple[tuple[str, Slot], ...]]]:
        if layout is not self._layout or points is not self._layout_points:
            found = [(points[i], self.finishers[points[i]], fields) for i, fields in layout
                     if points[i] in self.finishers]
            self._layout, self._layout_points, self._finishing = layout, points, found
        return self._finishing

    def deliver(self) -> None:
        """Hand every point its steps as one emission (fields concatenated along their `n` dimension)."""
        steps, self.steps = self.steps, []
        for _, group in groupby(steps, key=lambda s: (s.layout, s.points)):  # a new listener set: a new layout
            self._deliver(list(group))

    def _deliver(self, steps: list[_Step]) -> None:
        points, layout = steps[0].points, steps[0].layout
        per_point: dict[int, list[tuple[tuple[str, Slot], ...]]] = {}  # point index -> its payloads' fields
        for i, fields in layout:
            if points[i] not in self.finishers:
                per_point.setdefault(i, []).append(fields)
        # each packed buffer of every step, as one [steps, size] block (a field is a column range of it)
        blocks: dict[int, torch.Tensor] = {}
        first, n_steps = steps[0], len(steps)
        tags: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows per step -> (positions, steps), shared
        for i, payloads in per_point.items():
            point = points[i]
            sink = point.sink
            if sink is None:
                continue
            if n_steps == 1 and len(payloads) == 1:
                data = {name: _field(first.buffers, slot) for name, slot in payloads[0]}
                sink(Emission(point, first.step, first.phase, first.rank, {"positions": torch.tensor([first.start]), **data}))
                continue
            fields = {}
            per_step = len(payloads)
            for name, slot in payloads[0]:
                along = point.signal.field(name).dims.index("n")
                buffer, offset, shape = slot
                if len(payloads) == 1 and offset >= 0 and shape[along] == 1:
                    # one row per step: a column range of the stacked buffers, the steps along `n`
                    if buffer not in blocks:
                        blocks[buffer] = torch.stack([s.buffers[buffer] for s in steps])
                    rows = blocks[buffer][:, offset:offset + math.prod(shape)]
                    if along == 1 and shape[0] == 1:  # batch 1: the [steps, size] range is [1, steps, ...]
                        fields[name] = rows.view(1, n_steps, *shape[2:])
                    else:
                        fields[name] = rows.view(n_steps, *shape).movedim(0, along).reshape(
                            *shape[:along], n_steps, *shape[along + 1:])
                else:  # several payloads per step, or a tensor kept whole: concatenated in (step, payload) order
                    index = [dict(p)[name] for p in payloads]
                    parts = [_field(s.buffers, at) for s in steps for at in index]
                    per_step = len(payloads) * parts[0].shape[along]
                    fields[name] = torch.cat(parts, along)
            if per_step not in tags:
                tags[per_step] = (torch.tensor([s.start for s in steps]).repeat_interleave(per_step),
                                  torch.tensor([s.step for s in steps]).repeat_interleave(per_step))
            positions, row_steps = tags[per_step]
            sink(Emission(point, first.step, first.phase, first.rank, {"positions": positions, **fields}, row_steps))
