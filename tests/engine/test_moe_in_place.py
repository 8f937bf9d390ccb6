"""Eager CPU routed experts read each selected expert's matrices in place (`engine.ops.moe.grouped`).

The in-place form (no gather copy) against the gather form of the same op: fp32 within rounding,
repeated experts and experts held elsewhere (slot -1) included; the gather form is kept wherever
a gradient is wanted or the weights are MXFP4.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.common import activation
from engine.ops.moe import MXFP4, grouped
from engine.presets import get_preset
from tests.helpers import relative_error

ACT = activation(get_preset("tiny"))


def _case(N: int, k: int, E: int, D: int = 48, F: int = 40, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    slot_of = torch.arange(E)
    slot_of[1] = -1  # expert 1 held by another rank
    ids = torch.randint(0, E, (N, k), generator=g)
    ids[0, :2] = torch.tensor([1, 5])
    ids[-1, -1] = 5  # an expert read by two routes
    weights = torch.rand(N, k, generator=g)
    w1, w3 = (torch.randn(E, F, D, generator=g) * D ** -0.5 for _ in range(2))
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    return torch.randn(N, D, generator=g), ids, weights, slot_of, w1, w3, w2


@pytest.mark.parametrize("N,k,E", [(1, 4, 16), (3, 2, 16), (2, 3, 32)])
def test_in_place_experts_match_the_gathered_form(N, k, E, monkeypatch):
    case = _case(N, k, E)
    calls = []
    real = grouped._experts_in_place
    monkeypatch.setattr(grouped, "_experts_in_place", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        got = grouped.gathered_experts(*case, ACT)
        assert calls, "the eager CPU call should read the experts in place"
        monkeypatch.setattr(grouped, "_reads_in_place", lambda *a: False)
        want = grouped.gathered_experts(*case, ACT)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert relative_error(got, want) <= 1e-6


def test_gradients_and_mxfp4_keep_the_gather():
    h, ids, weights, slot_of, w1, w3, w2 = _case(1, 4, 16)
    assert not grouped._reads_in_place(h, w1.requires_grad_(), w3, w2, False)
    packed = MXFP4(torch.zeros(16, 40, 24, dtype=torch.uint8), torch.full((16, 40, 1), 127, dtype=torch.uint8))
    assert not grouped._reads_in_place(h, packed, w3, w2, False)
    assert not grouped._reads_in_place(h, w3, w3, w2, True)  # MXFP8 activation emulation
