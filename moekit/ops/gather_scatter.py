"""Token movement ops (MSLK ``mslk.moe.gather_scatter`` API): gather + scale (+ FP8 row-wise
quantization) and scatter-add (dense atomic, dense deterministic, padded).

Each public function validates its arguments, then calls its registered op
``torch.ops.moekit.<name>``, which runs the Triton kernel on CUDA tensors and the float32
reference (``moekit.reference.gather_scatter``) on CPU tensors.

Beyond MSLK: any ``D`` that is a multiple of 8 (MSLK needs multiples of 512/1024), rows whose
index is negative (the ``-1`` tail of ``index_shuffling``) or out of range are skipped, unwritten
output rows are left untouched, ``scores`` may have any strides, and
``scatter_add_dense_tokens(..., deterministic=True)`` gives a bitwise reproducible sum.
No op synchronizes with the host; all are CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import (
    INDEX_DTYPES,
    check_optional_count,
    check_no_broadcast,
    check_optional_scale_ub,
    check_tensor,
)
from moekit.ops._common import call_op, use_triton
from moekit.reference import gather_scatter as _ref

__all__ = [
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "scatter_add_dense_tokens",
    "scatter_add_dense_tokens_deterministic",
    "scatter_add_padded_tokens",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Validation (metadata only: no device synchronization)
# ----------------------------------------------------------------------------------------------


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Row-major token rows: ``D`` (the last dim) a multiple of 8, unit last stride, and every
    other stride a multiple of 8 (the kernels' 16-byte vector accesses rely on it)."""
    D = t.shape[-1]
    if D % 8 != 0:
        raise ValueError(f"{name} must have a last dim (D) that is a multiple of 8, got shape {tuple(t.shape)}")
    check_tensor(name, t, last_dim_contiguous=True)
    if D == 0:  # no element is accessed (and torch gives an empty contiguous tensor unit strides)
        return
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and t.stride(dim) % 8 != 0:
            raise ValueError(
                f"{name} must have strides that are multiples of 8 elements outside the last dim "
                f"(e.g. contiguous), got strides {t.stride()} for shape {tuple(t.shape)}"
            )


def _check_gather(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    valid_token_count: Optional[torch.Tensor],
) -> None:
    check_tensor("x", x, ndim=2, dtype=_FLOAT_DTYPES)
    _check_rows("x", x)
    T = x.shape[0]
    check_tensor("token_indices", token_indices, ndim=1, dtype=INDEX_DTYPES, device=x.device)
    a = token_indices.shape[0]
    check_tensor("expert_indices", expert_indices, shape=(a,), dtype=INDEX_DTYPES, device=x.device)
    if scores is not None:
        check_tensor("scores", scores, ndim=2, dtype=_FLOAT_DTYPES, device=x.device)
        if scores.shape[0] != T or scores.shape[1] < 1:
            raise ValueError(
                f"scores must have shape ({T}, E) with E >= 1 to match x's {T} tokens, got {tuple(scores.shape)}"
            )
    check_optional_count("valid_token_count", valid_token_count, x.device)


def _check_scatter(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor],
) -> None:
    check_tensor("out_tokens", out_tokens, ndim=2, dtype=_FLOAT_DTYPES)
    check_tensor("in_tokens", in_tokens, ndim=2, dtype=_FLOAT_DTYPES, device=out_tokens.device)
    a, D = in_tokens.shape
    if out_tokens.shape[1] != D:
        raise ValueError(
            f"out_tokens must have {D} columns like in_tokens {tuple(in_tokens.shape)}, got shape {tuple(out_tokens.shape)}"
        )
    _check_rows("out_tokens", out_tokens)
    check_no_broadcast("out_tokens", out_tokens)
    _check_rows("in_tokens", in_tokens)
    check_tensor("token_indices", token_indices, shape=(a,), dtype=INDEX_DTYPES, device=out_tokens.device)
    check_optional_count("valid_token_count", valid_token_count, out_tokens.device)


