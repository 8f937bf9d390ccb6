"""Where transformers' `kimi_k25` (the older MoonViT) coincides with MoonViT-V2, it is the oracle
(spec section 11: structure only; its sizes and norms differ, so only these parts are compared):
patch embedding, the position-table resize (its mode set to bilinear, ours), 2-D RoPE (its
rotate-half layout is ours with each head's dims permuted), RoPE + attention inside one image,
the 2x2 merge order, and the image processor's resize arithmetic, padding to 28 px and patch
layout (its torchvision backend is not installed here: that part runs in a subprocess with the
torchvision import stubbed, using only the processor's pure-torch pieces)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from engine.config import VisionConfig
from engine.vision import fit_to_limits, merge_patches, preprocess_image
from engine.vision.attention import image_attention
from engine.vision.rope import apply_rope2d, rope2d_angles
from engine.vision.tower import PatchEmbed
from tests.helpers import relative_error

M = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig  # noqa: E402

TOL = 1e-5
HIDDEN, HEADS, TABLE = 32, 2, 8
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _hf_config() -> Kimi_K25VisionConfig:
    return Kimi_K25VisionConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1,
                                intermediate_size=64, pos_emb_height=TABLE, pos_emb_width=TABLE)


def _ours() -> VisionConfig:
    return VisionConfig(hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, qkv_hidden_size=HIDDEN,
                        intermediate_size=64, pos_emb_height=TABLE, pos_emb_width=TABLE, text_hidden_size=HIDDEN)


def _thw(grid):
    return torch.tensor([[1, grid[0], grid[1]]])


def _to_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Our adjacent-pair layout (2p, 2p+1) -> rotate-half layout (p, p + d/2) along the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _from_rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return torch.stack([x[..., : d // 2], x[..., d // 2:]], dim=-1).flatten(-2)


@pytest.mark.parametrize("grid", [(8, 8), (4, 6), (12, 10)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_patch_embed_and_bilinear_position_table(grid):
    hf = M.Kimi_K25VisionPatchEmbed(_hf_config())
    ours = PatchEmbed(_ours())
    g = torch.Generator().manual_seed(0)
    ours.proj.weight.copy_(torch.randn(ours.proj.weight.shape, generator=g) * 0.1)
    ours.pos_emb.weight.copy_(torch.randn(ours.pos_emb.weight.shape, generator=g))
    hf.proj.weight.copy_(ours.proj.weight)
    hf.proj.bias.zero_()  # MoonViT-V2 has no biases
    hf.pos_emb.position_embeddings.copy_(ours.pos_emb.weight)
    hf.pos_emb.interpolation_mode = "bilinear"  # K2.5 resizes bicubically; V2 bilinearly
    pixels = torch.rand(grid[0] * grid[1], 3, 14, 14, generator=g) * 2 - 1
    assert relative_error(ours(pixels, grid), hf(pixels, _thw(grid))) <= TOL
    # the table alone (zero patch features)
    zeros = torch.zeros(grid[0] * grid[1], HIDDEN)
    assert relative_error(ours.pos_emb(grid), hf.pos_emb(zeros, _thw(grid))) <= TOL


@pytest.mark.parametrize("grid", [(4, 6), (7, 3)])
def test_rope2d_matches_the_axial_rope_up_to_the_pair_layout(grid):
    rope = M.Kimi_K25VisionRotaryEmbedding(_hf_config())
    from transformers.vision_utils import get_vision_position_ids
    pos = get_vision_position_ids(_thw(grid), spatial_merge_size=1)  # [P, 2] = (row, col)
    x = torch.randn(1, grid[0] * grid[1], HEADS, HEAD_DIM)
    cos, sin = rope(x, pos)
    theirs, _ = M.apply_rotary_pos_emb_vision(_to_rotate_half(x), _to_rotate_half(x), cos, sin)
    ours = apply_rope2d(x[0], rope2d_angles(grid, HEAD_DIM, 10000.0))
    assert relative_error(ours, _from_rotate_half(theirs[0])) <= TOL


@pytest.mark.parametrize("grid", [(4, 6), (6, 6)])
def test_rope_attention_inside_one_image(grid):
    """Their attention (biases zeroed, q/k rows permuted per head to rotate-half) == our wqkv ->
    2-D RoPE -> blockwise attention -> wo."""
    cfg = _hf_config()
    hf = M.Kimi_K25VisionAttention(cfg).eval()
    g = torch.Generator().manual_seed(1)
    wqkv = torch.randn(3 * HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5  # rows [q | k | v], head-major
    wo = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    wq, wk, wv = wqkv.split(HIDDEN)

    def permute_rows(w):
        return _to_rotate_half(w.T.reshape(HIDDEN, HEADS, HEAD_DIM)).reshape(HIDDEN, HIDDEN).T

    for lin, w in ((hf.q_proj, permute_rows(wq)), (hf.k_proj, permute_rows(wk)), (hf.v_proj, wv), (hf.proj, wo)):
        lin.weight.copy_(w)
        lin.bias.zero_()
    P = grid[0] * grid[1]
    x = torch.randn(P, HIDDEN, generator=g)
    from transformers.vision_utils import get_vision_position_ids
    rope = M.Kimi_K25VisionRotaryEmbedding(cfg)
    cos_sin = rope(x, get_vision_position_ids(_thw(grid), spatial_merge_size=1))
    theirs = hf(x, cu_seqlens=torch.tensor([0, P], dtype=torch.int32), position_embeddings=cos_sin)

    qkv = (x @ wqkv.T).view(P, 3, HEADS, HEAD_DIM)
    angles = rope2d_angles(grid, HEAD_DIM, 10000.0)
    for reference in (False, True):
        o = image_attention(apply_rope2d(qkv[:, 0], angles), apply_rope2d(qkv[:, 1], angles), qkv[:, 2],
                            HEAD_DIM ** -0.5, reference=reference)
        assert relative_error(o.reshape(P, HIDDEN) @ wo.T, theirs) <= TOL


@pytest.mark.parametrize("grid", [(4, 6), (2, 2), (8, 4)])
def test_merge_order(grid):
    model = M.Kimi_K25VisionModel(_hf_config())
    x = torch.randn(grid[0] * grid[1], HIDDEN)
    theirs = model.temporal_merge(x, _thw(grid), 2, 2)  # [tokens, 4, D]
    assert torch.equal(merge_patches(x, grid), theirs.reshape(theirs.shape[0], -1))


_PROCESSOR_SCRIPT = textwrap.dedent("""
    import json, sys, types
    import numpy as np, torch
    import torch.nn.functional as F
    import transformers  # noqa: F401  (its availability checks run before the stub below)
    import transformers.image_utils  # noqa: F401
    # the processor module imports torchvision at the top; only its pure-torch pieces are used
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor, navit_resize
    cases = json.loads(sys.stdin.read())
    out = {"sizes": [], "pixels": []}
    for h, w in cases["sizes"]:
        (rh, rw), (ph, pw) = navit_resize(h, w, patch_size=14, merge_kernel_size=2, max_patches=65536,
                                          max_size_per_side=512)
        out["sizes"].append([rw, rh, pw, ph])
    proc = Kimi_K25ImageProcessor.__new__(Kimi_K25ImageProcessor)
    for arr in cases["pixels"]:
        img = torch.tensor(arr, dtype=torch.uint8).permute(2, 0, 1)[None]  # [1, 3, H, W]
        H, W = img.shape[-2:]
        (rh, rw), (ph, pw) = navit_resize(H, W, patch_size=14, merge_kernel_size=2, max_patches=65536,
                                          max_size_per_side=512)
        assert (rh, rw) == (H, W)
        # TorchvisionBackend.pad: zeros at the bottom/right; then rescale 1/255 and normalise
        # with IMAGENET_STANDARD_MEAN/STD (0.5, 0.5)
        from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
        padded = F.pad(img, (0, pw - W, 0, ph - H)).float() / 255.0
        mean = torch.tensor(IMAGENET_STANDARD_MEAN)[:, None, None]
        std = torch.tensor(IMAGENET_STANDARD_STD)[:, None, None]
        patches, gh, gw = proc.patchify((padded - mean) / std, patch_size=14)
        out["pixels"].append({"grid": [gh, gw], "values": patches[0].flatten().tolist()})
    print(json.dumps(out))
""")


def test_image_processor_sizes_grid_and_pixel_values():
    # (h, w); 5000 x 5000 is left out on purpose: there the padded grid would exceed 65536 patches and
    # our rule tightens the scale (fit_to_limits docstring), theirs does not
    sizes = [(896, 896), (2160, 3840), (60, 100), (1000, 8000), (3000, 4000), (15, 29), (6000, 400)]
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((30, 45), (56, 28), (17, 60))]
    payload = json.dumps({"sizes": sizes, "pixels": [a.tolist() for a in arrays]})
    proc = subprocess.run([sys.executable, "-c", _PROCESSOR_SCRIPT], input=payload, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for (h, w), (rw, rh, pw, ph) in zip(sizes, theirs["sizes"]):
        assert fit_to_limits(w, h) == (rw, rh), (h, w)
    for arr, t in zip(arrays, theirs["pixels"]):
        ours = preprocess_image(Image.fromarray(arr, "RGB"))
        assert list(ours.grid) == t["grid"]
        values = torch.tensor(t["values"]).reshape(ours.pixel_values.shape)
        assert relative_error(ours.pixel_values, values) <= 1e-6
