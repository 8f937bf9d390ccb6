"""The optional probe measures in `engine.ops` against readable float64 references.

- `ops.mla.dense_mass` == a per-query, per-head loop over expanded keys [W_kb c, k_r] (the
  non-absorbed form), with empty slots, queries early in the sequence and a batch of 2.
- `ops.kda.state_stats`: norms and max |S| against explicit sums; `interval_means` against a loop
  over intervals (one interval, single-token intervals, odd ends).
- `ops.router.router_entropy` == `torch.distributions.Categorical(probs).entropy()` in float64.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops.kda.state_stats import interval_means, state_max_abs, state_norm
from engine.ops.mla.dense_mass import dense_mass
from engine.ops.router import router_entropy
from tests.helpers import assert_close

pytestmark = pytest.mark.usefixtures("nan_poison")  # unwritten outputs of ops fail loudly
SEED = 42


def reference_dense_mass(q_nope, q_rope, latent, k_rope, w_kb, q_pos, selected, scale) -> torch.Tensor:
    """float64, one query and head at a time: softmax over keys 0..t of [q_nope, q_rope] . [W_kb c, k_r]."""
    B, n, H, _ = q_nope.shape
    out = torch.zeros(B, n, H, dtype=torch.float64)
    for b in range(B):
        for i, t in enumerate(q_pos.tolist()):
            for h in range(H):
                keys = torch.cat((latent[b, : t + 1].double() @ w_kb[h].double().T, k_rope[b, : t + 1].double()), -1)
                q = torch.cat((q_nope[b, i, h].double(), q_rope[b, i, h].double()))
                p = torch.softmax(keys @ q * scale, dim=0)  # [t + 1]
                chosen = [s for s in selected[b, i].tolist() if s >= 0]
                out[b, i, h] = p[chosen].sum()
    return out


def _mla_query_inputs(S: int, q_pos: list[int], B: int = 2, H: int = 3, Dk: int = 8, Dr: int = 4, R: int = 12,
                      k: int = 6):
    """Random latent-MLA inputs for queries at `q_pos` over S keys, and a selection per query:
    up to k - 1 of its visible keys, ascending, -1 in the unused slots."""
    gen = torch.Generator().manual_seed(SEED)
    n = len(q_pos)
    q_nope, q_rope = torch.randn(B, n, H, Dk, generator=gen), torch.randn(B, n, H, Dr, generator=gen)
    latent, k_rope = torch.randn(B, S, R, generator=gen), torch.randn(B, S, Dr, generator=gen)
    w_kb = torch.randn(H, Dk, R, generator=gen) * 0.3
    selected = torch.full((B, n, k), -1, dtype=torch.long)
    for b in range(B):
        for i, t in enumerate(q_pos):
            keys = torch.randperm(t + 1, generator=gen)[: min(k - 1, t + 1)].sort().values
            selected[b, i, : len(keys)] = keys
    return q_nope, q_rope, latent, k_rope, w_kb, torch.tensor(q_pos), selected


@pytest.mark.parametrize("S, q_pos", [(9, [0, 3, 8]), (40, [5, 17, 39])], ids=["short", "long"])
def test_dense_mass_matches_per_query_loop(S: int, q_pos: list[int]) -> None:
    B, H = 2, 3
    n = len(q_pos)
    q_nope, q_rope, latent, k_rope, w_kb, pos, selected = _mla_query_inputs(S, q_pos, B=B, H=H)
    got = dense_mass(q_nope, q_rope, latent, k_rope, w_kb, pos, selected, 0.2)
    assert_close(got, reference_dense_mass(q_nope, q_rope, latent, k_rope, w_kb, pos, selected, 0.2), "mass")
    assert got.dtype == torch.float32 and got.shape == (B, n, H)
    if q_pos[0] == 0:  # one visible key, and it is selected: all the mass
        assert torch.allclose(got[:, 0], torch.ones(B, H))


def test_state_norm_and_max_abs() -> None:
    S = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(SEED))
    assert_close(state_norm(S), S.double().pow(2).sum((-2, -1)).sqrt(), "norm")
    expected = torch.stack([torch.stack([S[b, h].abs().max() for h in range(3)]) for b in range(2)])
    assert_close(state_max_abs(S), expected, "max |S|")


@pytest.mark.parametrize("ends", [[10], [0, 1, 2], [3, 4, 9, 10], [6, 10]], ids=["one", "singles", "odd", "two"])
def test_interval_means_match_loop(ends: list[int]) -> None:
    series = torch.rand(2, 11, 3, generator=torch.Generator().manual_seed(SEED))
    expected, begin = [], 0
    for end in ends:
        expected.append(series[:, begin: end + 1].double().mean(1))
        begin = end + 1
    assert_close(interval_means(series, torch.tensor(ends)), torch.stack(expected, 1), "interval means")


def test_router_entropy_matches_categorical() -> None:
    gen = torch.Generator().manual_seed(SEED)
    scores = torch.sigmoid(torch.randn(7, 32, generator=gen) * 3)
    scores[0] = torch.tensor([1.0] + [1e-38] * 31)  # almost one-hot: underflowing terms must stay finite
    expected = torch.distributions.Categorical(probs=scores.double()).entropy()
    assert_close(router_entropy(scores), expected, "entropy")
    assert router_entropy(torch.full((1, 16), 0.5)).item() == pytest.approx(torch.log(torch.tensor(16.0)).item())


def test_topk_overlap_matches_set_loop() -> None:
    """IoU / recall of the selection against the dense top-k of the head-averaged float64 probabilities."""
    from engine.ops.mla.dense_mass import dense_probs, topk_overlap

    B, S, q_pos = 2, 30, [2, 11, 29]
    q_nope, q_rope, latent, k_rope, w_kb, pos, selected = _mla_query_inputs(S, q_pos, B=B)
    mean = dense_probs(q_nope, q_rope, latent, k_rope, w_kb, pos, 0.2).mean(2)
    iou, recall = topk_overlap(mean, pos, selected)
    for b in range(B):
        for i, t in enumerate(q_pos):
            chosen = {s for s in selected[b, i].tolist() if s >= 0}
            probs = mean[b, i, : t + 1].double()
            dense = set(torch.argsort(probs, descending=True)[: len(chosen)].tolist())
            both = len(chosen & dense)
            assert float(iou[b, i]) == pytest.approx(both / len(chosen | dense))
            assert float(recall[b, i]) == pytest.approx(both / len(dense))
    assert float(recall[0, 0]) == 1.0  # 3 visible keys, all selected
