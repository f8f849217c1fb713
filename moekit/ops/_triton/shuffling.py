"""Triton kernel: expert-parallel shuffling, rank-major <-> expert-major (combine / split).

One launch per op. Every program turns the small ``[EP, E]`` counts into three tables over the
``EP x EG`` (rank, local expert) segments: their lengths, where each starts on the expert-major
side and where it starts on the rank-major side (dense or padded layout). Both ops then walk the
**expert-major** rows ``j < min(total, T)`` (the rows that move, packed from row 0), a unit of
``BLOCK_R`` rows at a time, find each row's segment with a vectorized compare against the tables
and copy the row:

- combine: ``out[j] = in[rank_major_row(j)]`` (a gather; program 0 also writes ``counts_out``);
- split:   ``out[rank_major_row(j)] = in[j]`` (a scatter of whole rows; every destination row is
  written by exactly one source row).

Walking the moved rows (not the rank-major buffer) keeps the work proportional to the rows that
move: in the padded layout the buffer is ``EP`` times larger than what the local experts own.
With ``init_with_zeros``, split then zero-fills the rank-major rows no segment covers (a second,
store-only walk). Rows move as raw bits (integer views), so any 1/2/4-byte dtype works, FP8
included. A row whose computed partner falls outside ``[0, T)`` (inconsistent counts) is skipped
rather than read or written out of bounds.

Each unit moves its rows whole: ``[BLOCK_R, W_MAIN]`` chunks (4 KB of a row) plus a
``[BLOCK_R, W_TAIL]`` chunk for the ``D % W_MAIN`` tail columns, so D = 5120 bf16 is
2 x 2048 + 1024 columns with no masked lanes; up to ``_UNROLL_MAX`` main chunks, every chunk is
loaded before the first is stored (the whole row in flight), longer rows loop. The
grid has one program per unit up to ``_MAX_PROGRAMS_PER_SM`` per SM (the hardware schedules the
waves; a grid-stride loop covers larger buffers); programs left without a unit (the padded
layout's buffer is larger than what moves) stop after reading the counts of the local experts.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
# Bytes of a row one main chunk covers, and rows per unit. Measured on the H200 (EP=8, T=4096,
# D=5120 bf16): 4 KB chunks, 8 programs per SM of 4 warps beat 8 KB / 16 / 8 warps by 2-7%
# (padded combine 25.6 vs 27.6 µs, split 25.3 vs 26.6). One row per unit measured 1-2% faster at
# T = 4096 but 6% slower at T = 16384 (97.7 vs 91.4 µs): two rows stay.
_CHUNK_BYTES = 4096
_ROWS_PER_UNIT = 2
# Budget for the [BLOCK_R, segments] lookup tile held in registers.
_LOOKUP_ELEMS = 4096
# Grid cap (programs per SM); past it, programs loop over units.
_MAX_PROGRAMS_PER_SM = 8
# Rows of at most this many main chunks are loaded whole before they are stored (unrolled:
# ``N_MAIN`` > 0; 0 is a loop of load-store steps).
_UNROLL_MAX = 4


@triton.jit
def _partner_rows(rows, look, look_end, delta):
    """For each row, ``row + delta[s]`` of the segment ``s`` with ``look[s] <= row < look_end[s]``,
    or -1 when no segment covers it. ``rows`` is ``[BLOCK_R]``; the tables are ``[1, EP, EG]``
    (3-D rather than flattened: reshapes of scanned tensors trip a layout bug in the Triton 3.6
    scan lowering on some small shapes)."""
    r3 = rows[:, None, None]
    hit = (r3 >= look) & (r3 < look_end)
    return tl.max(tl.max(tl.where(hit, r3 + delta, -1), axis=2), axis=1)


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
    W_MAIN: tl.constexpr,
    W_TAIL: tl.constexpr,
    N_MAIN: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, BLOCK_EP)
    rm = r < EP
    g = tl.arange(0, BLOCK_EG)
    gm = g < EG
    C = tl.load(
        counts_ptr + r[:, None] * stride_cr + (start + g)[None, :] * stride_ce,
        mask=rm[:, None] & gm[None, :],
        other=0,
    ).to(tl.int32)  # [BLOCK_EP, BLOCK_EG] rows per (rank, local expert)
    per_expert = tl.sum(C, axis=0)  # [BLOCK_EG]
    total = tl.sum(per_expert, axis=0)
    if COMBINE:
        first = pid == 0
        tl.store(counts_out_ptr + g, per_expert, mask=gm & first)
        tl.store(counts_out_ptr + EG, total, mask=first)

    n_rows = tl.minimum(total, T)  # expert-major rows that move
    n_units = tl.cdiv(n_rows, BLOCK_R)
    if ZERO_FILL:
        n_work = tl.maximum(n_units, tl.cdiv(T, BLOCK_R))
    else:
        n_work = n_units
    if pid < n_work:
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
        rank_major = pre[:, None] + tl.cumsum(C, axis=1) - C
        if PADDED:
            rank_major += (r * rows_per_rank)[:, None]
        else:
            rank_major += (tl.cumsum(tot, axis=0) - tot)[:, None]
        expert_major = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(C, axis=0) - C

        em = expert_major[None, :, :]
        em_end = (expert_major + C)[None, :, :]
        e2r = (rank_major - expert_major)[None, :, :]
        d_lim = (D // 8) * 8
        if N_MAIN > 0:
            d_main = N_MAIN * W_MAIN
        else:
            d_main = (D // W_MAIN) * W_MAIN
        for u in range(pid, n_units, nprog):
            rows = u * BLOCK_R + tl.arange(0, BLOCK_R)  # expert-major rows
            other = _partner_rows(rows, em, em_end, e2r)  # their rank-major rows
            ok = (rows < n_rows) & (other >= 0) & (other < T)
            if COMBINE:
                src = other
                dst = rows
            else:
                src = rows
                dst = other
            s_row = in_ptr + (src.to(tl.int64) * (stride_in // 8) * 8)[:, None]
            d_row = out_ptr + (dst.to(tl.int64) * (stride_out // 8) * 8)[:, None]
            if W_TAIL > 0:
                tc = d_main + tl.arange(0, W_TAIL)
                tmask = ok[:, None] & (tc < d_lim)[None, :]
                tv = tl.load(s_row + tc[None, :], mask=tmask, other=0, eviction_policy="evict_first")
            if N_MAIN > 0:
                # The whole row in flight: every chunk's load before the first store.
                chunks = ()
                for i in tl.static_range(N_MAIN):
                    cols = i * W_MAIN + tl.arange(0, W_MAIN)
                    m = ok[:, None] & (cols < d_lim)[None, :]
                    chunks = chunks + (tl.load(s_row + cols[None, :], mask=m, other=0, eviction_policy="evict_first"),)
                for i in tl.static_range(N_MAIN):
                    cols = i * W_MAIN + tl.arange(0, W_MAIN)
                    tl.store(d_row + cols[None, :], chunks[i], mask=ok[:, None] & (cols < d_lim)[None, :])
            else:
                for d0 in range(0, d_main, W_MAIN):
                    cols = d0 + tl.arange(0, W_MAIN)
                    m = ok[:, None] & (cols < d_lim)[None, :]
                    v = tl.load(s_row + cols[None, :], mask=m, other=0, eviction_policy="evict_first")
                    tl.store(d_row + cols[None, :], v, mask=m)
            if W_TAIL > 0:
                tl.store(d_row + tc[None, :], tv, mask=tmask)

        if ZERO_FILL:
            # Rank-major rows that no moved row lands on.
            rmj = rank_major[None, :, :]
            rmj_end = (rank_major + C)[None, :, :]
            r2e = (expert_major - rank_major)[None, :, :]
            for u in range(pid, tl.cdiv(T, BLOCK_R), nprog):
                rows = u * BLOCK_R + tl.arange(0, BLOCK_R)
                j = _partner_rows(rows, rmj, rmj_end, r2e)
                empty = (rows < T) & ((j < 0) | (j >= n_rows))
                d_row = out_ptr + (rows.to(tl.int64) * (stride_out // 8) * 8)[:, None]
                zdt = out_ptr.dtype.element_ty
                if W_TAIL > 0:
                    tc = d_main + tl.arange(0, W_TAIL)
                    tmask = empty[:, None] & (tc < d_lim)[None, :]
                    tl.store(d_row + tc[None, :], tl.zeros((BLOCK_R, W_TAIL), dtype=zdt), mask=tmask)
                for d0 in range(0, d_main, W_MAIN):
                    cols = d0 + tl.arange(0, W_MAIN)
                    m = empty[:, None] & (cols < d_lim)[None, :]
                    tl.store(d_row + cols[None, :], tl.zeros((BLOCK_R, W_MAIN), dtype=zdt), mask=m)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _config(T: int, D: int, elem_size: int, segments: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, W_MAIN, W_TAIL, programs, num_warps) from shape buckets."""
    w_main = min(_pow2_floor(max(D, 8)), max(8, _CHUNK_BYTES // elem_size))
    rem = D % w_main
    w_tail = next_pow2(rem) if rem else 0
    block_r = max(1, min(_ROWS_PER_UNIT, _LOOKUP_ELEMS // segments))
    units = cdiv(max(T, 1), block_r)
    programs = max(1, min(units, _MAX_PROGRAMS_PER_SM * num_sms(device)))
    tile_bytes = block_r * (w_main + w_tail) * elem_size
    # Warps for the data tile (16 B vectors, several per lane) and for the lookup tables.
    warps = _pow2_floor(max(1, min(8, max(tile_bytes // 2048, block_r * segments // 512, segments // 128))))
    return block_r, w_main, w_tail, programs, warps


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
    block_r, w_main, w_tail, programs, warps = _config(T, D, tokens.element_size(), block_ep * block_eg, device)
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
        W_MAIN=w_main,
        W_TAIL=w_tail,
        N_MAIN=D // w_main if D // w_main <= _UNROLL_MAX else 0,
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
