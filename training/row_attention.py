"""A DSA layer's dense attention from a few query rows, recomputed from the layer's own weights.

Used where training or a probe needs what the layer's heads attend to from chosen rows, with
gradients where wanted: the indexer's KL target (`training.distill`), the copy-attention targets
(`training.copy_targets`) and `training.jump_probe`. Only the rows' queries are computed, so the
largest tensor is [B, heads, rows, T], never [T, T]. No rotary: the MLA here is NoPE (spec section 4).
"""

from __future__ import annotations

import torch

from engine.layers.mla import GatedMLA


def row_attention_logp(module: GatedMLA, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, H, P, T] log of `module`'s dense causal attention from query rows `rows` [B, P] over every
    key of input `x` [B, T, D], recomputed from the module's own weights. Only the rows' queries are
    computed."""
    T = x.shape[1]
    H, nope = module.num_heads, module.nope
    xr = x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))                # [B, P, D]
    q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(xr))).unflatten(-1, (H, nope + module.rope))
    latent, k_rope = module.kv_a_proj_with_mqa(x).split([module.kv_lora_rank, module.rope], dim=-1)
    kv = module.kv_b_proj(module.kv_a_layernorm(latent)).unflatten(-1, (H, nope + module.v_dim))
    k = torch.cat((kv[..., :nope], k_rope.unsqueeze(2).expand(-1, -1, H, -1)), -1)  # [B, T, H, Dk]
    scores = torch.einsum("bphd,bthd->bhpt", q.float(), k.float()) * module.scale
    invisible = torch.arange(T, device=x.device)[None, None, :] > rows[:, :, None]   # [B, P, T]
    return torch.log_softmax(scores.masked_fill(invisible[:, None], float("-inf")), dim=-1)
