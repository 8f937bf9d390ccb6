"""DSA indexer training (DeepSeek V3.2's recipe) and aux-loss-free expert balancing, as module hooks.

Indexer: for sampled queries of each DSA layer, the target is the layer's dense attention
distribution summed over heads and L1-normalised; the indexer's scores (softmax over visible keys)
learn it by KL divergence. The indexer sees its inputs detached, so this loss trains the indexer
only and the language-model loss never reaches it (top-k selection has no gradient anyway).
- warm-up (`sparse=False`): KL over every visible key, while the rest of the model is frozen;
- sparse training (`sparse=True`): KL over the keys the indexer selects (its top-k), as V3.2 does.

The dense distribution is recomputed from the layer's own input (a forward pre-hook on the
`GatedMLA` module) with the module's weights (`training.row_attention`); the index scores come from
the engine's `engine.ops.dsa.reference.indexer_scores`. Only sampled query rows are scored, so the largest
tensor is [B, heads, queries, T], never [T, T].

Experts: the router's `e_score_correction_bias` (selection only) moves against each expert's
load after every step (DeepSeek V3's auxiliary-loss-free balancing).
"""

from __future__ import annotations

import torch

from engine.layers.mla import GatedMLA
from engine.layers.moe import Router
from engine.model import KimiForCausalLM
from engine.ops.dsa.reference import indexer_scores
from training.row_attention import row_attention_logp


class IndexerDistill:
    """Forward pre-hooks on every DSA layer; `losses` collects one KL value per layer per forward."""

    def __init__(self, model: KimiForCausalLM) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None]
        self.active = False
        self.sparse = False
        self.rows: torch.Tensor | None = None   # [B, n] query positions to score
        self.losses: list[torch.Tensor] = []
        self.coverage: list[float] = []         # dense mass inside the indexer's top-k (sampled rows)
        self._handles = [m.register_forward_pre_hook(self._hook) for m in self.layers]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, module: GatedMLA, args: tuple) -> None:
        if not self.active or self.rows is None:
            return
        x = args[0].detach()
        T = x.shape[1]
        rows = self.rows.to(x.device)                          # [B, n]
        with torch.no_grad():
            q_resid = module.q_a_layernorm(module.q_a_proj(x))                                # the indexer's input
            invisible = torch.arange(T, device=x.device)[None, None, :] > rows[:, :, None]    # [B, n, T]
            target = row_attention_logp(module, x, rows).exp().sum(1)                        # heads summed
            target = target / target.sum(-1, keepdim=True)                                   # [B, n, T]
        with torch.enable_grad():
            iq, iw = module.indexer.queries(q_resid.detach(), x)
            ik = module.indexer.keys(x)
            Di = iq.shape[-1]
            iq_rows = iq.gather(1, rows[:, :, None, None].expand(-1, -1, iq.shape[2], Di))
            iw_rows = iw.gather(1, rows[:, :, None].expand(-1, -1, iw.shape[2]))
            index = indexer_scores(iq_rows, iw_rows, ik).masked_fill(invisible, float("-inf"))  # [B, n, T]
            topk = module.indexer.topk
            keep = ~invisible
            if topk < T:
                sel = index.detach().topk(min(topk, T), dim=-1).indices
                chosen = torch.zeros_like(keep).scatter_(-1, sel, True) & keep
                self.coverage.append(float((target * chosen).sum(-1).mean()))
                if self.sparse:
                    keep = chosen
            t = target * keep
            t = t / t.sum(-1, keepdim=True).clamp_min(1e-12)
            logq = torch.log_softmax(index.masked_fill(~keep, float("-inf")), dim=-1)
            kl = (t * (t.clamp_min(1e-12).log() - logq.masked_fill(~keep, 0.0))).sum(-1)
            self.losses.append(kl.mean())

    def take(self) -> torch.Tensor | None:
        """Sum of the collected KL losses (and clear them)."""
        if not self.losses:
            return None
        out = torch.stack(self.losses).sum()
        self.losses = []
        return out


def query_rows(weights: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """[B, n] query positions for the indexer loss: half at answer positions, half uniform."""
    B, T = weights.shape
    weights = weights.cpu()   # drawn with a CPU generator: the same rows whatever device trains
    rows = torch.empty(B, n, dtype=torch.long)
    for b in range(B):
        answer = (weights[b] > 0.2).nonzero().flatten()
        half = min(n // 2, answer.numel())
        pick = answer[torch.randperm(answer.numel(), generator=generator)[:half]]
        rest = torch.randint(0, T, (n - half,), generator=generator)
        rows[b] = torch.cat((pick, rest)).sort().values
    return rows


class ExpertBalance:
    """Counts routes per expert in every router; `update()` nudges the selection biases."""

    def __init__(self, model: KimiForCausalLM, rate: float = 1e-3) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.rate = rate
        self.counts = [torch.zeros(r.weight.shape[0]) for r in self.routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, output) -> None:
            ids = output[1]
            if self.counts[i].device != ids.device:   # counted where the routes are: no host sync per layer
                self.counts[i] = self.counts[i].to(ids.device)
            self.counts[i] += torch.bincount(ids.flatten(), minlength=self.counts[i].numel()).float()
        return hook

    def update(self) -> float:
        """Apply one bias step; returns the worst max/mean load ratio seen since the last update."""
        worst = 0.0
        with torch.no_grad():
            for r, c in zip(self.routers, self.counts):
                if c.sum() == 0:
                    continue
                mean = c.mean()
                worst = max(worst, float(c.max() / mean))
                r.e_score_correction_bias -= self.rate * torch.sign(c - mean)
                c.zero_()
        return worst
