"""K3.1 pieces no library implements, against float64 code written here straight from the spec.

`SpecReference` re-implements, in float64 and from the formulas of
`shared/spec/k3.1-architecture.md` only, Block Attention Residuals (section 2), the KDA layer with
K3's bounded gate and full-rank output gate (section 3), gated MLA with the DSA indexer (section 4),
the latent MoE with SiTU, sigmoid/bias routing, renormalisation, routed_scaling_factor and
routed_expert_norm after the sum (section 5), and MXFP4 decoding (section 6). It reads the weights
of a loaded model, so every comparison is "same weights, independent code".

Checked: each component on its own, then whole-model logits of the tiny K3.1 preset at T below and
above the indexer's top-k (16), in fp32 against the float64 reference, relative error <= 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import load_model
from engine.layers.attn_res import attn_res
from engine.layers.common import situ
from engine.presets import get_preset
from engine.weights.write import write_checkpoint
from tests.helpers import assert_close, relative_error

SEED = 42
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NEAR_TIE = 1e-6  # selections (experts, indexer keys) closer than this would make fp32 vs fp64 ambiguous


def min_topk_gap(scores: torch.Tensor, k: int) -> float:
    """Smallest nonzero gap between the k-th and (k+1)-th score over rows (inf if there is none).

    Exact ties (gap 0) are left out: they are resolved by a rule (see `SpecReference.indexer_mask`).
    A tiny nonzero gap is what makes fp32 and fp64 selections legitimately differ.
    """
    rows = scores.isfinite().sum(-1) > k
    if not rows.any():
        return math.inf
    top = scores[rows].topk(k + 1, dim=-1).values
    gaps = top[:, k - 1] - top[:, k]
    gaps = gaps[gaps > 0]
    return float(gaps.min()) if gaps.numel() else math.inf


class SpecReference:
    """The K3.1 text model in float64, from the spec's formulas, over the weights of `model`.

    All functions work on one sequence: activations are [T, D]. `min_gaps` records the smallest
    selection margins met (router and indexer), so a test can tell ties from bugs.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.c = model.config
        self.w = {name: t.detach() for name, t in model.state_dict().items()}
        self.min_gaps = {"router": math.inf, "indexer": math.inf}

    def W(self, name: str) -> torch.Tensor:
        return self.w[name].double()

    # ---- small pieces ------------------------------------------------------------------------
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    @staticmethod
    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * weight + bias

    @staticmethod
    def l2norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    def situ(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        b, lb = self.c.situ_beta, self.c.situ_linear_beta
        return b * torch.tanh(g / b) * torch.sigmoid(g) * lb * torch.tanh(u / lb)

    def attn_res(self, p: torch.Tensor, blocks: list[torch.Tensor], prefix: str) -> torch.Tensor:
        """Spec section 2: softmax over [B_0 .. B_{n-1}, p] of RMS-normalised values . norm . proj."""
        V = torch.stack([*blocks, p])  # [n, T, D]
        K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)
        score = (K * self.W(prefix + "_norm.weight") * self.W(prefix + "_proj.weight")[0]).sum(-1)  # [n, T]
        return (torch.softmax(score, dim=0).unsqueeze(-1) * V).sum(0)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.W(name + ".weight").t()

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self.linear(self.situ(self.linear(x, prefix + "gate_proj"), self.linear(x, prefix + "up_proj")),
                           prefix + "down_proj")

    @staticmethod
    def mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Spec section 6: low nibble = even element, bit 3 = sign, LUT magnitude, 2^(e - 127) per 32."""
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
        mags = torch.tensor(E2M1, dtype=torch.float64)[codes & 0x7]
        values = torch.where(codes & 0x8 > 0, -mags, mags)
        return values * (2.0 ** (scale.double() - 127)).repeat_interleave(32, dim=-1)

    # ---- KDA (section 3) ---------------------------------------------------------------------
    @staticmethod
    def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv, x [T, D], weight [D, 1, k]: out[t] = sum_j w[j] x[t - k + 1 + j]."""
        k = weight.shape[-1]
        padded = torch.cat((x.new_zeros(k - 1, x.shape[1]), x))
        return sum(weight[:, 0, j] * padded[j:j + x.shape[0]] for j in range(k))

    def kda_gate(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """K3 bounded decay: g = lb * sigmoid(exp(A_log[h]) * (f_b(f_a x) + dt_bias)). -> [T, H, K]"""
        H, K = self.c.kda_num_heads, self.c.kda_head_dim
        z = (self.linear(self.linear(x, p + "f_a_proj"), p + "f_b_proj") + self.W(p + "dt_bias")).unflatten(-1, (H, K))
        a = torch.exp(self.W(p + "A_log")[:H]).view(H, 1)
        return self.c.kda_gate_lower_bound * torch.sigmoid(a * z)

    def kda(self, x: torch.Tensor, p: str) -> torch.Tensor:
        H, K = self.c.kda_num_heads, self.c.kda_head_dim
        T = x.shape[0]

        def branch(name: str) -> torch.Tensor:
            h = self.causal_conv(self.linear(x, p + name + "_proj"), self.W(p + name + "_conv1d.weight"))
            return torch.nn.functional.silu(h).unflatten(-1, (H, K))

        q, k, v = self.l2norm(branch("q")), self.l2norm(branch("k")), branch("v")
        g = self.kda_gate(x, p)
        beta = torch.sigmoid(self.linear(x, p + "b_proj"))  # [T, H]
        S = x.new_zeros(H, K, K)  # key rows x value cols
        o = x.new_zeros(T, H, K)
        for t in range(T):
            S = S * torch.exp(g[t]).unsqueeze(-1)
            u = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
            S = S + k[t].unsqueeze(-1) * u.unsqueeze(-2)
            o[t] = torch.einsum("hk,hkv->hv", q[t] / math.sqrt(K), S)
        gate = self.linear(x, p + "g_proj").unflatten(-1, (H, K))
        o = self.rms_norm(o, self.W(p + "o_norm.weight"), self.c.rms_norm_eps) * torch.sigmoid(gate)
        return self.linear(o.flatten(-2), p + "o_proj")

    # ---- gated MLA with the DSA indexer (section 4) ----------------------------------------
    def indexer_mask(self, x: torch.Tensor, q_resid: torch.Tensor, p: str) -> torch.Tensor:
        """[T, T] bool: the keys each query reads (its top-k index scores among s <= t)."""
        d = self.c.dsa
        T = x.shape[0]
        qi = self.linear(q_resid, p + "indexer.wq_b").unflatten(-1, (d.n_heads, d.head_dim))  # [T, Hi, Di]
        ki = self.layer_norm(self.linear(x, p + "indexer.wk"), self.W(p + "indexer.k_norm.weight"),
                             self.W(p + "indexer.k_norm.bias"), d.k_norm_eps)  # [T, Di]
        w = self.linear(x, p + "indexer.weights_proj") * d.n_heads ** -0.5  # [T, Hi]
        scores = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", qi, ki) / math.sqrt(d.head_dim)))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        self.min_gaps["indexer"] = min(self.min_gaps["indexer"], min_topk_gap(scores, d.topk))
        # relu makes exact ties common (every key whose head logits are all negative scores 0); the
        # spec leaves them open and the engine's contract is "the earlier key wins": a stable
        # descending sort keeps exactly that order among equal scores
        keep = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(d.topk, T)]
        return torch.zeros(T, T, dtype=torch.bool).scatter_(1, keep, True) & causal

    def mla(self, x: torch.Tensor, p: str, layer: int) -> torch.Tensor:
        c = self.c
        H, nope, rope, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        T = x.shape[0]
        q_resid = self.rms_norm(self.linear(x, p + "q_a_proj"), self.W(p + "q_a_layernorm.weight"), 1e-6)
        q = self.linear(q_resid, p + "q_b_proj").unflatten(-1, (H, nope + rope))
        latent, k_r = self.linear(x, p + "kv_a_proj_with_mqa").split([c.kv_lora_rank, rope], dim=-1)
        latent = self.rms_norm(latent, self.W(p + "kv_a_layernorm.weight"), 1e-6)
        kv = self.linear(latent, p + "kv_b_proj").unflatten(-1, (H, nope + dv))
        k = torch.cat((kv[..., :nope], k_r.unsqueeze(1).expand(T, H, rope)), dim=-1)  # no rotary (NoPE)
        v = kv[..., nope:]
        s = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        if c.is_dsa_layer(layer):
            allowed = self.indexer_mask(x, q_resid, p)
        s = s.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("hts,shv->thv", torch.softmax(s, dim=-1), v)
        attn = attn * torch.sigmoid(self.linear(x, p + "g_proj")).unflatten(-1, (H, dv))
        return self.linear(attn.flatten(-2), p + "o_proj")

    # ---- latent MoE (section 5) --------------------------------------------------------------
    def route(self, x: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [N, k], expert ids [N, k]) per the sigmoid / bias / grouped top-k rule."""
        c = self.c
        s = torch.sigmoid(self.linear(x, p + "gate"))  # [N, E]
        choice = s + self.W(p + "gate.e_score_correction_bias")
        if c.num_expert_group > 1:
            grouped = choice.unflatten(-1, (c.num_expert_group, -1))  # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            self.min_gaps["router"] = min(self.min_gaps["router"], min_topk_gap(group_score, c.topk_group))
            keep = group_score.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        self.min_gaps["router"] = min(self.min_gaps["router"], min_topk_gap(choice, c.num_experts_per_token))
        ids = choice.topk(c.num_experts_per_token, dim=-1).indices
        w = s.gather(-1, ids)
        if c.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, ids

    def expert(self, p: str, name: str, e: int) -> torch.Tensor:
        if self.c.expert_format == "mxfp4":
            return self.mxfp4(self.w[f"{p}experts.{name}_packed"][e], self.w[f"{p}experts.{name}_scale"][e])
        return self.W(f"{p}experts.{name}")[e]

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        weights, ids = self.route(x, p)
        h = self.linear(x, p + "routed_expert_down_proj")
        y = torch.zeros_like(h)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)  # tokens routed to e, and at which of their k
            inner = self.situ(h[rows] @ self.expert(p, "w1", e).t(), h[rows] @ self.expert(p, "w3", e).t())
            y.index_add_(0, rows, weights[rows, slot].unsqueeze(-1) * (inner @ self.expert(p, "w2", e).t()))
        y = self.rms_norm(y, self.W(p + "routed_expert_norm.weight"), self.c.rms_norm_eps)  # after the sum
        return self.linear(y, p + "routed_expert_up_proj") + self.mlp(x, p + "shared_experts.")

    # ---- the decoder (section 2) -------------------------------------------------------------
    def layer(self, i: int, P: torch.Tensor, B: list[torch.Tensor]) -> torch.Tensor:
        c, p = self.c, f"model.layers.{i}."
        h = self.attn_res(P, B, p + "self_attention_res") if B else P
        if i % c.attn_res_block_size == 0:
            B.append(P)
            P = torch.zeros_like(P)
        x = self.rms_norm(h, self.W(p + "input_layernorm.weight"), c.rms_norm_eps)
        mixer = self.kda(x, p + "self_attn.") if c.is_kda_layer(i) else self.mla(x, p + "self_attn.", i)
        P = P + mixer
        m = self.attn_res(P, B, p + "mlp_res")
        x = self.rms_norm(m, self.W(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
        ffn = self.moe(x, p + "block_sparse_moe.") if c.is_moe_layer(i) else self.mlp(x, p + "mlp.")
        return P + ffn

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [T] -> (logits [T, vocab], per-layer outputs)."""
        P = self.W("model.embed_tokens.weight")[ids]
        B: list[torch.Tensor] = []
        outputs = []
        for i in range(self.c.num_hidden_layers):
            P = self.layer(i, P, B)
            outputs.append(P)
        final = self.attn_res(P, B, "model.output_attn_res")
        final = self.rms_norm(final, self.W("model.norm.weight"), self.c.rms_norm_eps)
        return self.linear(final, "lm_head"), outputs


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return load_model("preset:tiny", seed=SEED)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory):
    """Tiny K3.1 with grouped routing, top-3, a non-unit routed_scaling_factor, written to disk and loaded."""
    config = get_preset("tiny").replace(num_expert_group=4, topk_group=2, num_experts_per_token=3,
                                        routed_scaling_factor=2.5)
    out = write_checkpoint(config, tmp_path_factory.mktemp("tiny-grouped"), seed=SEED, float_dtype=torch.float32)
    return load_model(out)


