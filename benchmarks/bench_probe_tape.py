"""Host cost per decode step of handing listening probe points their payloads, side by side in one run.

    python benchmarks/bench_probe_tape.py [--steps 1920]

The compiled decode step returns what its listening points collected as one flat tuple with a constant
layout (`engine.decode.probe_tape`). Two ways to hand that on, timed on the same payloads (the decode step's
shapes: KDA state norms per head, DSA top-k indices, MoE routes), for the demo preset's 23 points and
K3.1 Pro's 185 (69 KDA, 24 DSA, 92 MoE layers), with a sink that keeps nothing:
- `emit`: one emission per point per step (a lower bound: the sink here does nothing, while a real
  recorder reduces every emission it gets, which is why decode steps are handed on in bulk);
- `backlog`: each point keeps its step and concatenates its own 64 steps into one emission (what
  the decode step did before the tape: per-point host work at every step);
- `tape`: `ProbeTape.record` once per step, its delivery (one emission per point of 64 steps)
  every 64 steps included.
Prints microseconds per step; at 110 tokens/s (a published K3.1-class figure on 8 GPUs) a step is
~9 ms, so per-step host work is worth its share of that.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.decode.probe_tape import BACKLOG_STEPS, ProbeTape, collected_payloads
from engine.probes import Emission, ProbeContext, ProbePoint

SIZES = {"demo preset (5 KDA, 3 DSA, 15 MoE)": (5, 3, 15), "K3.1 Pro (69 KDA, 24 DSA, 92 MoE)": (69, 24, 92)}


def payloads(kda: int, dsa: int, moe: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    return ([("kda.state", {"norm": torch.zeros(1, 1, 96)})] * kda
            + [("dsa.topk", {"indices": torch.zeros(1, 1, 2048, dtype=torch.long)})] * dsa
            + [("moe.route", {"experts": torch.zeros(1, 1, 16, dtype=torch.long), "weights": torch.zeros(1, 1, 16),
                              "entropy": torch.zeros(1, 1)})] * moe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30 * BACKLOG_STEPS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    context = ProbeContext()
    context.begin(step=1, phase="decode")
    print(f"{'model':38s} {'points':>6s} {'emit us/step':>13s} {'backlog us/step':>16s} {'tape us/step':>13s} "
          f"{'backlog / tape':>15s}")
    for label, sizes in SIZES.items():
        items = payloads(*sizes)
        points = []
        for layer, (name, _) in enumerate(items):
            point = ProbePoint(name, layer)
            point.context = context
            point.attach(lambda emission: None)
            points.append(point)
        listening = tuple(points)
        positions = torch.arange(100, 101)

        def emit() -> None:
            for point, (_, data) in zip(listening, items):
                point.sink(Emission(point, context.step, context.phase, context.rank, {"positions": positions, **data}))

        backlogs: dict[ProbePoint, list] = {point: [] for point in listening}

        def backlog() -> None:
            for point, (_, data) in zip(listening, items):
                kept = backlogs[point]
                kept.append((context.step, positions, dict(data)))
                if len(kept) >= BACKLOG_STEPS:
                    fields = {name: torch.cat([d[name] for _, _, d in kept], 1) for name in data}
                    steps = torch.cat([torch.full((len(p),), s, dtype=torch.long) for s, p, _ in kept])
                    point.sink(Emission(point, kept[0][0], context.phase, context.rank,
                                        {"positions": torch.cat([p for _, p, _ in kept]), **fields}, steps))
                    kept.clear()

        tape = ProbeTape(listening)
        for point, (_, data) in zip(listening, items):
            point.collected.append(dict(data))
        flat, layout = collected_payloads(listening)
        layers = [None] * len(listening)

        def taped() -> None:
            tape.record(100, flat, layout, listening, layers)

        result = {}
        for name, fn in (("emit", emit), ("backlog", backlog), ("tape", taped)) * 2:
            for _ in range(BACKLOG_STEPS):  # warm
                fn()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            result[name] = min(result.get(name, float("inf")), (time.perf_counter() - start) / args.steps * 1e6)
        print(f"{label:38s} {len(listening):6d} {result['emit']:13.1f} {result['backlog']:16.1f} {result['tape']:13.1f} "
              f"{result['backlog'] / result['tape']:14.1f}x")


if __name__ == "__main__":
    main()
