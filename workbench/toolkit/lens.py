"""The logit lens for Block Attention Residuals (spec section 2).

A plain lens (final norm and LM head on a layer's output) reads the wrong thing on K3: the head
reads `norm(attn_res(P, B, output_attn_res_*))`, a learned mix of the current block's prefix sum P
with the earlier blocks B, not P. This lens applies the model's own output mix at every depth: after
layer L it mixes P_L with the blocks that exist after L (the embedding and the prefix sums entering
layers 0, s, 2s, ... <= L for block size s), then the final norm and the head
(`KimiModel.output_mix`). After the last layer that is exactly what the forward computes, so the last
layer's row equals the model's own logits. Kimi-Linear (no AttnRes) gets the plain lens.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from engine.errors import InputError
from engine.parallel import comm
from engine.session import Session
from workbench.toolkit.cache import position_set, replay, run_with_cache

# the lens holds every asked row in memory (it returns [layers, positions, vocab] anyway)
_IN_MEMORY = 2**62


def logit_lens(session: Session, positions: Iterable[int] | None = None) -> torch.Tensor:
    """Log-probabilities `[layers, positions, vocab]` (fp32) of the next token read at each layer's output.

    Runs the session's pending tokens (as `run_with_cache`; with none pending, its consumed tokens are
    replayed in a fresh session). `positions`: absolute positions among those run (default: the last);
    the row of the last layer at the session's last position is `log_softmax` of its next-token logits.
    """
    model = session.model
    config = model.config
    run = session if session.pending else replay(session)
    end = len(run.tokens)
    wanted = np.array([end - 1]) if positions is None else position_set(positions, end)
    assert wanted is not None
    if wanted.min() < run.length:
        raise InputError(f"positions= starts at {int(wanted.min())}, before the pending tokens (from {run.length})")
    n, size = config.num_hidden_layers, config.attn_res_block_size
    starts = [] if size is None else list(range(0, n, size))
    names = [f"blocks.{i}.hook_resid_post" for i in range(n)] + [f"blocks.{i}.hook_resid_pre" for i in starts]
    cache = run_with_cache(run, names, wanted, max_bytes=_IN_MEMORY)
    out = torch.empty(n, len(wanted), config.vocab_size, dtype=torch.float32)
    with torch.inference_mode():
        for layer in range(n):
            prefix = cache[f"blocks.{layer}.hook_resid_post"]  # [B, P, hidden]
            blocks = [cache[f"blocks.{i}.hook_resid_pre"] for i in starts if i <= layer]
            device = next(model.parameters()).device
            hidden = model.model.output_mix(prefix.to(device), [b.to(device) for b in blocks])
            logits = comm.all_gather(model.lm_head(hidden), model.parallel, dim=-1, tag="lm_head")
            out[layer] = torch.log_softmax(logits[0].float(), -1).cpu()
    return out


def target_rank(logprobs: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank `[layers, positions]` int64, 0 = the top token; probability `[layers, positions]`) of `target`
    in a lens's log-probabilities."""
    if logprobs.dim() != 3:
        raise InputError(f"expected lens log-probabilities [layers, positions, vocab], got {list(logprobs.shape)}")
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < logprobs.shape[-1]:
        raise InputError(f"target={target!r:.40} is no token id of this vocabulary [0, {logprobs.shape[-1]})")
    own = logprobs[..., int(target)]
    return (logprobs > own.unsqueeze(-1)).sum(-1), own.exp()


__all__ = ["logit_lens", "target_rank"]
