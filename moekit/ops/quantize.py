"""FP8 e4m3fn row-wise quantization: ``quantize_fp8_row`` (MSLK/fbgemm
``mslk.quantize.triton.fp8_quantize`` API) and its alias ``triton_quantize_fp8_row``.

Two epsilons are kept apart, as in MSLK: ``quantize_fp8_row`` floors each row's max at
``eps = 1/512`` by default (``DEFAULT_EPS``; a parameter here), while the fused kernels
(``silu_mul_quant``, ``gather_scale_quant_dense_tokens``) use ``1e-12`` (``FUSED_EPS``).

The public function validates its arguments, then calls the registered op
``torch.ops.moekit.quantize_fp8_row``: the Triton kernel for CUDA tensors (one read of the
input, one write of the output when a row fits in registers), the float32 reference otherwise.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch.library import triton_op

from moekit._validate import INDEX_DTYPES, check_int, check_optional_scale_ub, check_tensor
from moekit.ops._common import call_op, use_triton as _on_triton
from moekit.reference import quantize as _ref
from moekit.reference.quantize import DEFAULT_EPS, FUSED_EPS

__all__ = ["DEFAULT_EPS", "FUSED_EPS", "quantize_fp8_row", "triton_quantize_fp8_row"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _padded(K: int, align_rows_to: int) -> int:
    return -(-K // align_rows_to) * align_rows_to


def _reference(
    a: torch.Tensor,
    scale_ub: Optional[torch.Tensor],
    zero_start_index_M: Optional[torch.Tensor],
    eps: float,
    align_rows_to: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 PyTorch path (CPU tensors, or ``use_triton=False``): rows at or past
    ``zero_start_index_M`` quantize as zeros, columns past K (``align_rows_to`` padding) are 0."""
    rows = a.float()
    if zero_start_index_M is not None:
        n = a.shape[-2] if a.dim() >= 2 else 1
        starts = zero_start_index_M.reshape(tuple(a.shape[:-2]) + (1,)).to(torch.int64)
        keep = (torch.arange(n, device=a.device) < starts).reshape(a.shape[:-1])
        rows = torch.where(keep.unsqueeze(-1), rows, 0.0)
    K = a.shape[-1]
    k_out = _padded(K, align_rows_to)
    if k_out != K:
        rows = torch.nn.functional.pad(rows, (0, k_out - K))
    return _ref.quantize_rows(rows, scale_ub=scale_ub, eps=eps)


@triton_op("moekit::quantize_fp8_row", mutates_args=())
def _quantize_fp8_row_op(
    a: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    zero_start_index_M: Optional[torch.Tensor] = None,
    use_triton: bool = True,
    eps: float = DEFAULT_EPS,
    align_rows_to: int = 1,
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton and _on_triton(a):
        from moekit.ops._triton import quantize as _tri

        return _tri.quantize_fp8_row(a, scale_ub, zero_start_index_M, eps, _padded(a.shape[-1], align_rows_to))
    return _reference(a, scale_ub, zero_start_index_M, eps, align_rows_to)


def _check_args(a, scale_ub, zero_start_index_M, eps) -> None:
    check_tensor("a", a, dtype=_FLOATS, last_dim_contiguous=True)
    if a.dim() < 1:
        raise ValueError("a must have at least 1 dim ([..., K]), got a 0-dim tensor")
    check_optional_scale_ub("scale_ub", scale_ub, a.device)
    if zero_start_index_M is not None:
        check_tensor("zero_start_index_M", zero_start_index_M, dtype=INDEX_DTYPES, device=a.device)
        groups = math.prod(a.shape[:-2])
        if zero_start_index_M.numel() != groups:
            raise ValueError(
                f"zero_start_index_M must hold one row count per [{a.shape[-2] if a.dim() >= 2 else 1}, K] "
                f"matrix of a (prod(a.shape[:-2]) = {groups} elements), got shape {tuple(zero_start_index_M.shape)}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps}")


def quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    zero_start_index_M: Optional[torch.Tensor] = None,
    use_triton: bool = True,
    output_device: Optional[Union[torch.device, str]] = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 e4m3fn quantization of ``a`` ``[..., K]`` (MSLK ``quantize_fp8_row``).

    Per row: ``amax = min(max(max|row|, eps), scale_ub)``, ``inv = 448 / amax``,
    ``q = e4m3fn(clamp(row * inv, -448, 448))`` (nearest even), ``scale = 1 / inv``.

    Args:
        a: bf16/fp16/fp32 ``[..., K]``, any leading dims and strides, unit last stride.
        scale_ub: optional 1-element float32 tensor on ``a``'s device: upper bound of ``amax``.
        zero_start_index_M: optional int32/int64 tensor on ``a``'s device with one entry per
            ``[a.shape[-2], K]`` matrix (``prod(a.shape[:-2])`` entries, e.g. ``[G]`` for a
            ``[G, M, K]`` input): rows ``m >= zero_start_index_M[g]`` of matrix ``g`` are not read
            and quantize as zeros (scale ``eps / 448``, clamped by ``scale_ub``).
        use_triton: ``False`` runs the PyTorch reference even on CUDA.
        output_device: optional device to move both outputs to (as MSLK's CPU weight loading
            does; a copy to another device synchronizes).
        eps: floor of the row max, ``1/512`` by default (``DEFAULT_EPS``). The fused kernels use
            ``1e-12`` (``FUSED_EPS``).

    Returns ``(a_fp8 [..., K] float8_e4m3fn, a_scale [...] float32 dequant scale)``.
    """
    _check_args(a, scale_ub, zero_start_index_M, eps)
    if not isinstance(use_triton, bool):
        raise TypeError(f"use_triton must be a bool, got {type(use_triton).__name__}")
    if output_device is not None:
        try:
            output_device = torch.device(output_device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"output_device must be a torch.device or device string, got {output_device!r}") from e
    q, s = call_op(_quantize_fp8_row_op, a, scale_ub, zero_start_index_M, use_triton, float(eps), 1)
    if output_device is not None:
        q, s = q.to(output_device), s.to(output_device)
    return q, s


def triton_quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    zero_start_index_M: Optional[torch.Tensor] = None,
    align_rows_to: Optional[int] = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alias of ``quantize_fp8_row`` with MSLK ``triton_quantize_fp8_row``'s signature.

    ``align_rows_to`` (optional int >= 1) pads each output row with zeros up to a multiple of it
    (the scale is computed from the K real values): ``a_fp8`` is then ``[..., ceil(K / n) * n]``.
    On CPU tensors it runs the reference.
    """
    _check_args(a, scale_ub, zero_start_index_M, eps)
    align = 1 if align_rows_to is None else check_int("align_rows_to", align_rows_to, lo=1)
    return call_op(_quantize_fp8_row_op, a, scale_ub, zero_start_index_M, True, float(eps), align)
