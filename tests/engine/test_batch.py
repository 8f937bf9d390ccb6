"""Batches of sequences of different lengths: padding never leaks into any state."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from engine import load_model
from engine.session.batch import BatchSession
from engine.errors import InputError
from engine.session.sampling import SamplingParams
from engine.session import Session


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ["k3.1", "k3", "kimi-linear"])
def test_batched_prefill_equals_each_sequence_alone(variant):
    model = load_model(f"preset:tiny:{variant}", seed=2)
    rows = prompts(5, 41, 23)  # one below, two above the tiny DSA top-k of 16
    logits = BatchSession(model, prefill_chunk=9).prefill(rows, return_logits=True)
    width = logits.shape[1]
    for row, ids in enumerate(rows):
        alone = model(torch.tensor([ids]))[0]
        assert_close(logits[row, width - len(ids):], alone, f"row {row}")


def test_batched_generation_equals_sessions_and_rows_stop_independently():
    model = load_model("preset:tiny", seed=2)
    rows = prompts(7, 30, 19)
    params = [SamplingParams(temperature=0, max_new_tokens=n, stop_ids=()) for n in (4, 12, 9)]
    params[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=9, stop_ids=())
    results = BatchSession(model, prefill_chunk=16).generate(rows, params)
    for ids, p, res in zip(rows, params, results):
        session = Session(model)
        session.append(ids=ids)
        assert res.tokens == [t.id for t in session.generate(params=p)]
    assert [len(r.tokens) for r in results] == [4, 12, 9]


def test_padding_is_invisible_whatever_the_pad_token():
    model = load_model("preset:tiny:k3.1", seed=3)
    rows = prompts(6, 33)
    a = BatchSession(model, pad_id=0).prefill(rows)
    b = BatchSession(model, pad_id=300).prefill(rows)
    assert_close(a, b, "logits with another pad token", 1e-6)


def test_bad_batches():
    model = load_model("preset:tiny")
    with pytest.raises(InputError):
        BatchSession(model).prefill([[1, 2], []])
    with pytest.raises(InputError):
        BatchSession(model).generate([[1]], [SamplingParams(), SamplingParams()])
