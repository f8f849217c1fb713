"""Expert-parallel shuffling oracles: rank-major <-> expert-major reordering of received rows.

``tokens [T, D]`` holds the rows received from every rank, rank-major: all of rank 0's rows
(grouped by expert), then rank 1's, and so on. ``token_counts [EP, E]``: ``token_counts[r, e]``
rows from rank ``r`` for expert ``e``. Local experts are ``[expert_start, expert_end)``.

Layouts of the rank-major side:

- dense (``is_padded=False``): rank ``r``'s block starts at row ``sum(token_counts[:r, :])``;
  inside it, expert ``e``'s rows start at ``sum(token_counts[r, :e])``.
- padded (``is_padded=True``, the all-gather layout): rank ``r``'s block starts at row
  ``r * (T // EP)`` (``T % EP == 0``); inside it, expert ``e``'s rows start at
  ``sum(token_counts[r, :e])``.

The expert-major side packs local expert ``e``'s rows from rank 0, then rank 1, ..., then the
next expert, from row 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import INDEX_DTYPES, check_tensor, expert_range

__all__ = ["combine_shuffling", "split_shuffling", "shuffle_row_map"]


def _show(t: torch.Tensor, limit: int = 32) -> str:
    """A short rendering of a small CPU tensor for an error message."""
    if t.numel() <= limit:
        return str(t.tolist())
    return f"a tensor of shape {tuple(t.shape)} (first values {t.flatten()[:limit].tolist()} ...)"


def _check_counts_fit(c: torch.Tensor, num_rows: int, is_padded: bool) -> None:
    """Counts that the rows can hold, else a ValueError naming ``token_counts`` (instead of a raw
    IndexError from the row map). CPU tensors only: reading device counts would be a host sync,
    so on CUDA (and under torch.compile / fake tensors) the kernels skip the rows that would fall
    outside the buffer instead."""
    from torch._subclasses.fake_tensor import is_fake

    if c.device.type != "cpu" or is_fake(c) or torch.compiler.is_compiling() or c.numel() == 0:
        return
    if bool((c < 0).any()):
        raise ValueError(f"token_counts must be >= 0 everywhere, got a negative count in {_show(c)}")
    EP = c.shape[0]
    if is_padded:
        per = c.sum(dim=1)
        cap = num_rows // EP
        if bool((per > cap).any()):
            r = int((per > cap).nonzero()[0])
            raise ValueError(
                f"token_counts' rows must each sum to at most tokens.shape[0] / EP = {num_rows} / {EP} = {cap} "
                f"(is_padded=True: one block of {cap} rows per rank), got {int(per[r])} for rank {r} "
                f"(per-rank sums {_show(per)})"
            )
    elif int(c.sum()) > num_rows:
        raise ValueError(
            f"token_counts must sum to at most tokens.shape[0] = {num_rows} (the rows received), "
            f"got a sum of {int(c.sum())} (per-rank sums {_show(c.sum(dim=1))})"
        )


def shuffle_row_map(
    token_counts: torch.Tensor,
    num_rows: int,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row correspondence between the two layouts.

    Returns ``(src_rows [T], valid [T], counts_out [EG + 1])`` where expert-major row ``j``
    (valid when ``j < total``) comes from rank-major row ``src_rows[j]``.
    """
    check_tensor("token_counts", token_counts, ndim=2, dtype=INDEX_DTYPES)
    EP, E = token_counts.shape
    if EP < 1:
        raise ValueError(f"token_counts must have at least one rank row, got shape {tuple(token_counts.shape)}")
    start, end = expert_range(E, expert_start, expert_end, start_name="expert_start", end_name="expert_end")
    if is_padded and num_rows % EP != 0:
        raise ValueError(f"padded layout needs tokens.shape[0] ({num_rows}) divisible by EP ({EP})")
    device = token_counts.device
    c = token_counts.long()
    _check_counts_fit(c, num_rows, is_padded)
    EG = end - start
    # Start of every (rank, expert) segment on the rank-major side.
    within = torch.cumsum(c, dim=1) - c  # [EP, E] offset of expert e in rank r's block
    if is_padded:
        block = torch.arange(EP, device=device) * (num_rows // EP)
    else:
        tot = c.sum(dim=1)
        block = torch.cumsum(tot, 0) - tot
    src_start = (block.unsqueeze(1) + within)[:, start:end]  # [EP, EG]
    # Expert-major segments ordered (expert, rank).
    seg_len = c[:, start:end].transpose(0, 1).reshape(-1)  # [EG * EP]
    seg_src = src_start.transpose(0, 1).reshape(-1)
    seg_end = torch.cumsum(seg_len, 0)
    seg_beg = seg_end - seg_len
    total = seg_end[-1] if seg_len.numel() else torch.zeros((), dtype=torch.int64, device=device)
    j = torch.arange(num_rows, device=device)
    seg = torch.searchsorted(seg_end, j, right=True)
    valid = j < total
    seg_safe = torch.where(valid, seg, 0).clamp(max=max(seg_len.numel() - 1, 0))
    if seg_len.numel():
        src = seg_src[seg_safe] + (j - seg_beg[seg_safe])
    else:
        src = torch.zeros_like(j)
    src = torch.where(valid, src, 0)
    counts_out = torch.zeros(EG + 1, dtype=torch.int64, device=device)
    counts_out[:EG] = c[:, start:end].sum(dim=0)
    counts_out[EG] = total
    return src, valid, counts_out.int()


def combine_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-major -> expert-major. Returns ``(tokens_out [T, D], counts_out [EG + 1] int32)``:
    per local expert its total over ranks, then the grand total. Rows past the total are zeros
    here (kernels leave them unspecified)."""
    check_tensor("tokens", tokens, ndim=2)
    check_tensor("token_counts", token_counts, ndim=2, dtype=INDEX_DTYPES, device=tokens.device)
    src, valid, counts_out = shuffle_row_map(token_counts, tokens.shape[0], expert_start, expert_end, is_padded)
    out = torch.where(valid.unsqueeze(1), tokens[src] if tokens.shape[0] else tokens, 0).to(tokens.dtype)
    return out, counts_out


def split_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: Optional[int] = None,
    expert_end: Optional[int] = None,
    is_padded: bool = False,
    init_with_zeros: bool = False,
) -> torch.Tensor:
    """Expert-major -> rank-major, the inverse of ``combine_shuffling``. Rank-major rows that no
    local expert row maps to are zeros (kernels: zeros with ``init_with_zeros``, else untouched)."""
    check_tensor("tokens", tokens, ndim=2)
    check_tensor("token_counts", token_counts, ndim=2, dtype=INDEX_DTYPES, device=tokens.device)
    src, valid, _ = shuffle_row_map(token_counts, tokens.shape[0], expert_start, expert_end, is_padded)
    out = torch.zeros_like(tokens)
    if tokens.shape[0]:
        dst = torch.where(valid, src, tokens.shape[0])  # invalid rows go to a dropped extra row
        ext = torch.zeros(tokens.shape[0] + 1, tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
        ext[dst] = torch.where(valid.unsqueeze(1), tokens, 0).to(tokens.dtype)
        out = ext[:-1].clone()
    return out
