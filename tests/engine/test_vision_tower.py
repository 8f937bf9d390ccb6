"""The MoonViT-V2 tower, merge and projector against float64 implementations written from spec
section 8 (a second reading, independent of engine/vision), plus names, blockwise attention and
packing. fp32 relative error <= 1e-5."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import VisionConfig
from engine.presets import get_preset
from engine.vision import VisionModel, merge_patches
from engine.vision.attention import attention_reference, attention_sdpa
from engine.vision.rope import apply_rope2d, rope2d_angles
from engine.weights.names import checkpoint_tensors, is_vision_tensor
from engine.weights.random_init import RandomSource
from tests.helpers import relative_error

TOL = 1e-5


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _config(**kw) -> VisionConfig:
    base = dict(hidden_size=32, num_layers=2, num_heads=2, qkv_hidden_size=32, intermediate_size=64,
                pos_emb_height=8, pos_emb_width=8, text_hidden_size=48)
    base.update(kw)
    return VisionConfig(**base)


def _random_model(c: VisionConfig, seed: int = 0) -> VisionModel:
    g = torch.Generator().manual_seed(seed)
    model = VisionModel(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in if "pos_emb" not in name else 1))
    return model


def _pixels(grid: tuple[int, int], patch: int = 14, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(grid[0] * grid[1], 3, patch, patch, generator=g) * 2 - 1


# ---- float64 implementations from the spec text --------------------------------------------------

def rms64(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def resize_axis_weights(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] bilinear weights, align_corners=False, source clamped at the border."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for o in range(n_out):
        src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        frac = src - i0
        m[o, i0] += 1 - frac
        m[o, i1] += frac
    return m


def pos_table64(table, grid):
    H0, W0, D = table.shape
    if tuple(grid) == (H0, W0):
        return table.reshape(-1, D)
    wh, ww = resize_axis_weights(H0, grid[0]), resize_axis_weights(W0, grid[1])
    out = torch.einsum("ia,jb,abd->ijd", wh, ww, table)
    return out.reshape(-1, D)


def patch_embed64(sd, pixels, grid):
    w = sd["vision_tower.patch_embed.proj.weight"]  # [D, 3, p, p]
    x = pixels.reshape(pixels.shape[0], -1) @ w.reshape(w.shape[0], -1).T
    return x + pos_table64(sd["vision_tower.patch_embed.pos_emb.weight"], grid)


def rope64(x, grid, theta):
    """x [P, H, d]: pair p = (2p, 2p+1); even pair 2i turns by col * f_i, odd pair 2i+1 by row * f_i."""
    P, H, d = x.shape
    h, w = grid
    out = x.clone()
    for patch in range(P):
        row, col = divmod(patch, w)
        for p in range(d // 2):
            i = p // 2
            f = theta ** (-4.0 * i / d)
            angle = (col if p % 2 == 0 else row) * f
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[patch, :, 2 * p], x[patch, :, 2 * p + 1]
            out[patch, :, 2 * p] = a * c - b * s
            out[patch, :, 2 * p + 1] = a * s + b * c
    return out


def gelu_tanh64(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf64(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def block64(sd, i, x, grid, c):
    b = f"vision_tower.encoder.blocks.{i}."
    eps = torch.finfo(torch.float32).eps
    P, H, d = x.shape[0], c.num_heads, c.head_dim
    qkv = rms64(x, sd[b + "norm0.weight"], eps) @ sd[b + "wqkv.weight"].T
    q, k, v = (qkv[:, j * H * d:(j + 1) * H * d].reshape(P, H, d) for j in range(3))
    q, k = rope64(q, grid, c.rope_theta), rope64(k, grid, c.rope_theta)
    scores = torch.einsum("phd,qhd->hpq", q, k) / math.sqrt(d)
    attn = torch.einsum("hpq,qhd->phd", scores.softmax(-1), v).reshape(P, H * d)
    x = x + attn @ sd[b + "wo.weight"].T
    hmid = gelu_tanh64(rms64(x, sd[b + "norm1.weight"], eps) @ sd[b + "mlp.fc0.weight"].T)
    return x + hmid @ sd[b + "mlp.fc1.weight"].T


def merge64(x, grid):
    h, w = grid
    tokens = []
    for R in range(h // 2):
        for C in range(w // 2):
            tokens.append(torch.cat([x[(2 * R + dr) * w + 2 * C + dc] for dr, dc in ((0, 0), (0, 1), (1, 0), (1, 1))]))
    return torch.stack(tokens)


def projector64(sd, merged, eps):
    y = gelu_erf64(merged @ sd["mm_projector.proj.0.weight"].T) @ sd["mm_projector.proj.2.weight"].T
    return rms64(y, sd["mm_projector.post_norm.weight"], eps)


def tower64(sd, pixels, grid, c):
    x = patch_embed64(sd, pixels, grid)
    for i in range(c.num_layers):
        x = block64(sd, i, x, grid, c)
    x = rms64(x, sd["vision_tower.encoder.final_layernorm.weight"], torch.finfo(torch.float32).eps)
    return projector64(sd, merge64(x, grid), c.projector_norm_eps)


def _sd64(model):
    return {k: v.detach().double() for k, v in model.state_dict().items()}


# ---- stage oracles -------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", [(8, 8), (4, 6), (10, 14), (2, 2)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_patch_embed_and_position_table(grid):
    c = _config()
    model = _random_model(c)
    pixels = _pixels(grid)
    got = model.vision_tower.patch_embed(pixels, grid)
    want = patch_embed64(_sd64(model), pixels.double(), grid)
    assert relative_error(got, want) <= TOL


def test_position_table_is_not_resized_at_its_own_size():
    c = _config()
    model = _random_model(c)
    table = model.vision_tower.patch_embed.pos_emb
    assert torch.equal(table((8, 8)), table.weight.reshape(64, -1))


@pytest.mark.parametrize("grid", [(4, 6), (6, 4)])
def test_rope2d(grid):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(grid[0] * grid[1], 2, 16, generator=g)
    got = apply_rope2d(x, rope2d_angles(grid, 16, 10000.0))
    assert relative_error(got, rope64(x.double(), grid, 10000.0)) <= TOL


@pytest.mark.parametrize("grid", [(4, 6), (8, 8)])
def test_one_block(grid):
    c = _config()
    model = _random_model(c)
    sd = _sd64(model)
    x = torch.randn(grid[0] * grid[1], c.hidden_size, generator=torch.Generator().manual_seed(5))
    block = model.vision_tower.encoder.blocks[0]
    got = block(x, rope2d_angles(grid, c.head_dim, c.rope_theta))
    assert relative_error(got, block64(sd, 0, x.double(), grid, c)) <= TOL


def test_merge_order():
    grid = (4, 6)
    x = torch.randn(24, 5, dtype=torch.float64)
    assert torch.equal(merge_patches(x, grid), merge64(x, grid))
    # token (0, 1) = patches (0, 2), (0, 3), (1, 2), (1, 3)
    ids = torch.arange(24.0)[:, None]
    assert merge_patches(ids, grid)[1].tolist() == [2.0, 3.0, 8.0, 9.0]


def test_projector():
    c = _config()
    model = _random_model(c)
    merged = torch.randn(7, c.merged_hidden_size, generator=torch.Generator().manual_seed(6))
    got = model.mm_projector(merged)
    assert relative_error(got, projector64(_sd64(model), merged.double(), c.projector_norm_eps)) <= TOL


@pytest.mark.parametrize("grid", [(8, 8), (6, 10), (12, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("reference", [False, True], ids=["sdpa", "reference"])
def test_whole_tower(grid, reference):
    c = _config()
    model = _random_model(c)
    model.set_reference_attention(reference)
    pixels = _pixels(grid)
    got = model(pixels, grid)
    assert got.shape == (grid[0] * grid[1] // 4, c.text_hidden_size)
    assert relative_error(got, tower64(_sd64(model), pixels.double(), grid, c)) <= TOL


def test_tiny_preset_tower_from_a_random_checkpoint_loads_by_name():
    config = get_preset("tiny")
    source = RandomSource(config, seed=0, float_dtype=torch.float32)
    state = {s.name: source.get(s) for s in checkpoint_tensors(config)
             if s.name.startswith(("vision_tower.", "mm_projector."))}
    model = VisionModel(config.vision)
    model.load_state_dict(state, strict=True)  # every name and shape matches
    grid = (20, 18)  # larger than the 16 x 16 table: resized
    got = model(_pixels(grid), grid)
    assert relative_error(got, tower64(_sd64(model), _pixels(grid).double(), grid, config.vision)) <= TOL


@pytest.mark.parametrize("preset", ["tiny", "demo", "k3.1-pro"])
def test_parameter_names_are_the_checkpoint_names(preset):
    config = get_preset(preset)
    with torch.device("meta"):
        model = VisionModel(config.vision)
    table = {s.name: s.shape for s in checkpoint_tensors(config) if is_vision_tensor(s.name)}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == table
    # the loader fills `model.vision` by these names
    assert all(s.target == "vision." + s.name for s in checkpoint_tensors(config) if is_vision_tensor(s.name))
    if preset == "k3.1-pro":
        assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 0.447) < 0.005


# ---- attention without [P, P], packing ------------------------------------------------------------

def test_blockwise_attention_paths_agree_with_dense():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(300, 3, 16, generator=g) for _ in range(3))
    scale = 16 ** -0.5
    dense = torch.einsum("phd,qhd->hpq", q.double(), k.double()).mul(scale).softmax(-1)
    want = torch.einsum("hpq,qhd->phd", dense, v.double())
    assert relative_error(attention_reference(q, k, v, scale, q_block=64, key_block=70), want) <= TOL
    assert relative_error(attention_sdpa(q, k, v, scale, block_budget=3 * 300 * 50), want) <= TOL


def test_sdpa_query_blocks_bound_the_score_buffer(monkeypatch):
    import engine.vision.attention as attn
    seen = []
    real = attn.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.shape[-2] * k.shape[-2] * q.shape[-3])
        return real(q, k, v, **kw)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", spy)
    q = torch.randn(2000, 2, 8)
    attn.attention_sdpa(q, q, q, 0.3, block_budget=100_000)
    assert max(seen) <= 100_000 + 16 * 2000 * 2 and len(seen) > 1


def test_images_are_encoded_independently():
    """Packed images are block-diagonal: each image's output is what it gives alone."""
    from engine.vision import preprocess_image
    from PIL import Image
    import numpy as np
    c = get_preset("tiny").vision
    model = _random_model(c)
    rng = np.random.default_rng(0)
    a = preprocess_image(Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)))
    b = preprocess_image(Image.fromarray(rng.integers(0, 255, (30, 100, 3), dtype=np.uint8)))
    out_a, out_b = model.embed([a, b])
    assert torch.equal(out_a, model(a.pixel_values, a.grid))
    assert out_b.shape == (b.grid[0] // 2 * (b.grid[1] // 2), c.text_hidden_size)
