"""Statistics of the KDA recurrent state for the `kda.state` probe (measured only when requested).

- `state_norm(S)`: Frobenius norm of each head's state S [K, V], how full the memory is.
- `state_max_abs(S)`: max |S| per head, whether single entries saturate.
- `interval_means(series, ends)`: the mean of a per-token series (decay exp(g) averaged over
  channels, or beta) over each interval between two measurements, from one prefix sum over time
  (no Python loop over intervals, no device synchronisation: `ends` may live on the device).
- `state_effective_rank(S)`: exp of the entropy of the normalised singular values per head (one
  SVD of K x V per head: the policy samples the boundaries it runs at).
- `interval_half_life(g, ends, positions)`: per-channel half-life ln 2 / -mean(g) over each interval,
  as the median over channels and the share of "global" channels outliving the context so far.
"""

from __future__ import annotations

import torch


def state_norm(S: torch.Tensor) -> torch.Tensor:
    """S `[B, H, K, V]` -> `[B, H]` Frobenius norm per head."""
    return torch.linalg.vector_norm(S, dim=(-2, -1))


def state_max_abs(S: torch.Tensor) -> torch.Tensor:
    """S `[B, H, K, V]` -> `[B, H]` largest |entry| per head."""
    return S.abs().amax(dim=(-2, -1))


def interval_means(series: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Means of `series` over the intervals closed by each measurement.

    Args:
        series (torch.Tensor): `[B, T, H]` per-token values of this forward call.
        ends (torch.Tensor): `[n]` int64, ascending call-relative tokens after which the state was
            measured; interval i covers tokens `ends[i-1] + 1 .. ends[i]` (the first starts at 0).

    Returns:
        `[B, n, H]` in series' dtype.
    """
    begins = torch.cat((ends.new_zeros(1), ends[:-1] + 1))
    csum = torch.cat((series.new_zeros(series.shape[0], 1, series.shape[2]), series.cumsum(1)), 1)  # [B, T + 1, H]
    return (csum[:, ends + 1] - csum[:, begins]) / (ends - begins + 1).view(1, -1, 1)


def state_effective_rank(S: torch.Tensor) -> torch.Tensor:
    """S `[B, H, K, V]` -> `[B, H]` fp32 effective rank exp(-sum p log p), p = sigma / sum(sigma).

    1 for a rank-one state, min(K, V) when every direction holds the same energy; 0 for S = 0.
    """
    sigma = torch.linalg.svdvals(S.float())  # [B, H, min(K, V)]
    total = sigma.sum(-1, keepdim=True)
    p = sigma / total.clamp_min(torch.finfo(sigma.dtype).tiny)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return torch.where(total.squeeze(-1) > 0, entropy.exp(), torch.zeros_like(entropy))


def interval_half_life(g: torch.Tensor, ends: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay timescales over each measurement interval.

    Args:
        g (torch.Tensor): `[B, T, H, K]` per-channel log-decay (<= 0) of this forward call.
        ends (torch.Tensor): `[n]` int64 call-relative interval ends (as in `interval_means`).
        positions (torch.Tensor): `[n]` sequence positions of those ends (same device as g).

    Returns:
        (median half-life over channels `[B, n, H]`, share of channels whose half-life exceeds
        positions + 1 `[B, n, H]`), fp32; a channel that never decays has an infinite half-life.
    """
    B, T, H, K = g.shape
    mean_g = interval_means(g.float().reshape(B, T, H * K), ends).view(B, -1, H, K)  # [B, n, H, K]
    half = torch.log(torch.tensor(2.0, device=g.device)) / (-mean_g).clamp_min(0.0)  # inf where mean_g == 0
    median = half.median(-1).values  # lower median for even K (torch's convention)
    context = (positions.to(g.device).float() + 1).view(1, -1, 1, 1)
    return median, (half > context).float().mean(-1)
