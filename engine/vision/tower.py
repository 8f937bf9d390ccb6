"""MoonViT-V2 tower, 2x2 patch merge and `patchmergerv2` projector as nn.Modules (spec section 8).

Parameter names are the checkpoint's: `VisionModel().state_dict()` has exactly the keys
`vision_tower.patch_embed.proj.weight`, `vision_tower.patch_embed.pos_emb.weight`,
`vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.weight`,
`vision_tower.encoder.final_layernorm.weight`, `mm_projector.proj.{0,2}.weight`,
`mm_projector.post_norm.weight`, so a checkpoint loads by name (no biases anywhere).

- `PatchEmbed`: stride-14 conv + the learned position table resized bilinearly to the grid.
- `VisionBlock`: pre-norm attention with 2-D RoPE (blockwise, `engine.vision.attention`) and a
  tanh-GELU MLP; the three tower RMSNorms use float32 machine epsilon.
- `merge_patches`: 2x2 windows concatenated in the order (0,0), (0,1), (1,0), (1,1), merged
  tokens row-major over (h/2, w/2).
- `Projector`: Linear -> exact (erf) GELU -> Linear -> RMSNorm(rms_norm_eps).
- `VisionModel.embed(image)`: pixels -> `[(h/2)(w/2), text_hidden]` language-model embeddings.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.layers.common import RMSNorm
from engine.vision.attention import image_attention
from engine.vision.rope import apply_rope2d, rope2d_angles


class PositionTable(nn.Module):
    """Learned `[H0, W0, D]` table; an image of grid (h, w) reads it resized bilinearly."""

    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(height, width, dim))

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        """`[h * w, D]`, row-major."""
        H0, W0, D = self.weight.shape
        if tuple(grid) == (H0, W0):
            return self.weight.reshape(H0 * W0, D)
        table = self.weight.permute(2, 0, 1)[None]  # [1, D, H0, W0]
        resized = F.interpolate(table.float(), size=tuple(grid), mode="bilinear", align_corners=False,
                                antialias=False)  # [1, D, h, w]
        return resized[0].permute(1, 2, 0).reshape(grid[0] * grid[1], D).to(self.weight.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size, bias=False)
        self.pos_emb = PositionTable(c.pos_emb_height, c.pos_emb_width, c.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """`[P, 3, p, p]` -> `[P, D]`."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [P, D]
        return x + self.pos_emb(grid).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """x += wo(attn(rope2d(wqkv(norm0 x)))); x += fc1(gelu_tanh(fc0(norm1 x)))."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.norm0 = RMSNorm(c.hidden_size, c.tower_norm_eps)
        self.norm1 = RMSNorm(c.hidden_size, c.tower_norm_eps)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.qkv_hidden_size, bias=False)  # rows [q | k | v], head-major
        self.wo = nn.Linear(c.qkv_hidden_size, c.hidden_size, bias=False)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size)
        self.reference_attention = False

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """`x` `[P, D]` of one image, `angles` `[P, head_dim / 2]` from `rope2d_angles`."""
        P = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).view(P, 3, self.num_heads, self.head_dim)  # [P, 3, H, d]
        q, k = apply_rope2d(qkv[:, 0], angles), apply_rope2d(qkv[:, 1], angles)  # [P, H, d]
        o = image_attention(q, k, qkv[:, 2], self.head_dim ** -0.5, reference=self.reference_attention)
        x = x + self.wo(o.reshape(P, -1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.num_layers))
        self.final_layernorm = RMSNorm(c.hidden_size, c.tower_norm_eps)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, angles)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """Patch embedding + blocks + final norm for one image: `[P, 3, p, p]` -> `[P, D]`."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.encoder = VisionEncoder(c)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        c = self.config
        if pixel_values.shape[0] != grid[0] * grid[1]:
            raise ValueError(f"{pixel_values.shape[0]} patches do not fill a {grid[0]}x{grid[1]} grid")
        angles = rope2d_angles(grid, c.head_dim, c.rope_theta, device=pixel_values.device)
        return self.encoder(self.patch_embed(pixel_values, grid), angles)


def merge_patches(x: torch.Tensor, grid: tuple[int, int], kernel: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """`[h * w, D]` -> `[(h / kh) * (w / kw), kh * kw * D]`: each window's patches concatenated
    row by row ((0,0), (0,1), (1,0), (1,1) for 2x2), merged tokens row-major."""
    (h, w), (kh, kw) = grid, kernel
    D = x.shape[-1]
    windows = x.reshape(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4)  # [h/kh, w/kw, kh, kw, D]
    return windows.reshape((h // kh) * (w // kw), kh * kw * D)


class Projector(nn.Module):
    """`patchmergerv2`: RMSNorm(Linear(GELU_erf(Linear(merged)))); no pre-norm."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        m = c.merged_hidden_size
        self.proj = nn.Sequential(nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, c.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(c.text_hidden_size, c.projector_norm_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))


class VisionModel(nn.Module):
    """Tower + merge + projector. The state dict keys are the checkpoint's vision tensor names.

    Replicated on every rank under torchrun (it is small: 0.45 B parameters, 0.9 GB in bf16 at
    K3.1 Pro size), so every rank computes the same image embeddings.
    """

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.vision_tower = VisionTower(c)
        self.mm_projector = Projector(c)

    def set_reference_attention(self, on: bool = True) -> None:
        """Run every block's attention through the pure-torch online softmax instead of SDPA."""
        for block in self.vision_tower.encoder.blocks:
            block.reference_attention = on

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image: `[P, 3, p, p]` with grid (h, w) -> `[(h/2)(w/2), text_hidden]`."""
        c = self.config
        if grid[0] % c.merge_kernel[0] or grid[1] % c.merge_kernel[1]:
            raise ValueError(f"grid {grid} is not a multiple of the merge kernel {c.merge_kernel}")
        x = self.vision_tower(pixel_values, grid)
        return self.mm_projector(merge_patches(x, grid, c.merge_kernel))

    def embed(self, images: Sequence) -> list[torch.Tensor]:
        """`ProcessedImage`s -> one `[tokens, text_hidden]` tensor each, in order (block-diagonal:
        every image attends only to itself)."""
        device = self.mm_projector.post_norm.weight.device
        return [self(im.pixel_values.to(device), im.grid) for im in images]
