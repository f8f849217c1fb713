"""Triton kernel: expert-parallel shuffling, rank-major <-> expert-major (combine / split).

One launch per op. Every program turns the small ``[EP, E]`` counts into tables over the
``EP x EG`` (rank, local expert) segments: their lengths, where each starts on the expert-major
side and where it starts on the rank-major side (dense or padded layout). Both ops walk their
**source** rows, ``i < min(total, T)`` (the rows that move), a unit of ``BLOCK_R`` rows at a
time, and find each row's destination with a vectorized compare against the tables:

- split: the sources are the expert-major rows, packed from row 0 (``src = i``); each lands on
  its rank-major row (a scatter of whole rows; every destination row is written once);
- combine: the sources are each rank's block of local-expert rows, in rank order: ``src = i``
  when every expert is local in the dense layout, otherwise a compare against ``EP`` per-rank
  blocks (cheap: no scan) gives it; each lands on its expert-major row (program 0 also writes
  ``counts_out``).

The source row is known before the destination, so a row's loads never wait for the lookup:
rows of up to ``_UNROLL_MAX`` main chunks are held whole in registers, the first unit loaded as
soon as its source rows are known (dense split / all-local combine: before the counts are even
read) and overlapping the table scans, and every later unit loaded one step ahead: before the
current unit's stores (``_PIPELINE``) or right after them. Longer rows move chunk by chunk.
Walking the moved rows (not the rank-major buffer) keeps the work proportional to them: in the
padded layout the buffer is ``EP`` times larger than what the local experts own.

With ``init_with_zeros``, split then zero-fills the rank-major rows no segment covers (a second,
store-only walk). Rows move as raw bits (integer views), so any 1/2/4-byte dtype works, FP8
included. A row whose computed partner falls outside the buffer (inconsistent counts) is
skipped rather than read or written out of bounds; with inconsistent counts (a rank sending more
than ``T // EP`` rows in the padded layout, or more rows than the buffer holds) the rows moved are
unspecified, never out of bounds.

A unit's row is ``[BLOCK_R, W_MAIN]`` chunks (4 KB of a row) plus a ``[BLOCK_R, W_TAIL]`` chunk
for the ``D % W_MAIN`` tail columns, so D = 5120 bf16 is 2 x 2048 + 1024 columns with no masked
lanes. The grid has one program per unit up to ``_MAX_PROGRAMS_PER_SM`` per SM (the hardware
schedules the waves; a grid-stride loop covers larger buffers); programs left without a unit
(the padded layout's buffer is larger than what moves) stop after reading the local counts.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
# Bytes of a row one main chunk covers, rows per unit, programs per SM. Measured on the H200
# (D = 5120 bf16, benchmarks/sweep_memory.py --ops shuffle_walks, RESULTS.md run 22): one row per
# unit, pipelined, 16 programs per SM of 2 warps was in the best three of 13 of the 16 (op,
# layout, EP, T) cells and at least 83% of the copy floor in all of them; two rows per unit of 4
# warps (the previous buckets) fell to 80-82% at T = 4096 once pipelined (2 x 20 KB held per
# program: 115 registers, 4 programs resident per SM).
_CHUNK_BYTES = 4096
_ROWS_PER_UNIT = 1
# Budget for the [BLOCK_R, segments] lookup tile held in registers.
_LOOKUP_ELEMS = 4096
# Grid cap (programs per SM; more than are resident at once: the hardware schedules the rest);
# past it, programs loop over units.
_MAX_PROGRAMS_PER_SM = 16
# Rows of at most this many main chunks are loaded whole before they are stored (unrolled:
# ``N_MAIN`` > 0; 0 is a loop of load-store steps).
_UNROLL_MAX = 4
# Rows held whole: the next unit's loads go out before this unit's stores (two units in flight
# per program) rather than after them. Pipelined measured 1-6% faster at T = 4096 (run 22).
# Tests pin these two as the knobs ``UNROLL_MAX`` and ``PIPELINE`` (``moekit.settings``).
_PIPELINE = True


@triton.jit
def _partner_rows(rows, look, look_end, delta):
    """For each row, ``row + delta[s]`` of the segment ``s`` with ``look[s] <= row < look_end[s]``,
    or -1 when no segment covers it. ``rows`` is ``[BLOCK_R]``; the tables are ``[1, EP, EG]``
    (3-D rather than flattened: reshapes of scanned tensors trip a layout bug in the Triton 3.6
    scan lowering on some small shapes)."""
    r3 = rows[:, None, None]
    hit = (r3 >= look) & (r3 < look_end)
    return tl.max(tl.max(tl.where(hit, r3 + delta, -1), axis=2), axis=1)


@triton.jit
def _source_rows(i, IDENTITY: tl.constexpr, blk_beg, blk_len, blk_src):
    """Source row of the walked index ``i`` (``[BLOCK_R]``): ``i`` itself (split, and combine of
    the dense layout with every expert local), or for combine ``blk_src[r] + i - blk_beg[r]`` of
    the rank ``r`` whose local block ``[blk_beg[r], blk_beg[r] + blk_len[r])`` holds ``i`` (-1
    when none does); the tables are ``[BLOCK_EP]``."""
    if IDENTITY:
        src = i
    else:
        i2 = i[:, None]
        hit = (i2 >= blk_beg[None, :]) & (i2 < (blk_beg + blk_len)[None, :])
        src = tl.max(tl.where(hit, i2 - blk_beg[None, :] + blk_src[None, :], -1), axis=1)
    return src


@triton.jit
def _load_chunks(s_row, ok, d_lim, W_MAIN: tl.constexpr, W_TAIL: tl.constexpr, N_MAIN: tl.constexpr):
    """The ``[BLOCK_R, W_MAIN]`` main chunks of the rows at ``s_row`` then the tail chunk, as a
    tuple of tiles: every load issued before any is used."""
    chunks = ()
    for c in tl.static_range(N_MAIN):
        cols = c * W_MAIN + tl.arange(0, W_MAIN)
        m = ok[:, None] & (cols < d_lim)[None, :]
        chunks = chunks + (tl.load(s_row + cols[None, :], mask=m, other=0, eviction_policy="evict_first"),)
    if W_TAIL > 0:
        tc = N_MAIN * W_MAIN + tl.arange(0, W_TAIL)
        m = ok[:, None] & (tc < d_lim)[None, :]
        chunks = chunks + (tl.load(s_row + tc[None, :], mask=m, other=0, eviction_policy="evict_first"),)
    return chunks


@triton.jit
def _store_chunks(d_row, chunks, ok, d_lim, W_MAIN: tl.constexpr, W_TAIL: tl.constexpr, N_MAIN: tl.constexpr):
    for c in tl.static_range(N_MAIN):
        cols = c * W_MAIN + tl.arange(0, W_MAIN)
        tl.store(d_row + cols[None, :], chunks[c], mask=ok[:, None] & (cols < d_lim)[None, :])
    if W_TAIL > 0:
        tc = N_MAIN * W_MAIN + tl.arange(0, W_TAIL)
        tl.store(d_row + tc[None, :], chunks[N_MAIN], mask=ok[:, None] & (tc < d_lim)[None, :])


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
    ALL_EXPERTS: tl.constexpr = False,
    PIPELINE: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s_stride = (stride_in // 8) * 8
    d_stride = (stride_out // 8) * 8
    d_lim = (D // 8) * 8
    # The walked index i in [0, moved rows) is the source row itself for split and for combine
    # of the dense layout with every expert local; otherwise a cheap per-rank lookup gives it (the
    # padded layout's rank blocks start at r * rows_per_rank, whatever the counts).
    IDENTITY: tl.constexpr = (not COMBINE) or (ALL_EXPERTS and not PADDED)
    # Rows of up to N_MAIN main chunks are held whole in registers: their loads go out as soon as
    # the source rows are known, ahead of the tables and lookups that place them.
    HOLD: tl.constexpr = N_MAIN > 0
    i0 = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    if HOLD and IDENTITY and not PADDED:
        # Dense layout: every row moves, so the first unit's loads go out before the counts
        # are even read.
        v = _load_chunks(in_ptr + (i0.to(tl.int64) * s_stride)[:, None], i0 < T, d_lim, W_MAIN, W_TAIL, N_MAIN)
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

    n_rows = tl.minimum(total, T)  # rows that move
    n_units = tl.cdiv(n_rows, BLOCK_R)
    if HOLD and IDENTITY and PADDED:
        # The padded buffer is larger than what moves: load only rows that move.
        v = _load_chunks(in_ptr + (i0.to(tl.int64) * s_stride)[:, None], i0 < n_rows, d_lim, W_MAIN, W_TAIL, N_MAIN)
    if ZERO_FILL:
        n_work = tl.maximum(n_units, tl.cdiv(T, BLOCK_R))
    else:
        n_work = n_units
    if pid < n_work:
        # Per rank: rows for experts before `start` (offset of the local block inside the rank's
        # block) and, for the dense layout, rows over all experts (size of the rank's block).
        if ALL_EXPERTS:
            # The local experts are all of them: no offset, and C holds every count.
            pre = tl.zeros((BLOCK_EP,), dtype=tl.int32)
            tot = tl.sum(C, axis=1)
        else:
            pre = tl.zeros((BLOCK_EP,), dtype=tl.int32)
            tot = tl.zeros((BLOCK_EP,), dtype=tl.int32)
            e_stop = start if PADDED else E  # the padded layout needs only the offsets
            for e0 in range(0, e_stop, BLOCK_EC):
                e = e0 + tl.arange(0, BLOCK_EC)
                c = tl.load(
                    counts_ptr + r[:, None] * stride_cr + e[None, :] * stride_ce,
                    mask=rm[:, None] & (e < e_stop)[None, :],
                    other=0,
                ).to(tl.int32)
                tot += tl.sum(c, axis=1)
                pre += tl.sum(tl.where((e < start)[None, :], c, 0), axis=1)
        if PADDED:
            base = r * rows_per_rank
        else:
            base = tl.cumsum(tot, axis=0) - tot
        # The local rows of rank r, rank-major: [base + pre, + local) (the combine's sources).
        local = tl.sum(C, axis=1)
        blk_beg = tl.cumsum(local, axis=0) - local
        blk_src = base + pre
        if HOLD and not IDENTITY:
            src0 = _source_rows(i0, IDENTITY, blk_beg, local, blk_src)
            ok0 = (i0 < n_rows) & (src0 >= 0) & (src0 < T)
            v = _load_chunks(in_ptr + (src0.to(tl.int64) * s_stride)[:, None], ok0, d_lim, W_MAIN, W_TAIL, N_MAIN)
        # Segment tables over (rank, local expert): where each starts rank-major and expert-major.
        rank_major = blk_src[:, None] + tl.cumsum(C, axis=1) - C
        expert_major = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(C, axis=0) - C
        if COMBINE:  # the destination of a rank-major source row
            look = rank_major[None, :, :]
            look_end = (rank_major + C)[None, :, :]
            delta = (expert_major - rank_major)[None, :, :]
            dst_lim = n_rows  # the expert-major rows, packed
        else:  # the destination of an expert-major source row
            look = expert_major[None, :, :]
            look_end = (expert_major + C)[None, :, :]
            delta = (rank_major - expert_major)[None, :, :]
            dst_lim = T  # anywhere in the rank-major buffer

        if HOLD:
            d_main = N_MAIN * W_MAIN
        else:
            d_main = (D // W_MAIN) * W_MAIN
        for u in range(pid, n_units, nprog):
            i = u * BLOCK_R + tl.arange(0, BLOCK_R)
            src = _source_rows(i, IDENTITY, blk_beg, local, blk_src)
            dst = _partner_rows(src, look, look_end, delta)
            ok = (i < n_rows) & (src >= 0) & (src < T) & (dst >= 0) & (dst < dst_lim)
            d_row = out_ptr + (dst.to(tl.int64) * d_stride)[:, None]
            if HOLD:
                # The rows were loaded ahead (the first unit above, every other one by the
                # previous step); load the next unit's, then store these, or the other way round.
                nxt = i + nprog * BLOCK_R
                s_nxt = _source_rows(nxt, IDENTITY, blk_beg, local, blk_src)
                ok_nxt = (nxt < n_rows) & (s_nxt >= 0) & (s_nxt < T)
                p_nxt = in_ptr + (s_nxt.to(tl.int64) * s_stride)[:, None]
                if PIPELINE:
                    v_nxt = _load_chunks(p_nxt, ok_nxt, d_lim, W_MAIN, W_TAIL, N_MAIN)
                    _store_chunks(d_row, v, ok, d_lim, W_MAIN, W_TAIL, N_MAIN)
                    v = v_nxt
                else:
                    _store_chunks(d_row, v, ok, d_lim, W_MAIN, W_TAIL, N_MAIN)
                    v = _load_chunks(p_nxt, ok_nxt, d_lim, W_MAIN, W_TAIL, N_MAIN)
            else:
                # Long rows: chunk by chunk.
                s_row = in_ptr + (src.to(tl.int64) * s_stride)[:, None]
                if W_TAIL > 0:
                    tc = d_main + tl.arange(0, W_TAIL)
                    tmask = ok[:, None] & (tc < d_lim)[None, :]
                    tv = tl.load(s_row + tc[None, :], mask=tmask, other=0, eviction_policy="evict_first")
                for d0 in range(0, d_main, W_MAIN):
                    cols = d0 + tl.arange(0, W_MAIN)
                    m = ok[:, None] & (cols < d_lim)[None, :]
                    x = tl.load(s_row + cols[None, :], mask=m, other=0, eviction_policy="evict_first")
                    tl.store(d_row + cols[None, :], x, mask=m)
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
                d_row = out_ptr + (rows.to(tl.int64) * d_stride)[:, None]
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
    warps = _pow2_floor(max(1, min(8, max(tile_bytes // 3072, block_r * segments // 512, segments // 128))))
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
    s = settings.get()
    n_main = D // w_main if D // w_main <= s.knob("UNROLL_MAX", _UNROLL_MAX) else 0
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
        N_MAIN=n_main,
        ALL_EXPERTS=start == 0 and end == E,
        PIPELINE=s.knob("PIPELINE", _PIPELINE),
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
