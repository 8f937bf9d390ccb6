"""A recording and other listeners watch the same run (issue 30: a probe point takes several listeners)."""

from __future__ import annotations

import torch

import workbench
from engine import load_model
from engine.probes import probe_points
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.recorders.policy import ALL


def test_a_recording_and_a_second_sink_see_the_same_routes(tmp_path):
    model = load_model("preset:tiny:k3.1", seed=2)
    seen: dict[tuple[int, int], list[int]] = {}

    def mine(emission):
        experts = emission.data["experts"][0]
        for row, position in enumerate(emission.data["positions"].tolist()):
            seen[(emission.point.layer, position)] = experts[row].tolist()

    points = [p for p in probe_points(model) if p.name == "moe.route"]
    for p in points:
        p.attach(mine)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with workbench.record(session, trace=tmp_path / "t", policy=ALL):  # every route
        session.append(ids=ids, name="context")
        list(session.generate(5, temperature=0, stop_ids=()))
    assert all(p.listeners == (mine,) for p in points)  # the recording let go of its own sink only
    for p in points:
        p.detach(mine)
    routes = workbench.open_trace(tmp_path / "t").df("moe_routes")
    assert len(routes) > 0
    for layer, position, experts in zip(routes["layer"], routes["position"], routes["experts"]):
        assert seen[(int(layer), int(position))] == experts.tolist()
