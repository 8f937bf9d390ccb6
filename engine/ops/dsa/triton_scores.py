"""DSA index scores in Triton (GPU path; the reference is `engine.ops.dsa.reference.indexer_scores`).

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * D^-0.5)

One program computes a [BLOCK_Q, BLOCK_K] tile of I, looping over the indexer heads in registers:
the [T, H, S] per-head logits never reach memory (the reference materialises them), which is what
makes the O(T) scan of decode and the O(T^2) scoring of prefill memory-bound on the keys only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dsa_scores_fwd_kernel(q_ptr, w_ptr, k_ptr, out_ptr, Tq, Tk, scale,
                          H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rq = (pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)).to(tl.int64)
    rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rd = tl.arange(0, D).to(tl.int64)
    keys = tl.load(k_ptr + b * Tk * D + rk[:, None] * D + rd[None, :], mask=rk[:, None] < Tk, other=0.0)
    acc = tl.zeros((BLOCK_Q, BLOCK_K), dtype=tl.float32)
    for h in tl.static_range(H):
        q = tl.load(q_ptr + b * Tq * H * D + rq[:, None] * (H * D) + h * D + rd[None, :],
                    mask=rq[:, None] < Tq, other=0.0)
        w = tl.load(w_ptr + b * Tq * H + rq * H + h, mask=rq < Tq, other=0.0).to(tl.float32)
        # ieee: fp32 scores exactly as the reference computes them (tf32 would reorder near-ties)
        logits = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
        acc += w[:, None] * tl.maximum(logits, 0.0)
    tl.store(out_ptr + b * Tq * Tk + rq[:, None] * Tk + rk[None, :], acc,
             mask=(rq[:, None] < Tq) & (rk[None, :] < Tk))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, Tq, H, D], w [B, Tq, H], k [B, Tk, D] -> scores [B, Tq, Tk] fp32 (no causal mask)."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    assert D >= 16 and D & (D - 1) == 0, "the indexer head dimension must be a power of two >= 16"
    q, w, k = q.contiguous(), w.float().contiguous(), k.contiguous()
    out = torch.empty(B, Tq, Tk, dtype=torch.float32, device=q.device)
    block_q, block_k = 32, 64
    grid = (triton.cdiv(Tq, block_q), triton.cdiv(Tk, block_k), B)
    dsa_scores_fwd_kernel[grid](q, w, k, out, Tq, Tk, D ** -0.5, H=H, D=D, BLOCK_Q=block_q, BLOCK_K=block_k)
    return out
