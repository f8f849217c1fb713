"""Argument validation shared by every public entry point.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, value,
device or layout) with a message that names the argument, says what was expected and what came.
They only read metadata (shape, dtype, device, strides): no device synchronization.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional, Union

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INDEX_DTYPES = (torch.int32, torch.int64)

DTypeSpec = Union[torch.dtype, Iterable[torch.dtype], None]


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: DTypeSpec = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it.

    ``shape`` entries that are ``None`` are not checked. ``device`` compares the device type
    and index (an index-less CUDA device matches any index).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise TypeError(f"{name} must have dtype {_dtype_names(allowed)}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                pretty = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {pretty}, got {tuple(t.shape)} (dim {i})")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    if a == b:  # the common case, without building devices (hot: every op checks several tensors)
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def check_optional_count(name: str, t: Optional[torch.Tensor], device: torch.device) -> None:
    """A device-side count: ``None`` or a 1-element int32/int64 tensor on ``device``."""
    if t is None:
        return
    check_tensor(name, t, dtype=INDEX_DTYPES, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold exactly 1 element, got shape {tuple(t.shape)}")


def check_optional_scale_ub(name: str, t: Optional[torch.Tensor], device: torch.device) -> None:
    if t is None:
        return
    check_tensor(name, t, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold exactly 1 float32 element, got shape {tuple(t.shape)}")


def check_int(name: str, v: object, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """An integer in ``[lo, hi]`` (inclusive bounds, each optional)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_bool(name: str, v: object) -> bool:
    """A Python bool (``0`` / ``"yes"`` / a tensor are TypeErrors, not silently truthy)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def check_multiple(name: str, v: int, m: int) -> None:
    if v % m != 0:
        raise ValueError(f"{name} must be a multiple of {m}, got {v}")


def expert_range(
    num_experts: int, start: Optional[int], end: Optional[int], *, start_name: str, end_name: str
) -> tuple[int, int]:
    """Resolve an optional expert range ``[start, end)`` against ``num_experts``."""
    s = 0 if start is None else check_int(start_name, start)
    e = num_experts if end is None else check_int(end_name, end)
    if not 0 <= s <= e <= num_experts:
        raise ValueError(
            f"expert range [{start_name}, {end_name}) must satisfy 0 <= {start_name} <= {end_name} <= "
            f"{num_experts} (number of experts), got [{s}, {e})"
        )
    return s, e


def check_no_broadcast(name: str, t: torch.Tensor) -> None:
    """An output written in place must not alias itself (a stride-0 dim of size > 1, e.g. an
    ``expand()``ed tensor): the kernels would race on the shared elements."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(
            f"{name} is written in place and must not have overlapping elements (a stride-0 dim, e.g. an expand()ed "
            f"tensor), got strides {t.stride()} for shape {tuple(t.shape)}"
        )


def check_expert_weights(
    w13_e2FD: object,
    w2_eDF: object,
    w13_scale_e2F: object,
    w2_scale_eD: object,
    E: int,
    x: torch.Tensor,
    contiguous: bool = False,
) -> tuple[int, bool]:
    """SwiGLU expert weights for ``E`` experts and rows ``x [T, D]``: ``w13_e2FD [E, 2F, D]`` and
    ``w2_eDF [E, D, F]`` of x's dtype, or FP8 e4m3fn with float32 row scales ``w13_scale_e2F``
    (E * 2F values) and ``w2_scale_eD`` (E * D); ``contiguous``: the kernels read them flat.
    Returns ``(F, fp8)``."""
    D = x.shape[-1]
    dev = x.device
    check_tensor("w13_e2FD", w13_e2FD, ndim=3, device=dev, contiguous=contiguous)
    if w13_e2FD.shape[0] != E or w13_e2FD.shape[2] != D or w13_e2FD.shape[1] % 2:
        raise ValueError(
            f"w13_e2FD must have shape (E, 2F, D) = ({E}, 2F, {D}) for {E} experts, got {tuple(w13_e2FD.shape)}"
        )
    F = w13_e2FD.shape[1] // 2
    check_tensor("w2_eDF", w2_eDF, shape=(E, D, F), dtype=w13_e2FD.dtype, device=dev, contiguous=contiguous)
    fp8 = w13_e2FD.dtype == FP8_DTYPE
    if fp8:
        if w13_scale_e2F is None or w2_scale_eD is None:
            raise ValueError("FP8 expert weights need w13_scale_e2F and w2_scale_eD")
        check_tensor("w13_scale_e2F", w13_scale_e2F, dtype=torch.float32, device=dev, contiguous=contiguous)
        check_tensor("w2_scale_eD", w2_scale_eD, dtype=torch.float32, device=dev, contiguous=contiguous)
        if w13_scale_e2F.numel() != E * 2 * F or w2_scale_eD.numel() != E * D:
            raise ValueError(
                f"w13_scale_e2F / w2_scale_eD must have E*2F = {E * 2 * F} / E*D = {E * D} elements, got "
                f"{tuple(w13_scale_e2F.shape)} / {tuple(w2_scale_eD.shape)}"
            )
    elif w13_e2FD.dtype != x.dtype:
        raise TypeError(f"w13_e2FD must have x_TD's dtype {x.dtype} (or float8_e4m3fn), got {w13_e2FD.dtype}")
    return F, fp8
