"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 block scales) and MXFP8 activation emulation.

Layout of compressed-tensors "mxfp4-pack-quantized" (the K3 checkpoint format), per 2-D weight
[out, in]:
- `weight_packed` uint8 [out, in/2]: two E2M1 codes per byte, the low nibble holds the even element;
- `weight_scale`  uint8 [out, in/32]: one E8M0 exponent per 32 consecutive inputs, value 2^(e-127);
  0xFF encodes NaN and is rejected at load time.
An E2M1 code is sign (bit 3) + magnitude index (bits 0-2) into [0, .5, 1, 1.5, 2, 3, 4, 6]; the code
0x8 ("-0") decodes to zero. Dequantization is exact in bf16 and fp32.

This is the pure-torch reference of the Triton kernel beside it (`triton_dequant.py`); the package's
`dequantize` picks one, and the checkpoint writer uses `quantize` from here.
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_NAN = 0xFF
FP8_E4M3_MAX = 448.0

# code -> value for all 16 codes; -0 (0x8) maps to +0 so products never carry a signed zero
_CODE_VALUES = torch.tensor(list(E2M1_MAGNITUDES) + [0.0] + [-m for m in E2M1_MAGNITUDES[1:]],
                            dtype=torch.float32)
# exponent byte -> 2^(e-127), built in float64 then cast: exact for every byte (e=0 is a denormal)
_SCALE_VALUES = torch.tensor([2.0 ** (e - 127) for e in range(255)] + [float("nan")], dtype=torch.float64)
_SCALE_VALUES = _SCALE_VALUES.to(torch.float32)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> E2M1 codes uint8 [..., n] (low nibble first)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., n] (n even) -> packed uint8 [..., n/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"MXFP4 packing needs an even last dimension, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 powers of two (NaN for 0xFF)."""
    return _SCALE_VALUES.to(scale.device)[scale.long()]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 weight -> dense [..., out, in] in `dtype` (exact for bf16 and fp32).

    Args:
        packed (torch.Tensor): uint8 `[..., out, in/2]`.
        scale (torch.Tensor): uint8 `[..., out, in/32]`.
    """
    codes = unpack_codes(packed)  # [..., out, in]
    values = _CODE_VALUES.to(packed.device)[codes.long()]
    blocks = values.unflatten(-1, (-1, BLOCK)) * scale_values(scale).unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., out, in] -> (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).

    OCP rule: the block exponent is floor(log2(amax)) - 2 (E2M1's emax), elements are rounded to the
    nearest representable magnitude (ties to the even code) and saturate at 6.
    """
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension divisible by {BLOCK}, got {weight.shape[-1]}")
    w = weight.float().unflatten(-1, (-1, BLOCK))  # [..., out, in/32, 32]
    amax = w.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = (w / torch.exp2(exp)).clamp(-E2M1_MAX, E2M1_MAX)
    mags = torch.tensor(E2M1_MAGNITUDES, device=w.device)
    # nearest magnitude, ties to the even code (round-half-to-even on the E2M1 mantissa)
    dist = (scaled.abs().unsqueeze(-1) - mags).abs()
    idx = dist.argmin(-1)  # the first minimum: the lower code of a tie
    upper = (idx + 1).clamp_max(len(E2M1_MAGNITUDES) - 1)
    tie = (dist.gather(-1, upper.unsqueeze(-1)) == dist.gather(-1, idx.unsqueeze(-1))).squeeze(-1) & (upper != idx)
    idx = torch.where(tie & (idx % 2 == 1), upper, idx)
    codes = idx.to(torch.uint8) | ((scaled < 0) & (idx > 0)).to(torch.uint8) << 3
    packed = pack_codes(codes.flatten(-2))
    scale = (exp.squeeze(-1) + 127).to(torch.uint8)
    return packed, scale


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Round activations through MXFP8 (E4M3 elements, one E8M0 scale per 32 along the last dim).

    Emulates the training-time activation format; the result is returned in x's dtype. The last
    dimension must be a multiple of 32.
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP8 emulation needs the last dimension divisible by {BLOCK}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    # E4M3's largest power of two is 2^8 (max 448 = 1.75 * 2^8)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 8)
    q = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)
