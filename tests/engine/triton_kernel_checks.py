"""Every Triton kernel against the pure-torch reference beside it.

Run by `test_triton_kernels.py` in a fresh process with TRITON_INTERPRET=1 (Triton's interpreter must
be on before `triton` is first imported, so it cannot share the main test process), on the CPU with
small, odd shapes; on a GPU, `benchmarks/gpu_check.py` runs the same comparisons at real K3.1 shapes
and times them.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.ops.dsa import reference as dsa_reference
from engine.ops.kda.reference import kda_recurrent as kda_recurrent_reference
from engine.ops.mxfp4 import reference as mxfp4
from tests.helpers import NEAR_TIE, assert_close, topk_boundary_gap

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 (set by test_triton_kernels.py) or a GPU"),
              pytest.mark.usefixtures("nan_poison")]  # an output element a kernel leaves unwritten fails loudly


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    from engine.ops.dsa import triton_scores
    from engine.ops.kda import triton_recurrent
    from engine.ops.mxfp4 import triton_dequant

    return {"mxfp4": triton_dequant, "dsa": triton_scores, "kda": triton_recurrent}


@pytest.mark.parametrize("shape", [(5, 32), (3, 7, 64), (2, 33, 96)], ids=["5x32", "3x7x64", "2x33x96"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_dequant_kernel_is_bit_exact(kernels, shape, dtype):
    g = torch.Generator().manual_seed(42)
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 150, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=g)
    if dtype == torch.float32:
        # the denormal scale 2^-127 (the interpreter's numpy bf16 cast flushes denormals; a GPU rounds them)
        scale.view(-1)[0] = 0
    packed.view(-1)[:4] = torch.tensor([0x08, 0x80, 0x88, 0xF7], dtype=torch.uint8)  # "-0" codes, +-6
    got = kernels["mxfp4"].dequantize(packed, scale, dtype)
    assert got.dtype == dtype and torch.equal(got, mxfp4.dequantize(packed, scale, dtype))


@pytest.mark.parametrize("B,Tq,Tk,H,D", [(1, 37, 53, 3, 16), (2, 5, 130, 2, 32)], ids=["odd", "decode-like"])
def test_dsa_scores_kernel_matches_reference_and_selects_the_same_keys(kernels, B, Tq, Tk, H, D):
    g = torch.Generator().manual_seed(42)
    q, w, k = torch.randn(B, Tq, H, D, generator=g), torch.randn(B, Tq, H, generator=g), torch.randn(B, Tk, D, generator=g)
    scorer = kernels["dsa"].indexer_scores
    assert_close(scorer(q, w, k), dsa_reference.indexer_scores(q, w, k), "indexer scores", 1e-6)
    pos = torch.arange(Tk - Tq, Tk)
    a = dsa_reference.indexer_topk(q, w, k, pos, 16, scorer=scorer)
    b = dsa_reference.indexer_topk(q, w, k, pos, 16)
    # the kernel's scores round differently from the reference's: the same keys only without a near tie
    visible = dsa_reference.indexer_scores(q, w, k).masked_fill(torch.arange(Tk) > pos[:, None], float("-inf"))
    assert topk_boundary_gap(visible, 16) > NEAR_TIE, "inputs put two keys in a near tie; change the seed"
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("T,H,K,V", [(1, 3, 16, 24), (6, 2, 32, 40)], ids=["decode", "few-tokens"])
def test_kda_recurrent_kernel_matches_reference(kernels, T, H, K, V):
    g = torch.Generator().manual_seed(42)
    B = 2
    norm = torch.nn.functional.normalize
    q, k = norm(torch.randn(B, T, H, K, generator=g), dim=-1), norm(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g)
    o, s = kernels["kda"].kda_recurrent(q, k, v, gate, beta, state)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, gate, beta, state)
    assert_close(o, o_ref, "output")
    assert_close(s, s_ref, "final state")
    assert not torch.equal(state, s)  # the caller's state is not written in place
