"""The decode step's probe tape (`engine.decode.probe_tape`), without a model.

- Steps recorded with one layout reach each listening point as one emission: fields concatenated along
  the declared `n` dimension, positions and per-row step tags in order; one step alone comes unstacked.
- A new layout (a listener attached between steps) starts a new emission; points without a sink get
  nothing; a finisher's payload is completed at its own step and never emitted by the tape.
- The tape delivers itself when full.
"""

from __future__ import annotations

import torch

import engine.decode.probe_tape as probe_tape
from engine.decode.probe_tape import ProbeTape, collected_payloads
from engine.probes import ProbeContext, ProbePoint


def _points() -> tuple[ProbePoint, ProbePoint, ProbePoint]:
    context = ProbeContext()
    points = (ProbePoint("moe.route", 1), ProbePoint("kda.state", 0), ProbePoint("dsa.dense_mass", 2))
    for p in points:
        p.context = context
    return points


def _collect(points, start: int) -> tuple[tuple[torch.Tensor, ...], tuple, tuple]:
    """What a decode step over the listening points returns: (flat, layout, the points it indexes)."""
    moe, kda, dense = points
    if moe.sink is not None:
        moe.collected.append({"experts": torch.full((1, 1, 2), start), "weights": torch.full((1, 1, 2), start / 10)})
    if kda.sink is not None:
        kda.collected.append({"norm": torch.full((1, 1, 3), float(start))})
    dense.collected.append({"q": torch.full((1, 1, 4), float(start))})
    listening = tuple(p for p in points if p.sink is not None or p is dense)
    return (*collected_payloads(listening), listening)


def test_tape_cuts_steps_into_one_emission_per_point_and_layout() -> None:
    points = moe, kda, dense = _points()
    finished: list[tuple[int, float]] = []
    tape = ProbeTape(points, {dense: lambda point, data, start, cache: finished.append((start, float(data["q"][0, 0, 0])))})
    got = []
    moe.attach(got.append)
    for start in (10, 11):
        points[0].context.begin(step=start - 9, phase="decode")
        flat, layout, listening = _collect(points, start)
        assert all(not p.collected for p in points)
        tape.record(start, flat, layout, listening, layers=[None] * 3)
    kda.attach(got.append)  # a listener joins: the next steps have another layout
    points[0].context.begin(step=3, phase="decode")
    tape.record(12, *_collect(points, 12), layers=[None] * 3)
    assert got == [] and len(tape) == 3 and finished == [(10, 10.0), (11, 11.0), (12, 12.0)]
    moe.deliver()  # any point delivers the whole tape
    assert len(tape) == 0 and [(e.point, len(e.data["positions"])) for e in got] == [(moe, 2), (moe, 1), (kda, 1)]
    first, alone, norm = got
    assert first.data["positions"].tolist() == [10, 11] and first.row_steps().tolist() == [1, 2]
    assert first.data["experts"].shape == (1, 2, 2) and first.data["experts"][0, :, 0].tolist() == [10, 11]
    assert torch.allclose(first.data["weights"][0, :, 0], torch.tensor([1.0, 1.1]))
    assert alone.steps is None and alone.step == 3 and alone.data["positions"].tolist() == [12]
    assert norm.data["norm"].shape == (1, 1, 3) and all(e.point is not dense for e in got)


def test_tape_delivers_itself_when_full(monkeypatch) -> None:
    monkeypatch.setattr(probe_tape, "BACKLOG_STEPS", 3)
    points = moe, _, _ = _points()
    tape = ProbeTape(points, {points[2]: lambda *args: None})
    got = []
    moe.attach(got.append)
    for start in range(5):
        tape.record(start, *_collect(points, start), layers=[None] * 3)
    assert [e.data["positions"].tolist() for e in got] == [[0, 1, 2]] and len(tape) == 2
    moe.detach()  # detaching delivers the rest first
    assert [e.data["positions"].tolist() for e in got] == [[0, 1, 2], [3, 4]] and len(tape) == 0


def test_tape_keeps_batch_rows_and_several_payloads_per_step_in_order() -> None:
    """Batch 2 (steps along `n`, rows kept apart), a point with two payloads per step (concatenated in
    step, payload order), and a field the step passes whole (layout offset -1) arrive as the eager
    forward would emit them."""
    points = moe, kda, _ = _points()
    tape = ProbeTape(points)
    got = []
    moe.attach(got.append)
    kda.attach(got.append)
    listening = (moe, kda)
    for start in (5, 6, 7):
        points[0].context.begin(step=start, phase="decode")
        experts = torch.tensor([[[start, 1]], [[start, 2]]])  # [B=2, n=1, 2]
        moe.collected.append({"experts": experts, "weights": experts.float() / 10})
        kda.collected.append({"norm": torch.full((1, 1, 3), float(start))})
        kda.collected.append({"norm": torch.full((1, 1, 3), -float(start))})
        buffers, layout = collected_payloads(listening)
        tape.record(start, buffers, layout, listening, layers=[None] * 3)
    tape.deliver()
    routes, norms = got
    assert routes.data["experts"].tolist() == [[[5, 1], [6, 1], [7, 1]], [[5, 2], [6, 2], [7, 2]]]
    assert routes.data["positions"].tolist() == [5, 6, 7] and routes.row_steps().tolist() == [5, 6, 7]
    assert norms.data["norm"][0, :, 0].tolist() == [5, -5, 6, -6, 7, -7]
    assert norms.data["positions"].tolist() == [5, 5, 6, 6, 7, 7] and norms.row_steps().tolist() == [5, 5, 6, 6, 7, 7]
    # a field passed whole (a symbolic shape in the traced step) is the buffer itself
    whole = torch.arange(4.0).view(1, 1, 4)
    tape.record(9, (whole,), ((1, (("norm", (0, -1, ())),)),), listening, layers=[None] * 3)
    tape.record(10, (whole + 1,), ((1, (("norm", (0, -1, ())),)),), listening, layers=[None] * 3)
    tape.deliver()
    assert got[-1].data["norm"].tolist() == [[[0, 1, 2, 3], [1, 2, 3, 4]]] and got[-1].data["positions"].tolist() == [9, 10]
