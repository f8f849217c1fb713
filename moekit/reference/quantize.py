"""FP8 e4m3fn row-wise quantization oracles.

Two epsilons, kept apart as in MSLK: ``quantize_fp8_row`` floors the row max at ``1/512`` by
default (``DEFAULT_EPS``), while the fused kernels (``gather_scale_quant_dense_tokens``,
``silu_mul_quant``) floor it at ``1e-12`` (``FUSED_EPS``).
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import FP8_DTYPE, FP8_MAX, check_optional_scale_ub, check_tensor

DEFAULT_EPS = 1.0 / 512.0
FUSED_EPS = 1e-12

__all__ = ["DEFAULT_EPS", "FUSED_EPS", "quantize_rows", "quantize_fp8_row", "dequantize_fp8_row"]


def quantize_rows(
    rows: torch.Tensor, scale_ub: Optional[torch.Tensor] = None, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of ``rows`` (computed in float32).

    ``amax = max|row|`` clamped to ``[eps, scale_ub]`` (upper bound only when ``scale_ub`` is
    given); ``inv = 448 / amax``; ``q = clamp(row * inv, -448, 448)`` rounded to e4m3fn
    (nearest even); returns ``(q, 1 / inv)``, the second being the float32 dequant scale with
    shape ``rows.shape[:-1]``. An empty last dim gives ``amax = eps``.
    """
    r = rows.float()
    if r.shape[-1] == 0:
        amax = torch.zeros(r.shape[:-1], dtype=torch.float32, device=r.device)
    else:
        amax = r.abs().amax(dim=-1)
    if scale_ub is not None:
        amax = torch.minimum(torch.clamp(amax, min=eps), scale_ub.float().reshape(()).to(r.device))
    else:
        amax = torch.clamp(amax, min=eps)
    # A true float32 division (``scalar / tensor`` would compute ``reciprocal(amax) * 448``,
    # rounding twice).
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = torch.clamp(r * inv.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, 1.0 / inv


def quantize_fp8_row(
    a: torch.Tensor, scale_ub: Optional[torch.Tensor] = None, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 quantization of ``a`` ``[..., K]`` (bf16/fp16/fp32): see ``quantize_rows``.

    Returns ``(a_fp8 [..., K] e4m3fn, a_scale [...] float32 dequant scale)``.
    """
    check_tensor("a", a, dtype=(torch.bfloat16, torch.float16, torch.float32))
    if a.dim() < 1:
        raise ValueError("a must have at least 1 dim, got a scalar")
    check_optional_scale_ub("scale_ub", scale_ub, a.device)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return quantize_rows(a, scale_ub=scale_ub, eps=eps)


def dequantize_fp8_row(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale[..., None]`` in float32."""
    check_tensor("q", q, dtype=FP8_DTYPE)
    check_tensor("scale", scale, dtype=torch.float32, shape=tuple(q.shape[:-1]))
    return q.float() * scale.unsqueeze(-1)
