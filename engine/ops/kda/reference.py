"""Kimi Delta Attention core in pure PyTorch: the recurrent form and the chunked form.

Per head, with state S in R^{K x V} (key rows, value columns), for every token t:
    S = diag(exp(g_t)) S                  g_t <= 0 is the per-channel log-decay
    u = beta_t (v_t - S^T k_t)            delta rule: write the prediction error
    S = S + k_t u^T
    o_t = S^T (scale * q_t)

The chunked form computes the same function for C tokens at a time (WY representation). Inside a
chunk, with G the cumulative log-decay from the chunk start:
    A[t, i]   = beta_t sum_d k_t[d] k_i[d] exp(G_t[d] - G_i[d])      (i < t)
    Aqk[t, i] =        sum_d q_t[d] k_i[d] exp(G_t[d] - G_i[d])      (i <= t)
    U = (I + A)^{-1} (beta V - beta (K exp(G)) S0)
    O = (Q exp(G)) S0 + Aqk U
    S_C = exp(G_C) S0 + (K exp(G_C - G))^T U
The pairwise factors exp(G_t - G_i) are formed as exp(G_t - G_r) * exp(G_r - G_i) with r the start of
i's sub-block, so every product is a matmul and no exponent ever exceeds the decay inside one
sub-block. The sub-block size is chosen per call so that this range stays far below fp32 overflow
(16 for K3's bounded gate; smaller, down to 1 = plain pairwise, for steep Kimi-Linear decays).

Both functions take q, k already L2-normalised, all in [B, T, H, *] layout, and compute in fp32.
"""

from __future__ import annotations

import torch

# largest in-sub-block log-decay range we factor through exp(): e^60 ~ 1e26, far from fp32's 3e38
_SAFE_RANGE = 60.0


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (decode path and the readable definition).

    Args:
        q (torch.Tensor): `[B, T, H, K]`, L2-normalised.
        k (torch.Tensor): `[B, T, H, K]`, L2-normalised.
        v (torch.Tensor): `[B, T, H, V]`.
        g (torch.Tensor): `[B, T, H, K]` log-decay (<= 0).
        beta (torch.Tensor): `[B, T, H]` write strength in (0, 1).
        initial_state (torch.Tensor, Optional): `[B, H, K, V]` fp32; zeros when None.
        scale (float, Optional): query scale, `K ** -0.5` by default.

    Returns:
        o `[B, T, H, V]` fp32 and the final state `[B, H, K, V]` fp32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # [B, H, K, V]
        k_t = k[:, t]  # [B, H, K]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)  # [B, H, V]
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def _sub_block_size(G: torch.Tensor, chunk: int) -> int:
    """Largest of 16, 4, 1 whose in-sub-block decay range is safe for every chunk of G."""
    for size in (16, 4, 2):
        if chunk % size:
            continue
        blocks = G.unflatten(-2, (-1, size))  # [..., nc, C/size, size, K]
        spread = blocks[..., 0:1, :] - blocks  # >= 0: decay from the sub-block start
        if spread.amax().item() < _SAFE_RANGE:
            return size
    return 1


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise decayed products inside each chunk.

    Args:
        q, k, G: `[..., C, K]` (any leading dims: batch, heads, chunks).
        sub: sub-block size (divides C).

    Returns:
        Aqk `[..., C, C]` (lower triangle incl. diagonal) and Akk `[..., C, C]` (strictly lower).
    """
    C = q.shape[-2]
    Aqk = q.new_zeros(*q.shape[:-1], C)
    Akk = q.new_zeros(*q.shape[:-1], C)
    for start in range(0, C, sub):
        end = start + sub
        ref = G[..., start:start + 1, :]  # [..., 1, K] the sub-block's first position
        k_b = k[..., start:end, :] * (ref - G[..., start:end, :]).exp()  # exponents >= 0, bounded
        rows = slice(start, C)
        decay_rows = (G[..., rows, :] - ref).exp()  # exponents <= 0
        Aqk[..., rows, start:end] = (q[..., rows, :] * decay_rows) @ k_b.transpose(-1, -2)
        Akk[..., rows, start:end] = (k[..., rows, :] * decay_rows) @ k_b.transpose(-1, -2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    Aqk = Aqk.masked_fill(~causal, 0.0)
    Akk = Akk.masked_fill(~causal.tril(-1), 0.0)
    return Aqk, Akk


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    group_tokens: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA: the same function as `kda_recurrent`, computed C tokens at a time.

    Intra-chunk work of up to `group_tokens` tokens is batched; only the state hand-off between
    chunks is sequential. Memory is O(group_tokens * C) per head, independent of T.

    Args: as `kda_recurrent`, plus `chunk_size` (C) and `group_tokens` (batching of chunks).

    Returns:
        o `[B, T, H, V]` fp32 and the final state `[B, H, K, V]` fp32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(B, T, H, V, dtype=torch.float32)
    group = max(C, group_tokens // C * C)
    for g0 in range(0, T, group):
        g1 = min(T, g0 + group)
        n = g1 - g0
        pad = (-n) % C
        # [B, H, n(+pad), *]; padded tokens have k = v = beta = 0 and g = 0: they leave S untouched
        qs, ks, vs, gs = (torch.nn.functional.pad(x[:, g0:g1].float().transpose(1, 2), (0, 0, 0, pad))
                          for x in (q, k, v, g))
        bs = torch.nn.functional.pad(beta[:, g0:g1].float().transpose(1, 2), (0, pad))
        nc = (n + pad) // C
        qc, kc, vc, gc = (x.unflatten(2, (nc, C)) for x in (qs, ks, vs, gs))  # [B, H, nc, C, *]
        bc = bs.unflatten(2, (nc, C)).unsqueeze(-1)  # [B, H, nc, C, 1]
        G = gc.cumsum(-2)
        qc = qc * scale
        Aqk, Akk = _intra_chunk(qc, kc, G, _sub_block_size(G, C))
        # (I + beta * Akk) is unit lower-triangular: one batched triangular solve per group
        lower = torch.eye(C, device=q.device) + bc * Akk
        rhs = torch.cat((bc * vc, bc * (kc * G.exp())), dim=-1)  # [B, H, nc, C, V + K]
        sol = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        U0, W = sol[..., :V], sol[..., V:]  # U = U0 - W S0
        q_decay = qc * G.exp()
        k_tail = kc * (G[..., -1:, :] - G).exp()  # decay from each token to the chunk end
        tail = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, nc, K, 1]
        out = torch.empty(B, H, nc, C, V, device=q.device)
        for c in range(nc):
            U = U0[:, :, c] - W[:, :, c] @ S  # [B, H, C, V]
            out[:, :, c] = q_decay[:, :, c] @ S + Aqk[:, :, c] @ U
            S = tail[:, :, c] * S + k_tail[:, :, c].transpose(-1, -2) @ U
        o[:, g0:g1] = out.flatten(2, 3)[:, :, :n].transpose(1, 2)
    return o, S
