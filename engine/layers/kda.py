"""Kimi Delta Attention layer (spec section 3): projections, short conv, gates and output norm.

The core recurrence lives in `engine.ops.kda`; this module only wires the checkpoint's tensors to
it. With a `KDAState` the layer continues from it and leaves the new state in it (conv tail and
recurrent S); without one it starts from zeros (the full causal forward).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.cache import KDAState
from engine.config import ModelConfig
from engine.hooks import HookPoint, through
from engine.interventions import KdaRule
from engine.layers.common import GatedRMSNorm, l2norm
from engine.layers.fused import FusedLinears
from engine.ops.kda import kda_chunked, kda_recurrent
from engine.ops.integrity import chunked_vs_recurrent, frozen_channels, unmeasured_drift
from engine.ops.kda.state_stats import (interval_half_life, interval_means, state_effective_rank, state_max_abs,
                                       state_norm)
from engine.parallel import comm
from engine.parallel.mesh import SINGLE, ParallelContext
from engine.probes import Deferred, ProbePoint
from engine.runtime import RuntimeOptions


# up to this many new tokens the short conv runs as a multiply-sum (see ShortConv.forward)
SHORT_CONV_TAPS_MAX_T = 16


class ShortConv(nn.Module):
    """Causal depthwise conv (no bias) over time; `weight` is [D, 1, kernel] as in the checkpoint."""

    def __init__(self, dim: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, 1, kernel))

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (silu(conv(x)) [B, T, D] fp32, new tail [B, D, kernel - 1] fp32)."""
        kernel = self.weight.shape[-1]
        B, T, D = x.shape
        if tail is None:
            tail = x.new_zeros(B, D, kernel - 1, dtype=torch.float32)
        if T <= SHORT_CONV_TAPS_MAX_T:
            # decode and short chunks: the taps as a multiply-sum over sliding windows. A depthwise
            # conv1d call has a large fixed cost for one token on CPU (a quarter of a small model's
            # decode step) and stays an opaque extern call in a compiled graph; this fuses to one loop.
            padded = torch.cat((tail.float(), x.float().transpose(1, 2)), dim=-1)  # [B, D, kernel - 1 + T]
            windows = padded.unfold(-1, kernel, 1)  # [B, D, T, kernel]
            out = (windows * self.weight.float()).sum(-1)   # weight [D, 1, kernel] broadcasts over T
            return F.silu(out).transpose(1, 2), padded[:, :, padded.shape[-1] - (kernel - 1):]
        # prefill: the taps as shifted multiply-adds in the [B, T, D] layout. Going through conv1d
        # needs [B, D, T]: transposing a chunk into it, and back, costs an order of magnitude more than
        # the arithmetic (figures in docs/benchmarks.md, 'Kernels and layers (CPU)').
        padded = torch.cat((tail.float().transpose(1, 2), x.float()), dim=1)  # [B, kernel - 1 + T, D]
        taps = self.weight.float().view(D, kernel)
        out = padded[:, :T] * taps[:, 0]
        for j in range(1, kernel):
            out.addcmul_(padded[:, j:j + T], taps[:, j])
        # the tail copied out: a view would keep the whole padded input alive until the state takes it
        return F.silu(out), padded[:, T:].transpose(1, 2).clone()


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, runtime: RuntimeOptions,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        # tensor parallel: this rank's heads (their state lives here too); o_proj is row-parallel
        hd, nh = config.kda_head_dim, parallel.split(config.kda_num_heads)
        h, d = config.hidden_size, nh * hd
        self.layer_idx = layer_idx
        self.parallel = parallel
        self.num_heads, self.head_dim = nh, hd
        self.head_range = parallel.local_range(config.kda_num_heads)  # global ids of this rank's heads
        self.lower_bound = config.kda_gate_lower_bound
        self.runtime = runtime
        self.q_proj = nn.Linear(h, d, bias=False)
        self.k_proj = nn.Linear(h, d, bias=False)
        self.v_proj = nn.Linear(h, d, bias=False)
        self.q_conv1d = ShortConv(d, config.conv_kernel_size)
        self.k_conv1d = ShortConv(d, config.conv_kernel_size)
        self.v_conv1d = ShortConv(d, config.conv_kernel_size)
        self.f_a_proj = nn.Linear(h, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.A_log = nn.Parameter(torch.zeros(nh))
        self.b_proj = nn.Linear(h, nh, bias=False)
        self.full_rank_gate = config.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = nn.Linear(h, d, bias=False)
        else:
            self.g_a_proj = nn.Linear(h, hd, bias=False)
            self.g_b_proj = nn.Linear(hd, d, bias=False)
        self.o_norm = GatedRMSNorm(hd, config.rms_norm_eps)
        self.o_proj = nn.Linear(d, h, bias=False)
        # every projection of the layer input as one matmul (q, k, v, f_a, b, then g or g_a)
        self.input_projections = FusedLinears(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                              self.g_proj if self.full_rank_gate else self.g_a_proj)
        self.probe_state = ProbePoint("kda.state", layer_idx)
        # the recurrent state [B, heads, K, V] fp32 after the positions `hook_state.positions` names (engine.hooks)
        self.hook_state = HookPoint(f"blocks.{layer_idx}.kda.hook_state")

    def decay(self, x: torch.Tensor, f_a: torch.Tensor | None = None) -> torch.Tensor:
        """Per-channel log-decay g [B, T, H, K] (fp32, <= 0); `f_a`: f_a_proj(x) when already computed."""
        z = self.f_b_proj(self.f_a_proj(x) if f_a is None else f_a).float() + self.dt_bias.float()
        z = z.unflatten(-1, (self.num_heads, self.head_dim))
        a = self.A_log.float().exp().view(self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * z)  # K3: bounded in (lb, 0)
        return -a * F.softplus(z)  # Kimi-Linear

    def _observer(self, g: torch.Tensor, beta: torch.Tensor, start: int, window: tuple | None = None):
        """A state observer for the `kda.state` probe, and a function that emits what it saw.

        Norms always; the optional statistics only when the listener's request names them (the
        effective rank only at the positions its `queries` sample keeps: an SVD per head). `window`
        (q, k, v, initial) is the call's input when the chunked form runs: the integrity `drift` runs one
        of its chunks (at most one chunk of tokens) again token by token, from the state the chunked
        form reached before it, and compares the states after it; which chunk rotates with the step
        (step % chunks), so the first chunk of a call checks the state it started from and the
        others the hand-over between chunks.
        """
        point = self.probe_state
        request = point.request
        max_abs, mean_decay, mean_beta = (request.wants(f) for f in ("max_abs", "mean_decay", "mean_beta"))
        rank, timescales = request.wants("eff_rank"), request.wants("half_life")
        frozen = request.wants("frozen")
        drift = request.wants("drift")
        seen: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        ranks: list[torch.Tensor] = []
        drifts: list[torch.Tensor] = []
        # which observation the drift check re-runs up to; read only for a chunked (eager, prefill) call, so
        # the compiled decode step never depends on the step counter
        chunks = -(-g.shape[1] // self.runtime.kda_chunk_size)
        target = point.context.step % max(1, chunks) if drift and window is not None else -1
        before: list = [-1, None if window is None else window[3]]  # the previous observation: t, S

        def observe(t: int, S: torch.Tensor) -> None:
            seen.append((t, state_norm(S), state_max_abs(S) if max_abs else None))  # [B, H] each
            if rank:
                sampled = request.queries is None or len(request.queries.rows(np.array([start + t])))
                ranks.append(state_effective_rank(S) if sampled else S.new_full(S.shape[:2], float("nan")))
            if drift and window is not None:
                if len(drifts) != target:  # one chunk per call: a bounded check, off the bulk of the prefill
                    drifts.append(S.new_full(S.shape[:2], float("nan")))
                else:
                    q, k, v, _ = window
                    a, b = before[0] + 1, t + 1
                    drifts.append(chunked_vs_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                       before[1], S))
                before[:] = [t, S]  # the chunked form makes a new S for each chunk: no copy needed

        def gather(x: torch.Tensor) -> torch.Tensor:  # [B, n, local heads] -> [B, n, heads]
            return comm.all_gather(x, self.parallel, -1, "probe.kda")

        def emit(start: int) -> None:
            if not seen:
                return
            ends_cpu = torch.tensor([t for t, _, _ in seen])
            norms = seen[0][1].unsqueeze(1) if len(seen) == 1 else torch.stack([n for _, n, _ in seen], 1)
            data = {"norm": gather(norms)}
            if max_abs:
                data["max_abs"] = gather(torch.stack([a for _, _, a in seen], 1))
            if mean_decay or mean_beta:
                ends = ends_cpu.to(g.device)
                if mean_decay:
                    data["mean_decay"] = gather(interval_means(g.exp().mean(-1), ends))  # channel mean [B, T, H]
                if mean_beta:
                    data["mean_beta"] = gather(interval_means(beta, ends))
            # an eager decode step (observed at its every token) hands the checks' input over by reference:
            # the recorder computes them in bulk over many steps (`engine.probes.Deferred`)
            defer = len(seen) == g.shape[1] and point.may_defer(len(seen)) and not self.parallel.communicates
            if frozen:  # observed after every token (decode): the per-token counts are the interval means
                if defer:
                    data["frozen"] = Deferred(frozen_channels, g)
                else:
                    counts = frozen_channels(g)
                    if len(seen) != g.shape[1]:
                        counts = interval_means(counts, ends_cpu.to(g.device))
                    data["frozen"] = gather(counts)
            if drift:  # recurrent calls (decode steps among them) are token by token already: NaN, not measured
                if drifts:
                    data["drift"] = gather(torch.stack(drifts, 1).float())
                elif defer:
                    data["drift"] = Deferred(unmeasured_drift, g)
                else:
                    data["drift"] = gather(g.new_full((g.shape[0], len(seen), g.shape[2]), float("nan")))
            if rank:
                data["eff_rank"] = gather(torch.stack(ranks, 1).float())
            if timescales:
                ends = ends_cpu.to(g.device)
                half, share = interval_half_life(g, ends, start + ends)
                data["half_life"], data["global_share"] = gather(half), gather(share)
            point.emit(positions=None if point.collecting else start + ends_cpu, **data)

        return observe, emit

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial: torch.Tensor | None, start: int | torch.Tensor, observe) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[1] <= self.runtime.kda_recurrent_max_tokens:
            # the compiled decode step (device-tensor start) leaves fusion to the compiler
            impl = "reference" if isinstance(start, torch.Tensor) else self.runtime.kernels
            return kda_recurrent(q, k, v, g, beta, initial, observe=observe, impl=impl)
        return kda_chunked(q, k, v, g, beta, initial, chunk_size=self.runtime.kda_chunk_size, observe=observe)

    def _edited_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial: torch.Tensor | None, start: int | torch.Tensor, rule: KdaRule | None,
                     observe) -> tuple[torch.Tensor, torch.Tensor]:
        """The core with the state multiplied by the rule's factors right after each edited position, and
        shown to `hook_state` (which may replace it) after each position it asks for: the decode step (a
        device-tensor start, one token) multiplies at every step (by 1 off the edits); a host-known start
        splits the tokens at the edits and the shown positions."""
        T = q.shape[1]
        hook = self.hook_state if self.hook_state.attached else None
        edits = rule.edit_positions if rule is not None and rule.edit_at is not None else ()
        if isinstance(start, torch.Tensor):
            o, final = self._core(q, k, v, g, beta, initial, start, observe)
            if edits:
                factor = rule.state_factor(start + T - 1, self.head_range)
                final = final * factor.view(1, -1, 1, 1)
            if hook is not None and (hook.positions is None or int(start) + T - 1 in hook.positions):
                final = through(hook, final, start + T - 1)
            return o, final
        if hook is None:
            shown: set[int] = set()
        elif hook.positions is None:
            shown = {start + T - 1}
        else:
            shown = {at for at in hook.positions if start <= at < start + T}
        cuts = sorted({at + 1 - start for at in (*edits, *shown) if start <= at < start + T})
        outputs, state, lo = [], initial, 0
        for hi in cuts + ([T] if not cuts or cuts[-1] < T else []):
            seen = None if observe is None else (lambda t, S, at=lo: observe(t + at, S))
            o, state = self._core(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state, start,
                                  seen)
            outputs.append(o)
            if hi - 1 + start in edits:
                factor = rule.state_factor(torch.tensor(start + hi - 1, device=q.device), self.head_range)
                state = state * factor.view(1, -1, 1, 1)
            if hi - 1 + start in shown:
                state = through(hook, state, start + hi - 1)
            lo = hi
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)), state

    def forward(self, x: torch.Tensor, state: KDAState | None = None, start: int | torch.Tensor = 0,
                key_start: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] (normed) at slots [start, start + T) -> [B, T, hidden]; updates `state`
        in place when given. Slots before `key_start[b]` are left padding: their conv inputs are
        zeroed and their decay is 0, so the state after them is exactly a fresh one."""
        B, T, _ = x.shape
        heads = (self.num_heads, self.head_dim)
        tails = (None, None, None) if state is None else state.conv.chunk(3, dim=1)
        pad = None
        if key_start is not None:
            slots = start + torch.arange(T, device=x.device)  # start may be a device tensor (decode step)
            pad = (slots < key_start.view(-1, 1)).unsqueeze(-1)  # [B, T, 1]

        q_in, k_in, v_in, f_a, b_in, gate_in = self.input_projections(x)

        def inputs(y: torch.Tensor) -> torch.Tensor:
            return y if pad is None else y.masked_fill(pad, 0.0)

        q, q_tail = self.q_conv1d(inputs(q_in), tails[0])
        k, k_tail = self.k_conv1d(inputs(k_in), tails[1])
        v, v_tail = self.v_conv1d(inputs(v_in), tails[2])
        q = l2norm(q.unflatten(-1, heads))  # [B, T, H, K]
        k = l2norm(k.unflatten(-1, heads))
        v = v.unflatten(-1, heads)
        g = self.decay(x, f_a)
        beta = torch.sigmoid(b_in.float())  # [B, T, H]
        if T > self.runtime.kda_recurrent_max_tokens:
            # the projections are views of one matmul's output (q, k, v, f_a, b and the gate side by side):
            # only the gate's columns are read after this, so they are copied out and the rest is freed
            # before the core runs, a prefill's largest buffer then; decode steps keep the views
            gate_in = gate_in.clone()
        del q_in, k_in, v_in, f_a, b_in
        if pad is not None:
            g = g.masked_fill(pad.unsqueeze(-1), 0.0)
            beta = beta.masked_fill(pad, 0.0)
        initial = None if state is None else state.recurrent
        plan = self.runtime.interventions
        rule = None if plan is None else plan.kda[self.layer_idx]
        if rule is not None:
            keep = rule.write_keep(start + torch.arange(T, device=x.device), self.head_range)
            if keep is not None:  # no write for those tokens; their decay still runs
                beta = beta * keep
        chunked = q.shape[1] > self.runtime.kda_recurrent_max_tokens and not isinstance(start, torch.Tensor)
        window = (q, k, v, initial) if chunked else None
        observe, emit = self._observer(g, beta, start, window) if self.probe_state.listening else (None, None)
        if (rule is not None and rule.edit_at is not None) or self.hook_state.attached:
            o, final = self._edited_core(q, k, v, g, beta, initial, start, rule, observe)
        else:
            o, final = self._core(q, k, v, g, beta, initial, start, observe)
        if emit is not None:
            emit(start)
        if state is not None:
            state.recurrent = final
            state.conv = torch.cat((q_tail, k_tail, v_tail), dim=1)
        gate = gate_in if self.full_rank_gate else self.g_b_proj(gate_in)
        o = self.o_norm(o.to(x.dtype), gate.unflatten(-1, heads))  # [B, T, H, V]
        return comm.all_reduce(self.o_proj(o.flatten(-2)), self.parallel, "attn.o_proj")
