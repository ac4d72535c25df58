"""MXFP4, the OCP microscaling 4-bit format gpt-oss checkpoints keep their expert weights in.

A tensor W [*, rows, cols] is stored as `<name>_blocks` uint8 [*, rows, cols / 32, 16] and `<name>_scales` uint8
[*, rows, cols / 32]: each run of 32 consecutive values of a row shares one E8M0 scale (a power of two, 2^(s - 127)),
and each value is an FP4 E2M1 code (sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), two per byte, the even-indexed value in the low nibble. gpt-oss stores the experts [experts, out, in],
while transformers' dequantized parameters (and so its bf16 checkpoints) are [experts, in, out]: `dequantize_mxfp4`
gives the stored orientation, and the checkpoint reader (quantization/prequantized.py) answers with transformers'.
"""

from __future__ import annotations

import torch

# FP4 E2M1 code -> value (code 8 is -0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact: every value is a power of
    two times an FP4 value)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit together "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), scales.to(torch.int32).sub(127).unsqueeze(-1))  # [..., G, 32]
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols a multiple of 32) -> (blocks uint8 [..., cols / 32, 16], scales uint8 [..., cols / 32]):
    each block's scale is the smallest power of two that brings its largest magnitude within 6, values rounded to
    the nearest FP4 value. For writing test checkpoints in the format; not a calibrated quantizer."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} values (got {w.shape[-1]})")
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = torch.ldexp(x, -exponent.unsqueeze(-1))
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)
