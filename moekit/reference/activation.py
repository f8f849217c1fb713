"""SwiGLU activation oracles: ``silu(x0) * x1`` (+ FP8 row-wise quantization)."""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import FP8_DTYPE, check_optional_count, check_optional_scale_ub, check_tensor
from moekit.reference.gather_scatter import row_mask
from moekit.reference.quantize import FUSED_EPS, quantize_rows

__all__ = ["silu_mul", "silu_mul_quant"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check(x0, x1, valid_token_count):
    check_tensor("x0", x0, ndim=2, dtype=_FLOATS, last_dim_contiguous=True)
    check_tensor("x1", x1, shape=tuple(x0.shape), dtype=x0.dtype, device=x0.device, last_dim_contiguous=True)
    check_optional_count("valid_token_count", valid_token_count, x0.device)


def _silu_mul_f32(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    a = x0.float()
    return a * torch.sigmoid(a) * x1.float()


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x0 * sigmoid(x0) * x1`` in float32, returned in ``x0.dtype``, shape ``[T, F]``.

    ``x0`` and ``x1`` may be column slices of one ``[T, 2F]`` tensor (unit last stride). Rows
    ``t >= valid_token_count[0]`` are not computed (zeros here; kernels leave them untouched).
    """
    _check(x0, x1, valid_token_count)
    y = _silu_mul_f32(x0, x1)
    keep = row_mask(x0.shape[0], valid_token_count, x0.device).unsqueeze(1)
    return torch.where(keep, y, 0.0).to(x0.dtype)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul`` in float32 (not rounded to ``x0.dtype``), then FP8 row-wise quantization with
    ``eps = 1e-12`` and optional ``scale_ub``. Returns ``(y_fp8 [T, F], dequant scale [T] float32)``.
    Rows past ``valid_token_count`` are zeros with scale 0 here.
    """
    _check(x0, x1, valid_token_count)
    check_optional_scale_ub("scale_ub", scale_ub, x0.device)
    q, scale = quantize_rows(_silu_mul_f32(x0, x1), scale_ub=scale_ub, eps=FUSED_EPS)
    keep = row_mask(x0.shape[0], valid_token_count, x0.device)
    return torch.where(keep.unsqueeze(1), q.float(), 0.0).to(FP8_DTYPE), torch.where(keep, scale, 0.0)
