"""Probe points emit what `engine.probes` declares, on the real layers of the tiny preset.

- Every probe of every variant (K3.1, K3, Kimi-Linear), through chunked prefill and decode, with
  every optional field requested and with none: field names, dims and dtypes match the
  declaration (`Signal.check`), positions are on the host, tags carry step, phase and rank.
- Points are named by module path and by family + layer; a model declares exactly the points its
  config implies.
- `ProbeRequest` is data the layer reads: dense-mass queries are the rows the request picks
  (stride, marks, spans; decode steps by `decode_every`), decided from host positions.
- `ProbePoint.attach` refuses optional fields the signal does not declare and a second listener.
- The static decode step's probe tape reaches a listener in bulk with the eager forward's rows, steps
  and positions, in order, and nothing is lost (full tape, end of generation, next forward, detach).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import load_model
from engine.probes import SIGNALS, Marks, ProbeRequest, Sample, probe_points
from engine.session import Session
from engine.tokenizer import Tokenizer

PREFILL, CHUNK, NEW = 45, 20, 4


def run_session(model, request_for) -> list:
    """Attach a collecting sink (request from `request_for(point)`) to every point; prefill + decode."""
    seen = []
    points = list(probe_points(model))
    for point in points:
        point.attach(seen.append, request_for(point))
    try:
        session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
        session.append(ids=torch.randint(0, 256, (PREFILL,), generator=torch.Generator().manual_seed(1)).tolist())
        list(session.generate(NEW, temperature=0, stop_ids=()))
    finally:
        for point in points:
            point.detach()
    return seen


def sizes(config) -> dict[str, int]:
    return {"B": 1, "topk": config.dsa.topk if config.dsa is not None else -1, "heads": config.kda_num_heads,
            "experts_per_token": config.num_experts_per_token}


@pytest.mark.parametrize("variant", ["k3.1", "k3", "kimi-linear"])
@pytest.mark.parametrize("optional", ["all", "none"])
def test_every_emission_matches_its_declaration(variant: str, optional: str) -> None:
    model = load_model(f"preset:tiny:{variant}", seed=3)
    cfg = model.config

    def request(point):
        return ProbeRequest(optional=point.signal.optional if optional == "all" else frozenset())

    seen = run_session(model, request)
    for e in seen:
        requested = e.point.signal.optional if optional == "all" else frozenset()
        problems = e.point.signal.check(e.data, sizes(cfg), requested)
        assert not problems, problems
        assert e.rank == 0 and e.phase in ("prefill", "decode")
    steps = PREFILL // CHUNK + 1 + NEW - 1  # prefill chunks, then one forward per decoded token but the last
    emitted = {(e.point.name, e.point.layer, e.phase) for e in seen}
    for point in probe_points(model):
        for phase in ("prefill", "decode"):
            assert (point.name, point.layer, phase) in emitted, f"{point} never emitted in {phase}"
    assert sorted({e.step for e in seen}) == list(range(steps))


@pytest.mark.parametrize("variant", ["k3.1", "k3", "kimi-linear"])
def test_points_are_named_by_module_path_and_follow_the_config(variant: str) -> None:
    model = load_model(f"preset:tiny:{variant}", seed=3)
    cfg = model.config
    points = list(probe_points(model))
    expected = set()
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kda_layer(i):
            expected.add(("kda.state", i, f"model.layers.{i}.self_attn"))
        elif cfg.is_dsa_layer(i):
            expected |= {(name, i, f"model.layers.{i}.self_attn") for name in ("dsa.topk", "dsa.dense_mass")}
        if cfg.is_moe_layer(i):
            expected.add(("moe.route", i, f"model.layers.{i}.block_sparse_moe"))
    assert {(p.name, p.layer, p.path) for p in points} == expected
    modules = dict(model.named_modules())
    for p in points:
        assert p.full_name == f"{p.path}:{p.name}" and p.family == p.name.split(".")[0]
        assert p in vars(modules[p.path]).values() and p.context is model.probe_context
    if variant == "k3":
        assert not any(p.family == "dsa" for p in points)  # K3 has no indexer


def test_dense_mass_measures_exactly_the_requested_queries() -> None:
    model = load_model("preset:tiny:k3.1", seed=3)
    sample = Sample(stride=7, marks=Marks(positions=(2,), spans=((30, 33),)))

    def request(point):
        return ProbeRequest(queries=sample, decode_every=2) if point.name == "dsa.dense_mass" else ProbeRequest()

    seen = [e for e in run_session(model, request) if e.point.name == "dsa.dense_mass"]
    layers = {p.layer for p in probe_points(model) if p.name == "dsa.dense_mass"}
    prefill = np.arange(PREFILL)
    wanted = prefill[((prefill + 1) % 7 == 0) | (prefill == 2) | ((prefill >= 30) & (prefill < 33))]
    for layer in layers:
        mine = [e for e in seen if e.point.layer == layer]
        got = np.concatenate([e.data["positions"].numpy() for e in mine if e.phase == "prefill"])
        assert got.tolist() == wanted.tolist()
        decoded = [e.step for e in mine if e.phase == "decode"]
        assert decoded and all(step % 2 == 0 for step in decoded)
        assert all(((e.data["mass"] > 0) & (e.data["mass"] <= 1 + 1e-6)).all() for e in mine)


def test_request_rows_are_host_decisions() -> None:
    r = ProbeRequest(queries=Sample(stride=4, window_every=10, window_tokens=2, marks=Marks((13,), ((17, 19),))),
                     decode_every=3)
    # positions 8..19: stride 11 15 19, window 10 11, marks 13 and 17 18 -> rows (position - 8)
    assert r.rows(8, 12, step=5, phase="prefill").tolist() == [2, 3, 5, 7, 9, 10, 11]
    assert r.rows(40, 1, step=6, phase="decode").tolist() == [0]
    assert r.rows(41, 1, step=7, phase="decode").tolist() == []
    assert ProbeRequest().rows(0, 3, step=0, phase="idle").tolist() == [0, 1, 2]


def test_attach_validates_the_request() -> None:
    model = load_model("preset:tiny:k3.1", seed=3)
    point = next(p for p in probe_points(model) if p.name == "kda.state")
    with pytest.raises(ValueError, match="no optional fields"):
        point.attach(lambda e: None, ProbeRequest(optional=frozenset({"scores"})))
    first, second = (lambda e: None), (lambda e: None)
    point.attach(first)
    assert point.sink is first  # one listener: no fan-out on the path
    point.attach(second, ProbeRequest(optional=frozenset({"max_abs"})))
    assert point.listeners == (first, second) and point.request.optional == {"max_abs"}
    point.detach(first)
    assert point.sink is second and point.request.optional == {"max_abs"}
    with pytest.raises(ValueError, match="is not listening"):
        point.detach(first)
    point.detach()
    assert point.sink is None and point.request == ProbeRequest()


def test_two_listeners_each_get_what_they_asked_for_from_one_run() -> None:
    """Two sinks on every point watch the same run; each receives what it would have received alone: its
    own optional fields and, for the dense mass, its own sampled queries and decode steps."""
    model = load_model("preset:tiny:k3.1", seed=3)
    wants = {"a": (frozenset({"scores"}), Sample(stride=5), 2), "b": (frozenset(), Sample(stride=3), 3)}

    def request(point, who):
        optional, sample, every = wants[who]
        if point.name == "dsa.dense_mass":
            return ProbeRequest(queries=sample, decode_every=every)
        return ProbeRequest(optional=optional if point.name == "dsa.topk" else frozenset())

    alone = {who: run_session(model, lambda p, who=who: request(p, who)) for who in wants}
    together: dict[str, list] = {"a": [], "b": []}
    points = list(probe_points(model))
    for point in points:
        for who in wants:
            point.attach(together[who].append, request(point, who))
    try:
        session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
        session.append(ids=torch.randint(0, 256, (PREFILL,), generator=torch.Generator().manual_seed(1)).tolist())
        list(session.generate(NEW, temperature=0, stop_ids=()))
    finally:
        for point in points:
            point.detach()
    def rows(emissions) -> dict:
        out: dict = {}
        for e in emissions:
            for name, t in e.data.items():
                out.setdefault((e.point.full_name, name), []).append(t.flatten())
        return out

    for who in wants:
        got, want = rows(together[who]), rows(alone[who])
        assert got.keys() == want.keys(), who
        for key, tensors in want.items():
            assert [t.shape for t in got[key]] == [t.shape for t in tensors], (who, key)
            for g, w in zip(got[key], tensors):
                if w.is_floating_point():
                    # the dense mass of the union of both listeners' queries is one larger matmul than
                    # either listener's alone: the same function, another BLAS blocking, so fp32 rounding
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{who} {key}: {m}")
                else:  # positions, selections, steps: the same integers whatever else was asked
                    assert torch.equal(g, w), (who, key)


def test_check_reports_departures() -> None:
    signal = SIGNALS["moe.route"]
    data = {"positions": torch.arange(3), "experts": torch.zeros(1, 3, 2, dtype=torch.int32),
            "weights": torch.zeros(1, 3, 5)}
    problems = signal.check(data, {"B": 1, "experts_per_token": 2})
    assert any("dtype torch.int32" in p for p in problems) and any("weights: shape" in p for p in problems)
    assert signal.check({**data, "entropy": torch.zeros(1, 3)}, {"B": 1, "experts_per_token": 2},
                        frozenset({"entropy"}))[0].startswith("moe.route.experts")


def _rows_by_point(seen: list) -> dict:
    """point name + layer -> (row steps, positions, each field's rows) over the point's emissions in order."""
    out: dict = {}
    for e in seen:
        key = (e.point.name, e.point.layer)
        steps, positions, fields = out.setdefault(key, ([], [], {}))
        steps += e.row_steps().tolist()
        positions += e.data["positions"].tolist()
        for name, t in e.data.items():
            if name != "positions":
                fields.setdefault(name, []).append(t.movedim(e.point.signal.field(name).dims.index("n"), 0))
    return {k: (s, p, {n: torch.cat(v) for n, v in f.items()}) for k, (s, p, f) in out.items()}


def test_decode_step_tape_delivers_the_eager_rows_in_bulk(monkeypatch) -> None:
    """The static decode step hands a listener its steps in bulk (`engine.decode.probe_tape`): the rows, their
    step tags and positions equal the eager forward's one emission per step; the tape is delivered
    when full, when generation ends, before the next prefill, and on detach."""
    import engine.decode.probe_tape as probe_tape

    model = load_model("preset:tiny:k3.1", seed=3)

    def run(compile_setting, extra_prompt: bool):
        model.runtime.compile = compile_setting
        seen = []
        points = list(probe_points(model))
        for point in points:
            point.attach(seen.append)
        try:
            session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
            session.append(ids=list(range(30, 30 + PREFILL)))
            list(session.generate(5, temperature=0, stop_ids=()))
            if extra_prompt:
                session.append(ids=[65, 66, 67])
                session.prefill()
        finally:
            for point in points:
                point.detach()
        return seen

    monkeypatch.setattr(probe_tape, "BACKLOG_STEPS", 3)
    eager = run(False, True)
    static = run("static", True)
    from engine.decode.step import DecodeStep
    DecodeStep.of(model).copy_out = True  # as on CUDA: the packed payloads are cloned off the graph's outputs
    copied = run("static", True)
    assert _rows_by_point(copied).keys() == _rows_by_point(static).keys()
    for key, (steps, positions, fields) in _rows_by_point(copied).items():
        assert (steps, positions) == _rows_by_point(static)[key][:2]
        for name, t in fields.items():
            assert torch.equal(t, _rows_by_point(static)[key][2][name]), (key, name)
    model.runtime.compile = "auto"
    a, b = _rows_by_point(eager), _rows_by_point(static)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0] and a[key][1] == b[key][1], key  # steps and positions, in order
        for name in a[key][2]:
            torch.testing.assert_close(a[key][2][name], b[key][2][name], rtol=1e-5, atol=1e-6)
    # 4 decode steps ran (the 5th token is sampled from the last step's logits): bulk of 3, then the
    # end of generation delivers the last one; the prefill after it follows it (dsa.dense_mass is
    # measured on the host at its own step, by `finish_probe`, and emitted there)
    first = next(e.point for e in static if e.phase == "decode" and e.point.name != "dsa.dense_mass")
    decode = [e for e in static if e.phase == "decode" and e.point is first]
    assert [len(e.data["positions"]) for e in decode] == [3, 1]
    assert decode[0].steps.tolist() == [decode[0].step + i for i in range(3)]
    phases = [e.phase for e in static if e.point is first]
    assert phases[-1] == "prefill" and phases.index("decode") < len(phases) - 1

    # detaching one point delivers what the tape holds, to every listener, and nothing twice
    model.runtime.compile = "static"
    moe = [p for p in probe_points(model) if p.name == "moe.route"]
    got = []
    for point in moe:
        point.attach(got.append)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
    session.append(ids=list(range(30, 40)))
    session.prefill()
    got.clear()
    step = DecodeStep.of(model)
    for _ in range(2):  # two static steps straight through the decode step (no generation to end)
        step([65], session.state, torch.device("cpu"), compiled=False)
        session.state.length += 1
    assert got == [] and len(step.tape) == 2
    moe[0].detach()
    assert len(got) == len(moe) and len(step.tape) == 0
    assert all(e.data["positions"].tolist() == [10, 11] and e.row_steps().tolist() == [e.step] * 2 for e in got)
    for point in moe[1:]:
        point.detach()
    assert len(got) == len(moe)
    model.runtime.compile = "auto"
