"""The health tables may wait between periodic flushes (`SignalFamily.may_wait`): a decode that flushes at
every step writes their rows in a part only when a check fails for the first time at a (check, layer)
(a reader sees since when at once), every `HOLD_SECONDS`, and at the end; the trace closed is the same as
one written at every flush."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

import workbench
from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from tests.helpers import random_ids
from workbench.recorders import recorder as recorder_module
from workbench.recorders.policy import load_policy
from workbench.signals import integrity

HEALTH = integrity.HEALTH_TABLES
NO_TIMED_FLUSH = dataclasses.replace(load_policy("default"), flush_seconds=3600.0)
PROMPT, NEW = 56, 12  # decode crosses position 63, where a KDA state norm is measured (every 64 tokens)


@pytest.fixture()
def model(checkpoint_dir):
    model = load_model(checkpoint_dir("tiny", "k3.1", seed=5, dtype=torch.float32))
    model.runtime.compile = False
    return model


def kda_layer(model) -> int:
    return next(i for i in range(model.config.num_hidden_layers) if model.config.layer_kind(i) == "kda")


def run(model, path, *, poison_at: int | None = None) -> dict[str, int]:
    """Record a prompt and NEW tokens with a periodic flush after every token (called here, as the recorder's
    timer would); from token `poison_at` on, a KDA state holds a
    norm far beyond the policy's bound (head 1's recurrent state grown 1e6-fold: a fault, though the logits stay finite). Returns the parts each table had just before the recording ended."""
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16, progress=False)
    layer = kda_layer(model)
    with workbench.record(session, trace=path, policy=NO_TIMED_FLUSH) as rec:
        session.append(ids=random_ids(PROMPT, 1))
        session.prefill()
        for i, _ in enumerate(session.generate(NEW, temperature=0, stop_ids=())):
            if poison_at is not None and i + 1 == poison_at:
                with torch.inference_mode():
                    session.state.layers[layer].recurrent[0, 1] *= 1e6
            rec.flush(wait=False)
        rec.writer.flush(wait=True, hold=HEALTH)  # what the periodic flushes wrote, the held rows left out
        parts = dict(rec.writer.session["parts"])
    return parts


def test_clean_health_rows_wait_and_the_closed_trace_holds_them_all(model, tmp_path, monkeypatch):
    parts = run(model, tmp_path / "held")
    # the tiny preset's frozen decays warn at its first flush (news: written), then the same warnings wait
    assert parts["moe_counts"] >= NEW
    assert all(parts.get(t, 0) <= 1 for t in HEALTH), parts
    monkeypatch.setattr(recorder_module, "HOLD_SECONDS", 0.0)
    every = run(model, tmp_path / "every")
    assert all(every[t] >= NEW for t in HEALTH), every
    # (the last failing position is the first of the last failing batch: batches follow the flush timing)
    held = integrity.health(workbench.open_trace(tmp_path / "held")).drop(columns="last_failed_position")
    written = integrity.health(workbench.open_trace(tmp_path / "every")).drop(columns="last_failed_position")
    pd.testing.assert_frame_equal(held, written)
    assert (held["positions_checked"] > 0).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the grown state overflows its fp16 norm column
def test_a_new_fault_is_written_at_the_flush_that_finds_it(model, tmp_path):
    clean = run(model, tmp_path / "clean")
    faulty = run(model, tmp_path / "nan", poison_at=2)
    # the health part came at the flush after the fault, before the close
    assert faulty["kda_health"] > clean.get("kda_health", 0)
    trace = workbench.open_trace(tmp_path / "nan")
    top = integrity.findings(trace, ("fault",)).iloc[0]
    assert (top["check"], top["layer"], top["head"]) == ("kda.state_norm", kda_layer(model), 1)
