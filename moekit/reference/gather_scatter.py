"""Token movement oracles: gather + scale (+ FP8 quant) and scatter-add (dense and padded).

Semantics follow MSLK ``mslk.moe.gather_scatter`` (seeds/000) with moekit's extensions:
any D, and rows whose index is negative (the ``-1`` tail of ``index_shuffling``) or out of range
are skipped.
Rows that a kernel does not write are returned as zeros here; kernels leave them untouched.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import (
    FP8_DTYPE,
    INDEX_DTYPES,
    check_optional_count,
    check_optional_scale_ub,
    check_tensor,
)
from moekit.reference.quantize import FUSED_EPS, quantize_rows

__all__ = [
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "scatter_add_dense_tokens",
    "scatter_add_padded_tokens",
    "scatter_add_dense_tokens_deterministic",
    "row_mask",
]


def row_mask(n: int, valid_count: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[n]`` bool: ``r < valid_count[0]`` (all True when ``valid_count`` is None)."""
    rows = torch.arange(n, device=device)
    if valid_count is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    return rows < valid_count.reshape(()).to(device=device, dtype=torch.int64)


def _check_gather_args(x, token_indices, expert_indices, scores, valid_token_count):
    check_tensor("x", x, ndim=2, dtype=(torch.bfloat16, torch.float16, torch.float32))
    T, D = x.shape
    check_tensor("token_indices", token_indices, ndim=1, dtype=INDEX_DTYPES, device=x.device)
    a = token_indices.shape[0]
    check_tensor("expert_indices", expert_indices, shape=(a,), dtype=INDEX_DTYPES, device=x.device)
    if scores is not None:
        check_tensor("scores", scores, ndim=2, device=x.device)
        if scores.shape[0] != T:
            raise ValueError(f"scores must have shape ({T}, E) to match x's {T} tokens, got {tuple(scores.shape)}")
    check_optional_count("valid_token_count", valid_token_count, x.device)
    return T, D, a


def _gathered_scaled(x, token_indices, expert_indices, scores, valid_token_count):
    """(fp32 rows [a, D], written mask [a])."""
    T, D, a = _check_gather_args(x, token_indices, expert_indices, scores, valid_token_count)
    tok = token_indices.long()
    exp = expert_indices.long()
    # Rows whose token or expert index is negative or out of range are skipped (as the kernels do).
    written = row_mask(a, valid_token_count, x.device) & (tok >= 0) & (tok < T) & (exp >= 0)
    E = scores.shape[1] if scores is not None else None  # no scores: a scale of 1, any expert >= 0
    if E is not None:
        written &= exp < E
    if T == 0 or E == 0:  # no row can be in range (and nothing to index with 0)
        return torch.zeros(a, D, dtype=torch.float32, device=x.device), written & False
    # Skipped rows index row 0 (always in range here) and are zeroed below: never clamped.
    tok_safe = torch.where(written, tok, 0)
    rows = x.float()[tok_safe]
    if scores is not None:
        rows = rows * scores.float()[tok_safe, torch.where(written, exp, 0)].unsqueeze(1)
    rows = torch.where(written.unsqueeze(1), rows, 0.0)
    return rows, written


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    valid_token_count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[r] = x[token_indices[r]] * scores[token_indices[r], expert_indices[r]]``.

    ``x`` ``[T, D]``; indices ``[a]``; ``scores`` ``[T, E]`` (any strides; None: a scale of 1, any
    expert index ``>= 0`` in range). Computed in float32, returned in ``x.dtype``. Row ``r`` is
    written only when ``r < valid_token_count[0]`` (the number of valid *rows*, as in MSLK),
    ``0 <= token_indices[r] < T`` and ``0 <= expert_indices[r] < E``; other rows (negative or out-of-range indices included, which
    are skipped, never clamped) are zero here, where the kernel leaves them unwritten.
    """
    rows, _ = _gathered_scaled(x, token_indices, expert_indices, scores, valid_token_count)
    return rows.to(x.dtype)


def gather_scale_quant_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather + scale as ``gather_scale_dense_tokens``, then FP8 e4m3fn row-wise quantization.

    Per written row: ``amax = max|row|`` (the scaled fp32 row), clamped to ``[1e-12, scale_ub]``
    (``scale_ub`` optional); ``q = clamp(row * (448 / amax), -448, 448)`` as e4m3fn; the returned
    scale is the dequant scale ``1 / (448 / amax)``. Unwritten rows: zeros and scale 0 here.
    """
    rows, written = _gathered_scaled(x, token_indices, expert_indices, scores, valid_token_count)
    check_optional_scale_ub("scale_ub", scale_ub, x.device)
    q, scale = quantize_rows(rows, scale_ub=scale_ub, eps=FUSED_EPS)
    q = torch.where(written.unsqueeze(1), q.float(), 0.0).to(FP8_DTYPE)
    return q, torch.where(written, scale, 0.0)


