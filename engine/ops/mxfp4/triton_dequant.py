"""MXFP4 dequantization in Triton (GPU path; the reference beside it is `reference.dequantize`).

One program expands a [rows, 16] tile of packed bytes (32 elements, i.e. one E8M0 scale group per
row) into dense values. E2M1 codes are decoded arithmetically (sign, 2-bit exponent, 1-bit
mantissa) and the scale 2^(e - 127) is built from its bit pattern, so the result is exact, as in
the reference; hopper has no MX tensor cores, so experts are expanded before the GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BYTES_PER_GROUP = 16  # 32 E2M1 elements share one scale byte


@triton.jit
def mxfp4_dequant_fwd_kernel(packed_ptr, scale_ptr, out_ptr, rows, packed_cols,
                             BLOCK_ROWS: tl.constexpr, GROUP_BYTES: tl.constexpr):
    pid_r = tl.program_id(0)
    group = tl.program_id(1)
    r = (pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # [BR]
    c = (group * GROUP_BYTES + tl.arange(0, GROUP_BYTES)).to(tl.int64)  # [16] packed byte columns
    mask = r[:, None] < rows
    byte = tl.load(packed_ptr + r[:, None] * packed_cols + c[None, :], mask=mask, other=0).to(tl.int32)
    e8 = tl.load(scale_ptr + r * (packed_cols // GROUP_BYTES) + group, mask=r < rows, other=127).to(tl.int32)
    # 2^(e - 127) from its float32 bits; e = 0 is the denormal 2^-127
    bits = tl.where(e8 == 0, 1 << 22, e8 << 23)
    scale = bits.to(tl.float32, bitcast=True)[:, None]  # [BR, 1]
    for half in tl.static_range(2):
        code = (byte >> (4 * half)) & 0xF  # low nibble = even element
        exp = (code >> 1) & 3
        man = (code & 1).to(tl.float32)
        mag = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.exp2((exp - 1).to(tl.float32)))
        value = tl.where((code & 8) != 0, -mag, mag) * scale
        value = tl.where(mag == 0.0, 0.0, value)  # the "-0" code decodes to +0
        dst = out_ptr + r[:, None] * (2 * packed_cols) + 2 * c[None, :] + half
        tl.store(dst, value.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 [..., out, in/2] + [..., out, in/32] -> dense [..., out, in] (same contract as the reference)."""
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8, "MXFP4 parts are uint8"
    assert packed.shape[-1] % _BYTES_PER_GROUP == 0, "the input dimension must be a multiple of 32"
    assert scale.shape[-1] * _BYTES_PER_GROUP == packed.shape[-1], "one scale per 32 elements"
    packed, scale = packed.contiguous(), scale.contiguous()
    rows, cols = packed.numel() // packed.shape[-1], packed.shape[-1]
    out = torch.empty(*packed.shape[:-1], 2 * cols, dtype=dtype, device=packed.device)
    block_rows = 32
    grid = (triton.cdiv(rows, block_rows), cols // _BYTES_PER_GROUP)
    mxfp4_dequant_fwd_kernel[grid](packed, scale, out, rows, cols, BLOCK_ROWS=block_rows,
                                   GROUP_BYTES=_BYTES_PER_GROUP)
    return out