def normed_inputs(T: int, hidden: int, seed: int = SEED) -> torch.Tensor:
    """Inputs of the scale a layer sees after its RMSNorm. [T, hidden]"""
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(seed))
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


# ---- components -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_blocks", [1, 2, 5])
def test_block_attention_residuals(tiny, n_blocks: int) -> None:
    ref = SpecReference(tiny)
    gen = torch.Generator().manual_seed(SEED)
    blocks = [torch.randn(2, 13, 64, generator=gen) * (i + 1) for i in range(n_blocks - 1)]
    prefix = torch.randn(2, 13, 64, generator=gen)
    p = "model.layers.3.mlp_res"
    ours = attn_res(prefix, blocks, tiny.state_dict()[p + "_norm.weight"], tiny.state_dict()[p + "_proj.weight"],
                    tiny.config.rms_norm_eps)
    expected = torch.stack([ref.attn_res(prefix[b].double(), [x[b].double() for x in blocks], p) for b in range(2)])
    assert_close(ours, expected, "attn_res")


def test_situ() -> None:
    g = torch.linspace(-60, 60, 1201)
    u = torch.linspace(-200, 200, 1201).flip(0)
    ours = situ(g, u, 4.0, 25.0)
    gd, ud = g.double(), u.double()
    expected = 4 * torch.tanh(gd / 4) * torch.sigmoid(gd) * 25 * torch.tanh(ud / 25)
    assert_close(ours, expected, "SiTU")
    # bounded by beta * linear_beta, unlike SiLU * u
    assert ours.abs().max() <= 4.0 * 25.0


