"""Triton kernel: expert-parallel shuffling, rank-major <-> expert-major (combine / split).

One launch per op. Every program first turns the small ``[EP, E]`` counts into two tables over the
``EP x EG`` (rank, local expert) segments: where each segment starts on the rank-major side (dense
or padded layout) and where it starts on the expert-major side. It then walks the output rows of
its share (a grid-stride loop over row blocks, one program per SM slot) and, for each row, finds
its segment with a vectorized compare against the tables and copies the row. Both ops are gathers
(every output row is written by exactly one program, reads and writes are row-contiguous):

- combine: output row ``j`` (expert-major, ``j < total``) reads rank-major row
  ``rank_major_start[seg] + (j - expert_major_start[seg])``; program 0 also writes ``counts_out``.
- split: output row ``i`` (rank-major) reads expert-major row
  ``expert_major_start[seg] + (i - rank_major_start[seg])``; rows no local segment covers are left
  untouched, or zero-filled with ``init_with_zeros``.

Rows are moved as raw bits (the launcher passes integer views), so any 1/2/4-byte dtype works,
FP8 included. Rows whose computed source falls outside ``[0, T)`` (inconsistent counts) are
skipped rather than read out of bounds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, launch, next_pow2, num_sms

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
# Bytes a program moves per tile, and the budget for its [BLOCK_R, segments] lookup tile.
# The grid is persistent: _PROGRAMS_PER_SM programs of 8 warps per SM, few enough to be
# co-resident (<= 128 registers per thread), so no program waits for a second wave; each keeps
# one 32 KB tile in flight.
_TILE_BYTES = 32768
_LOOKUP_ELEMS = 8192
_PROGRAMS_PER_SM = 2


# The count strides are never specialized: a unit stride would let the compiler vectorize the
# tiny counts tile wider than it is, which the Triton 3.6 scan lowering rejects (seen at
# EP=8, EG=2 with one warp).
@triton.jit(do_not_specialize=["stride_cr", "stride_ce"])
def _shuffle_kernel(
    out_ptr,
    in_ptr,
    counts_ptr,
    counts_out_ptr,
    T,
    D,
    EP,
    E,
    start,
    EG,
    rows_per_rank,
    stride_in,
    stride_out,
    stride_cr,
    stride_ce,
    COMBINE: tl.constexpr,
    PADDED: tl.constexpr,
    ZERO_FILL: tl.constexpr,
    BLOCK_EP: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    BLOCK_EC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, BLOCK_EP)
    rm = r < EP

    # Per rank: rows for experts before `start` (offset of the local block inside the rank's
    # block) and rows over all experts (size of the rank's block in the dense layout).
    pre = tl.zeros((BLOCK_EP,), dtype=tl.int32)
    tot = tl.zeros((BLOCK_EP,), dtype=tl.int32)
    for e0 in range(0, E, BLOCK_EC):
        e = e0 + tl.arange(0, BLOCK_EC)
        c = tl.load(
            counts_ptr + r[:, None] * stride_cr + e[None, :] * stride_ce,
            mask=rm[:, None] & (e < E)[None, :],
            other=0,
        ).to(tl.int32)
        tot += tl.sum(c, axis=1)
        pre += tl.sum(tl.where((e < start)[None, :], c, 0), axis=1)

    g = tl.arange(0, BLOCK_EG)
    gm = g < EG
    C = tl.load(
        counts_ptr + r[:, None] * stride_cr + (start + g)[None, :] * stride_ce,
        mask=rm[:, None] & gm[None, :],
        other=0,
    ).to(tl.int32)  # [BLOCK_EP, BLOCK_EG]
    rank_major = pre[:, None] + tl.cumsum(C, axis=1) - C
    if PADDED:
        rank_major += (r * rows_per_rank)[:, None]
    else:
        rank_major += (tl.cumsum(tot, axis=0) - tot)[:, None]
    per_expert = tl.sum(C, axis=0)  # [BLOCK_EG]
    expert_major = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(C, axis=0) - C
    total = tl.sum(per_expert, axis=0)
    if COMBINE:
        first = pid == 0
        tl.store(counts_out_ptr + g, per_expert, mask=gm & first)
        tl.store(counts_out_ptr + EG, total, mask=first)

    # Lookup tables over the (rank, local expert) segments, broadcast against a block of rows as
    # [BLOCK_R, BLOCK_EP, BLOCK_EG] (3-D rather than flattened: reshapes of scanned tensors trip
    # a layout bug in the Triton 3.6 scan lowering on some small shapes).
    if COMBINE:
        look = expert_major
        delta = rank_major - expert_major
        n_rows = tl.minimum(total, T)
    else:
        look = rank_major
        delta = expert_major - rank_major
        n_rows = T
    look_end = (look + C)[None, :, :]
    look = look[None, :, :]
    delta = delta[None, :, :]
    d_lim = (D // 8) * 8

    for rb in range(pid, tl.cdiv(n_rows, BLOCK_R), nprog):
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        r3 = rows[:, None, None]
        hit = (r3 >= look) & (r3 < look_end)
        src = tl.sum(tl.sum(tl.where(hit, r3 + delta, 0), axis=2), axis=1)
        n_hit = tl.sum(tl.sum(hit.to(tl.int32), axis=2), axis=1)
        found = (n_hit > 0) & (rows < T) & (src >= 0) & (src < T)
        if ZERO_FILL:
            wmask = rows < T
        else:
            wmask = found
        s_off = src.to(tl.int64) * (stride_in // 8) * 8
        d_off = rows.to(tl.int64) * (stride_out // 8) * 8
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            cm = (cols < d_lim)[None, :]
            v = tl.load(in_ptr + s_off[:, None] + cols[None, :], mask=found[:, None] & cm, other=0,
                        eviction_policy="evict_first")
            tl.store(out_ptr + d_off[:, None] + cols[None, :], v, mask=wmask[:, None] & cm)


def _config(T: int, D: int, elem_size: int, segments: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_D, programs, num_warps) from shape buckets."""
    tile = max(8, _TILE_BYTES // elem_size)
    block_d = min(max(next_pow2(D), 8), 1024)
    block_r = max(1, min(tile // block_d, max(1, _LOOKUP_ELEMS // segments), next_pow2(max(T, 1))))
    # Every program slot gets at least one row block.
    while block_r > 1 and cdiv(T, block_r) < _PROGRAMS_PER_SM * num_sms(device):
        block_r //= 2
    # Few rows per block (small T or many segments): widen the column block instead.
    block_d = min(max(next_pow2(D), 8), max(block_d, tile // block_r))
    programs = max(1, min(cdiv(T, block_r), _PROGRAMS_PER_SM * num_sms(device)))
    # Warps for the data tile (16 B per lane) and for the lookup tables held in registers.
    warps = max(1, min(8, max(block_r * block_d * elem_size // 2048, block_r * segments // 1024, segments // 128)))
    return block_r, block_d, programs, warps


def _run(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    start: int,
    end: int,
    is_padded: bool,
    combine: bool,
    init_with_zeros: bool,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, D = tokens.shape
    EP, E = token_counts.shape
    EG = end - start
    device = tokens.device
    if out is None:
        out = torch.empty((T, D), dtype=tokens.dtype, device=device)
    counts_out = torch.empty((EG + 1,), dtype=torch.int32, device=device)
    if not combine and (T == 0 or D == 0):
        return out, counts_out
    int_dtype = _INT_VIEW[tokens.element_size()]
    if T == 0 or D == 0:
        # Only counts_out to write: no row is visited, any pointer of the view dtype will do.
        src = dst = torch.empty((1, 8), dtype=int_dtype, device=device)
    else:
        src, dst = tokens.view(int_dtype), out.view(int_dtype)
    block_ep, block_eg = next_pow2(EP), next_pow2(max(EG, 1))
    block_r, block_d, programs, warps = _config(T, D, tokens.element_size(), block_ep * block_eg, device)
    launch(_shuffle_kernel)[(programs,)](
        dst,
        src,
        token_counts,
        counts_out,
        T,
        D,
        EP,
        E,
        start,
        EG,
        T // EP,
        src.stride(0),
        dst.stride(0),
        token_counts.stride(0),
        token_counts.stride(1),
        COMBINE=combine,
        PADDED=is_padded,
        ZERO_FILL=(not combine) and init_with_zeros,
        BLOCK_EP=block_ep,
        BLOCK_EG=block_eg,
        BLOCK_EC=min(next_pow2(max(E, 1)), max(16, 4096 // block_ep)),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out, counts_out


def combine_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    start: int,
    end: int,
    is_padded: bool,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (arguments validated and the expert range resolved by the public op). ``out``
    (tests): a preallocated ``[T, D]`` output whose rows past the total stay as they are."""
    return _run(tokens, token_counts, start, end, is_padded, True, False, out)


def split_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    start: int,
    end: int,
    is_padded: bool,
    init_with_zeros: bool,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launcher. ``out`` (tests): a preallocated rank-major output whose uncovered rows stay as
    they are (without ``init_with_zeros``)."""
    return _run(tokens, token_counts, start, end, is_padded, False, init_with_zeros, out)[0]