def _check_padded(
    in_tokens: torch.Tensor, token_counts: torch.Tensor, token_indices: torch.Tensor, out_tokens: torch.Tensor
) -> None:
    check_tensor("in_tokens", in_tokens, ndim=3, dtype=_FLOAT_DTYPES)
    EP, T_K, D = in_tokens.shape
    if EP < 1:
        raise ValueError(f"in_tokens must have at least one rank block (EP >= 1), got shape {tuple(in_tokens.shape)}")
    _check_rows("in_tokens", in_tokens)
    check_tensor("token_counts", token_counts, ndim=1, dtype=INDEX_DTYPES, device=in_tokens.device)
    E = token_counts.shape[0]
    if E % EP != 0:
        raise ValueError(f"token_counts' length (experts, {E}) must be a multiple of in_tokens.shape[0] (EP, {EP})")
    check_tensor("token_indices", token_indices, shape=(T_K,), dtype=INDEX_DTYPES, device=in_tokens.device)
    check_tensor("out_tokens", out_tokens, ndim=2, dtype=in_tokens.dtype, device=in_tokens.device)
    if out_tokens.shape[1] != D:
        raise ValueError(
            f"out_tokens must have {D} columns like in_tokens {tuple(in_tokens.shape)}, got shape {tuple(out_tokens.shape)}"
        )
    _check_rows("out_tokens", out_tokens)
    check_no_broadcast("out_tokens", out_tokens)


# ----------------------------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------------------------


