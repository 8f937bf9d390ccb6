"""Chance baselines: exact hypergeometric formula vs brute force, edge cases, formatting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workbench.analysis.chance import chance_of_hit, expected_hits, format_hits, format_read


def _exact_by_combinations(v: int, s: int, k: int) -> float:
    k = min(k, v)
    return 1.0 - math.comb(v - s, k) / math.comb(v, k)


@pytest.mark.parametrize("v,s,k", [(10, 3, 2), (50, 1, 7), (33, 5, 4), (200, 20, 16), (7, 6, 3)])
def test_matches_simulation(v: int, s: int, k: int) -> None:
    rng = np.random.default_rng(0)
    trials = 20000
    # brute force: k distinct uniform picks among v keys; keys [0, s) are the span
    picks = np.argsort(rng.random((trials, v)), axis=1)[:, :k]
    simulated = float(np.mean((picks < s).any(axis=1)))
    exact = chance_of_hit(v, s, k)
    assert abs(simulated - exact) < 4 * math.sqrt(exact * (1 - exact) / trials) + 1e-3
    assert exact == pytest.approx(_exact_by_combinations(v, s, k), rel=1e-12, abs=1e-12)
    hits = float(np.mean((picks < s).sum(axis=1)))
    assert hits == pytest.approx(expected_hits(v, s, k), rel=0.05)


def test_issue_example_and_long_contexts() -> None:
    # the issue's figure: 256 picks among ~33K keys hitting an 86-token span, about 49%
    assert chance_of_hit(33000, 86, 256) == pytest.approx(0.49, abs=0.01)
    assert chance_of_hit(33000, 86, 256) == pytest.approx(_exact_by_combinations(33000, 86, 256), rel=1e-9)
    # 1M visible keys: no overflow, tiny probabilities keep their precision
    p = chance_of_hit(1_000_000, 1, 1)
    assert p == pytest.approx(1e-6, rel=1e-9)


def test_long_products_and_mixed_rows() -> None:
    # spans and picks past the exact-product limit take the lgamma path; check against a direct sum
    v, s, k = 50_000, 6_000, 5_000
    direct = -math.expm1(sum(math.log1p(-s / (v - i)) for i in range(k)))
    assert chance_of_hit(v, s, k) == pytest.approx(direct, rel=1e-9)
    # rows of very different widths in one call (padding must not leak between rows)
    out = chance_of_hit(np.array([5, 40, 100_000]), np.array([1, 30, 2]), np.array([4, 3, 256]))
    for got, (vv, ss, kk) in zip(out, [(5, 1, 4), (40, 30, 3), (100_000, 2, 256)]):
        assert got == pytest.approx(_exact_by_combinations(vv, ss, kk), rel=1e-10)


def test_edge_cases() -> None:
    assert chance_of_hit(100, 0, 10) == 0.0
    assert chance_of_hit(100, 5, 0) == 0.0
    assert chance_of_hit(100, 100, 1) == 1.0
    assert chance_of_hit(100, 150, 1) == 1.0            # span larger than what is visible
    assert chance_of_hit(10, 1, 10) == 1.0              # picks == visible: everything is read
    assert chance_of_hit(10, 1, 64) == 1.0              # picks > visible
    assert chance_of_hit(10, 4, 7) == 1.0               # too many picks to miss 4 of 10
    assert chance_of_hit(0, 0, 5) == 0.0
    assert expected_hits(0, 0, 5) == 0.0
    assert expected_hits(10, 2, 64) == pytest.approx(2.0)   # k clipped to visible
    with pytest.raises(ValueError, match=">= 0"):
        chance_of_hit(-1, 1, 1)


def test_vectorised_broadcast() -> None:
    visible = np.array([10, 100, 1000, 5])
    out = chance_of_hit(visible, 3, 4)
    assert out.shape == (4,)
    for i, v in enumerate(visible):
        assert out[i] == pytest.approx(chance_of_hit(int(v), 3, 4))
    assert isinstance(chance_of_hit(10, 3, 4), float)
    grid = chance_of_hit(np.array([[100], [200]]), np.array([1, 5, 10]), 8)
    assert grid.shape == (2, 3)
    assert np.all(np.diff(grid, axis=1) > 0)


def test_format() -> None:
    assert format_read(0.43, 0.49) == "43% read, chance 49%, 0.9x"
    assert format_read(1.0, 0.0021) == "100% read, chance 0.21%, 476x"
    assert format_read(0.0, 0.0) == "0% read, chance 0%, n/a"
    assert format_hits(120, 13.4) == "120 hits, expected 13.4, 9.0x"
