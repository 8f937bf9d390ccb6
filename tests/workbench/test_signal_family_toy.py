"""A fourth signal family needs one module and a probe declaration: nothing in the recorder, the trace
writer or the reader names a family.

The toy family below is what such a module holds (here inside the test): the router's entropy as its
own probe signal, one trace table citing it, and a registration. A forward hook stands in for the
layer's `if point.listening: point.emit(...)`. It records, reads back through `open_trace` (rows
equal to the router's entropy recomputed here) and exports, and the built-in families are untouched.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

import workbench
from engine import load_model
from engine.errors import InputError
from engine.ops.router import router_entropy
from engine.probes import SIGNALS, Field, ProbePoint, Signal, probe_points
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.signals import SignalFamily, register, registered, unregister
from workbench.trace import TABLES, open_trace
from workbench.trace.export import export_trace
from workbench.trace.schema import Column, TableSpec, signal_tags

# ---- the toy family's probe declaration (what `engine/probes.py` would list in SIGNALS) -------------
TOY_SIGNAL = Signal("toy.router_entropy", "entropy of each MoE layer's router distribution, as its own family", (
    Field("positions", ("n",), "int64", "token positions of this forward call", host=True),
    Field("entropy", ("B", "n"), "float32", "entropy (nats) of the router's normalised scores"),
))

# ---- the toy family's module (what `workbench/signals/toy.py` would hold) -----------------------------
def toy_family() -> SignalFamily:
    """One table citing the signal (checked against the declaration, so built once it is declared); the
    default request (every optional field) and rows (every emitted row into the tables citing the signal)."""
    table = TableSpec("toy_router_entropy", "router entropy of one token on one MoE layer", (
        *signal_tags(),
        Column("position", pa.int32(), "token position", encoding="delta", field="positions"),
        Column("entropy", pa.float32(), "router entropy (nats)", encoding="bss", field="entropy"),
    ), signal="toy.router_entropy")
    return SignalFamily("toy", (table,))


CONTEXT, CHUNK = 40, 16


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(SIGNALS, TOY_SIGNAL.name, TOY_SIGNAL)
    family = register(toy_family())
    yield family
    unregister("toy")
    assert "toy_router_entropy" not in TABLES


def _emit_from_router(model) -> tuple[list, dict[int, list[torch.Tensor]]]:
    """A toy probe point on every MoE layer, emitted after its forward (as a layer's emit would)."""
    hooks, expected = [], {}
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or not hasattr(moe, "gate"):
            continue
        moe.probe_toy = ProbePoint(TOY_SIGNAL.name, i)
        expected[i] = []

        def hook(module, args, kwargs, output, layer=i):
            point = module.probe_toy
            if not point.listening:
                return
            x = args[0]
            start = int(kwargs.get("start", args[1] if len(args) > 1 else 0))
            _, _, scores = module.gate(x.reshape(-1, x.shape[-1]), return_scores=True)
            entropy = router_entropy(scores).view(x.shape[:-1]).float()
            expected[layer].append(entropy[0].detach().clone())
            point.emit(positions=torch.arange(start, start + x.shape[-2]), entropy=entropy)

        hooks.append(moe.register_forward_hook(hook, with_kwargs=True))
    return hooks, expected


def test_toy_family_records_reads_and_exports(toy, tmp_path):
    assert "toy" in registered() and TABLES["toy_router_entropy"] is toy.tables[0]
    model = load_model("preset:tiny", dtype=torch.float32, seed=0)
    hooks, expected = _emit_from_router(model)
    try:
        session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
        ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
        with workbench.record(session, trace=tmp_path / "t", signals=["toy", "moe"]) as rec:
            session.append(ids=ids, name="context")
            session.prefill()
        assert all(p.sink is None for p in probe_points(model))
    finally:
        for h in hooks:
            h.remove()
    assert rec.rows_written > 0

    trace = open_trace(tmp_path / "t", strict=True)
    assert trace.problems == []
    assert trace.layers("toy_router_entropy") == sorted(expected)
    for layer, chunks in expected.items():
        table = trace.table("toy_router_entropy", [layer]).to_pandas().sort_values("position")
        want = torch.cat(chunks).numpy()
        assert table["position"].tolist() == list(range(CONTEXT))
        np.testing.assert_allclose(table["entropy"].to_numpy(), want, rtol=1e-6)
    # the families not asked for wrote nothing; the one asked for beside the toy did
    assert trace.table("dsa_topk").num_rows == 0 and trace.table("kda_norms").num_rows == 0
    assert trace.moe_counts_matrix().sum() > 0

    manifest = export_trace(tmp_path / "t", tmp_path / "out", "csv", tables=["toy_router_entropy"])
    assert (tmp_path / "out" / "toy_router_entropy.csv").is_file()
    assert "toy_router_entropy" in json.dumps(manifest, default=str)


def test_unknown_family_is_named(tmp_path):
    model = load_model("preset:tiny", dtype=torch.float32, seed=0)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
    with pytest.raises(InputError, match="unknown signal family.*'kdaa'"):
        with workbench.record(session, trace=tmp_path / "t", signals=["dsa", "kdaa"]):
            pass
    assert not (tmp_path / "t").exists()


def test_old_family_flags_are_an_alias(tmp_path):
    model = load_model("preset:tiny", dtype=torch.float32, seed=0)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK)
    with pytest.warns(DeprecationWarning, match="signals="):
        with workbench.record(session, trace=tmp_path / "t", dsa=False) as rec:
            assert sorted(rec.families) == ["kda", "moe"]
            assert {p.signal.family for p in rec._points} == {"kda", "moe"}


