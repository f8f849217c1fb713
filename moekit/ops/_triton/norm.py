"""Triton kernel: RMSNorm ``y = v * rsqrt(mean(v^2) + eps) * gamma`` with ``v = x (+ residual)``
in float32, output in ``x.dtype``.

One pass (read the row once, write it once) when the row fits in registers
(``ONE_PASS_BYTES``: H <= 16384 in bf16/fp16, 8192 in fp32), several rows per program for small
H, two passes beyond. Rows of ``x``/``residual`` are addressed through a two-level row layout,
so strided leading dims need no copy.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, launch
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.quantize import MAX_ROWS, row_config, row_offsets, rows_of


@triton.jit
def _load_rows(x_ptr, x_rows, res_ptr, res_rows, cols, mask, HAS_RES: tl.constexpr):
    v = tl.load(x_ptr + x_rows[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        v += tl.load(res_ptr + res_rows[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _rms_norm_kernel(
    y_ptr,
    x_ptr,
    g_ptr,
    res_ptr,
    R,
    H,
    eps,
    X_INNER,
    SX_OUTER,
    SX_INNER,
    R_INNER,
    SR_OUTER,
    SR_INNER,
    HAS_RES: tl.constexpr,
    X_TWO_LEVEL: tl.constexpr,
    R_TWO_LEVEL: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < R
    # Python floats arrive as fp64 under torch.compile (inductor), fp32 from Triton's launcher.
    eps = tl.cast(eps, tl.float32)
    x_rows = row_offsets(rows, X_INNER, SX_OUTER, SX_INNER, X_TWO_LEVEL)
    res_rows = x_rows
    if HAS_RES:
        res_rows = row_offsets(rows, R_INNER, SR_OUTER, SR_INNER, R_TWO_LEVEL)
    y_rows = (rows.to(tl.int64) * H)[:, None]
    out_ty = y_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < H
        mask = row_ok[:, None] & col_ok[None, :]
        v = _load_rows(x_ptr, x_rows, res_ptr, res_rows, cols[None, :], mask, HAS_RES)
        inv = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
        g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = v * inv[:, None] * g[None, :]
        tl.store(y_ptr + y_rows + cols[None, :], y.to(out_ty), mask=mask)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for h0 in tl.range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < H)[None, :]
            v = _load_rows(x_ptr, x_rows, res_ptr, res_rows, cols[None, :], mask, HAS_RES)
            acc += v * v
        inv = tl.rsqrt(tl.sum(acc, axis=1) / H + eps)
        for h0 in tl.range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_ok = cols < H
            mask = row_ok[:, None] & col_ok[None, :]
            v = _load_rows(x_ptr, x_rows, res_ptr, res_rows, cols[None, :], mask, HAS_RES)
            g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = v * inv[:, None] * g[None, :]
            tl.store(y_ptr + y_rows + cols[None, :], y.to(out_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Launcher (arguments already validated): ``[..., H]`` in ``x.dtype`` (contiguous)."""
    H = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = y.numel() // H if H else 0
    if R == 0:
        return y
    if R > MAX_ROWS:
        raise ValueError(f"x must have at most {MAX_ROWS} rows (prod(x.shape[:-1])), got {R}")
    x, xl = rows_of(x)
    has_res = residual is not None
    rl = xl
    if has_res:  # same shape as x; its rows may still need a different (one- or two-level) layout
        residual, rl = rows_of(residual)
    elem = max(x.element_size(), residual.element_size() if has_res else 1)
    cfg = row_config(R, H, elem, x.device)
    launch(_rms_norm_kernel)[(cdiv(R, cfg.block_t),)](
        y,
        x,
        gamma,
        residual if has_res else x,  # unused placeholder: an input, never an output
        R,
        H,
        float(eps),
        xl.inner,
        xl.s_outer,
        xl.s_inner,
        rl.inner,
        rl.s_outer,
        rl.s_inner,
        HAS_RES=has_res,
        X_TWO_LEVEL=xl.inner != 1,
        R_TWO_LEVEL=rl.inner != 1,
        ONE_PASS=cfg.one_pass,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_c,
        num_warps=cfg.num_warps,
    )
    return y
