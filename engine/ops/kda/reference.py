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
The pairwise factors exp(G_t - G_i) are formed as exp(G_t - G_r) * exp(G_r - G_i) with r the first
position of t's sub-block (`_intra_chunk`): for keys before r both exponents are <= 0, so those
products are matmuls that cannot overflow. Keys inside t's sub-block join the same matmul while the
decay inside a sub-block stays below e^40 (sub-blocks of 16, or 8: K3's bounded gate always fits);
steeper decays (Kimi-Linear) get those few pairs formed directly. Factors below e^-40 are flushed
to exact zeros so that no denormal float reaches a matmul (x86 runs those in slow microcode).

Both functions take q, k already L2-normalised, all in [B, T, H, *] layout, and compute in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch

# largest in-sub-block log-decay range factored through exp(): e^40 ~ 2e17, far from fp32's 3e38
_SAFE_RANGE = 40.0
# decay factors below e^-40 (< 5e-18) are flushed to exact zeros: a product of two kept factors
# then stays a normal float (> e^-80), and x86 CPUs run arithmetic on denormal floats through
# microcode, many times slower
_NEGLIGIBLE = -_SAFE_RANGE
_BELOW_NEGLIGIBLE = float(torch.nextafter(torch.tensor(_NEGLIGIBLE), torch.tensor(float("-inf"))))


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) with negligible factors (exponent < -40) set to exactly 0.

    Only for factors whose partner in a product is <= 1 in magnitude, so the dropped part of any
    product is below 5e-18.
    """
    # one pass (keep above the bound, else -inf) instead of a comparison, a mask fill and an exp: this
    # runs on every [chunk, K] block of the prefill, ~2x faster; the bound is the float just below
    # _NEGLIGIBLE so that exactly _NEGLIGIBLE is kept, as the definition says
    return torch.nn.functional.threshold(log_decay, _BELOW_NEGLIGIBLE, float("-inf")).exp_()


StateObserver = Callable[[int, torch.Tensor], None]


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    observe: StateObserver | None = None,
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
        observe (callable, Optional): called as `observe(t, S)` after every token t (for probes).

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
        if observe is not None:
            observe(t, S)
    return o, S


def _flush_tiny(x: torch.Tensor) -> torch.Tensor:
    """Entries below 1e-30 in magnitude set to 0 (negligible, and they would breed denormals)."""
    return x.masked_fill(x.abs() < 1e-30, 0.0)


def _sub_block(G: torch.Tensor) -> tuple[int, bool]:
    """Sub-block size for `_intra_chunk`, and whether keys inside a sub-block factor through its start.

    16 when every sub-block's decay range (G at its start minus G at its end) is below _SAFE_RANGE,
    else 8 (K3's bounded gate, >= -5 per token, always fits: 7 steps x 5 = 35); steeper decays use 8
    with exact pairwise products inside the sub-block.
    """
    C = G.shape[-2]
    for sub in (16, 8):
        starts = list(range(0, C, sub))
        ends = [min(s + sub, C) - 1 for s in starts]
        if (G[..., starts, :] - G[..., ends, :]).amax().item() < _SAFE_RANGE:
            return sub, True
    return 8, False


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise decayed products inside each chunk.

    The factor exp(G_t - G_i) of query t and key i <= t is split at r, the first position of t's
    sub-block: exp(G_t - G_r) * exp(G_r - G_i). For keys before r both exponents are <= 0, so those
    products are one matmul per sub-block that cannot overflow, however steep the decay. Keys inside
    t's own sub-block have G_r - G_i >= 0: while that in-sub-block range stays below _SAFE_RANGE (K3's
    bounded gate, mild decays) they join the same matmul; steeper decays (Kimi-Linear's softplus form
    can drop by tens per token) get their sub x sub pairs formed directly instead.

    Args:
        q, k, G: `[..., C, K]` (any leading dims: batch, heads, chunks).

    Returns:
        Aqk `[..., C, C]` (lower triangle incl. diagonal) and Akk `[..., C, C]` (strictly lower).
    """
    C = q.shape[-2]
    sub, factor_inside = _sub_block(G)
    starts = range(0, C, sub)
    Aqk = q.new_zeros(*q.shape[:-1], C)
    Akk = q.new_zeros(*q.shape[:-1], C)
    for s0 in starts:
        s1 = min(C, s0 + sub)
        ref = G[..., s0:s0 + 1, :]  # [..., 1, K]
        # [..., sub, K]; exponents <= 0 and, where keys inside join the matmul, above -_SAFE_RANGE
        from_ref = _decay(G[..., s0:s1, :] - ref)
        q_rows, k_rows = q[..., s0:s1, :] * from_ref, k[..., s0:s1, :] * from_ref
        n_keys = s1 if factor_inside else s0  # keys whose decay goes through ref
        if n_keys:
            # exponents <= 0 for keys before ref; below _SAFE_RANGE inside the sub-block
            k_ref = k[..., :n_keys, :] * _decay(ref - G[..., :n_keys, :])
            Aqk[..., s0:s1, :n_keys] = q_rows @ k_ref.transpose(-1, -2)
            Akk[..., s0:s1, :n_keys] = k_rows @ k_ref.transpose(-1, -2)
        if not factor_inside:
            Gs = G[..., s0:s1, :]
            # exact decays [..., t, i, K]; future pairs (t < i) are clamped to exp(0) and masked below
            decayed_k = _decay((Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).clamp_max(0.0)) * k[..., s0:s1, :].unsqueeze(-3)
            Aqk[..., s0:s1, s0:s1] = (q[..., s0:s1, :].unsqueeze(-2) * decayed_k).sum(-1)
            Akk[..., s0:s1, s0:s1] = (k[..., s0:s1, :].unsqueeze(-2) * decayed_k).sum(-1)
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
    observe: StateObserver | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA: the same function as `kda_recurrent`, computed C tokens at a time.

    Intra-chunk work of up to `group_tokens` tokens is batched; only the state hand-off between
    chunks is sequential. Memory is O(group_tokens * C) per head, independent of T.

    Args: as `kda_recurrent`, plus `chunk_size` (C) and `group_tokens` (batching of chunks);
        `observe(t, S)` is called at every chunk boundary (t = last token of the chunk) and at T - 1.

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
        out, S = _chunk_group(q[:, g0:g1], k[:, g0:g1], v[:, g0:g1], g[:, g0:g1], beta[:, g0:g1], S, scale, C,
                              None if observe is None else (lambda t, S, g0=g0: observe(min(T - 1, g0 + t), S)))
        o[:, g0:g1] = out.transpose(1, 2)
    return o, S


def _chunk_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 S: torch.Tensor, scale: float, C: int,
                 observe: StateObserver | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One group of `kda_chunked` (`[B, n, H, *]` slices, n tokens): its chunks' intra-chunk work batched,
    then the state handed from chunk to chunk. Returns (o `[B, H, n, V]`, the state after it); `observe(t,
    S)` gets t = the chunk's end relative to the group's start (past n when the last chunk is padded).
    A function of its own so that its buffers (a dozen of `[B, H, n, K]`) are freed before the next group
    makes its own, not when each name is bound again."""
    B, n, H, _ = q.shape
    V = v.shape[-1]
    pad = (-n) % C
    nc = (n + pad) // C
    # [B, H, nc, C, *]; padded tokens have k = v = beta = 0 and g = 0: they leave S untouched
    qc, kc, vc, gc = (torch.nn.functional.pad(x.float().transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (nc, C))
                      for x in (q, k, v, g))
    bc = torch.nn.functional.pad(beta.float().transpose(1, 2), (0, pad)).unflatten(2, (nc, C)).unsqueeze(-1)
    G = gc.cumsum(-2)
    del gc
    qc = qc * scale
    Aqk, Akk = _intra_chunk(qc, kc, G)
    # (I + beta * Akk) is unit lower-triangular: invert it once per chunk (a C x C solve, cheaper
    # than solving for the V + K right-hand sides, whose tiny W entries would go denormal), then
    # two matmuls
    lower = torch.eye(C, device=q.device) + bc * Akk
    eye = torch.eye(C, device=q.device).expand_as(lower)
    inverse = _flush_tiny(torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True))
    U0 = inverse @ (bc * vc)  # [B, H, nc, C, V]
    W = _flush_tiny(inverse @ (bc * (kc * _decay(G))))  # [B, H, nc, C, K]; U = U0 - W S0
    q_decay = qc * _decay(G)
    k_tail = kc * _decay(G[..., -1:, :] - G)  # decay from each token to the chunk end
    tail = _decay(G[..., -1, :]).unsqueeze(-1)  # [B, H, nc, K, 1]
    out = torch.empty(B, H, nc, C, V, device=q.device)
    for c in range(nc):
        U = U0[:, :, c] - W[:, :, c] @ S  # [B, H, C, V]
        out[:, :, c] = q_decay[:, :, c] @ S + Aqk[:, :, c] @ U
        S = tail[:, :, c] * S + k_tail[:, :, c].transpose(-1, -2) @ U
        if observe is not None:
            observe((c + 1) * C - 1, S)  # padding past T leaves S unchanged
    return out.flatten(2, 3)[:, :, :n], S
