"""Integrity checks of eager decode steps computed in bulk (`engine.probes.Deferred`): the recorder receives
the inputs of the KDA, DSA (a tie band no tie cut) and MoE checks by reference and computes them once over many steps. The health
tables must be those of the checks computed at every step (bit for bit: the same elementwise ops), with a
decode-time fault found at its step, and the cap on held steps (`DEFER_MAX_ITEMS`) must not change them."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import workbench
from engine import load_model
from engine import probes
from engine.layers import kda as kda_layer
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.recorders import recorder as recorder_module
from workbench.signals import integrity

PROMPT, NEW = 40, 12


@pytest.fixture()
def model(checkpoint_dir):
    model = load_model(checkpoint_dir("tiny", "k3.1", seed=5, dtype=torch.float32))
    model.runtime.compile = False  # the eager decode step is the one that defers
    layer = next(i for i in range(model.config.num_hidden_layers) if model.config.layer_kind(i) == "kda")
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():  # decays of head 1 near 1 - 2e-4: frozen once decode rounds them through bf16 (below)
        attn.A_log[1] = 0.0
        attn.dt_bias[attn.head_dim:2 * attn.head_dim] = -8.5
    return model


def run(model, path, monkeypatch, *, defer: bool, poison_at: int | None = None) -> tuple[pd.DataFrame, int]:
    """Record a prompt and NEW greedy tokens; from generated token `poison_at` on, the decay of every KDA
    layer is rounded through bf16 (a decode-time fault). Returns the health summary and how many Deferred
    values the layers made."""
    made = [0]
    real_init = probes.Deferred.__init__

    def counting_init(self, *args, **kwargs):
        made[0] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(probes.Deferred, "__init__", counting_init)
    monkeypatch.setattr(probes, "DEFER_MAX_ROWS", probes.DEFER_MAX_ROWS if defer else 0)  # every layer's rule
    real_decay = kda_layer.KimiDeltaAttention.decay
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=24, progress=False)
    step = [0]

    def decay(self, x, f_a=None):
        g = real_decay(self, x, f_a)
        if poison_at is not None and x.shape[1] == 1 and step[0] >= poison_at:
            return torch.log(torch.exp(g).to(torch.bfloat16).float())
        return g

    monkeypatch.setattr(kda_layer.KimiDeltaAttention, "decay", decay)
    with workbench.record(session, trace=path):
        session.append(ids=torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist())
        session.prefill()
        for _ in session.generate(NEW, temperature=0, stop_ids=()):
            step[0] += 1
    monkeypatch.undo()
    return integrity.health(workbench.open_trace(path)), made[0]


def test_deferred_checks_equal_the_per_step_checks_and_find_a_decode_fault_at_its_step(model, tmp_path, monkeypatch):
    now, made_now = run(model, tmp_path / "now", monkeypatch, defer=False, poison_at=5)
    later, made_later = run(model, tmp_path / "later", monkeypatch, defer=True, poison_at=5)
    assert made_now == 0 and made_later > 0
    pd.testing.assert_frame_equal(now, later)
    frozen = later[(later["check"] == "kda.frozen_decay") & (later["positions_failed"] > 0)]
    assert len(frozen)  # the bf16 decode steps froze channels
    clean, _ = run(model, tmp_path / "clean", monkeypatch, defer=True)
    clean_frozen = clean[clean["check"] == "kda.frozen_decay"].set_index("layer")["positions_failed"]
    grew = frozen.set_index("layer")["positions_failed"] > clean_frozen.reindex(frozen["layer"]).fillna(0).values
    assert grew.any()
    moe = later[later["check"].str.startswith("moe.")]
    assert (moe["positions_checked"] == clean[clean["check"].str.startswith("moe.")]["positions_checked"].values).all()
    assert (moe["positions_checked"] >= PROMPT + NEW - 1).all()  # every decode step's router was checked


def test_the_cap_on_held_decode_steps_leaves_the_health_tables_as_they_were(model, tmp_path, monkeypatch):
    whole, _ = run(model, tmp_path / "whole", monkeypatch, defer=True, poison_at=3)
    monkeypatch.setattr(recorder_module, "DEFER_MAX_ITEMS", 4)
    capped, _ = run(model, tmp_path / "capped", monkeypatch, defer=True, poison_at=3)
    # last_failed_position is the first failure of the last batch that failed: batches are what the cap changes
    batch_bound = "last_failed_position"
    pd.testing.assert_frame_equal(whole.drop(columns=batch_bound), capped.drop(columns=batch_bound))
    assert (capped["last_failed_position"] >= whole["last_failed_position"]).all()


def test_a_sink_that_does_not_take_deferred_values_gets_them_computed(model):
    point = next(p for p in probes.probe_points(model) if p.name == "moe.route")
    seen = []
    point.attach(seen.append, probes.ProbeRequest(optional=frozenset({"logit_sum", "kth_choice", "runner_up"})))
    try:
        assert not point.defers
        session = Session(model, Tokenizer.byte_level(), progress=False)
        session.append(ids=[1, 2, 3])
        list(session.generate(2, temperature=0, stop_ids=()))
    finally:
        point.detach(seen.append)
    assert seen and all(isinstance(e.data["logit_sum"], torch.Tensor) for e in seen)
