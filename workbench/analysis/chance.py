"""Chance baselines for read statistics: what uniformly random DSA selections would give.

A DSA layer that picks `picks` keys among the `visible` keys a query can see "reads" a span of
`span` given keys when at least one pick lands in it. Random picks do that with the exact
hypergeometric probability

    P(hit) = 1 - C(visible - span, k) / C(visible, k),   k = min(picks, visible),

so every observed read rate is shown beside this value and their ratio (spec rule: a statistic
chance could produce is never shown alone). Aggregates over many queries compare observed hit
counts with `expected_hits` (the expected number of picks inside the span, k * span / visible).

Binomial coefficients of ~1M-token contexts overflow any float, so the ratio is computed in log
space and `1 - exp(x)` as `-expm1(x)`. The ratio is symmetric in span and picks,
C(v-s, k)/C(v, k) = prod_{i<m} (1 - M/(v-i)) with m = min(s, k), M = max(s, k), so short products
are summed term by term with log1p (full precision for tiny hit probabilities at 1M keys, where
lgamma differences of ~1e7 would lose digits); long ones use lgamma, whose error is then harmless.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["chance_of_hit", "expected_hits", "expected_key_selections", "format_read", "format_hits"]

_lgamma = np.frompyfunc(math.lgamma, 1, 1)


def _log_gamma(x: np.ndarray) -> np.ndarray:
    return _lgamma(x).astype(np.float64)


def _clean(visible, span, picks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v, s, p = (np.asarray(a, dtype=np.float64) for a in (visible, span, picks))
    v, s, p = np.broadcast_arrays(v, s, p)
    if np.any(v < 0) or np.any(s < 0) or np.any(p < 0):
        raise ValueError("chance: visible, span and picks must be >= 0")
    k = np.minimum(p, v)
    s = np.minimum(s, v)
    return v, s, k


_PRODUCT_TERMS = 4096        # up to this many factors the product is summed exactly
_CHUNK_CELLS = 1 << 22       # rows x terms evaluated at once (bounded memory for big arrays)


def _log_miss(v: np.ndarray, s: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log(C(v-s, k) / C(v, k)) for 1-d arrays with v - s >= k, s > 0, k > 0."""
    small, big = np.minimum(s, k), np.maximum(s, k)
    out = np.empty(v.shape, dtype=np.float64)
    long = small > _PRODUCT_TERMS
    if np.any(long):
        vl, sl, kl = v[long], s[long], k[long]
        out[long] = (_log_gamma(vl - sl + 1) - _log_gamma(vl - sl - kl + 1)
                     - _log_gamma(vl + 1) + _log_gamma(vl - kl + 1))
    idx = np.nonzero(~long)[0]
    if idx.size:
        width = int(small[idx].max())
        rows = max(1, _CHUNK_CELLS // max(width, 1))
        i = np.arange(width, dtype=np.float64)
        for start in range(0, idx.size, rows):
            sel = idx[start:start + rows]
            past = i[None, :] >= small[sel, None]        # padding beyond this row's own terms
            denom = np.where(past, 1.0, v[sel, None] - i[None, :])
            terms = np.where(past, 0.0, np.log1p(-np.where(past, 0.0, big[sel, None]) / denom))
            out[sel] = terms.sum(axis=1)
    return out


def chance_of_hit(visible, span, picks) -> np.ndarray | float:
    """P(at least one of `picks` distinct uniform picks among `visible` keys lands in `span` keys).

    Vectorised over numpy arrays (broadcast); scalars in give a float out. span 0 or no picks
    gives 0; span >= visible or k > visible - span (too many picks to miss) gives 1.
    """
    v, s, k = _clean(visible, span, picks)
    out = np.zeros(v.shape, dtype=np.float64)
    miss_possible = (v - s) >= k
    some = (s > 0) & (k > 0)
    out[some & ~miss_possible] = 1.0
    m = some & miss_possible
    if np.any(m):
        out[m] = np.clip(-np.expm1(np.minimum(_log_miss(v[m], s[m], k[m]), 0.0)), 0.0, 1.0)
    return float(out) if out.ndim == 0 else out


def expected_hits(visible, span, picks) -> np.ndarray | float:
    """Expected number of random picks inside the span: k * span / visible (0 where nothing is visible)."""
    v, s, k = _clean(visible, span, picks)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(v > 0, k * s / np.where(v > 0, v, 1.0), 0.0)
    return float(out) if out.ndim == 0 else out


def expected_key_selections(queries: np.ndarray, picks: int, edges: np.ndarray) -> np.ndarray:
    """Selections of keys in each range [edges[b], edges[b+1]) that uniformly random top-k picks would make.

    Args:
        queries (np.ndarray): [T] how many queries were made at each position 0..T-1 (each sees keys 0..q).
        picks (int): keys each query selects (the DSA top-k; a query seeing fewer selects them all).
        edges (np.ndarray): [bins + 1] ascending range edges in positions (fractional edges split a key).

    A query at q picks each visible key with probability min(k, q + 1) / (q + 1), so key p expects
    sum over q >= p of that: a suffix sum, O(T) with no [T, T] array. Returns float64 [bins].
    """
    queries = np.asarray(queries, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    q = np.arange(len(queries), dtype=np.float64)
    rate = queries * np.minimum(float(picks), q + 1) / (q + 1)
    per_key = np.cumsum(rate[::-1])[::-1]  # expected selections of the key at each position
    cum = np.concatenate([[0.0], np.cumsum(per_key)])
    at_edges = np.interp(edges, np.arange(len(cum), dtype=np.float64), cum, left=0.0, right=cum[-1])
    return np.diff(at_edges)


def _ratio(observed: float, chance: float) -> str:
    if chance <= 0:
        return "n/a" if observed <= 0 else "inf"
    r = observed / chance
    return f"{r:.1f}x" if r < 100 else f"{r:.0f}x"


def format_read(observed_rate: float, chance_rate: float) -> str:
    """'43% read, chance 49%, 0.9x': an observed read rate beside its chance value and their ratio."""
    return f"{observed_rate * 100:.0f}% read, chance {_pct(chance_rate)}, {_ratio(observed_rate, chance_rate)}"


def format_hits(observed: float, expected: float) -> str:
    """'120 hits, expected 13.4, 9.0x': an aggregate hit count beside its chance expectation."""
    return f"{observed:g} hits, expected {expected:.3g}, {_ratio(observed, expected)}"


def _pct(p: float) -> str:
    # small chance values must not print as a misleading "0%"
    if p <= 0:
        return "0%"
    if p < 0.01:
        return f"{p * 100:.2g}%"
    return f"{p * 100:.0f}%"
