"""SwiGLU activation ops: ``silu_mul`` and ``silu_mul_quant`` (MSLK ``mslk.moe.activation`` API).

Each public function validates its arguments, then calls its registered op
``torch.ops.moekit.<name>``, which runs the Triton kernel on CUDA tensors and the float32
reference (``moekit.reference.activation``) on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._checks import FP8_DTYPE
from moekit.ops._common import use_triton
from moekit.reference import activation as _ref

__all__ = ["silu_mul", "silu_mul_quant"]


@triton_op("moekit::silu_mul", mutates_args=())
def _silu_mul_op(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    if use_triton(x0):
        from moekit.ops._triton import activation as _tri

        return _tri.silu_mul(x0, x1, valid_token_count)
    return _ref.silu_mul(x0, x1, valid_token_count)


@triton_op("moekit::silu_mul_quant", mutates_args=())
def _silu_mul_quant_op(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x0):
        from moekit.ops._triton import activation as _tri

        return _tri.silu_mul_quant(x0, x1, scale_ub, valid_token_count)
    return _ref.silu_mul_quant(x0, x1, scale_ub, valid_token_count)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x0 * sigmoid(x0) * x1`` in float32, output ``[T, F]`` in ``x0.dtype``.

    ``x0``/``x1`` ``[T, F]`` bf16/fp16/fp32 with unit last stride (column slices of one
    ``[T, 2F]`` tensor are fine). Rows ``t >= valid_token_count[0]`` are left unwritten.
    """
    _ref._check(x0, x1, valid_token_count)
    return torch.ops.moekit.silu_mul(x0, x1, valid_token_count)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul`` fused with FP8 e4m3fn row-wise quantization (eps 1e-12, optional
    ``scale_ub``): returns ``(y [T, F] e4m3fn, dequant scale [T] float32)``."""
    _ref._check(x0, x1, valid_token_count)
    from moekit._checks import check_optional_scale_ub

    check_optional_scale_ub("scale_ub", scale_ub, x0.device)
    return torch.ops.moekit.silu_mul_quant(x0, x1, scale_ub, valid_token_count)


assert FP8_DTYPE is torch.float8_e4m3fn
