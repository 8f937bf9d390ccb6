"""Latent MoE (spec section 5): sigmoid/bias router, routed experts (MXFP4 or dense), shared experts.

    s = sigmoid(x W_gate^T)                       fp32, on the full-width normed input
    idx = topk(s + e_score_correction_bias, k)    (grouped top-k when num_expert_group > 1)
    w = s[idx] / (sum + 1e-20) * routed_scaling_factor
    h = routed_expert_down_proj(x)                K3: into the latent; Kimi-Linear: h = x
    y = routed_expert_norm(sum_k w_k W2_k act(W1_k h, W3_k h))
    out = routed_expert_up_proj(y) + shared_experts(x)

Routed experts are stored stacked per layer (`w1_packed [E, F, in/2]`, ...). A module may hold a
subset of the experts (`expert_ids`, global ids in order): expert parallelism gives each rank its
slice. MXFP4 experts stay packed; the grouped op dequantises what it reads (`engine.ops.moe`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from engine.config import ModelConfig
from engine.hooks import HookPoint, through
from engine.interventions import MoeRule
from engine.layers.common import GatedMLP, RMSNorm, activation
from engine.layers.fused import FusedLinears
from engine.parallel import comm
from engine.parallel.mesh import SINGLE, ParallelContext
from engine.probes import Deferred, ProbePoint
from engine.runtime import RuntimeOptions
from engine.ops.moe import MXFP4, ExpertMatrix, routed_experts
from engine.ops.moe.weights import dense_bytes, take_range
from engine.ops.integrity import router_boundary, router_kth_choice, router_logit_sums, router_runner_up
from engine.ops.router import router_entropy


class Router(nn.Module):
    """`block_sparse_moe.gate`: weight [E, hidden] and the selection-only bias [E]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))
        self.top_k = config.num_experts_per_token
        self.groups, self.topk_group = config.num_expert_group, config.topk_group
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.hook_router_logits = HookPoint("")  # named by the layer: [B, T, experts] fp32, before the sigmoid
        self.hook_experts = HookPoint("")  # [B, T, k] int64: an edit routes the token to the experts given

    def forward(self, x: torch.Tensor, return_scores: bool = False, *, intervention: MoeRule | None = None,
                positions: torch.Tensor | None = None, rows: tuple[int, ...] | None = None,
                start: int | torch.Tensor = 0, health: bool | str = False):
        """x [N, hidden] -> (weights [N, k] fp32, expert ids [N, k] int64[, sigmoid scores [N, E]][, non-finite
        logit sum [N], k-th choice score [N], best score left out [N]] (the last three with `health`:
        `engine.ops.integrity.router_boundary`); with `health="raw"` instead the logits, choice scores, top-k
        values and ids those three are taken from).
        `intervention` bans (-inf) or forces (+inf) experts' choice scores for the tokens at `positions`
        [N] before the top-k; the weights stay the router's scores of the experts chosen. `rows` ([B, T],
        the tokens' layout) and `start` are what the hook points show."""
        logits = x.float() @ self.weight.float().t()  # [N, E]
        if self.hook_router_logits.attached:
            logits = through(self.hook_router_logits, logits.view(*(rows or logits.shape[:1]), -1), start
                             ).reshape(logits.shape)
        scores = torch.sigmoid(logits)  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        if intervention is not None:
            assert positions is not None
            banned, forced = intervention.masks(positions)
            if banned is not None:
                choice = choice.masked_fill(banned, float("-inf"))
            if forced is not None:
                choice = choice.masked_fill(forced, float("inf"))
        if self.groups > 1 and self.topk_group < self.groups:
            grouped = choice.unflatten(-1, (self.groups, -1))  # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = group_score.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        top = choice.topk(self.top_k, dim=-1)
        ids = top.indices
        if self.hook_experts.attached:
            ids = through(self.hook_experts, ids.view(*(rows or ids.shape[:1]), -1), start).reshape(ids.shape)
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        out = (weights * self.scaling, ids) + ((scores,) if return_scores else ())
        if health == "raw":  # the tensors the checks read, for `engine.probes.Deferred` values
            return out + (logits, choice, top.values, top.indices)
        return out + (router_boundary(logits, choice, top.values, top.indices) if health else ())


