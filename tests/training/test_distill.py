"""Indexer warm-up: the hook's dense distribution is the engine's attention, and KL falls."""

from __future__ import annotations

import torch

from engine.ops.mla.reference import dense_attention_expanded
from training.distill import IndexerDistill
from training.model_setup import trainable_model, trained_demo_config


def test_dense_target_matches_engine_attention_and_kl_falls() -> None:
    torch.manual_seed(0)
    model = trainable_model(trained_demo_config(), 0)
    mod = next(m for m in model.modules() if getattr(m, "indexer", None) is not None)
    x = torch.randn(2, 300, 128)
    H, nope = mod.num_heads, mod.nope
    with torch.no_grad():
        q = mod.q_b_proj(mod.q_a_layernorm(mod.q_a_proj(x))).unflatten(-1, (H, nope + mod.rope))
        latent, k_rope = mod.kv_a_proj_with_mqa(x).split([mod.kv_lora_rank, mod.rope], dim=-1)
        kv = mod.kv_b_proj(mod.kv_a_layernorm(latent)).unflatten(-1, (H, nope + mod.v_dim))
        k = torch.cat((kv[..., :nope], k_rope.unsqueeze(2).expand(-1, -1, H, -1)), -1)
        rows = torch.tensor([[5, 100, 299], [0, 64, 250]])
        # the hook's per-head probabilities (before its head sum) times the values = engine attention
        qs = q.gather(1, rows[:, :, None, None].expand(-1, -1, H, q.shape[-1]))
        scores = torch.einsum("bnhd,bshd->bhns", qs, k) * mod.scale
        invisible = torch.arange(300)[None, None, :] > rows[:, :, None]
        probs = torch.softmax(scores.masked_fill(invisible[:, None], float("-inf")), -1)
        ours = torch.einsum("bhns,bshv->bnhv", probs, kv[..., nope:])
        ref = dense_attention_expanded(q, k, kv[..., nope:], torch.arange(300), mod.scale)
        torch.testing.assert_close(ours, ref.gather(1, rows[:, :, None, None].expand(-1, -1, H, ref.shape[-1])),
                                   rtol=1e-5, atol=1e-5)

    distill = IndexerDistill(model)
    distill.active = True
    distill.rows = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if ".indexer." in n], lr=3e-3)
    kls = []
    for _ in range(6):
        with torch.no_grad():
            model(ids)
        kl = distill.take()
        kl.backward()
        opt.step()
        opt.zero_grad()
        kls.append(float(kl.detach()))
    assert kls[-1] < 0.7 * kls[0], kls
    distill.remove()
