"""Issue 11 item 7: a forward whose logits are not finite stops with an error naming the first bad layer."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.errors import NumericsError
from engine.numerics import first_nonfinite


def test_first_nonfinite():
    ok, bad = torch.zeros(3), torch.tensor([0.0, float("inf")])
    assert first_nonfinite([ok, ok]) is None and first_nonfinite([ok, bad, bad]) == 1


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny", seed=0)


def _poison(model, layer: int):
    weight = model.model.layers[layer].self_attn.o_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    return weight, saved


@pytest.mark.parametrize("layer", [0, 2])
def test_nan_weights_name_the_first_bad_layer(model, layer):
    weight, saved = _poison(model, layer)
    try:
        with pytest.raises(NumericsError, match=f"first layer whose output is not finite is layer {layer} "
                                                f"\\({model.config.layer_kind(layer)}"):
            model(torch.tensor([[1, 2, 3, 4]]))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]]))).all()


def test_a_session_stops_with_the_error_not_a_sampler_traceback(model):
    from engine import Session
    from engine.tokenizer import Tokenizer
    weight, saved = _poison(model, 1)
    try:
        session = Session(model, Tokenizer.byte_level())
        with pytest.raises(NumericsError, match="layer 1"):
            session.append("hello there")
            list(session.generate(2, temperature=0.7))
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_all_finite_answers_like_the_elementwise_test() -> None:
    from engine.numerics import all_finite

    big = torch.full((4, 8), 3e38)   # finite values whose sum overflows: the exact test decides
    cases = [torch.zeros(0), torch.randn(5, 7), big, big.bfloat16()]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for base in (torch.randn(3, 9), big):
            t = base.clone()
            t[1, 2] = bad
            cases.append(t)
    mixed = torch.randn(3, 4)
    mixed[0, 0], mixed[2, 3] = float("inf"), float("-inf")   # their sum is NaN, never mistaken for finite
    cases.append(mixed)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