class RoutedExperts(nn.Module):
    """Stacked routed experts of one layer: w1 (gate) and w3 (up) [F, in], w2 (down) [in, F].

    The compute is `engine.ops.moe.routed_experts` (gather for decode, grouped GEMM for prefill).
    MXFP4 stacks are dequantised as a whole and kept when the layer's share of
    `runtime.expert_cache_mib` holds them (demo sizes: decode then reads dense experts); otherwise
    each call dequantises only what it reads.
    """

    def __init__(self, config: ModelConfig, runtime: RuntimeOptions, expert_ids: Sequence[int] | None = None) -> None:
        super().__init__()
        f, d = config.moe_intermediate_size, config.expert_in_dim
        self.num_experts = config.num_experts
        ids = list(range(config.num_experts)) if expert_ids is None else list(expert_ids)
        self.expert_ids: list[int] = ids  # global ids of the experts held here, in slot order
        # global id -> local slot, -1 when another rank holds it (plain list: survives meta init)
        self._slot_of = [-1] * config.num_experts
        for slot, e in enumerate(ids):
            self._slot_of[e] = slot
        self._slot_tensor: dict[torch.device, torch.Tensor] = {}  # the same map on each device used
        self.packed = config.expert_format == "mxfp4"
        self.moe_layers = max(1, sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)))
        self._dense: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (dtype, device) -> dequantized (w1, w3, w2)
        self.runtime = runtime
        self.act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = activation(config)
        e = len(ids)
        shapes = {"w1": (f, d), "w3": (f, d), "w2": (d, f)}
        for name, (out_f, in_f) in shapes.items():
            if self.packed:
                self.register_buffer(name + "_packed", torch.zeros(e, out_f, in_f // 2, dtype=torch.uint8))
                self.register_buffer(name + "_scale", torch.zeros(e, out_f, in_f // 32, dtype=torch.uint8))
            else:
                self.register_parameter(name, nn.Parameter(torch.zeros(e, out_f, in_f)))

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._dense.clear()  # new weights: the dequantized copies are stale
        super()._load_from_state_dict(*args, **kwargs)

    def kept(self) -> tuple:
        """Which dequantized stacks are kept, and where (a compiled step reads them as inputs)."""
        return tuple((key, tuple(t.data_ptr() for t in stacks)) for key, stacks in self._dense.items())

    def stacks(self, dtype: torch.dtype) -> tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]:
        """(w1, w3, w2) as the op reads them: dense tensors (parameters, or the kept dequantized
        copy) or `MXFP4` stacks dequantised at use."""
        if not self.packed:
            return self.w1, self.w3, self.w2
        device = self.w1_packed.device
        hit = self._dense.get((dtype, device))
        if hit is not None:
            return hit
        quant = tuple(MXFP4(getattr(self, n + "_packed"), getattr(self, n + "_scale"), self.runtime.kernels)
                      for n in ("w1", "w3", "w2"))
        budget = self.runtime.expert_cache_mib * 2**20 // self.moe_layers
        if device.type != "meta" and sum(dense_bytes(w, dtype) for w in quant) <= budget:
            self._dense[(dtype, device)] = tuple(take_range(w, 0, len(self.expert_ids), dtype) for w in quant)
            return self._dense[(dtype, device)]
        return quant  # type: ignore[return-value]

    def prepare(self, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]]:
        """What `forward` reads for inputs of `dtype` on `device`: the slot map and the stacks, made and
        kept at the first call (the decode step calls this before its trace, so the trace finds them)."""
        if device not in self._slot_tensor:
            self._slot_tensor[device] = torch.tensor(self._slot_of, device=device)
        return self._slot_tensor[device], self.stacks(dtype)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [N, in], ids/weights [N, k] -> sum over the locally held experts [N, in] (fp32)."""
        slot_of, (w1, w3, w2) = self.prepare(h.dtype, ids.device)
        return routed_experts(h, ids, weights, slot_of, w1, w3, w2, self.act, mxfp8=self.runtime.mxfp8_activations)


class LatentMoE(nn.Module):
    """`block_sparse_moe` of layers >= first_k_dense_replace."""

    def __init__(self, config: ModelConfig, runtime: RuntimeOptions, expert_ids: Sequence[int] | None = None,
                 parallel: ParallelContext = SINGLE, layer_idx: int = 0) -> None:
        super().__init__()
        c = config
        # parallel layout: router, routed_expert_down_proj and the norm replicated; experts held
        # per `expert_ids`; shared experts split by width and routed_expert_up_proj by latent columns
        # (row-parallel), so both end in partial sums that share one all-reduce
        self.parallel = parallel
        self.layer_idx = layer_idx
        self.runtime = runtime
        self.gate = Router(c)
        self.gate.hook_router_logits.name = f"blocks.{layer_idx}.moe.hook_router_logits"
        self.gate.hook_experts.name = f"blocks.{layer_idx}.moe.hook_experts"
        self.probe_route = ProbePoint("moe.route", layer_idx)
        self.experts = RoutedExperts(c, runtime, expert_ids)
        act = activation(c)
        self.shared_experts = (GatedMLP(c.hidden_size, parallel.split(c.shared_intermediate_size), act)
                               if c.num_shared_experts else None)
        self.latent = c.routed_expert_hidden_size is not None
        if self.latent:
            r = c.routed_expert_hidden_size
            self.latent_cols = parallel.local_range(r)
            self.routed_expert_down_proj = nn.Linear(c.hidden_size, r, bias=False)
            self.routed_expert_norm = RMSNorm(r, c.rms_norm_eps) if c.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(parallel.split(r), c.hidden_size, bias=False)
        # the projections of the layer input as one matmul: into the latent, shared gate and up
        readers = [self.routed_expert_down_proj] if self.latent else []
        if self.shared_experts is not None:
            readers += [self.shared_experts.gate_proj, self.shared_experts.up_proj]
            self.shared_experts.gate_up = None  # fused here instead
        self.input_projections = FusedLinears(*readers) if readers else None

    def forward(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """x [B, T, hidden] at positions [start, start + T) -> [B, T, hidden]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        point = self.probe_route
        plan = self.runtime.interventions
        rule = None if plan is None else plan.moe[self.layer_idx]
        routing: dict = {"rows": tuple(shape[:-1]), "start": start}
        if rule is not None:  # every row of the batch sits at the same positions
            steps = start + torch.arange(shape[-2], device=x.device)
            routing = {"intervention": rule, "positions": steps.expand(*shape[:-2], -1).reshape(-1)}
        if not point.listening:
            weights, ids = self.gate(flat, **routing)
        else:
            with_entropy, with_health = point.request.wants("entropy"), point.request.wants("logit_sum")
            # an eager decode step hands its checks' inputs over by reference (computed in bulk later)
            defer = with_health and shape[0] == 1 and point.may_defer(flat.shape[0])
            weights, ids, *extra = self.gate(flat, return_scores=with_entropy, health="raw" if defer else with_health,
                                             **routing)
            scores = extra[:1] if with_entropy else []
            if defer:
                logits, choice, top_values, top_ids = extra[-4:]
                health = [Deferred(router_logit_sums, logits, axis=0), Deferred(router_kth_choice, top_values, axis=0),
                          Deferred(router_runner_up, choice, top_ids, axis=0)]
            else:
                health = [t.view(shape[:-1]) for t in extra[-3:]] if with_health else [None, None, None]
            # collecting (the decode step, `start` a device tensor): the host adds the positions
            positions = None if point.collecting else torch.arange(start, start + shape[-2])
            point.emit(positions=positions, experts=ids.view(*shape[:-1], -1),
                       weights=weights.view(*shape[:-1], -1),
                       entropy=router_entropy(scores[0]).view(shape[:-1]) if with_entropy else None,
                       logit_sum=health[0], kth_choice=health[1], runner_up=health[2])
        if self.parallel.debug_checks:
            comm.assert_same(ids, self.parallel, "routed expert ids")
        parts = list(self.input_projections(flat)) if self.input_projections is not None else []
        h = parts.pop(0) if self.latent else flat
        y = self.experts(h, ids, weights).to(x.dtype)  # this rank's experts only
        if self.latent:
            # combine: sum the ranks' partial outputs in the latent, before the norm (the bytes
            # per token of this choice against all-to-all are in engine.parallel.ep)
            y = comm.all_reduce(y, self.parallel, "moe.routed")
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            a, b = self.latent_cols
            y = self.routed_expert_up_proj(y[:, a:b])
        if self.shared_experts is not None:
            y = y + self.shared_experts.down(*parts)
        return comm.all_reduce(y, self.parallel, "moe.out").view(shape)
