"""Triton kernels: SwiGLU ``silu(x0) * x1`` (+ FP8 row-wise quantization).

``x0``/``x1`` are ``[T, F]`` with unit last stride and any row stride (typically the two column
halves of one ``[T, 2F]`` GEMM output). Math is float32. Rows at or past ``valid_token_count[0]``
are neither read nor written.

Both kernels run one tile per program (``silu_mul``: ``[BLOCK_T, BLOCK_F]`` tiles of about 1024
values; ``silu_mul_quant``: blocks of whole rows, about 2048 values of each input). Their loop is
a grid-stride loop (``tl.range(pid, n, num_programs, num_stages=STAGES)``) that runs once per
program unless the grid is capped; ``STAGES > 1`` turns it into a persistent kernel with
``cp.async`` loads issued ``STAGES - 1`` tiles ahead. Measured on the H200, one tile per program
wins at every size tried ([2048..16384] x [2048, 8192]: the hardware keeps enough programs
resident to cover the DRAM latency, and no program waits to fill a pipeline before its first
store) except ``silu_mul_quant`` on long rows of large problems ([16384, 8192]), which keeps the
persistent kernel.

The sigmoid uses the MUFU ``ex2``/``rcp`` approximations with flush-to-zero (``FAST_MATH``):
about 6 instructions per value instead of 16 for ``tl.sigmoid`` (which adds denormal and
overflow fix-ups to ``exp`` and ``/``); the relative error stays within a few float32 ulps.
``silu_mul_quant`` rows up to 16384 bf16 values are held in registers; longer rows take two
passes over the row (the second mostly from L2).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, interpreting, launch, next_pow2
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.ops._triton.quantize import (
    MAX_GRID,
    MAX_ROWS,
    PipeConfig,
    fp8_saturate,
    max_nan,
    np_row_config,
    pipe_row_config,
    prev_pow2,
    row_amax,
    row_scales,
)
from moekit.ops._triton._pdl import pdl_prologue
from moekit.reference.quantize import FUSED_EPS

# silu_mul_quant rows at least this long, on inputs (both halves) over this many bytes, take the
# persistent kernel ([16384, 8192], 512 MB: 168 µs vs 181; [2048, 8192], 64 MB, stays one row per
# program: 20.9 µs vs 25.2). Tests pin it as the knob ``PIPE_MIN_BYTES_SILU`` (``moekit.settings``).
PIPE_MIN_ROW = 4096
PIPE_MIN_BYTES_SILU = 256 * 1024 * 1024

# Values of each input per silu_mul tile (one program each, 4 warps: one 16-byte vector per thread
# and input). Measured on the H200 against the persistent pipelined variant and other tiles: [2048,
# 2048] 7.8 µs vs 8.1, [2048, 8192] 25.8 vs 26.8, [16384, 2048] 50.7 vs 51.3.
TILE_ELEMS = 1024
# MUFU approximations (inline PTX) on the GPU; the interpreter runs tl.sigmoid.
FAST_MATH = not interpreting()


class TileConfig(NamedTuple):
    block_t: int
    block_f: int
    num_warps: int
    stages: int
    grid: int


def tile_config(T: int, F: int, elem_bytes: int, device: torch.device) -> TileConfig:
    """Tiles of the elementwise ``silu_mul`` kernel for ``[T, F]`` (a cheap shape bucket): about
    ``TILE_ELEMS`` values, one tile per program (``stages == 1``; the grid is capped at
    ``MAX_GRID`` programs, which then stride over the tiles)."""
    vec = max(1, 16 // elem_bytes)
    tile = TILE_ELEMS
    # The widest power-of-two column block that wastes at most 1/8 of its lanes on F's tail;
    # else one masked block covering F (tiny or awkward F).
    for cand in (tile, tile // 2, tile // 4, tile // 8, tile // 16, tile // 32, tile // 64):
        if cand >= vec and cdiv(F, cand) * cand * 8 <= F * 9:
            block_f = cand
            break
    else:
        block_f = min(max(next_pow2(F), vec), tile)
    block_t = max(1, min(tile // block_f, next_pow2(max(T, 1))))
    warps = int(min(4, prev_pow2(max(1, (block_t * block_f) // (32 * vec)))))
    n_tiles = cdiv(T, block_t) * cdiv(F, block_f)
    return TileConfig(block_t, block_f, warps, 1, max(1, min(n_tiles, MAX_GRID)))


@triton.jit
def _silu(a, FAST: tl.constexpr):
    """``a * sigmoid(a)`` in float32."""
    if FAST:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [a * -1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1
        )
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [e + 1.0], dtype=tl.float32, is_pure=True, pack=1
        )
        return a * r
    else:
        return a * tl.sigmoid(a)


@triton.jit
def _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, EVICT: tl.constexpr, FAST: tl.constexpr):
    a = tl.load(x0_ptr + r64 * stride_x0 + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    b = tl.load(x1_ptr + r64 * stride_x1 + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return _silu(a, FAST) * b


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
    STAGES: tl.constexpr,
    FAST: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_rows = T
    if HAS_VALID:
        n_rows = tl.minimum(tl.load(valid_ptr).to(tl.int64), T).to(tl.int32)
    n_fb = tl.cdiv(F, BLOCK_F)
    n_tiles = tl.cdiv(n_rows, BLOCK_T) * n_fb
    for tile in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        tr = tile // n_fb
        rows = tr * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = (tile - tr * n_fb) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows < n_rows)[:, None] & (cols < F)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        c = cols[None, :]
        # Inputs are dead after this kernel: let them leave L2 first (the output feeds the next GEMM).
        y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, c, mask, "evict_first", FAST)
        tl.store(y_ptr + r64 * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mask)


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
    FAST: tl.constexpr,
    ONE_PASS: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_rows = T
    if HAS_VALID:
        n_rows = tl.minimum(tl.load(valid_ptr).to(tl.int64), T).to(tl.int32)
    ub = 0.0
    if HAS_UB:
        ub = tl.load(ub_ptr).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    for blk in tl.range(pid, tl.cdiv(n_rows, BLOCK_T), nprog, num_stages=STAGES):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < n_rows
        r64 = rows.to(tl.int64)[:, None]
        if ONE_PASS:
            cols = tl.arange(0, BLOCK_F)[None, :]
            mask = row_ok[:, None] & (cols < F)
            y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_first", FAST)
            inv, scale = row_scales(row_amax(y), ub, EPS, HAS_UB, MAX_FP8)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            q = fp8_saturate(y * inv[:, None], MAX_FP8, EMULATE)
            tl.store(y_ptr + r64 * stride_y + cols, to_fp8(q, out_ty, EMULATE), mask=mask)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
            for f0 in tl.range(0, F, BLOCK_F):
                cols = f0 + tl.arange(0, BLOCK_F)[None, :]
                mask = row_ok[:, None] & (cols < F)
                # The row is read again below: keep it in L2.
                y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_last", FAST)
                acc = max_nan(acc, tl.abs(y))
            inv, scale = row_scales(tl.reduce(acc, 1, max_nan), ub, EPS, HAS_UB, MAX_FP8)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            for f0 in tl.range(0, F, BLOCK_F):
                cols = f0 + tl.arange(0, BLOCK_F)[None, :]
                mask = row_ok[:, None] & (cols < F)
                y = _silu_mul_tile(x0_ptr, x1_ptr, r64, stride_x0, stride_x1, cols, mask, "evict_first", FAST)
                q = fp8_saturate(y * inv[:, None], MAX_FP8, EMULATE)
                tl.store(y_ptr + r64 * stride_y + cols, to_fp8(q, out_ty, EMULATE), mask=mask)


def silu_mul_quant_config(T: int, F: int, elem_bytes: int, device: torch.device) -> PipeConfig:
    """Launch of ``silu_mul_quant`` over ``[T, F]`` (a cheap shape bucket): one row block per
    program, except long rows of large problems, which take the persistent pipelined kernel
    when a pipeline stage fits (measured [16384, 8192]: 168 µs vs 181 for one row per program;
    at F = 2048 one row per program wins at any T)."""
    min_bytes = settings.get().knob("PIPE_MIN_BYTES_SILU", PIPE_MIN_BYTES_SILU)
    if F >= PIPE_MIN_ROW and 2 * T * F * elem_bytes > min_bytes:
        cfg = pipe_row_config(T, F, elem_bytes, 2, device)
        if cfg.stages > 1:
            return cfg
    return np_row_config(T, max(F, 1), elem_bytes, 2, 512, device)


def _check_rows(T: int) -> None:
    if T > MAX_ROWS:
        raise ValueError(f"x0 must have at most {MAX_ROWS} rows, got {T}")


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
    _check_rows(T)
    cfg = tile_config(T, F, x0.element_size(), x0.device)
    has_valid = valid_token_count is not None
    launch(_silu_mul_kernel)[(cfg.grid,)](
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
        STAGES=cfg.stages,
        FAST=FAST_MATH,
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
    _check_rows(T)
    cfg = silu_mul_quant_config(T, F, x0.element_size(), x0.device)
    has_valid = valid_token_count is not None
    launch(_silu_mul_quant_kernel)[(cfg.grid,)](
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
        FAST=FAST_MATH,
        ONE_PASS=cfg.one_pass,
        STAGES=cfg.stages,
        BLOCK_T=cfg.block_t,
        BLOCK_F=cfg.block_c,
        num_warps=cfg.num_warps,
    )
    return y, scale
