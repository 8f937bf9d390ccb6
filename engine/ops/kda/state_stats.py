"""Statistics of the KDA recurrent state for the `kda.state` probe (measured only when requested).

- `state_norm(S)`: Frobenius norm of each head's state S [K, V], how full the memory is.
- `state_max_abs(S)`: max |S| per head, whether single entries saturate.
- `interval_means(series, ends)`: the mean of a per-token series (decay exp(g) averaged over
  channels, or beta) over each interval between two measurements, from one prefix sum over time
  (no Python loop over intervals, no device synchronisation: `ends` may live on the device).
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