@triton_op("moekit::gather_scale_dense_tokens", mutates_args=())
def _gather_scale_dense_tokens_op(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    valid_token_count: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(x):
        from moekit.ops._triton import gather_scatter as _tri

        return _tri.gather_scale_dense_tokens(x, token_indices, expert_indices, scores, valid_token_count)
    return _ref.gather_scale_dense_tokens(x, token_indices, expert_indices, scores, valid_token_count)


@triton_op("moekit::gather_scale_quant_dense_tokens", mutates_args=())
def _gather_scale_quant_dense_tokens_op(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from moekit.ops._triton import gather_scatter as _tri

        return _tri.gather_scale_quant_dense_tokens(
            x, token_indices, expert_indices, scores, scale_ub, valid_token_count
        )
    return _ref.gather_scale_quant_dense_tokens(x, token_indices, expert_indices, scores, scale_ub, valid_token_count)


@triton_op("moekit::scatter_add_dense_tokens", mutates_args={"out_tokens"})
def _scatter_add_dense_tokens_op(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> None:
    if use_triton(out_tokens):
        from moekit.ops._triton import gather_scatter as _tri

        _tri.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)
        return
    _ref.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)


@triton_op("moekit::scatter_add_dense_tokens_deterministic", mutates_args={"out_tokens"})
def _scatter_add_dense_tokens_deterministic_op(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> None:
    if use_triton(out_tokens):
        from moekit.ops._triton import gather_scatter as _tri

        _tri.scatter_add_dense_tokens_deterministic(out_tokens, in_tokens, token_indices, valid_token_count)
        return
    _ref.scatter_add_dense_tokens_deterministic(out_tokens, in_tokens, token_indices, valid_token_count)


@triton_op("moekit::scatter_add_padded_tokens", mutates_args={"out_tokens"})
def _scatter_add_padded_tokens_op(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
    cache_tag: str = "",
) -> None:
    if use_triton(in_tokens):
        from moekit.ops._triton import gather_scatter as _tri

        _tri.scatter_add_padded_tokens(in_tokens, token_counts, token_indices, out_tokens)
        return
    _ref.scatter_add_padded_tokens(in_tokens, token_counts, token_indices, out_tokens)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    valid_token_count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[r] = x[token_indices[r]] * scores[token_indices[r], expert_indices[r]]``.

    ``x`` ``[T, D]`` bf16/fp16/fp32 (``D % 8 == 0``, unit last stride); ``token_indices`` and
    ``expert_indices`` ``[a]`` int32/int64 (e.g. from ``index_shuffling``); ``scores`` ``[T, E]``
    with any strides, or None: the rows copied (a scale of 1; any expert index ``>= 0`` is in
    range). Returns ``[a, D]`` in ``x.dtype``, computed in float32. Row ``r`` is written only when
    ``r < valid_token_count[0]`` and both indices are in range (negative = skipped); other rows
    are left unwritten (uninitialized on CUDA, zeros on the CPU path).
    """
    _check_gather(x, token_indices, expert_indices, scores, valid_token_count)
    return call_op(_gather_scale_dense_tokens_op, x, token_indices, expert_indices, scores, valid_token_count)


def gather_scale_quant_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_scale_dense_tokens`` fused with FP8 e4m3fn row-wise quantization (``scores`` None:
    the rows quantized unscaled).

    Per written row (the scaled float32 row): ``amax`` floored at 1e-12 and clamped to
    ``scale_ub`` (a 1-element float32 tensor, optional); values ``clamp(row * 448 / amax, ±448)``
    as e4m3fn; returns ``(q [a, D] e4m3fn, dequant scale [a] float32 = 1 / (448 / amax))``.
    Unwritten rows (see ``gather_scale_dense_tokens``) keep both outputs unwritten.
    """
    _check_gather(x, token_indices, expert_indices, scores, valid_token_count)
    check_optional_scale_ub("scale_ub", scale_ub, x.device)
    return call_op(
        _gather_scale_quant_dense_tokens_op, x, token_indices, expert_indices, scores, scale_ub, valid_token_count
    )


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """In place ``out_tokens[token_indices[r]] += in_tokens[r]`` for ``r < valid_token_count[0]``;
    rows with a negative (or out of range) index are skipped. Returns ``out_tokens``.

    ``out_tokens`` ``[T, D]``, ``in_tokens`` ``[a, D]`` (bf16/fp16/fp32, ``D % 8 == 0``). The default
    is the fastest path on the GPU: atomics (as MSLK) for few rows; from 1024 rows with fewer than
    two rows per token on average (top-1; ``D <= 8192``), a read-add-write of each output row under
    a per-token lock (no atomics on the data; rows of one token serialize, so a token hit by
    thousands of rows is slow there); the deterministic sum where tokens receive two or more rows
    on average (``a >= 2 T``, more than 1024 rows). Except for that last one, the order of
    additions, hence the rounding, may vary between runs when several rows hit one token.
    Under torch.compile the top-1 case uses atomics. ``deterministic=True`` always sums each
    token's rows in ascending row order in float32 and adds the sum once: bitwise reproducible.
    """
    _check_scatter(out_tokens, in_tokens, token_indices, valid_token_count)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if deterministic:
        call_op(_scatter_add_dense_tokens_deterministic_op, out_tokens, in_tokens, token_indices, valid_token_count)
    else:
        call_op(_scatter_add_dense_tokens_op, out_tokens, in_tokens, token_indices, valid_token_count)
    return out_tokens


def scatter_add_dense_tokens_deterministic(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``scatter_add_dense_tokens(..., deterministic=True)``: the rows that land on one token are
    summed in ascending row order in float32 and added to ``out_tokens`` once (no atomics;
    bitwise identical across runs). Returns ``out_tokens``."""
    _check_scatter(out_tokens, in_tokens, token_indices, valid_token_count)
    call_op(_scatter_add_dense_tokens_deterministic_op, out_tokens, in_tokens, token_indices, valid_token_count)
    return out_tokens


def scatter_add_padded_tokens(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> torch.Tensor:
    """In place: add back the rows every expert-parallel rank returned (static EP path).

    ``in_tokens`` ``[EP, T_K, D]`` (block ``r`` from rank ``r``, in this rank's send layout),
    ``token_counts`` ``[E]`` rows per global expert (``E % EP == 0``; expert ``e`` lives on rank
    ``e // (E // EP)``), ``token_indices`` ``[T_K]`` the token of each send row, ``out_tokens``
    ``[T, D]``. Send row ``o`` of expert ``e`` adds ``in_tokens[e // (E // EP), o]`` into
    ``out_tokens[token_indices[o]]`` (atomics). Returns ``out_tokens``.
    """
    _check_padded(in_tokens, token_counts, token_indices, out_tokens)
    call_op(_scatter_add_padded_tokens_op, in_tokens, token_counts, token_indices, out_tokens)
    return out_tokens
