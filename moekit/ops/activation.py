"""SwiGLU activation ops: ``silu_mul`` and ``silu_mul_quant`` (MSLK ``mslk.moe.activation`` API).

Each public function validates its arguments, then calls its registered op
``torch.ops.moekit.<name>``, which runs the Triton kernel on CUDA tensors and the float32
reference (``moekit.reference.activation``) on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import check_optional_scale_ub
from moekit.ops._common import call_op, use_triton
from moekit.reference import activation as _ref

__all__ = ["silu_mul", "silu_mul_quant"]


@triton_op("moekit::silu_mul", mutates_args=())
def _silu_mul_op(
    x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None, cache_tag: str = ""
) -> torch.Tensor:
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
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x0):
        from moekit.ops._triton import activation as _tri

        return _tri.silu_mul_quant(x0, x1, scale_ub, valid_token_count)
    return _ref.silu_mul_quant(x0, x1, scale_ub, valid_token_count)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU: ``y = x0 * sigmoid(x0) * x1`` computed in float32, returned ``[T, F]`` in ``x0.dtype``.

    Args:
        x0: ``[T, F]`` gate, bf16/fp16/fp32, unit last stride, any row stride (e.g.
            ``h[:, :F]`` of a ``[T, 2F]`` GEMM output).
        x1: ``[T, F]`` up projection, same dtype, device and shape as ``x0``, unit last stride
            (e.g. ``h[:, F:]``).
        valid_token_count: optional 1-element int32/int64 device tensor; rows
            ``t >= valid_token_count[0]`` are neither read nor written (their output is
            uninitialized on CUDA, zeros on CPU). No host synchronization.

    Raises ``TypeError``/``ValueError`` naming the offending argument.
    """
    _ref._check(x0, x1, valid_token_count)
    return call_op(_silu_mul_op, x0, x1, valid_token_count)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul`` fused with FP8 e4m3fn row-wise quantization, in one pass over the data.

    The float32 activation (not rounded to ``x0.dtype``) of each row is scaled by
    ``inv = 448 / amax`` with ``amax = min(max(max|y_row|, 1e-12), scale_ub)`` (eps ``1e-12``,
    ``FUSED_EPS``, unlike ``quantize_fp8_row``'s ``1/512``), clamped to ``±448`` and rounded to
    e4m3fn (nearest even).

    Args:
        x0, x1: as in ``silu_mul``.
        scale_ub: optional 1-element float32 device tensor, upper bound of the row max.
        valid_token_count: as in ``silu_mul`` (rows past it: values and scales untouched).

    Returns ``(y [T, F] float8_e4m3fn, scale [T] float32)`` where ``scale = 1 / inv`` is the
    dequantization scale: ``y.float() * scale[:, None]`` approximates the activation.
    """
    _ref._check(x0, x1, valid_token_count)
    check_optional_scale_ub("scale_ub", scale_ub, x0.device)
    return call_op(_silu_mul_quant_op, x0, x1, scale_ub, valid_token_count)