# ---- through the front doors: the CLI and the server record a family they have never heard of ------------
def test_toy_family_records_through_workbench_run(toy, tmp_path, monkeypatch):
    import workbench.sessions
    from apps.cli import main

    real_load = workbench.sessions.load_model
    hooks: list = []

    def load_with_toy_points(*args, **kwargs):  # the toy's emit lives in a hook (see _emit_from_router)
        model = real_load(*args, **kwargs)
        hooks.extend(_emit_from_router(model)[0])
        return model

    monkeypatch.setattr(workbench.sessions, "load_model", load_with_toy_points)
    try:
        assert main(["run", "--model", "preset:tiny", "--prompt", "a toy prompt for the router", "--max-new-tokens",
                     "2", "--temperature", "0", "--record", "toy,moe", "--trace", str(tmp_path / "t"),
                     "--compile", "off"]) == 0
        assert main(["run", "--model", "preset:tiny", "--prompt", "every family by default", "--max-new-tokens",
                     "1", "--trace", str(tmp_path / "all"), "--compile", "off"]) == 0
    finally:
        for h in hooks:
            h.remove()
    trace = open_trace(tmp_path / "t", strict=True)
    assert trace.table("toy_router_entropy").num_rows > 0 and trace.table("dsa_topk").num_rows == 0
    assert open_trace(tmp_path / "all", strict=True).table("toy_router_entropy").num_rows > 0
    assert main(["run", "--model", "preset:tiny", "--prompt", "x", "--record", "toy,nope",
                 "--trace", str(tmp_path / "bad")]) == 2


def test_toy_family_records_through_serve(toy, tmp_path):
    import httpx

    from apps.web_guard import HostPolicy
    from apps.serve.app import AppConfig
    from apps.serve.server import Server
    from apps.serve.worker import ServeOptions
    from workbench.sessions import load_with_tokenizer

    model, tokenizer = load_with_tokenizer("preset:tiny", seed=1)
    hooks, _ = _emit_from_router(model)
    srv = Server(model, tokenizer, ServeOptions(model_name="preset:tiny", trace_root=tmp_path, max_queue=2),
                 AppConfig(model_id="preset:tiny", hosts=HostPolicy.for_server("127.0.0.1"), max_body_bytes=1 << 20,
                           max_tokens=4096), port=0)
    srv.start_in_thread()
    try:
        reply = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": "preset:tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "a toy family through the server"}]})
        assert reply.status_code == 200, reply.text
    finally:
        srv.stop()
        for h in hooks:
            h.remove()
    traces = [d for d in tmp_path.iterdir() if (d / "session.json").is_file()]
    assert len(traces) == 1
    assert open_trace(traces[0]).table("toy_router_entropy").num_rows > 0
