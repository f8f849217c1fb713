"""Triton kernels: SwiGLU ``silu(x0) * x1`` (+ FP8 row-wise quantization).

``x0``/``x1`` are ``[T, F]`` with unit last stride and any row stride (typically the two column
halves of one ``[T, 2F]`` GEMM output). Math is float32. Rows at or past ``valid_token_count[0]``
are neither read nor written.

- ``silu_mul``: a tiled elementwise kernel over ``[BLOCK_T, BLOCK_F]`` tiles (1-D grid). Tiles are
  sized by a shape bucket: wide enough for 16-byte vector accesses, several rows per program when
  F is small, smaller tiles when the problem is small so every SM gets work.
- ``silu_mul_quant``: one pass (read x0/x1 once, write fp8 + scale) when a row fits in registers
  (``ONE_PASS_BYTES`` of input per row: F <= 16384 in bf16/fp16, 8192 in fp32), several rows per
  program for small F; longer rows take two passes (row max, then quantize).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE, FP8_MAX
from moekit.ops._common import launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.ops._triton.quantize import prev_pow2, row_config, row_scales
from moekit.reference.quantize import FUSED_EPS

# Input bytes per program the elementwise kernel aims for, and the least it shrinks to.
TILE_BYTES = 8192
MIN_TILE_BYTES = 1024
# silu_mul_quant reads two inputs: half the row-tile budget per input.
QUANT_TILE_BYTES = 8192


class TileConfig(NamedTuple):
    block_t: int
    block_f: int
    num_warps: int


def tile_config(T: int, F: int, elem_bytes: int, device: torch.device) -> TileConfig:
    """Tile of the elementwise ``silu_mul`` kernel for ``[T, F]`` (a cheap shape bucket)."""
    vec = max(1, 16 // elem_bytes)
    tile = TILE_BYTES // elem_bytes
    min_tile = MIN_TILE_BYTES // elem_bytes
    want = 2 * num_sms(device)
    while tile > min_tile and (T * F) // tile < want:
        tile //= 2
    # The widest power-of-two column block that wastes at most 1/8 of its lanes on F's tail;
    # else one masked block covering F (tiny or awkward F).
    for cand in (tile, tile // 2, tile // 4, tile // 8, tile // 16, tile // 32, tile // 64):
        if cand >= vec and triton.cdiv(F, cand) * cand * 8 <= F * 9:
            block_f = cand
            break
    else:
        block_f = min(max(next_pow2(F), vec), tile)
    block_t = max(1, min(tile // block_f, next_pow2(max(T, 1))))
    warps = prev_pow2(max(1, (block_t * block_f) // (32 * vec * 2)))
    return TileConfig(block_t, block_f, int(min(8, warps)))


@triton.jit
def _silu_mul_kernel(
    y_ptr,
    x0_ptr,
    x1_ptr,
    valid_ptr,
    T,
    F,
    stride_x0,
    stride_x1,
    stride_y,
    HAS_VALID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    n_fb = tl.cdiv(F, BLOCK_F)
    pid_t = pid // n_fb
    pid_f = pid % n_fb
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    if HAS_VALID:
        row_ok = rows < tl.minimum(tl.load(valid_ptr).to(tl.int64), T)
    else:
        row_ok = rows < T
    mask = row_ok[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c = cols[None, :]
    # Inputs are dead after this kernel: let them leave L2 first (the output feeds the next GEMM).
    a = tl.load(x0_ptr + r64 * stride_x0 + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b = tl.load(x1_ptr + r64 * stride_x1 + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(y_ptr + r64 * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, EVICT: tl.constexpr):
    a = tl.load(x0_ptr + r64 * stride_x0 + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    b = tl.load(x1_ptr + r64 * stride_x1 + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return a * tl.sigmoid(a) * b


@triton.jit
def _silu_mul_quant_kernel(
    y_ptr,
    scale_ptr,
    x0_ptr,
    x1_ptr,
    valid_ptr,
    ub_ptr,
    T,
    F,
    stride_x0,
    stride_x1,
    stride_y,
    HAS_VALID: tl.constexpr,
    HAS_UB: tl.constexpr,
    EPS: tl.constexpr,
    MAX_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    if HAS_VALID:
        row_ok = rows < tl.minimum(tl.load(valid_ptr).to(tl.int64), T)
    else:
        row_ok = rows < T
    r64 = rows.to(tl.int64)[:, None]
    out_ty = y_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_F)[None, :]
        mask = row_ok[:, None] & (cols < F)
        y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_first")
        inv, scale = row_scales(tl.max(tl.abs(y), axis=1), ub_ptr, EPS, HAS_UB, MAX_FP8)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        q = tl.clamp(y * inv[:, None], -MAX_FP8, MAX_FP8)
        tl.store(y_ptr + r64 * stride_y + cols, to_fp8(q, out_ty, EMULATE), mask=mask)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
        for f0 in tl.range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)[None, :]
            mask = row_ok[:, None] & (cols < F)
            y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_last")  # re-read below
            acc = tl.maximum(acc, tl.abs(y))
        inv, scale = row_scales(tl.max(acc, axis=1), ub_ptr, EPS, HAS_UB, MAX_FP8)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        for f0 in tl.range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)[None, :]
            mask = row_ok[:, None] & (cols < F)
            y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_first")
            q = tl.clamp(y * inv[:, None], -MAX_FP8, MAX_FP8)
            tl.store(y_ptr + r64 * stride_y + cols, to_fp8(q, out_ty, EMULATE), mask=mask)


def silu_mul(
    x0: torch.Tensor,
    x1: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launcher (arguments already validated): ``[T, F]`` in ``x0.dtype``. ``out`` (tests only):
    a preallocated contiguous ``[T, F]`` output of that dtype, e.g. poisoned."""
    T, F = x0.shape
    y = torch.empty((T, F), dtype=x0.dtype, device=x0.device) if out is None else out
    if T == 0 or F == 0:
        return y
    cfg = tile_config(T, F, x0.element_size(), x0.device)
    has_valid = valid_token_count is not None
    grid = (triton.cdiv(T, cfg.block_t) * triton.cdiv(F, cfg.block_f),)
    launch(_silu_mul_kernel)[grid](
        y,
        x0,
        x1,
        valid_token_count if has_valid else x0,  # unused placeholder: an input, never an output
        T,
        F,
        x0.stride(0),
        x1.stride(0),
        y.stride(0),
        HAS_VALID=has_valid,
        BLOCK_T=cfg.block_t,
        BLOCK_F=cfg.block_f,
        num_warps=cfg.num_warps,
    )
    return y


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (arguments already validated): ``(y [T, F] e4m3fn, dequant scale [T] float32)``.
    ``out`` (tests only): preallocated ``(y, scale)``, e.g. poisoned."""
    T, F = x0.shape
    if out is None:
        y = torch.empty((T, F), dtype=FP8_DTYPE, device=x0.device)
        scale = torch.empty((T,), dtype=torch.float32, device=x0.device)
    else:
        y, scale = out
    if T == 0:
        return y, scale
    cfg = row_config(T, max(F, 1), x0.element_size(), x0.device, tile_bytes=QUANT_TILE_BYTES)
    has_valid = valid_token_count is not None
    launch(_silu_mul_quant_kernel)[(triton.cdiv(T, cfg.block_t),)](
        y,
        scale,
        x0,
        x1,
        valid_token_count if has_valid else x0,  # unused placeholders: inputs, never outputs
        scale_ub if scale_ub is not None else x0,
        T,
        F,
        x0.stride(0),
        x1.stride(0),
        y.stride(0),
        HAS_VALID=has_valid,
        HAS_UB=scale_ub is not None,
        EPS=FUSED_EPS,
        MAX_FP8=FP8_MAX,
        EMULATE=EMULATE_FP8,
        ONE_PASS=cfg.one_pass,
        BLOCK_T=cfg.block_t,
        BLOCK_F=cfg.block_c,
        num_warps=cfg.num_warps,
    )
    return y, scale
