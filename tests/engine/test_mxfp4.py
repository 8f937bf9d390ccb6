"""MXFP4 / MXFP8 oracles: our dequantization against compressed-tensors and torch's MX dtypes.

- `dequantize` == compressed-tensors' `unpack_fp4_from_uint8` x `decompress_mx_scale`, over every
  byte value and a wide scale range (bit-exact).
- E2M1 codes against torch's `float4_e2m1fn_x2` and E8M0 scales against `float8_e8m0fnu`.
- The "-0" nibble 0x8 decodes to +0; quantize -> dequantize is exact for representable values;
  bf16 dequantization is exact; a NaN scale byte (0xFF) makes `load_model` fail naming file and tensor.
- `fake_quantize_mxfp8` sanity: exact on representable blocks, idempotent, E4M3 error bounds.
"""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from safetensors.torch import load_file, save_file

from engine import CheckpointError, load_model
from engine.presets import get_preset
from engine.ops.mxfp4 import reference as mxfp4
from engine.weights.safetensors_io import INDEX_FILE
from engine.weights.write import write_checkpoint

pytestmark = pytest.mark.usefixtures("nan_poison")  # unwritten outputs of ops and kernels fail loudly
SEED = 42


def random_mxfp4(out_f: int, in_f: int, scale_lo: int = 100, scale_hi: int = 150,
                 seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes (all 256 values likely) and E8M0 scale bytes in [scale_lo, scale_hi]."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(scale_lo, scale_hi + 1, (out_f, in_f // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 by its OCP bit definition (sign, 2-bit exponent with bias 1, 1-bit mantissa), float64."""
    c = codes.long()
    sign = torch.where(c & 0x8 > 0, -1.0, 1.0).double()
    exp, man = (c >> 1) & 0x3, (c & 0x1).double()
    normal = 2.0 ** (exp.double() - 1) * (1.0 + man / 2)
    subnormal = man / 2  # exponent field 0: 0 or 0.5
    return sign * torch.where(exp == 0, subnormal, normal)


# ---- against compressed-tensors ---------------------------------------------------------------

@pytest.mark.parametrize(("out_f", "in_f"), [(1, 32), (7, 96), (33, 320)], ids=["1x32", "7x96", "33x320"])
def test_dequantize_matches_compressed_tensors(out_f: int, in_f: int) -> None:
    packed, scale = random_mxfp4(out_f, in_f, scale_lo=90, scale_hi=160)
    ours = mxfp4.dequantize(packed, scale, torch.float32)
    elements = unpack_fp4_from_uint8(packed, out_f, in_f, dtype=torch.float32)
    # decompress_mx_scale returns bf16 powers of two: exact for these exponents
    block_scale = decompress_mx_scale(scale).float().repeat_interleave(mxfp4.BLOCK, dim=-1)
    expected = elements * block_scale
    assert ours.dtype == torch.float32 and ours.shape == (out_f, in_f)
    assert torch.equal(ours, expected)  # == treats compressed-tensors' -0.0 and our +0.0 as equal


def test_dequantize_batched_experts_match_per_expert() -> None:
    """Stacked [E, out, in/2] tensors dequantize like each expert on its own."""
    parts = [random_mxfp4(5, 64, seed=SEED + e) for e in range(3)]
    packed = torch.stack([p for p, _ in parts])
    scale = torch.stack([s for _, s in parts])
    batched = mxfp4.dequantize(packed, scale)
    for e, (p, s) in enumerate(parts):
        assert torch.equal(batched[e], mxfp4.dequantize(p, s))


# ---- against torch's MX dtypes --------------------------------------------------------------

def test_e2m1_codes_match_torch_float4_dtype() -> None:
    """Every packed byte through `torch.float4_e2m1fn_x2` (low nibble = first element)."""
    packed = torch.arange(256, dtype=torch.uint8).unsqueeze(0)  # [1, 256] -> 512 elements
    fp4 = packed.view(torch.float4_e2m1fn_x2)
    try:
        expected = fp4.to(torch.float32).double()
    except (NotImplementedError, RuntimeError):
        # torch 2.13's CPU build has the dtype but no conversion kernel ("copy_kernel" not implemented
        # for Float4_e2m1fn_x2); decode the dtype's bits by the E2M1 definition instead, after
        # checking that the dtype view carries exactly the packed bytes.
        assert torch.equal(fp4.view(torch.uint8), packed)
        bits = fp4.view(torch.uint8)
        codes = torch.stack((bits & 0x0F, bits >> 4), dim=-1).flatten(-2)
        expected = e2m1_from_bits(codes)
    ones = torch.full((1, 512 // mxfp4.BLOCK), 127, dtype=torch.uint8)  # scale 2^0
    ours = mxfp4.dequantize(packed, ones, torch.float64)
    assert torch.equal(ours, expected)
    assert sorted(set(ours.abs().flatten().tolist())) == list(mxfp4.E2M1_MAGNITUDES)


def test_e8m0_scales_match_torch_float8_e8m0fnu() -> None:
    all_bytes = torch.arange(256, dtype=torch.uint8)
    ours = mxfp4.scale_values(all_bytes)
    theirs = all_bytes.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours[:255], theirs[:255])
    assert torch.isnan(ours[255]) and torch.isnan(theirs[255])
    assert torch.equal(ours[:255].double(), 2.0 ** (torch.arange(255, dtype=torch.float64) - 127))


# ---- format properties ------------------------------------------------------------------------

def test_minus_zero_nibble_decodes_to_positive_zero() -> None:
    # 0x88: both nibbles are "-0"; 0x08 / 0x80: one of them
    packed = torch.tensor([[0x88, 0x08, 0x80] + [0x00] * 13], dtype=torch.uint8)
    scale = torch.tensor([[140]], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        values = mxfp4.dequantize(packed, scale, dtype)
        assert (values == 0).all()
        assert not torch.signbit(values).any(), f"-0 must decode to +0 ({dtype})"


def test_quantize_dequantize_round_trip_is_exact_for_representable_values() -> None:
    gen = torch.Generator().manual_seed(SEED)
    out_f, in_f = 9, 160
    # codes without the redundant -0 (0x8), and one element of magnitude 4 or 6 per block, so the OCP
    # exponent rule (floor(log2 amax) - 2) gives back exactly the block scale we chose
    mags = torch.randint(0, 8, (out_f, in_f), generator=gen)
    mags.view(out_f, -1, mxfp4.BLOCK)[..., 0] = torch.randint(6, 8, (out_f, in_f // mxfp4.BLOCK), generator=gen)
    signs = torch.randint(0, 2, (out_f, in_f), generator=gen) * (mags > 0)
    codes = (mags | (signs << 3)).to(torch.uint8)
    packed = mxfp4.pack_codes(codes)
    scale = torch.randint(100, 150, (out_f, in_f // mxfp4.BLOCK), generator=gen, dtype=torch.uint8)
    dense = mxfp4.dequantize(packed, scale)

    packed2, scale2 = mxfp4.quantize(dense)
    assert torch.equal(scale2, scale)
    assert torch.equal(packed2, packed)
    assert torch.equal(mxfp4.dequantize(packed2, scale2), dense)


def test_quantize_rounds_to_nearest_representable() -> None:
    """Off-grid values round to the nearest E2M1 step of their block (never further than half a step)."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(6, 64, generator=gen)
    back = mxfp4.dequantize(*mxfp4.quantize(w))
    step = mxfp4.scale_values(mxfp4.quantize(w)[1]).repeat_interleave(mxfp4.BLOCK, -1)  # 2^e, the value of code 1.0
    grid = torch.tensor(mxfp4.E2M1_MAGNITUDES)
    scaled = (w / step).abs().clamp_max(6.0)
    nearest = (scaled.unsqueeze(-1) - grid).abs().amin(-1)
    assert torch.allclose(((back / step).abs() - scaled).abs(), nearest, rtol=0, atol=1e-6)


def test_dequantize_is_exact_in_bfloat16() -> None:
    # scales 2^-127 .. 2^123: every product code x scale stays finite and is a bf16 value
    packed, scale = random_mxfp4(16, 256, scale_lo=0, scale_hi=250)
    full = mxfp4.dequantize(packed, scale, torch.float32)
    half = mxfp4.dequantize(packed, scale, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.isfinite(full).all()
    assert torch.equal(half.float(), full)
    exact = e2m1_from_bits(mxfp4.unpack_codes(packed)) * (2.0 ** (scale.double() - 127)).repeat_interleave(32, -1)
    assert torch.equal(full.double(), exact)


def test_nan_scale_is_rejected_naming_file_and_tensor(tmp_path) -> None:
    ckpt = write_checkpoint(get_preset("tiny"), tmp_path / "ckpt", seed=SEED, float_dtype=torch.float32)
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    name = next(n for n in weight_map if n.endswith("experts.3.w2.weight_scale"))
    shard = ckpt / weight_map[name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].clone()
    tensors[name][5, -1] = mxfp4.E8M0_NAN
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt)
    message = str(info.value)
    assert shard.name in message and name in message and "0xFF" in message


# ---- MXFP8 activation emulation -----------------------------------------------------------------

def test_fake_quantize_mxfp8_sanity() -> None:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(7, 96, generator=gen) * torch.logspace(-3, 3, 7).unsqueeze(-1)
    y = mxfp4.fake_quantize_mxfp8(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(mxfp4.fake_quantize_mxfp8(y), y), "rounding must be idempotent"
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal values; below the block's normal
    # range the absolute error is at most half the subnormal step (2^-10 of the scale unit)
    blocks = x.unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 8)
    bound = torch.maximum(blocks.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert torch.all((y.unflatten(-1, (-1, 32)) - blocks).abs() <= bound)
    # blocks are independent and scale-equivariant under powers of two
    assert torch.equal(mxfp4.fake_quantize_mxfp8(x * 8.0), y * 8.0)
    # values already on a block's E4M3 grid survive unchanged; zeros stay zero; bf16 stays bf16
    grid = torch.tensor([448.0, -1.0, 0.375, 2 ** -9] + [0.0] * 28) * 2.0 ** -5
    assert torch.equal(mxfp4.fake_quantize_mxfp8(grid), grid)
    assert mxfp4.fake_quantize_mxfp8(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp4.fake_quantize_mxfp8(torch.ones(3, 33))
