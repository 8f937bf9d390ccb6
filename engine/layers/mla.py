"""Gated MLA with the optional DSA indexer (spec section 4).

K3 and K3.1 share this code: a layer with an `indexer` (K3.1) reads only the top-k keys its indexer
selects; without one (K3, Kimi-Linear) or when `runtime.reads_dense(layer)` (`dsa_force_dense`, `dsa_dense_layers`) it reads every past key.
When every query sees at most top-k keys the two are the same function, and the cheaper dense
path runs.

Attention itself is in `engine.ops.mla`: expanded keys for dense prefill, latent (absorbed) form
for decode and sparse reads. The model is NoPE: `k_r` is a shared, unrotated key part.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
from torch import nn

from engine.cache import MLACache
from engine.config import ModelConfig
from engine.hooks import HookPoint, through
from engine.interventions import DsaRule
from engine.layers.common import RMSNorm
from engine.layers.fused import FusedLinears
from engine.layers.indexer import Indexer
from engine.ops.dsa import indexer_topk
from engine.ops.dsa.masked import masked_indexer_topk
from engine.ops.mla.dense_mass import dense_probs, mass_inside, topk_overlap
from engine.ops.mla.masked import masked_attention_latent
from engine.ops.mla.reference import dense_attention_expanded, dense_attention_latent, sparse_attention_latent
from engine.parallel import comm
from engine.parallel.mesh import SINGLE, ParallelContext
from engine.probes import ProbePoint
from engine.runtime import RuntimeOptions


class _Projected(NamedTuple):
    """What one layer input projects to (`GatedMLA._project`)."""

    q: torch.Tensor  # [B, T, H, Dk + Dr]
    latent: torch.Tensor  # [B, T, R] normed
    k_rope: torch.Tensor  # [B, T, Dr]
    gate: torch.Tensor | None  # g_proj(x) [B, T, H * Dv]
    index_keys: torch.Tensor | None  # [B, T, Di]
    index_queries: torch.Tensor | None  # [B, T, Hi, Di]
    index_weights: torch.Tensor | None  # [B, T, Hi] fp32, scaled


class GatedMLA(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, runtime: RuntimeOptions,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.runtime = runtime
        # tensor parallel: this rank's heads; the latent (shared by all heads), its cache and the
        # indexer are replicated, so every rank selects the same top-k; o_proj is row-parallel
        self.parallel = parallel
        self.num_heads = parallel.split(c.num_attention_heads)
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.scale = c.qk_head_dim ** -0.5
        h, nh = c.hidden_size, self.num_heads
        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.latent_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=False)
        self.use_output_gate = c.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = nn.Linear(h, nh * c.v_head_dim, bias=False)
        self.indexer = Indexer(c.dsa, h, c.q_lora_rank) if c.is_dsa_layer(layer_idx) else None
        # the projections of the layer input as one matmul, and those of the query latent as another
        readers = [self.q_proj if c.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]
        readers += [self.g_proj] if self.use_output_gate else []
        readers += [self.indexer.wk, self.indexer.weights_proj] if self.indexer is not None else []
        self.input_projections = FusedLinears(*readers)
        self.latent_projections = (FusedLinears(self.q_b_proj, self.indexer.wq_b)
                                   if self.indexer is not None and c.q_lora_rank is not None else None)
        if self.indexer is not None:
            self.probe_topk = ProbePoint("dsa.topk", layer_idx)
            self.probe_dense_mass = ProbePoint("dsa.dense_mass", layer_idx)
            # the indexer's kept keys per query [B, T, top-k] (positions ascending, -1 empty) and their scores
            # (fp32, -inf empty); an edit of the selection is what attention reads (engine.hooks)
            self.hook_scores = HookPoint(f"blocks.{layer_idx}.dsa.hook_scores")
            self.hook_selection = HookPoint(f"blocks.{layer_idx}.dsa.hook_selection")

    def _intervention(self) -> DsaRule | None:
        """This layer's rule among the session's interventions (only DSA layers have one)."""
        plan = self.runtime.interventions
        return None if plan is None or self.indexer is None else plan.dsa[self.layer_idx]

    def _project(self, x: torch.Tensor) -> _Projected:
        """Every projection of the layer input (one matmul) and of the query latent (another)."""
        parts = list(self.input_projections(x))
        first, kv_a = parts[0], parts[1]
        gate = parts[2] if self.use_output_gate else None
        iq = iw = index_keys = None
        if self.q_lora_rank is None:
            q_resid, q = None, first
        else:
            q_resid = self.q_a_layernorm(first)
            if self.latent_projections is not None:
                q, iq = self.latent_projections(q_resid)
            else:
                q = self.q_b_proj(q_resid)
        if self.indexer is not None:
            index_keys = self.indexer.keys_of(parts[-2])
            if iq is None:
                iq = self.indexer.wq_b(q_resid)
            iq, iw = self.indexer.queries_of(iq, parts[-1])
        q = q.unflatten(-1, (self.num_heads, self.nope + self.rope))  # [B, T, H, Dk + Dr]
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        return _Projected(q, self.kv_a_layernorm(latent), k_rope, gate, index_keys, iq, iw)

    def _gated(self, attn: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """attn [B, T, H, Dv] (x's dtype) times sigmoid(g_proj x) when the layer has the output gate."""
        if gate is None:
            return attn
        return attn * torch.sigmoid(gate.float()).to(attn.dtype).unflatten(-1, (self.num_heads, self.v_dim))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as per-head W_kb [H, Dk, R] and W_vb [H, Dv, R]."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope + self.v_dim))
        return w[:, : self.nope], w[:, self.nope:]

    def _dense_mass(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    start: int, idx: torch.Tensor, w_kb: torch.Tensor) -> None:
        """Emit `dsa.dense_mass` for the queries the listener's request picks (decided on the host).

        Mass is averaged over all heads: a sum over this rank's heads, all-reduced under tensor
        parallelism.
        """
        point = self.probe_dense_mass
        rows = point.rows(start, q_nope.shape[1])
        if len(rows) == 0:
            return
        picked = torch.from_numpy(start + rows)  # [n] positions, CPU
        at = torch.from_numpy(rows).to(q_nope.device)
        probs = dense_probs(q_nope[:, at], q_rope[:, at], latent, k_rope, w_kb, picked, self.scale)
        heads = self.num_heads * self.parallel.world
        mass = comm.all_reduce(mass_inside(probs, idx[:, at]).sum(-1), self.parallel, "probe.dense_mass") / heads
        iou = recall = None
        if point.request.wants("iou"):  # the dense top-k of the head-averaged probabilities
            mean = comm.all_reduce(probs.sum(2), self.parallel, "probe.dense_topk") / heads
            iou, recall = topk_overlap(mean, picked, idx[:, at])
        point.emit(positions=picked, mass=mass, iou=iou, recall=recall)

    @property
    def host_finished_probes(self) -> tuple[ProbePoint, ...]:
        """Points whose decode-step payload `finish_probe` completes on the host (`engine.decode.probe_tape`)."""
        return (self.probe_dense_mass,)

    def finish_probe(self, point: ProbePoint, data: Mapping[str, torch.Tensor], start: int, cache: MLACache) -> None:
        """Measure the dense mass for what `_static_step` collected at position `start` (host side, at the
        step, while the context names it); the tape calls it at the steps the listener's request measures,
        and `_dense_mass` picks the rows."""
        end = start + data["q_nope"].shape[1]
        w_kb, _ = self._kv_b()
        self._dense_mass(data["q_nope"], data["q_rope"], cache.latent[:, :end], cache.k_rope[:, :end], start,
                         data["indices"], w_kb)

    def _static_step(self, x: torch.Tensor, cache: MLACache | None, start: torch.Tensor,
                     key_start: torch.Tensor | None, p: _Projected) -> torch.Tensor:
        """The decode step's form (`engine.decode.step`): `start` is a device tensor, the cache is read
        whole at its capacity with invisible slots masked, so shapes never change and no device
        value reaches the host. Listening probes collect (`ProbePoint.collecting`): the selection, and
        for `dsa.dense_mass` the query, which `finish_probe` measures on the host when the listener's
        request picks the step."""
        if cache is None:
            raise ValueError("the static decode step needs a cache")
        T = x.shape[1]
        positions = start.view(1) + torch.arange(T, device=x.device)
        cache.write_at(positions, p.latent, p.k_rope, p.index_keys)
        w_kb, w_vb = self._kv_b()
        q_nope, q_rope = p.q[..., : self.nope], p.q[..., self.nope:]
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_kb.float())
        dense = self.runtime.reads_dense(self.layer_idx)
        rule = self._intervention()
        idx = None
        # a dense-reading layer still runs its indexer for a listener (what it would have read)
        if self.indexer is not None and (not dense or self.probe_topk.collecting or self.probe_dense_mass.collecting):
            assert cache.index_keys is not None and p.index_queries is not None and p.index_weights is not None
            ties = self.probe_topk.collecting and self.probe_topk.request.wants("tie_band")
            idx, scores, *band = masked_indexer_topk(p.index_queries, p.index_weights, cache.index_keys, positions,
                                                     self.indexer.topk, key_start=key_start, intervention=rule,
                                                     ties=ties)
            scores = through(self.hook_scores, scores, start)
            idx = through(self.hook_selection, idx, start)
            if self.probe_topk.collecting:
                self.probe_topk.emit(indices=idx, scores=scores if self.probe_topk.request.wants("scores") else None,
                                     tie_band=band[0] if ties else None, tie_cut=band[1] if ties else None)
            if self.probe_dense_mass.collecting:
                self.probe_dense_mass.collected.append({"q_nope": q_nope, "q_rope": q_rope, "indices": idx})
        if idx is not None and not dense:
            # with fewer visible keys than top-k the selection holds all of them: equal to dense
            o_lat = sparse_attention_latent(q_lat, q_rope, cache.latent, cache.k_rope, idx, self.scale)
        else:
            o_lat = masked_attention_latent(q_lat, q_rope, cache.latent, cache.k_rope, positions, self.scale,
                                            key_start=key_start, intervention=rule)
        attn = self._gated(torch.einsum("bthr,hvr->bthv", o_lat, w_vb.float()).to(x.dtype), p.gate)
        return comm.all_reduce(self.o_proj(attn.flatten(-2)), self.parallel, "attn.o_proj")

    def forward(self, x: torch.Tensor, cache: MLACache | None = None, start: int | torch.Tensor = 0,
                key_start: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] (normed) at positions [start, start + T) -> [B, T, hidden].

        With a cache, rows [start, start + T) are written and attention reads rows [0, start + T);
        without one, `start` must be 0 and attention reads this call's tokens only.
        """
        B, T, _ = x.shape
        p = self._project(x)
        if isinstance(start, torch.Tensor):
            return self._static_step(x, cache, start, key_start, p)
        q = p.q
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        latent, k_rope, index_keys = p.latent, p.k_rope, p.index_keys  # [B, T, R], [B, T, Dr], [B, T, Di]
        if cache is not None:
            cache.write(start, latent, k_rope, index_keys)
            end = start + T
            latent_all, k_rope_all = cache.latent[:, :end], cache.k_rope[:, :end]
            keys_all = cache.index_keys[:, :end] if cache.index_keys is not None else None
        else:
            if start != 0:
                raise ValueError("MLA without a cache can only run from position 0")
            latent_all, k_rope_all, keys_all = latent, k_rope, index_keys
        positions = torch.arange(start, start + T, device=x.device)
        w_kb, w_vb = self._kv_b()

        idx = None  # [B, T, topk] key positions selected by the indexer (-1 = empty)
        rule = self._intervention()
        if self.indexer is not None:
            assert keys_all is not None and p.index_queries is not None and p.index_weights is not None
            point = self.probe_topk
            ties = point.listening and point.request.wants("tie_band")
            # an eager decode step hands a tie-free band over as `Deferred` (counted in bulk by the recorder)
            defer = ties and point.may_defer(T) and not self.parallel.communicates
            idx, scores, *band = indexer_topk(p.index_queries, p.index_weights, keys_all, positions, self.indexer.topk,
                                              key_start=key_start, impl=self.runtime.kernels, intervention=rule,
                                              ties=ties, defer_ties=defer)
            scores = through(self.hook_scores, scores, start)
            idx = through(self.hook_selection, idx, start)
            if self.parallel.debug_checks:
                comm.assert_same(idx, self.parallel, f"DSA top-k of layer {self.layer_idx}")
            if self.probe_topk.listening:
                self.probe_topk.emit(positions=torch.arange(start, start + T), indices=idx,
                                     scores=scores if self.probe_topk.request.wants("scores") else None,
                                     tie_band=band[0] if ties else None, tie_cut=band[1] if ties else None)
            if self.probe_dense_mass.listening:
                self._dense_mass(q_nope, q_rope, latent_all, k_rope_all, start, idx, w_kb)
        # an edited selection is read as given, even where every past key fits in the top-k
        sparse = idx is not None and not self.runtime.reads_dense(self.layer_idx) and (
            start + T > self.indexer.topk or self.hook_selection.attached)

        if sparse:
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_kb.float())
            o_lat = sparse_attention_latent(q_lat, q_rope, latent_all, k_rope_all, idx, self.scale)
            attn = torch.einsum("bthr,hvr->bthv", o_lat, w_vb.float())
        elif T * 4 < start + T:
            # few queries over a long cache (decode): stay in latent space
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_kb.float())
            o_lat = dense_attention_latent(q_lat, q_rope, latent_all, k_rope_all, positions, self.scale,
                                           key_start=key_start, intervention=rule)
            attn = torch.einsum("bthr,hvr->bthv", o_lat, w_vb.float())
        else:
            kv = self.kv_b_proj(latent_all).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
            k = torch.cat((kv[..., : self.nope], k_rope_all.unsqueeze(2).expand(-1, -1, self.num_heads, -1)), -1)
            attn = dense_attention_expanded(q, k, kv[..., self.nope:], positions, self.scale, key_start=key_start,
                                            intervention=rule)
        attn = self._gated(attn.to(x.dtype), p.gate)  # [B, T, H, Dv]
        return comm.all_reduce(self.o_proj(attn.flatten(-2)), self.parallel, "attn.o_proj")