def test_dense_mlp_layer0(tiny) -> None:
    ref = SpecReference(tiny)
    x = normed_inputs(37, tiny.config.hidden_size)
    with torch.no_grad():
        ours = tiny.model.layers[0].mlp(x)
    assert_close(ours, ref.mlp(x.double(), "model.layers.0.mlp."), "dense SiTU MLP")


@pytest.mark.parametrize("model_name", ["tiny", "grouped"])
def test_latent_moe(request, model_name: str) -> None:
    model = request.getfixturevalue(model_name)
    ref = SpecReference(model)
    layer = model.config.num_hidden_layers - 1
    x = normed_inputs(37, model.config.hidden_size)
    with torch.no_grad():
        ours = model.model.layers[layer].block_sparse_moe(x)
    expected = ref.moe(x.double(), f"model.layers.{layer}.block_sparse_moe.")
    assert ref.min_gaps["router"] > NEAR_TIE, "inputs put two experts in a near tie; change the seed"
    assert_close(ours, expected, "latent MoE")


def test_router_weights_and_choice(grouped) -> None:
    """Selection uses s + bias, weights use s alone, renormalised, times routed_scaling_factor."""
    ref = SpecReference(grouped)
    moe = grouped.model.layers[2].block_sparse_moe
    x = normed_inputs(29, grouped.config.hidden_size)
    with torch.no_grad():
        weights, ids = moe.gate(x)
    ref_weights, ref_ids = ref.route(x.double(), "model.layers.2.block_sparse_moe.")
    # fp32 against fp64: the same experts unless two of them nearly tie
    assert ref.min_gaps["router"] > NEAR_TIE, "inputs put two experts in a near tie; change the seed"
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert_close(weights.gather(-1, order.indices), ref_weights.gather(-1, ref_order.indices), "router weights")
    assert torch.allclose(weights.sum(-1), torch.full((29,), 2.5))
    # only topk_group of the 4 groups (2 experts each) are ever used per token
    assert ((ids // 2).unsqueeze(-1) == (ids // 2).unsqueeze(-2)).any(-1).all()
    assert max(len(set(row)) for row in (ids // 2).tolist()) <= 2


def test_bounded_kda_gate(tiny) -> None:
    ref = SpecReference(tiny)
    i = tiny.config.kda_layers[0]
    x = normed_inputs(41, tiny.config.hidden_size)
    with torch.no_grad():
        g = tiny.model.layers[i].self_attn.decay(x)
    expected = ref.kda_gate(x.double(), f"model.layers.{i}.self_attn.")
    assert_close(g, expected, "bounded gate")
    lb = tiny.config.kda_gate_lower_bound
    assert g.min() > lb and g.max() < 0


def test_a_log_is_read_from_its_padded_storage(checkpoint_dir) -> None:
    """K3 stores A_log padded to 128 entries; the first num_heads are the heads' values."""
    from safetensors import safe_open
    ckpt = checkpoint_dir("tiny", "k3.1", seed=0)
    model = load_model(ckpt)
    layer = model.config.kda_layers[0]
    name = f"language_model.model.layers.{layer}.self_attn.A_log"
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            if name in f.keys():
                stored = f.get_tensor(name)
    assert stored.shape == (128,)
    assert torch.equal(model.model.layers[layer].self_attn.A_log, stored[: model.config.kda_num_heads])


@pytest.mark.parametrize("T", [1, 37, 70])
def test_kda_layer(tiny, T: int) -> None:
    ref = SpecReference(tiny)
    i = tiny.config.kda_layers[-1]
    x = normed_inputs(T, tiny.config.hidden_size)
    with torch.no_grad():
        ours = tiny.model.layers[i].self_attn(x.unsqueeze(0))[0]
    assert_close(ours, ref.kda(x.double(), f"model.layers.{i}.self_attn."), "KDA layer")


@pytest.mark.parametrize("T", [9, 16, 45])
def test_gated_mla_with_indexer(tiny, T: int) -> None:
    ref = SpecReference(tiny)
    i = tiny.config.mla_layers[0]
    x = normed_inputs(T, tiny.config.hidden_size)
    with torch.no_grad():
        ours = tiny.model.layers[i].self_attn(x.unsqueeze(0))[0]
    expected = ref.mla(x.double(), f"model.layers.{i}.self_attn.", i)
    assert ref.min_gaps["indexer"] > NEAR_TIE, "inputs put two keys in a near tie; change the seed"
    assert_close(ours, expected, "gated MLA + DSA")


def test_mla_output_gate(tiny) -> None:
    """The gate scales the attention output elementwise before o_proj: with g_proj zeroed (sigmoid(0) =
    1/2 on every channel) the layer still matches the reference, and it differs from the gated layer."""
    i = tiny.config.mla_layers[0]
    attn = tiny.model.layers[i].self_attn
    x = normed_inputs(12, tiny.config.hidden_size).unsqueeze(0)
    saved = attn.g_proj.weight.detach().clone()
    with torch.no_grad():
        gated = attn(x)
        try:
            attn.g_proj.weight.zero_()
            half = attn(x)
            expected = SpecReference(tiny).mla(x[0].double(), f"model.layers.{i}.self_attn.", i)
        finally:
            attn.g_proj.weight.copy_(saved)
    assert_close(half[0], expected, "MLA with a zero gate")
    assert relative_error(gated, half) > 1e-2


# ---- the whole model ------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [13, 40], ids=["T13-below-topk", "T40-above-topk"])
def test_tiny_k31_end_to_end(tiny, T: int) -> None:
    """fp32 engine logits (and every layer's output) == float64 spec forward, below and above top-k."""
    ids = torch.randint(0, tiny.config.vocab_size, (T,), generator=torch.Generator().manual_seed(SEED))
    ref = SpecReference(tiny)
    expected_logits, expected_layers = ref.forward(ids)
    assert ref.min_gaps["router"] > NEAR_TIE and ref.min_gaps["indexer"] > NEAR_TIE, \
        f"near-tied selections {ref.min_gaps}: the comparison would be ambiguous; change the seed"
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        logits = tiny(ids.unsqueeze(0), layer_outputs=outputs)
    for i, (ours, expected) in enumerate(zip(outputs, expected_layers)):
        assert_close(ours[0], expected, f"layer {i} output")
    assert_close(logits[0], expected_logits, "logits")


def test_dsa_actually_sparsifies_above_topk(tiny) -> None:
    """Above top-k the DSA mask drops keys: forcing dense reads changes the later logits (so the
    end-to-end test above is not vacuous) and leaves the first top-k positions as they were."""
    T = 40
    ids = torch.randint(0, tiny.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        sparse = tiny(ids)
        tiny.runtime.dsa_force_dense = True
        try:
            dense = tiny(ids)
        finally:
            tiny.runtime.dsa_force_dense = False
    assert relative_error(sparse[0, tiny.config.dsa.topk:], dense[0, tiny.config.dsa.topk:]) > 1e-4
    assert_close(sparse[0, :tiny.config.dsa.topk], dense[0, :tiny.config.dsa.topk], "queries below top-k")
