"""2-D rotary position embedding of the MoonViT-V2 tower (spec section 8), in pure torch.

The head dim d holds d/2 adjacent pairs (2p, 2p+1) (not rotate-half). Pair 2i turns by
`column * f_i`, pair 2i+1 by `row * f_i`, with `f_i = theta^(-4i/d)` for i < d/4. Positions are
the patch's (row, col) inside its own image, starting at (0, 0) for every image.
"""

from __future__ import annotations

import torch


def rope2d_angles(grid: tuple[int, int], head_dim: int, theta: float = 10000.0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Rotation angle of every pair of every patch: `[h * w, head_dim / 2]` fp32, patches row-major."""
    h, w = grid
    i = torch.arange(head_dim // 4, device=device, dtype=torch.float64)
    freqs = theta ** (-4.0 * i / head_dim)  # [d/4]
    rows = torch.arange(h, device=device, dtype=torch.float64).repeat_interleave(w)  # [P]
    cols = torch.arange(w, device=device, dtype=torch.float64).repeat(h)  # [P]
    angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)  # [P, d/4, 2]: (col, row)
    return angles.reshape(h * w, head_dim // 2).float()  # pair 2i = col, pair 2i+1 = row


def apply_rope2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of `x` `[P, H, d]` by `angles` `[P, d/2]`; computed in fp32, returns x's dtype."""
    P, H, d = x.shape
    pairs = x.float().reshape(P, H, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [P, H, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [P, 1, d/2]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # [P, H, d/2, 2]
    return out.reshape(P, H, d).to(x.dtype)
