"""Packed float16 products for the weight-only FP8 GEMVs (CUDA-core kernels that stream FP8
weights against 16-bit rows: ``gg_swiglu._gemv_pair``, ``gg_combine._combine_kernel``,
``gg_kernels._gg_gemv_kernel``).

On sm_90 the float32 form of such a GEMV issues ~4.6 instructions per weight (e4m3 -> f16x2, f16
-> f32, FFMA) and is issue-bound (H200 stall counters, session 20: 34-48% of the DRAM peak). With
``HALF`` the row is scaled by a power of two to below 1 in magnitude (``_row_scale``: one pass
over it), converted to float16 once per K tile, and multiplied with the weights' native e4m3 ->
f16x2 conversion in packed ``HFMA2`` into float16 accumulators (two products per instruction;
~2.6 instructions per weight in the SASS). Each accumulator element sums one product per K tile,
each below 448 (e4m3's largest), so no sum can overflow within ``HALF_MAX_STEPS`` tiles; the
sums over the tile are taken in float32 and the scale undone exactly. Float16 rounds those few
terms to 11 bits (relative ~1e-3), far under the FP8 weights' own 4-bit precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_DTYPE
from moekit.ops._common import cdiv, next_pow2


@triton.jit
def _pow2_scale(amax):
    """``(s, 1 / s)``: powers of two with ``amax * s < 1`` (float32, both exact; ``amax`` zero,
    subnormal or not finite: the scale's range is clamped, so an inf or NaN stays one)."""
    eb = tl.minimum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 252)  # amax < 2 ** (eb - 126)
    s = ((253 - eb) << 23).to(tl.float32, bitcast=True)  # 2 ** (126 - eb)
    inv = ((eb + 1) << 23).to(tl.float32, bitcast=True)  # 2 ** (eb - 126)
    return s, inv


@triton.jit
def _row_scale(x_row, K, X_BLOCK: tl.constexpr):
    """``_pow2_scale`` of ``max |x_row[:K]|`` (one vector load when ``K <= X_BLOCK``)."""
    amax = tl.zeros((X_BLOCK,), dtype=x_row.dtype.element_ty)
    for k0 in tl.range(0, K, X_BLOCK):
        offs = k0 + tl.arange(0, X_BLOCK)
        a = tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0))
        amax = tl.where(a > amax, a, amax)  # exact in x's 16-bit dtype (packed compares)
    return _pow2_scale(tl.max(amax, axis=0).to(tl.float32))


# Most K tiles of a half-precision GEMV (``_gemv_pair``'s ``HALF``): every accumulator element
# sums one product per tile, each below 448 in magnitude, so the sums stay under 65504.
HALF_MAX_STEPS = 128
# Widest vector of ``_row_scale``'s pass over x (one load for K up to it).
X_BLOCK_MAX = 8192


def half_gemv(w_dtype: torch.dtype, x_dtype: torch.dtype, K: int, block_k: int) -> tuple[bool, int]:
    """``(HALF, X_BLOCK)`` of a GEMV over FP8 weights (``_gemv_pair``): float16 products where the
    weights are FP8 and x 16-bit (weight-only FP8) within ``HALF_MAX_STEPS`` K tiles; knobs
    ``FP8_GEMV_HALF`` (default True) and ``HALF_X_BLOCK_MAX`` (``X_BLOCK_MAX``)."""
    on = (
        w_dtype == FP8_DTYPE and x_dtype in (torch.bfloat16, torch.float16) and cdiv(K, block_k) <= HALF_MAX_STEPS
        and bool(settings.get().knob("FP8_GEMV_HALF", True))
    )  # fmt: skip
    x_block = min(int(settings.get().knob("HALF_X_BLOCK_MAX", X_BLOCK_MAX)), max(16, next_pow2(K)))
    return on, x_block if on else 16
