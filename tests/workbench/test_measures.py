"""The memory-health and selection-structure measures against independent computations on known inputs:
a float64 SVD for effective rank, hand-built decays for half-lives, sets with known overlaps for
Jaccard / IoU, brute-force counts for locality and sinks, a Monte-Carlo draw for the chance values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from engine.ops.kda.state_stats import interval_half_life, state_effective_rank
from engine.ops.mla.dense_mass import topk_overlap
from workbench.analysis import (chance_jaccard, cross_layer_jaccard, decay_timescales, effective_rank, half_lives,
                                heads_at_risk, jaccard, locality, memory_health, sink_over_time, write_vs_forget)


def test_effective_rank_known_spectra_and_op_matches_float64_svd():
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    v, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    equal = u[:, :4] @ v[:, :4].T  # four equal singular values: rank 4 exactly
    one = np.outer(rng.normal(size=8), rng.normal(size=8))
    assert effective_rank(equal) == pytest.approx(4.0)
    assert effective_rank(one) == pytest.approx(1.0, abs=1e-6)
    assert effective_rank(np.zeros((8, 8))) == 0.0
    sigma = np.array([3.0, 1.0])  # by hand: p = (3/4, 1/4)
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert effective_rank(np.diag(sigma)) == pytest.approx(expected)
    S = torch.randn(2, 3, 16, 16, dtype=torch.float64) * torch.logspace(0, -3, 16, dtype=torch.float64)
    np.testing.assert_allclose(state_effective_rank(S.float()).numpy(), effective_rank(S.numpy()), rtol=1e-4)
    assert float(state_effective_rank(torch.zeros(1, 1, 4, 4))[0, 0]) == 0.0


def test_half_lives_from_hand_built_decays():
    # channel c of head h keeps fraction 2**(-1/L) per token, so its half-life is L tokens
    lives = np.array([[10.0, 100.0, 1000.0, 10000.0], [1.0, 2.0, 4.0, 8.0]])
    g = np.log(2.0 ** (-1.0 / lives))
    np.testing.assert_allclose(half_lives(g), lives)
    assert half_lives(np.zeros(2))[0] == np.inf
    df = decay_timescales(np.broadcast_to(g, (5, 2, 4)), context=500)
    np.testing.assert_allclose(df["median_half_life"], np.median(lives, -1))
    np.testing.assert_allclose(df["global_share"], [0.5, 0.0])  # 1000 and 10000 outlive 500 tokens
    # the engine op: interval means of g, lower median over channels, share beyond position + 1
    gt = torch.tensor(g, dtype=torch.float32).expand(1, 6, 2, 4).contiguous()
    median, share = interval_half_life(gt, torch.tensor([2, 5]), torch.tensor([2, 1499]))
    np.testing.assert_allclose(median[0].numpy(), [[100.0, 2.0]] * 2, rtol=1e-4)
    np.testing.assert_allclose(share[0].numpy(), [[1.0, 0.5], [0.25, 0.0]])  # contexts 3 and 1500
    with pytest.raises(ValueError):
        half_lives(np.array([0.1]))


def test_write_vs_forget_weights_intervals_and_fits_growth():
    pos = np.array([9, 19, 39])
    norms = np.stack([2.0 + 0.01 * pos, 5.0 - 0.0 * pos], 1)
    beta = np.array([[0.2, 0.5], [0.4, 0.5], [0.6, 0.5]])
    decay = np.full((3, 2), 0.9)
    df = write_vs_forget(pos, norms, beta, decay)
    # intervals of 10, 10, 20 tokens
    assert df["mean_beta"][0] == pytest.approx((0.2 * 10 + 0.4 * 10 + 0.6 * 20) / 40)
    np.testing.assert_allclose(df["norm_growth_per_1k"], [10.0, 0.0], atol=1e-9)
    assert df["write_forget_ratio"][1] == pytest.approx(0.5 / 0.1)


def _norm_rows():
    pos = np.arange(63, 64 * 10, 64)
    h0 = np.minimum(pos / 128.0, 1.0)  # saturates at position 127
    h1 = pos / pos[-1]  # grows to the end
    h1[6] = h1[5] * 0.4  # falls by 60% at the 7th measurement
    rank = np.stack([np.full(len(pos), 3.0), np.linspace(8, 2, len(pos))], 1)
    half = np.stack([np.full(len(pos), 50.0), np.full(len(pos), 5000.0)], 1)
    return pd.DataFrame({"layer": 2, "position": pos, "norm": list(np.stack([h0, h1], 1)),
                         "eff_rank": list(rank), "half_life": list(half), "global_share": list(half > pos[:, None])})


def test_memory_health_finds_saturation_and_forgetting_by_brute_force():
    rows = _norm_rows()
    segments = pd.DataFrame({"id": [0, 1], "start": [0, 300], "end": [300, 700]})
    health = memory_health(rows, segments)
    h0, h1 = health.iloc[0], health.iloc[1]
    assert h0["saturate_position"] == 127 and h0["saturate_segment"] == 0
    assert h1["forget_position"] == 6 * 64 + 63 and h1["forget_segment"] == 1
    assert h1["forget_drop"] == pytest.approx(0.6)
    assert h1["min_eff_rank"] == pytest.approx(2.0) and h1["min_eff_rank_position"] == 9 * 64 + 63
    assert h0["saturate_growth_per_1k"] == pytest.approx(0.5 / 64 * 1000)  # 63 -> 127: from 0.49 to 0.99
    risk = heads_at_risk(health, top=1)
    assert list(risk["kind"]) == ["saturates", "forgets"]
    # head 0 saturates first and has the shortest half-life: listed once, as saturating (the ranks tie); head 1
    # is then the fastest to forget, at its 60% fall
    assert list(risk["head"]) == [0, 1] and risk.iloc[1]["position"] == 6 * 64 + 63


def test_jaccard_and_topk_overlap_on_sets_with_known_overlaps():
    assert jaccard([1, 2, 3, -1], [2, 3, 4, 5]) == pytest.approx(2 / 5)
    assert jaccard([], [-1]) == 1.0
    # dense probabilities whose top-3 is {7, 8, 9}; the selection {5, 8, 9} shares two of them
    probs = torch.zeros(1, 1, 10)
    probs[0, 0, [7, 8, 9]] = torch.tensor([0.3, 0.2, 0.25])
    probs[0, 0, 5] = 0.1
    iou, recall = topk_overlap(probs, torch.tensor([9]), torch.tensor([[[5, 8, 9, -1]]]))
    assert float(iou) == pytest.approx(2 / 4) and float(recall) == pytest.approx(2 / 3)


def test_chance_jaccard_matches_monte_carlo():
    rng = np.random.default_rng(1)
    draws = [jaccard(rng.choice(50, 10, replace=False), rng.choice(50, 10, replace=False)) for _ in range(20000)]
    assert chance_jaccard(50, 10) == pytest.approx(np.mean(draws), abs=3e-3)
    assert chance_jaccard(10, 10) == 1.0


def _topk_rows(rng, layers=(1, 3), positions=range(40, 80), k=8):
    rows = []
    for p in positions:
        base = rng.choice(p + 1, k, replace=False)
        for i, l in enumerate(layers):
            sel = base.copy()
            sel[: i * 2] = rng.choice(p + 1, i * 2, replace=False)  # layer 3 replaces 2 picks
            rows.append({"layer": l, "position": p, "selected": np.unique(sel)})
    return pd.DataFrame(rows)


def test_cross_layer_jaccard_and_locality_by_brute_force():
    rng = np.random.default_rng(2)
    df = _topk_rows(rng)
    out = cross_layer_jaccard(df)
    a, b = df[df.layer == 1].set_index("position"), df[df.layer == 3].set_index("position")
    brute = np.mean([len(set(a.selected[p]) & set(b.selected[p])) / len(set(a.selected[p]) | set(b.selected[p]))
                     for p in a.index])
    assert out["jaccard"][0] == pytest.approx(brute)
    assert out["chance"][0] < 0.2 < out["jaccard"][0]
    loc = locality(df, topk_k=8).set_index("layer")
    d = np.concatenate([p - s for p, s in zip(a.index, a.selected)])
    assert loc.loc[1, "share_w2k"] == pytest.approx((d < 16).mean())
    assert loc.loc[1, "p50"] == pytest.approx(np.quantile(d, 0.5))
    assert loc.loc[1, "chance_w8k"] == pytest.approx(np.mean(np.minimum(64, np.arange(41, 81)) / np.arange(41, 81)))
    window = pd.DataFrame({"layer": 5, "position": np.arange(100, 120),
                           "selected": [np.arange(p - 7, p + 1) for p in range(100, 120)]})
    assert bool(locality(window, 8)["collapsed"][0])


def test_sink_over_time_alarm_only_past_topk():
    steps = np.arange(8)
    pos = (steps + 1) * 10 - 1  # context 10, 20, ... 80 tokens
    rate = np.array([1, 1, 1, 1, 0.9, 0.2, 0.1, 0.1])
    df = pd.DataFrame({"layer": 4, "step": steps, "position": pos, "queries": 10, "sink_hits": (rate * 10).astype(int)})
    healthy = df.assign(layer=6, sink_hits=10)
    timeline, alarms = sink_over_time(pd.concat([df, healthy]), topk_k=16, sink_tokens=4)
    assert list(alarms["layer"]) == [4] and alarms["position"][0] == 59
    from workbench.analysis.chance import chance_of_hit
    row = timeline[(timeline.layer == 4) & (timeline.step == 5)].iloc[0]
    assert row["rate"] == pytest.approx(0.2) and row["chance"] == pytest.approx(chance_of_hit(60, 4, 16))
    # a brute-force chance: random 16-sets of 60 keys hitting one of the first 4
    rng = np.random.default_rng(3)
    hits = np.mean([(rng.choice(60, 16, replace=False) < 4).any() for _ in range(20000)])
    assert row["chance"] == pytest.approx(hits, abs=0.01)