def _check_scatter_args(out_tokens, in_tokens, token_indices, valid_token_count):
    check_tensor("out_tokens", out_tokens, ndim=2, dtype=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("in_tokens", in_tokens, ndim=2, device=out_tokens.device)
    a, D = in_tokens.shape
    if out_tokens.shape[1] != D:
        raise ValueError(f"out_tokens must have {D} columns like in_tokens, got shape {tuple(out_tokens.shape)}")
    check_tensor("token_indices", token_indices, shape=(a,), dtype=INDEX_DTYPES, device=out_tokens.device)
    check_optional_count("valid_token_count", valid_token_count, out_tokens.device)
    return a, D


def _scatter_add_rows(out_tokens: torch.Tensor, in_rows: torch.Tensor, tok: torch.Tensor, use: torch.Tensor):
    """``out[tok[r]] += in[r]`` for rows with ``use``, in place: the rows that land on one token
    are summed in float32 (ascending row order on the CPU), added to ``out`` once in float32, and
    rounded once to ``out``'s dtype."""
    T = out_tokens.shape[0]
    if T == 0 or in_rows.shape[0] == 0:
        return  # nothing can land anywhere (and index_add_ would reject index 0 on an empty out)
    use = use & (tok >= 0) & (tok < T)
    sums = torch.zeros(out_tokens.shape, dtype=torch.float32, device=out_tokens.device)
    idx = torch.where(use, tok, 0)
    sums.index_add_(0, idx, torch.where(use.unsqueeze(1), in_rows.float(), 0.0))
    out_tokens.copy_((out_tokens.float() + sums).to(out_tokens.dtype))


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    """In place: ``out_tokens[token_indices[r]] += in_tokens[r]`` for ``r < valid_token_count[0]``.

    ``out_tokens`` ``[T, D]``, ``in_tokens`` ``[a, D]``. Rows with an index outside ``[0, T)`` are skipped.
    The oracle sums in float32 and rounds once; atomic kernels round per addition.
    """
    a, _ = _check_scatter_args(out_tokens, in_tokens, token_indices, valid_token_count)
    use = row_mask(a, valid_token_count, out_tokens.device)
    _scatter_add_rows(out_tokens, in_tokens, token_indices.long(), use)


def scatter_add_dense_tokens_deterministic(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    """Same contract as ``scatter_add_dense_tokens``; the rows that land on one token are summed
    in ascending row order in float32 and added to ``out_tokens`` once (bitwise reproducible)."""
    scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)


def scatter_add_padded_tokens(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> None:
    """In place: combine the rows that every expert-parallel rank sent back (static EP path).

    ``in_tokens`` ``[EP, T_K, D]``: block ``r`` is what rank ``r`` returned, in this rank's send
    layout (rows grouped by global expert, ``token_counts[e]`` rows for expert ``e``).
    ``token_counts`` ``[E]`` with ``E % EP == 0``; expert ``e`` lives on rank ``e // (E // EP)``.
    ``token_indices`` ``[T_K]``: the token of each send row. For each expert ``e`` and each of
    its rows ``j`` (offset ``o = sum(token_counts[:e]) + j``):
    ``out_tokens[token_indices[o]] += in_tokens[e // (E // EP), o]``.
    """
    check_tensor("in_tokens", in_tokens, ndim=3)
    EP, T_K, D = in_tokens.shape
    check_tensor("token_counts", token_counts, ndim=1, dtype=INDEX_DTYPES, device=in_tokens.device)
    E = token_counts.shape[0]
    if EP < 1 or E % EP != 0:
        raise ValueError(f"token_counts' length (experts, {E}) must be a multiple of in_tokens.shape[0] (EP, {EP})")
    check_tensor("token_indices", token_indices, shape=(T_K,), dtype=INDEX_DTYPES, device=in_tokens.device)
    check_tensor("out_tokens", out_tokens, ndim=2, dtype=in_tokens.dtype, device=in_tokens.device)
    if out_tokens.shape[1] != D:
        raise ValueError(f"out_tokens must have {D} columns like in_tokens, got shape {tuple(out_tokens.shape)}")
    counts = token_counts.long()
    ends = torch.cumsum(counts, 0)
    rows = torch.arange(T_K, device=in_tokens.device)
    # Expert of each send row (rows past the total belong to no expert).
    expert_of_row = torch.searchsorted(ends, rows, right=True)
    use = expert_of_row < E
    rank_of_row = torch.where(use, expert_of_row, 0) // (E // EP)
    src = in_tokens[rank_of_row, rows]
    _scatter_add_rows(out_tokens, src, token_indices.long(), use)
