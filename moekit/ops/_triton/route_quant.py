"""The token rows' FP8 copy that rides along ``route_and_shuffle``'s routing launch: the row job
its extra programs run (``_quant_row``) and the sizes where riding pays (``route.quant_rides``)."""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops._common import next_pow2
from moekit.ops._triton.quantize import _store_fp8, max_nan, row_scales

# The token rows' FP8 copy rides along the routing launch (``quant_rides``) while a row takes at
# most ``QUANT_RIDE_MAX_CHUNKS`` chunks of 16 values per thread of a routing program (each chunk a
# dependent load, twice) and the copy holds at most ``QUANT_RIDE_MAX`` elements (past it the rows'
# programs, as heavy as the routing ones in registers, take more waves than the routing does).
# H200, session 24 run 1, layer from logits, same call, separate quantize launch -> riding:
# Qwen3-30B FP8 (D=2048) T = 16 / 64 / 256 / 1024 102.8 / 156.0 / 175.1 / 243.4 -> 101.7 / 153.6 /
# 175.2 / 240.8 µs; DeepSeek-V3 TP8 (D=7168) 153.7 / 287.1 / 360.5 / 516.1 -> 156.7 / 289.9 / 359.9
# / 528.8 (T = 16 and 64: 1-warp programs, 14 chunks a row; T=1024: 7.3M elements).
QUANT_RIDE_MAX_CHUNKS = 4
QUANT_RIDE_MAX = 2 * 1024 * 1024


def quant_chunk(cols: int, warps: int) -> int:
    """Columns of one chunk of a riding quantization row: 16 values per thread, the row's power of
    two at most."""
    return min(max(16, next_pow2(cols)), 512 * warps)


@triton.jit
def _quant_row(x_ptr, q_ptr, s_ptr, row, C, stride_x, eps, QC: tl.constexpr, MAX_FP8: tl.constexpr,
               EMULATE: tl.constexpr):  # fmt: skip
    """Row ``row`` of ``x [R, C]`` (16-bit, row stride ``stride_x``) quantized as
    ``quantize_fp8_row`` does it, to the same bits: the row max in ``QC``-wide chunks (a max is
    exact in any order), the scale pair of ``quantize.row_scales``, then each chunk again (from
    L1/L2) scaled and converted. Programs past the routing ones run it: the token rows' FP8
    copy rides along the routing launch."""
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([QC], dtype=tl.float32)
    for c0 in range(0, C, QC):
        cols = c0 + tl.arange(0, QC)
        v = tl.load(x_row + cols, mask=cols < C, other=0.0, eviction_policy="evict_last").to(tl.float32)
        amax = max_nan(amax, tl.abs(v))
    inv, scale = row_scales(tl.reduce(amax[None, :], 1, max_nan), 0.0, eps, False, MAX_FP8)
    tl.store(s_ptr + row + tl.arange(0, 1), scale)
    q_row = q_ptr + row.to(tl.int64) * C + tl.zeros([1], dtype=tl.int64)
    for c0 in range(0, C, QC):
        cols = c0 + tl.arange(0, QC)
        v = tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)
        _store_fp8(q_row, cols, tl.full([1], 1, tl.int1), C, v[None, :] * inv[:, None], MAX_FP8, EMULATE)
