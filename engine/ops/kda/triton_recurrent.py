"""Fused recurrent KDA in Triton: the decode path (reference: `engine.ops.kda.reference.kda_recurrent`).

One program owns one (sequence, head, value block): it keeps its [K, BLOCK_V] slice of the state
S in registers for all T tokens, so decode reads and writes the state once per call instead of
once per elementwise op:
    S = diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  o_t = S^T (scale q_t)
Value columns are independent in this recurrence (k, g, beta act on rows), which is what makes the
split over value blocks exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kda_recurrent_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, T, H, scale,
                             K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)  # b * H + h
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rk = tl.arange(0, K).to(tl.int64)
    rv = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    vmask = rv < V
    s_ptrs = state_ptr + pid_bh * K * V + rk[:, None] * V + rv[None, :]
    S = tl.load(s_ptrs, mask=vmask[None, :], other=0.0).to(tl.float32)  # [K, BLOCK_V]
    for t in range(T):
        row = (b * T + t) * H + h  # token t of sequence b, head h, in [B, T, H, *] layout
        q = tl.load(q_ptr + row * K + rk).to(tl.float32)
        k = tl.load(k_ptr + row * K + rk).to(tl.float32)
        g = tl.load(g_ptr + row * K + rk).to(tl.float32)
        v = tl.load(v_ptr + row * V + rv, mask=vmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.sum(S * k[:, None], axis=0))  # [BLOCK_V]
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + row * V + rv, o, mask=vmask)
    tl.store(s_ptrs, S, mask=vmask[None, :])


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference (`[B, T, H, K]` inputs, fp32 state `[B, H, K, V]`), no observer."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert K & (K - 1) == 0, "the KDA key dimension must be a power of two"
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = (torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float().clone().contiguous())
    out = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    block_v = min(32, triton.next_power_of_2(V))
    grid = (B * H, triton.cdiv(V, block_v))
    kda_recurrent_fwd_kernel[grid](q, k, v, g, beta, state, out, T, H, scale, K=K, V=V, BLOCK_V=block_v)
    return out, state
