"""Expert-parallel shuffling ops (MSLK ``mslk.moe.shuffling`` API): ``combine_shuffling``
(rank-major -> expert-major) and ``split_shuffling`` (its inverse).

Each public function validates its arguments, then calls its registered op
``torch.ops.moekit.<name>``: one Triton launch on CUDA tensors (the row offsets are derived from
the ``[EP, E]`` counts inside the kernel: no host sync, CUDA-graph capturable), the float32
reference (``moekit.reference.shuffling``) on CPU tensors. Layouts: see that module.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import FP8_DTYPE, INDEX_DTYPES, check_tensor, expert_range
from moekit.ops._common import call_op, use_triton
from moekit.reference import shuffling as _ref

__all__ = ["combine_shuffling", "split_shuffling"]

_TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


def _check(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int],
    expert_end: Optional[int],
    is_padded: bool,
) -> None:
    check_tensor("tokens", tokens, ndim=2, dtype=_TOKEN_DTYPES)
    T, D = tokens.shape
    if D % 8 != 0:
        raise ValueError(f"tokens must have a last dim (D) that is a multiple of 8, got shape {tuple(tokens.shape)}")
    check_tensor("tokens", tokens, last_dim_contiguous=True)
    if T > 1 and D and tokens.stride(0) % 8 != 0:  # D = 0: no element is accessed
        raise ValueError(
            f"tokens must have a row stride that is a multiple of 8 elements (e.g. contiguous), "
            f"got strides {tokens.stride()}"
        )
    check_tensor("token_counts", token_counts, ndim=2, dtype=INDEX_DTYPES, device=tokens.device)
    EP, E = token_counts.shape
    if EP < 1:
        raise ValueError(f"token_counts must be [EP, E] with EP >= 1, got shape {tuple(token_counts.shape)}")
    expert_range(E, expert_start, expert_end, start_name="expert_start", end_name="expert_end")
    if not isinstance(is_padded, bool):
        raise TypeError(f"is_padded must be a bool, got {type(is_padded).__name__}")
    if is_padded and T % EP != 0:
        raise ValueError(f"is_padded=True needs tokens.shape[0] ({T}) divisible by EP (token_counts.shape[0], {EP})")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 rows as bytes for the CPU reference (row movement only; CPU fp8 ops are sparse)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@triton_op("moekit::combine_shuffling", mutates_args=())
def _combine_shuffling_op(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(tokens):
        from moekit.ops._triton import shuffling as _tri

        start, end = expert_range(
            token_counts.shape[1], expert_start, expert_end, start_name="expert_start", end_name="expert_end"
        )
        return _tri.combine_shuffling(tokens, token_counts, start, end, is_padded)
    out, counts_out = _ref.combine_shuffling(_bits(tokens), token_counts, expert_start, expert_end, is_padded)
    return (out.view(tokens.dtype) if tokens.dtype == FP8_DTYPE else out), counts_out


@triton_op("moekit::split_shuffling", mutates_args=())
def _split_shuffling_op(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
    init_with_zeros: bool = False,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(tokens):
        from moekit.ops._triton import shuffling as _tri

        start, end = expert_range(
            token_counts.shape[1], expert_start, expert_end, start_name="expert_start", end_name="expert_end"
        )
        return _tri.split_shuffling(tokens, token_counts, start, end, is_padded, init_with_zeros)
    out = _ref.split_shuffling(_bits(tokens), token_counts, expert_start, expert_end, is_padded)
    return out.view(tokens.dtype) if tokens.dtype == FP8_DTYPE else out


def combine_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder received rows from rank-major to expert-major (local experts only).

    ``tokens`` ``[T, D]`` (bf16/fp16/fp32/fp8 e4m3fn, ``D % 8 == 0``) rank-major: rank ``r``'s
    block starts at ``sum(token_counts[:r])`` (dense) or ``r * (T // EP)`` (``is_padded``), its
    rows grouped by expert. ``token_counts`` ``[EP, E]`` int32/int64. Local experts
    ``[expert_start, expert_end)`` (default all), ``EG = end - start``.

    Returns ``(tokens_out [T, D], counts_out [EG + 1] int32)``: local expert ``e``'s rows from rank
    0, 1, ... packed from row 0; ``counts_out`` per local expert its total over ranks, then the
    grand total. Rows past the total are unspecified (left uninitialized on CUDA).

    Shapes, dtypes and the expert range are checked everywhere. The count values are checked only
    on CPU tensors (reading CUDA counts would be a host sync): a negative count, counts summing to
    more than ``T``, or (``is_padded``) a rank's counts summing to more than ``T // EP`` raise a
    ValueError naming ``token_counts``; on CUDA the kernel skips rows that would fall outside the
    buffer and the rows moved are unspecified.
    """
    _check(tokens, token_counts, expert_start, expert_end, is_padded)
    return call_op(_combine_shuffling_op, tokens, token_counts, expert_start, expert_end, is_padded)


def split_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
    init_with_zeros: bool = False,
) -> torch.Tensor:
    """The inverse of ``combine_shuffling``: expert-major rows back to the rank-major layout.

    Returns ``[T, D]``. Rank-major rows that no local expert row maps to are zeros with
    ``init_with_zeros`` and unspecified otherwise (uninitialized on CUDA, zeros on the CPU path).
    Counts inconsistent with ``T`` raise a ValueError on CPU tensors, as in ``combine_shuffling``.
    """
    _check(tokens, token_counts, expert_start, expert_end, is_padded)
    if not isinstance(init_with_zeros, bool):
        raise TypeError(f"init_with_zeros must be a bool, got {type(init_with_zeros).__name__}")
    return call_op(_split_shuffling_op, tokens, token_counts, expert_start, expert_end, is_padded, init_with_zeros)
