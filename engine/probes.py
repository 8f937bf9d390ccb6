"""Named probe points: the engine's one surface for observers (the workbench's recorders).

A layer declares a `ProbePoint` per signal it can report. With nothing attached, the cost is one
`None` check per layer call; a recorder attaches a sink (`point.sink = fn`) inside a context
manager that always detaches it. The engine never imports the workbench.

Catalogue (payload keys; positions are sequence positions, given as CPU int64 tensors so that a
listener can decide what to keep without synchronising the device; expert ids are logical):
- `dsa.topk`   (DSA layers): positions [T] int64, indices [B, T, k] int64 (ascending, -1 = empty),
  scores [B, T, k] fp32.
- `dsa.dense_mass` (DSA layers, only when a sink asks for it): positions [n] of sampled queries,
  mass [B, n] fp32 = share of the dense softmax attention mass inside the selected set.
- `kda.state`  (KDA layers): positions [n] int64 (the state is measured after these positions),
  norm [B, n, H] fp32 Frobenius norms, and when requested max_abs [B, n, H], mean_decay [B, n, H],
  mean_beta [B, n, H].
- `moe.route`  (MoE layers): positions [T] int64, experts [B, T, k] int64, weights [B, T, k] fp32,
  entropy [B, T] fp32 (of the router's normalised sigmoid scores over all experts).

`ProbeContext` (one per model, set by the session around each forward) tags every signal with the
step (prefill chunk or decode step), the phase, the rank and the session id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

PROBE_NAMES = ("dsa.topk", "dsa.dense_mass", "kda.state", "moe.route")

Sink = Callable[["ProbePoint", dict], None]


class ProbePoint:
    """One recordable signal of one layer. `sink` is None unless a recorder listens."""

    __slots__ = ("name", "layer", "sink", "options")

    def __init__(self, name: str, layer: int) -> None:
        if name not in PROBE_NAMES:
            raise ValueError(f"unknown probe {name!r}")
        self.name = name
        self.layer = layer
        self.sink: Sink | None = None
        self.options: dict = {}  # what the listener asks for (e.g. extras, sampled positions)

    def emit(self, **payload) -> None:
        if self.sink is not None:
            self.sink(self, payload)

    def __repr__(self) -> str:
        return f"ProbePoint({self.name!r}, layer={self.layer}, listening={self.sink is not None})"


@dataclass
class ProbeContext:
    """Where the model is in its session: read by sinks when a probe fires."""

    step: int = 0
    phase: str = "idle"  # "prefill" | "decode" | "forward" | "idle"
    start: int = 0  # first position of this forward call
    count: int = 0  # tokens in this forward call
    rank: int = 0
    session: str = ""

    def begin(self, *, step: int, phase: str, start: int, count: int) -> None:
        self.step, self.phase, self.start, self.count = step, phase, start, count

    def end(self) -> None:
        self.phase = "idle"


def probe_points(model: torch.nn.Module) -> Iterator[ProbePoint]:
    """Every probe point declared by the modules of `model`, in module order."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, ProbePoint):
                yield value
