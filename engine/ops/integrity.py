"""Integrity checks of the model's running state, as plain functions on tensors.

Silent corruption of a deployment's state shows in numbers the layers already hold: a KDA state
that went non-finite or grew without bound, a decay that the running precision rounds to exactly
1.0 (a channel that never forgets), a DSA selection or an expert choice decided by a tie rather
than by a score, a chunked prefill whose state differs from the same tokens run one by one, a
restored state that is not the one that was saved. Each check here takes tensors and returns a
verdict per row; the layers call them when a listener asks (`engine.probes` optional fields), the
workbench turns them into the trace's health table, and `workbench conformance` can call them on
tensors it captured from any engine. None builds a [T, T] matrix or reads the context twice.

Tie-break rule of the DSA selection (both the reference and the decode step's masked path): the
keys with the largest scores, and among keys tied at the k-th score the earliest positions. So a
recording replays the same selection, and `dsa_ties` says which rows that rule decided.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, TypeVar

import numpy as np
import torch

# the verdicts below take torch tensors or numpy arrays alike (the recorder checks a CPU decode's rows in numpy)
Array = TypeVar("Array", torch.Tensor, np.ndarray)


def _isfinite(x: Array) -> Array:
    return np.isfinite(x) if isinstance(x, np.ndarray) else torch.isfinite(x)


def kda_state_faults(norm: Array, bound: float) -> Array:
    """Per-head state norms `[..., H]` -> bool `[..., H]`: the state is non-finite (its Frobenius norm is
    NaN or inf exactly when an entry is) or its norm exceeds `bound`."""
    return ~_isfinite(norm) | (norm > bound)


def frozen_channels(g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Log-decays g `[..., K]` -> `[...]` float32: how many channels decay by exactly 1.0 (never forget)
    once exp(g) is rounded to `dtype` (the precision the state update runs in). In fp32 only
    |g| < ~6e-8 rounds to 1; in bf16 every decay above ~0.998 does."""
    decay = torch.exp(g.float())
    return ((decay if dtype == torch.float32 else decay.to(dtype)) == 1.0).sum(-1, dtype=torch.float32)


def topk_ties(scores: torch.Tensor, kth: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie band at rank k of each row of a top-k selection.

    Args:
        scores: `[..., n]` every candidate's score (-inf = not a candidate).
        kth: `[...]` the k-th largest score of each row (the smallest selected).
        selected: `[..., k]` the selected candidates' scores (-inf = empty slot).

    Returns:
        band `[...]` int64: how many candidates score exactly the k-th score (0 where the row keeps
        every candidate, i.e. the k-th score is not finite), and cut `[...]` int64: how many of those
        were left out (> 0: the tie-break, not the score, decided the selection).
    """
    finite = torch.isfinite(kth)
    at_kth = kth.unsqueeze(-1)
    band = (scores == at_kth).sum(-1) * finite
    return band, band - (selected == at_kth).sum(-1) * finite


def router_faults(logits: torch.Tensor, choice: torch.Tensor, ids: torch.Tensor,
                  picked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE router checks per token.

    Args:
        logits: `[N, E]` router logits (before the sigmoid).
        choice: `[N, E]` the scores the top-k ran on (sigmoid + correction bias).
        ids: `[N, k]` the chosen experts.
        picked: `[N, k]` their choice scores when the top-k already gave them (else gathered here).

    Returns:
        nonfinite `[N]` int64: non-finite logits; boundary_ties `[N]` int64: experts left out whose
        choice score equals the k-th chosen one (> 0: a tie at the top-k boundary decided the route).
    """
    nonfinite = logits.shape[-1] - torch.isfinite(logits).sum(-1)
    picked = choice.gather(-1, ids) if picked is None else picked
    kth = picked.amin(-1)
    _, cut = topk_ties(choice, kth, picked)
    return nonfinite, cut


def router_boundary(logits: torch.Tensor, choice: torch.Tensor, top_values: torch.Tensor,
                    top_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a router step keeps for its checks, in three cheap ops (the verdicts come later, in bulk:
    `router_verdicts`): logit sum `[N]`, the k-th chosen choice score `[N]` (the top-k's own sorted
    values) and the best score left out `[N]`."""
    runner_up = choice.scatter(-1, top_ids, float("-inf")).amax(-1)
    return logits.sum(-1), top_values[..., -1], runner_up


# The same measures over one sequence's rows, from the tensors a step already holds (`engine.probes.Deferred`:
# eager decode steps hand these over by reference and the recorder computes them once over many steps).
def unmeasured_drift(g: torch.Tensor) -> torch.Tensor:
    """Log-decays `[B, n, H, K]` -> `[B, n, H]` NaN: `drift` of token-by-token calls (nothing to compare)."""
    return g.new_full(g.shape[:3], float("nan"), dtype=torch.float32)


def router_logit_sums(logits: torch.Tensor) -> torch.Tensor:
    """Router logits `[n, E]` of one sequence -> `[1, n]` (`router_boundary`'s logit sum)."""
    return logits.sum(-1).unsqueeze(0)


def router_kth_choice(top_values: torch.Tensor) -> torch.Tensor:
    """The top-k's sorted values `[n, k]` of one sequence -> `[1, n]` the k-th chosen choice score."""
    return top_values[:, -1].unsqueeze(0)


def router_runner_up(choice: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Choice scores `[n, E]` and the chosen ids `[n, k]` of one sequence -> `[1, n]` the best score left out."""
    return choice.scatter(-1, top_ids, float("-inf")).amax(-1).unsqueeze(0)


def router_verdicts(logit_sum: Array, kth: Array, runner_up: Array) -> tuple[Array, Array]:
    """`router_boundary`'s values -> (a router logit is non-finite, a tie at the top-k boundary decided the
    route), bool each."""
    return ~_isfinite(logit_sum), (kth == runner_up) & _isfinite(kth)


def state_drift(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Relative difference per head of two states `[B, H, K, V]` -> `[B, H]` float32:
    ||a - b||_F / max(||a||_F, 1e-6) (NaN in either gives NaN: a fault in itself)."""
    diff = torch.linalg.vector_norm((reference.float() - other.float()), dim=(-2, -1))
    return diff / torch.linalg.vector_norm(reference.float(), dim=(-2, -1)).clamp_min(1e-6)


def chunked_vs_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         initial: torch.Tensor | None, chunked_state: torch.Tensor) -> torch.Tensor:
    """The state a chunked prefill left after these tokens against the same tokens run one by one.

    Args:
        q, k, v, g, beta: a bounded window of one KDA layer's inputs (`[B, T, H, K]`, beta `[B, T, H]`),
            the window the chunked kernel ran over from `initial`.
        initial: `[B, H, K, V]` the state before the window (None: zeros).
        chunked_state: `[B, H, K, V]` the state the chunked kernel left after the window.

    Returns:
        `[B, H]` relative drift (`state_drift`); fp32 chunked and recurrent forms agree to ~1e-5.
    """
    from engine.ops.kda.reference import kda_recurrent

    _, state = kda_recurrent(q, k, v, g, beta, initial)
    return state_drift(state, chunked_state)


def state_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (hex, 32 characters) over named tensors' float32 bytes in the given order: equal for a
    state and its exact copy (a snapshot, a restore, a fork), different after any change of a value."""
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]
