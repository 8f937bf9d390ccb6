"""What each listening probe family costs inside a decode step, side by side in one run.

    python benchmarks/bench_decode_probes.py [--preset demo] [--context 4096] [--steps 64] [--rounds 8]

One prefilled session (unrecorded, then restored from its `state_dict` for every run), then `--steps`
greedy decode steps with null sinks attached to one family at a time (`dsa.topk`, `dsa.dense_mass`
measured every 64th step as the default policy does, `kda.state`, `moe.route` with its router
entropy), all four together (what the default policy listens to), and nothing twice (the second
"none" row is the noise floor). Families rotate within each round, so a machine that drifts slows
them alike; per decode step the minimum over rounds is kept and steps 8.. are averaged (the first
steps after a prefill are slow for every set). This is the in-step cost only: what a recorder then
does with the payloads (reduction, Parquet) is `bench_record.py`'s decode overhead.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine import load_model
from engine.probes import ProbeRequest, probe_points
from engine.session import Session
from engine.tokenizer import Tokenizer
from measure import filler_ids

FAMILIES = {"none": (), "dsa.topk": ("dsa.topk",), "dsa.dense_mass/64": ("dsa.dense_mass",),
            "kda.state": ("kda.state",), "moe.route": ("moe.route",),
            "all four": ("dsa.topk", "dsa.dense_mass", "kda.state", "moe.route"), "none again": ()}
SKIP_STEPS = 8


def request(name: str) -> ProbeRequest:
    if name == "moe.route":
        return ProbeRequest(optional=frozenset({"entropy"}))
    if name == "dsa.dense_mass":
        return ProbeRequest(decode_every=64)
    return ProbeRequest()


def decode_ms(model, tokenizer: Tokenizer, snapshot: dict, names: tuple[str, ...], steps: int) -> np.ndarray:
    """Milliseconds of each decode step with null sinks on the probe points of `names`."""
    points = [p for p in probe_points(model) if p.name in names]
    for point in points:
        point.attach(lambda emission: None, request(point.name))
    try:
        session = Session(model, tokenizer, progress=False)
        session.load_state_dict(snapshot)
        times = [time.perf_counter()]
        for _ in session.generate(steps, temperature=0, stop_ids=()):
            times.append(time.perf_counter())
    finally:
        for point in points:
            point.detach()
    return np.diff(times)[1:] * 1e3  # the first interval is the sampling of the prefill's token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--compile", choices=["off", "on"], default="on")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(f"preset:{args.preset}")
    model.runtime.compile = args.compile == "on"
    tokenizer = Tokenizer.byte_level()
    session = Session(model, tokenizer, progress=False)
    session.append(ids=filler_ids(args.context, tokenizer.encode), name="document")
    session.prefill()
    snapshot = session.state_dict()
    for names in FAMILIES.values():  # compile every listener set's graph before timing
        decode_ms(model, tokenizer, snapshot, names, 4)
    runs: dict[str, list[np.ndarray]] = {label: [] for label in FAMILIES}
    for _ in range(args.rounds):
        for label, names in FAMILIES.items():
            runs[label].append(decode_ms(model, tokenizer, snapshot, names, args.steps))
    print(f"{args.preset} preset, {args.context}-token context, {args.steps} decode steps, compile {args.compile}, "
          f"best of {args.rounds} rounds per step, steps {SKIP_STEPS}.. averaged")
    print(f"{'listening':>18}  {'ms/step':>8}  {'vs none':>8}")
    base = None
    for label, per_round in runs.items():
        n = min(len(r) for r in per_round)
        best = np.min(np.stack([r[:n] for r in per_round]), 0)
        ms = float(best[min(SKIP_STEPS, n - 1):].mean())
        base = base if base is not None else ms
        print(f"{label:>18}  {ms:8.3f}  {(ms / base - 1) * 100:+7.1f}%")


if __name__ == "__main__":
    main()
