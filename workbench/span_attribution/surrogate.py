"""The sparse linear surrogate of ablation masks (ContextCite's method, written here in numpy): random
masks keep each span with probability 1/2; a Lasso fit of the target's log-probability on the masks
gives each span a weight (what keeping it adds, in nats); its LDS on held-out masks (the Spearman
correlation of predicted and measured log-probabilities, each mask predicted by a fit that never saw
it: `held_out_predictions`) says how far to trust the ranking.

Coordinate descent on centred data, the penalty chosen by k-fold cross-validation over a log grid
(a handful of candidates a few hundred masks wide: milliseconds). No scikit-learn in this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def random_masks(count: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """`[count, width]` bool: True = the span is kept (each with probability 1/2, independently)."""
    return rng.random((count, width)) < 0.5


def lasso(X: np.ndarray, y: np.ndarray, alpha: float, iterations: int = 500, tol: float = 1e-7
          ) -> tuple[np.ndarray, float]:
    """Weights `w` `[d]` and intercept of min 1/(2n) |y - X w - b|^2 + alpha |w|_1 (cyclic coordinate descent)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, d = X.shape
    mean_x, mean_y = X.mean(0), y.mean()
    Xc, yc = X - mean_x, y - mean_y
    norms = (Xc ** 2).sum(0) / n
    w = np.zeros(d)
    residual = yc.copy()
    for _ in range(iterations):
        largest = 0.0
        for j in range(d):
            if norms[j] == 0.0:
                continue
            old = w[j]
            rho = Xc[:, j] @ residual / n + norms[j] * old
            new = np.sign(rho) * max(abs(rho) - alpha, 0.0) / norms[j]
            if new != old:
                residual -= Xc[:, j] * (new - old)
                w[j] = new
                largest = max(largest, abs(new - old))
        if largest < tol:
            break
    return w, float(mean_y - mean_x @ w)


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when either side is constant or n < 3."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    ra, rb = _ranks(a), _ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):  # ties share their average rank
        same = x == value
        if same.sum() > 1:
            ranks[same] = ranks[same].mean()
    return ranks


@dataclass
class Surrogate:
    """A fitted surrogate: `weights` `[d]` (nats added by keeping each span; hiding it: `-weights`),
    `intercept`, the penalty `alpha` cross-validation chose, and `lds` on held-out masks (None when not
    measured or undefined)."""

    weights: np.ndarray
    intercept: float
    alpha: float
    lds: float | None = None

    def predict(self, masks: np.ndarray) -> np.ndarray:
        return masks.astype(np.float64) @ self.weights + self.intercept


def held_out_predictions(X: np.ndarray, y: np.ndarray, alpha: float, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Each mask's prediction by a surrogate fitted (at penalty `alpha`) on the other folds only: every
    mask is held out once, so a Spearman correlation over all of them is an LDS on held-out masks with
    `folds` times fewer masks than a single held-out set would leave to the fit."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    order = np.random.default_rng(seed + 1).permutation(n)
    out = np.empty(n)
    for k in range(folds):
        held = order[k::folds]
        train = np.setdiff1d(order, held)
        w, b = lasso(X[train], y[train], alpha)
        out[held] = X[held] @ w + b
    return out


def fit(X: np.ndarray, y: np.ndarray, folds: int = 4, grid: int = 12, seed: int = 0) -> Surrogate:
    """The Lasso surrogate with its penalty chosen by `folds`-fold cross-validation (squared error) over
    `grid` values from the smallest penalty that zeroes every weight down to 1/1000 of it."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    top = float(np.abs((X - X.mean(0)).T @ (y - y.mean())).max() / n) if n else 0.0
    if top == 0.0:
        return Surrogate(np.zeros(X.shape[1]), float(y.mean()) if n else 0.0, 0.0)
    alphas = top * np.logspace(0, -3, grid)
    order = np.random.default_rng(seed).permutation(n)
    parts = [order[i::folds] for i in range(folds)] if n >= 2 * folds else []
    best, best_error = alphas[-1], np.inf
    for alpha in alphas:
        if not parts:
            break
        error = 0.0
        for held in parts:
            train = np.setdiff1d(order, held)
            w, b = lasso(X[train], y[train], alpha)
            error += float(((X[held] @ w + b - y[held]) ** 2).sum())
        if error < best_error - 1e-12:
            best, best_error = alpha, error
    w, b = lasso(X, y, best)
    return Surrogate(w, b, float(best))


__all__ = ["random_masks", "lasso", "spearman", "Surrogate", "fit", "held_out_predictions"]
