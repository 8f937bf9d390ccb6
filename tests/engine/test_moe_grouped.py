"""The grouped routed-expert op (`engine.ops.moe`) against the per-expert loop reference.

fp32, relative RMS error, odd shapes, experts with zero routes, expert-parallel subsets (slot -1),
MXFP4 and dense stacks, MXFP8 activation emulation, chunked dequantisation (several chunks: the
host-sync path) and gradients for dense experts (the demo model trains through this op).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.common import activation
from engine.ops.moe import MXFP4, gathered_experts, grouped_experts, routed_experts, sort_routes
from engine.ops.moe.reference import routed_experts_reference
from engine.presets import get_preset
from tests.helpers import relative_error

ACT = activation(get_preset("tiny"))
TOL = 1e-6


def make_case(N: int, k: int, E_global: int, D: int, F: int, held: list[int] | None, packed: bool,
              skew: bool = False, seed: int = 42):
    g = torch.Generator().manual_seed(seed)
    held = list(range(E_global)) if held is None else held
    slot_of = torch.full((E_global,), -1, dtype=torch.int64)
    slot_of[torch.tensor(held)] = torch.arange(len(held))
    h = torch.randn(N, D, generator=g)
    # skew: only the first few experts get routes, the rest none
    pool = max(k, E_global // 3) if skew else E_global
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    E = len(held)

    def matrix(out_f: int, in_f: int):
        if packed:
            return MXFP4(torch.randint(0, 256, (E, out_f, in_f // 2), dtype=torch.uint8, generator=g),
                         torch.randint(118, 124, (E, out_f, in_f // 32), dtype=torch.uint8, generator=g))
        return torch.randn(E, out_f, in_f, generator=g) * in_f ** -0.5

    return h, ids, weights, slot_of, matrix(F, D), matrix(F, D), matrix(D, F)


CASES = [  # N, k, E_global, D, F, held, packed
    (37, 3, 8, 64, 96, None, True),
    (1, 4, 16, 64, 32, None, True),
    (5, 2, 9, 96, 64, [0, 3, 4, 8], True),
    (29, 3, 10, 37, 21, None, False),
    (64, 4, 12, 48, 40, [1, 2, 5, 7, 11], False),
]
IDS = ["37x3-e8-mxfp4", "decode-1x4-e16", "ep-subset-mxfp4", "odd-dense-37x21", "ep-subset-dense"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("op", [grouped_experts, gathered_experts, routed_experts], ids=["grouped", "gathered", "auto"])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "zero-route-experts"])
def test_grouped_op_matches_the_per_expert_loop(case, op, skew):
    h, ids, weights, slot_of, w1, w3, w2 = make_case(*case, skew=skew)
    ref = routed_experts_reference(h, ids, weights, slot_of, w1, w3, w2, ACT)
    got = op(h, ids, weights, slot_of, w1, w3, w2, ACT)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert not got.isnan().any()
    assert relative_error(got, ref) <= TOL


@pytest.mark.parametrize("op", [grouped_experts, gathered_experts], ids=["grouped", "gathered"])
def test_mxfp8_activation_emulation_matches_the_reference(op):
    h, ids, weights, slot_of, w1, w3, w2 = make_case(23, 3, 8, 64, 96, [0, 2, 3, 5, 6], True)
    ref = routed_experts_reference(h, ids, weights, slot_of, w1, w3, w2, ACT, mxfp8=True)
    exact = routed_experts_reference(h, ids, weights, slot_of, w1, w3, w2, ACT)
    got = op(h, ids, weights, slot_of, w1, w3, w2, ACT, mxfp8=True)
    assert relative_error(got, ref) <= TOL < relative_error(got, exact)


@pytest.mark.parametrize("held", [None, [1, 2, 4, 6, 7]], ids=["all", "ep-subset"])
def test_chunked_dequantisation_gives_the_single_chunk_result(held):
    h, ids, weights, slot_of, w1, w3, w2 = make_case(41, 3, 8, 64, 96, held, True, skew=True)
    one = grouped_experts(h, ids, weights, slot_of, w1, w3, w2, ACT)
    per_expert = 3 * 96 * 64 * 4
    for chunk in (per_expert, 2 * per_expert + 1, 3 * per_expert):  # 1, 2 and 3 experts per chunk
        assert relative_error(grouped_experts(h, ids, weights, slot_of, w1, w3, w2, ACT, chunk_bytes=chunk),
                              one) <= TOL


def test_sort_routes_orders_by_slot_with_remote_experts_last():
    slot_of = torch.tensor([-1, 0, -1, 1, 2])
    ids = torch.tensor([[3, 0], [1, 3], [2, 4], [4, 1]])
    order, ends, local = sort_routes(ids, slot_of, 3)
    slots = slot_of[ids.flatten()][order]
    assert ends.tolist() == [2, 4, 6] and ends.dtype == torch.int32
    assert slots[:6].tolist() == [0, 0, 1, 1, 2, 2] and (slots[6:] == -1).all()
    assert local.tolist() == [True] * 6 + [False] * 2


@pytest.mark.parametrize("op", [grouped_experts, gathered_experts], ids=["grouped", "gathered"])
def test_dense_expert_gradients_match_the_reference(op):
    h, ids, weights, slot_of, w1, w3, w2 = make_case(19, 2, 6, 32, 48, [0, 1, 3, 4, 5], False)
    grads = []
    for fn in (routed_experts_reference, op):
        params = [t.clone().requires_grad_() for t in (h, weights, w1, w3, w2)]
        x, w, a, b, c = params
        (fn(x, ids, w, slot_of, a, b, c, ACT) * torch.linspace(-1, 1, 32)).sum().backward()
        grads.append([p.grad for p in params])
    for ref, got in zip(*grads):
        assert relative_error(got, ref) <= 1e-5


def test_both_ways_of_combining_sorted_rows_agree():
    """`add_into_tokens` (CPU) and `gather_back` (GPUs: a fixed summation order) are one function."""
    from engine.ops.moe.grouped import add_into_tokens, gather_back
    g = torch.Generator().manual_seed(3)
    N, k, D = 37, 4, 24
    order = torch.randperm(N * k, generator=g)
    y, weights = torch.randn(N * k, D, generator=g), torch.rand(N, k, generator=g)
    want = torch.zeros(N, D)
    for r in range(N * k):  # row r is route order[r]: token order[r] // k, its slot order[r] % k
        t, j = divmod(int(order[r]), k)
        want[t] += weights[t, j] * y[r]
    for combine in (add_into_tokens, gather_back):
        assert relative_error(combine(y, order, weights), want) < 1e-6


def test_combining_in_place_equals_the_copy_and_leaves_the_callers_rows_alone():
    """`add_into_tokens(overwrite=True)` weights the rows in place (the prefill's scratch): the same values
    bit for bit as weighting a copy, and without it the caller's rows are left as they were."""
    from engine.ops.moe.grouped import add_into_tokens
    g = torch.Generator().manual_seed(4)
    N, k, D = 29, 4, 16
    order = torch.randperm(N * k, generator=g)
    y, weights = torch.randn(N * k, D, generator=g), torch.rand(N, k, generator=g)
    kept = y.clone()
    copied = add_into_tokens(y, order, weights)
    assert torch.equal(y, kept)
    assert torch.equal(add_into_tokens(y, order, weights, overwrite=True), copied)
