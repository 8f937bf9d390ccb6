"""Integrity in every recording (issue 41 section 1): a clean run reports clean; each fault injected here, from
test code, is found by the health tables and localised (check, layer, head, since which position):
a NaN written into a KDA state, decay rounded through bf16, a KDA state read in the wrong layout at
chunked-prefill calls, a tie plateau in the indexer scores, a NaN router logit. A failed check never
stops the session, and the one-line summary names the first fault."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import workbench
from engine import load_model
from engine.errors import NumericsError
from engine.layers import kda as kda_layer
from engine.session import Session
from engine.tokenizer import Tokenizer
from tests.helpers import random_ids
from workbench.signals import integrity

FIRST, SECOND, CHUNK, NEW = 40, 30, 24, 3  # tiny top-k is 16: most rows choose among more keys


@pytest.fixture()
def model(checkpoint_dir):
    return load_model(checkpoint_dir("tiny", "k3.1", seed=5, dtype=torch.float32))


def first_kind(model, kind: str) -> int:
    return next(i for i in range(model.config.num_hidden_layers) if model.config.layer_kind(i) == kind)


def record(model, tmp_path, between=None, *, nan_logits: bool = False):
    """Record FIRST tokens, run `between(session)` (the fault), then SECOND tokens and NEW generated ones.

    The checks never stop a session; a NaN that reaches the logits does (the engine's own NumericsError,
    `nan_logits`), and the trace, closed as failed, still holds every health row up to it."""
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
    with contextlib.ExitStack() as stack:
        if nan_logits:
            stack.enter_context(pytest.raises(NumericsError))
        with workbench.record(session, trace=tmp_path / "t"):
            session.append(ids=random_ids(FIRST, 1), name="first")
            session.prefill()
            if between is not None:
                between(session)
            session.append(ids=random_ids(SECOND, 2), name="second")
            generated = list(session.generate(NEW, temperature=0, stop_ids=()))
        assert len(generated) == NEW  # the session went on whatever the checks found
    return workbench.open_trace(tmp_path / "t")


def test_clean_run_reports_clean(model, tmp_path):
    trace = record(model, tmp_path)
    table = integrity.health(trace)
    assert set(table["check"]) >= {"kda.state_nonfinite", "kda.state_norm", "kda.frozen_decay", "kda.chunk_drift",
                                   "dsa.tie", "moe.router_nonfinite", "moe.boundary_tie"}
    assert (table["positions_checked"] > 0).all()
    drift = table[table["check"] == "kda.chunk_drift"]
    assert (drift["positions_checked"] > 0).all()  # measured (one boundary per chunked call)
    # the tiny preset has decays within 1e-7 of 1 (they freeze in fp32 too): warnings, never faults
    assert integrity.findings(trace, ("fault",)).empty, integrity.findings(trace)
    assert set(integrity.findings(trace)["check"]) <= {"kda.frozen_decay"}
    assert integrity.summary_line(trace).startswith("integrity: no faults")


def test_nan_in_a_kda_state_is_found_at_its_layer_head_and_position(model, tmp_path):
    layer, head = first_kind(model, "kda"), 1

    def poison(session):
        with torch.inference_mode():
            session.state.layers[layer].recurrent[0, head, 2, 3] = float("nan")

    trace = record(model, tmp_path, poison, nan_logits=True)
    bad = integrity.findings(trace)
    top = bad.iloc[0]
    assert (top["check"], top["layer"], top["head"]) == ("kda.state_nonfinite", layer, head)
    assert FIRST <= top["since_position"] < FIRST + model.runtime.kda_chunk_size  # the next call's first boundary
    assert f"layer {layer} head {head}" in integrity.summary_line(trace)


def test_bf16_rounded_decay_is_found_per_layer_and_head(model, tmp_path):
    layer, head = first_kind(model, "kda"), 1
    attn = model.model.layers[layer].self_attn
    hd = attn.head_dim
    with torch.no_grad():  # decays of this head near 0.999: exact in fp32, 1.0 in bf16
        attn.A_log[head] = 0.0
        attn.dt_bias[head * hd:(head + 1) * hd] = -8.5
    clean = record(model, tmp_path / "clean")

    real = kda_layer.KimiDeltaAttention.decay

    def bf16_decay(self, x, f_a=None):  # the fault: decay computed in bf16, then logged
        return torch.log(torch.exp(real(self, x, f_a)).to(torch.bfloat16).float())

    kda_layer.KimiDeltaAttention.decay = bf16_decay
    try:
        trace = record(model, tmp_path / "bf16")
    finally:
        kda_layer.KimiDeltaAttention.decay = real
    def most_frozen(t) -> list[float]:  # per head: the most channels frozen at any measured position
        rows = t.table("kda_health", [layer]).to_pandas()
        rows = rows[rows["check"] == "kda.frozen_decay"]
        return [max(v[h] for v in rows["per_head"]) for h in range(attn.num_heads)]

    before, after = most_frozen(clean), most_frozen(trace)
    assert after[head] >= before[head] + hd / 4, (before, after)  # this head's channels stopped forgetting
    frozen = integrity.findings(trace, ("warn",))
    row = frozen[(frozen["check"] == "kda.frozen_decay") & (frozen["layer"] == layer)].iloc[0]
    assert row["since_position"] == CHUNK - 1  # the first measured boundary


def test_state_layout_error_at_chunked_prefill_is_found(model, tmp_path, monkeypatch):
    real = kda_layer.kda_chunked

    def transposed_restore(q, k, v, g, beta, initial=None, **kw):  # the fault: state read as [V, K]
        return real(q, k, v, g, beta, None if initial is None else initial.transpose(-1, -2).contiguous(), **kw)

    monkeypatch.setattr(kda_layer, "kda_chunked", transposed_restore)
    trace = record(model, tmp_path)
    drift = integrity.findings(trace)
    drift = drift[drift["check"] == "kda.chunk_drift"]
    assert first_kind(model, "kda") in set(drift["layer"])
    row = drift[drift["layer"] == first_kind(model, "kda")].iloc[0]
    # the first call starts from zeros (no layout to get wrong); the second call's first boundary shows it
    assert CHUNK <= row["since_position"] < 2 * CHUNK
    assert row["worst"] > 1e-3


def test_tie_plateau_in_indexer_scores_is_reported_and_replayed(model, tmp_path):
    layer = next(i for i, block in enumerate(model.model.layers) if getattr(block.self_attn, "indexer", None))
    indexer = model.model.layers[layer].self_attn.indexer
    with torch.no_grad():  # every key the same: every score of a row ties
        indexer.k_norm.weight.zero_()
        indexer.k_norm.bias.fill_(0.5)
    trace = record(model, tmp_path)
    table = integrity.health(trace)
    ties = table[(table["check"] == "dsa.tie") & (table["layer"] == layer)].iloc[0]
    topk = model.config.dsa.topk
    assert ties["since_position"] == topk  # the first row with more keys than top-k
    assert ties["positions_failed"] == FIRST + SECOND + NEW - 1 - topk + 0  # every row from there on
    rows = trace.table("dsa_topk", [layer]).to_pandas()
    for _, row in rows.iterrows():  # the documented rule: earliest positions win the tie
        assert list(row["selected"]) == list(range(min(topk, row["position"] + 1)))
    assert integrity.findings(trace, ("fault",)).empty  # a tie is a note, not a fault


def test_nan_router_logit_is_found_at_its_layer_and_position(model, tmp_path):
    layer = next(i for i, block in enumerate(model.model.layers) if hasattr(block, "block_sparse_moe"))
    gate = model.model.layers[layer].block_sparse_moe.gate

    def poison(session):
        with torch.no_grad():
            gate.weight[3, 0] = float("nan")

    trace = record(model, tmp_path, poison, nan_logits=True)
    top = integrity.findings(trace).iloc[0]
    assert (top["check"], top["layer"], top["since_position"]) == ("moe.router_nonfinite", layer, FIRST)
    assert not math.isnan(top["worst"])


def test_health_off_writes_no_health_rows(model, tmp_path):
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=CHUNK, progress=False)
    with workbench.record(session, trace=tmp_path / "t", policy={"health": False}):
        session.append(ids=random_ids(FIRST, 1))
    trace = workbench.open_trace(tmp_path / "t")
    assert integrity.health(trace).empty
    assert integrity.summary_line(trace).startswith("integrity: not checked")


def test_state_handed_over_wrongly_between_chunks_is_found(model, tmp_path, monkeypatch):
    real = kda_layer.kda_chunked
    size = model.runtime.kda_chunk_size

    def bad_handover(q, k, v, g, beta, initial=None, *, chunk_size, observe=None, **kw):  # the fault: after the
        if q.shape[1] <= chunk_size:  # first chunk of a call, the state goes on as [V, K]
            return real(q, k, v, g, beta, initial, chunk_size=chunk_size, observe=observe, **kw)
        head = [x[:, :chunk_size] for x in (q, k, v, g, beta)]
        rest = [x[:, chunk_size:] for x in (q, k, v, g, beta)]
        o1, state = real(*head, initial, chunk_size=chunk_size, observe=observe, **kw)
        later = None if observe is None else (lambda t, S: observe(t + chunk_size, S))
        o2, state = real(*rest, state.transpose(-1, -2).contiguous(), chunk_size=chunk_size, observe=later, **kw)
        return torch.cat((o1, o2), 1), state

    monkeypatch.setattr(kda_layer, "kda_chunked", bad_handover)
    call = 2 * size + size // 2  # three chunks per prefill call: the check rotates over them with the step
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=call, progress=False)
    with workbench.record(session, trace=tmp_path / "t"):
        session.append(ids=random_ids(4 * call, 3))
        session.prefill()
    drift = integrity.findings(workbench.open_trace(tmp_path / "t"))
    drift = drift[(drift["check"] == "kda.chunk_drift") & (drift["layer"] == first_kind(model, "kda"))]
    assert len(drift) == 1
    # the first call re-ran its first chunk (right); the second re-ran its second: the hand-over was wrong
    assert drift.iloc[0]["since_position"] == call + 2 * size - 1
