"""Triton kernels: SwiGLU ``silu(x0) * x1`` (+ FP8 row-wise quantization)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE, FP8_MAX
from moekit.ops._common import launch, next_pow2
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.reference.quantize import FUSED_EPS


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
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0)
    n_rows = T
    if HAS_VALID:
        n_rows = tl.minimum(tl.load(valid_ptr).to(tl.int32), T)
    if row < n_rows:
        r64 = row.to(tl.int64)
        for f0 in tl.range(0, F, BLOCK_F):
            offs = f0 + tl.arange(0, BLOCK_F)
            m = offs < F
            a = tl.load(x0_ptr + r64 * stride_x0 + offs, mask=m, other=0.0).to(tl.float32)
            b = tl.load(x1_ptr + r64 * stride_x1 + offs, mask=m, other=0.0).to(tl.float32)
            y = a * tl.sigmoid(a) * b
            tl.store(y_ptr + r64 * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=m)


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
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0)
    n_rows = T
    if HAS_VALID:
        n_rows = tl.minimum(tl.load(valid_ptr).to(tl.int32), T)
    if row < n_rows:
        r64 = row.to(tl.int64)
        amax = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for f0 in tl.range(0, F, BLOCK_F):
            offs = f0 + tl.arange(0, BLOCK_F)
            m = offs < F
            a = tl.load(x0_ptr + r64 * stride_x0 + offs, mask=m, other=0.0).to(tl.float32)
            b = tl.load(x1_ptr + r64 * stride_x1 + offs, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(a * tl.sigmoid(a) * b))
        row_max = tl.max(amax, axis=0)
        row_max = tl.maximum(row_max, EPS)
        if HAS_UB:
            row_max = tl.minimum(row_max, tl.load(ub_ptr))
        inv = MAX_FP8 / row_max
        tl.store(scale_ptr + row, 1.0 / inv)
        for f0 in tl.range(0, F, BLOCK_F):
            offs = f0 + tl.arange(0, BLOCK_F)
            m = offs < F
            a = tl.load(x0_ptr + r64 * stride_x0 + offs, mask=m, other=0.0).to(tl.float32)
            b = tl.load(x1_ptr + r64 * stride_x1 + offs, mask=m, other=0.0).to(tl.float32)
            q = tl.clamp(a * tl.sigmoid(a) * b * inv, -MAX_FP8, MAX_FP8)
            tl.store(y_ptr + r64 * stride_y + offs, to_fp8(q, y_ptr.dtype.element_ty, EMULATE), mask=m)


def _block_f(F: int) -> int:
    return min(max(next_pow2(F), 16), 2048)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    T, F = x0.shape
    y = torch.empty((T, F), dtype=x0.dtype, device=x0.device)
    if T == 0 or F == 0:
        return y
    has_valid = valid_token_count is not None
    launch(_silu_mul_kernel)[(T,)](
        y,
        x0,
        x1,
        valid_token_count if has_valid else x0,
        T,
        F,
        x0.stride(0),
        x1.stride(0),
        y.stride(0),
        HAS_VALID=has_valid,
        BLOCK_F=_block_f(F),
    )
    return y


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, F = x0.shape
    y = torch.empty((T, F), dtype=FP8_DTYPE, device=x0.device)
    scale = torch.empty((T,), dtype=torch.float32, device=x0.device)
    if T == 0:
        return y, scale
    has_valid = valid_token_count is not None
    launch(_silu_mul_quant_kernel)[(T,)](
        y,
        scale,
        x0,
        x1,
        valid_token_count if has_valid else x0,
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
        BLOCK_F=_block_f(F),
    )
    return y, scale
