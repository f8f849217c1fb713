"""RMSNorm op: ``rms_norm(x, gamma, eps=1e-6, residual=None)``.

``y = v * rsqrt(mean(v^2) + eps) * gamma`` over the last dim with ``v = x (+ residual)``, all in
float32 (the ``fp32_internal=True`` contract of ``moekit.reference.norm.rms_norm``), returned in
``x.dtype``. The public function validates, then calls the registered op
``torch.ops.moekit.rms_norm``: the Triton kernel on CUDA tensors, the reference on CPU tensors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import check_tensor
from moekit.ops._common import call_op, use_triton
from moekit.reference import norm as _ref

__all__ = ["rms_norm"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton_op("moekit::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float = 1e-6,
    residual: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(x):
        from moekit.ops._triton import norm as _tri

        return _tri.rms_norm(x, gamma, eps, residual)
    return _ref.rms_norm(x, gamma, eps, True, residual).to(x.dtype)


def rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """RMSNorm over the last dim, float32 math, output ``[..., H]`` in ``x.dtype`` (contiguous).

    Args:
        x: bf16/fp16/fp32 ``[..., H]`` (any H >= 1; leading dims of any strides), unit last stride.
        gamma: ``[H]`` bf16/fp16/fp32 weight on ``x``'s device.
        eps: added to the mean square, a finite float >= 0.
        residual: optional tensor of ``x``'s shape (bf16/fp16/fp32, unit last stride) added to
            ``x`` in float32 before normalizing. The sum itself is not returned.
    """
    check_tensor("x", x, dtype=_FLOATS, last_dim_contiguous=True)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim ([..., H]), got a 0-dim tensor")
    check_tensor("gamma", gamma, dtype=_FLOATS, shape=(x.shape[-1],), device=x.device, last_dim_contiguous=True)
    if residual is not None:
        check_tensor(
            "residual", residual, dtype=_FLOATS, shape=tuple(x.shape), device=x.device, last_dim_contiguous=True
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    return call_op(_rms_norm_op, x, gamma, float(eps), residual)
