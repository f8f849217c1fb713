"""Triton kernels of ``route_and_shuffle``: router logits to the sorted row layout.

Up to ``settings.route_fused_max_t`` tokens one program routes every token (one launch: the
decode critical path), in sub-tiles of ``BT`` tokens x ``BLOCK_E`` experts:

1. scores in float32 (sigmoid / softmax / the logits themselves for top-k softmax), the
   correction bias added for selection, DeepSeek's group mask (a group's score is the sum of its
   top two; the ``TOPK_GROUP`` best groups stay), then the top-k by unique integer keys (value
   descending, expert ascending: ``moekit.ops._triton.routing``'s keys and rounds);
2. each selection's weight (the unbiased score, or the softmax over the k logits; renormalized,
   scaled) and its rank among the earlier tokens' selections of its expert (a running count
   per expert carried across sub-tiles plus a cumulative sum down the sub-tile), packed
   ``rank << 16 | expert`` into a scratch row per (token, slot);
3. after a barrier, the expert bases (exclusive scan of the counts) place every selection at
   ``base[e] + rank``: expert, token and weight of each sorted row, ``-1`` / 0 in the tail, and
   the selection's row itself (the token-major inverse map).

Larger batches split step 1-2 over programs of ``tokens_per_block`` tokens each (``SPLIT``: ranks
counted within the block, the block's expert counts stored as one row of a ``[blocks, HS]``
table), and a last launch (``_route_place_kernel``, one program per block, PDL-chained) scans the
table (expert totals -> bases; the blocks before its own -> its offsets) and places the block's
rows; with many blocks ``routing._scan_blocks_kernel`` scans the table between the two, so that
the placing programs read one row each. One program routing 256 tokens took 103 µs at E = 128
(H200, 16 serial sub-tiles of K rounds of row reductions); the split path runs the sub-tiles side
by side on narrow programs (``split_plan``).

The ranks count earlier tokens only, so rows of an expert come in token order and the result is
bitwise the layout of ``index_shuffling`` (no atomics anywhere). Programs past the routing ones
zero an optional buffer (the routed output that the down GEMM scatter-adds into): the memset
needs no launch of its own.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2
from moekit.ops._triton._fp8 import EMULATE_FP8
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.route_quant import QUANT_RIDE_MAX, QUANT_RIDE_MAX_CHUNKS, _quant_row, quant_chunk
from moekit.reference.quantize import DEFAULT_EPS
from moekit.ops._triton.route_select import SCORE_CODES, _select_topk
from moekit.ops._triton.routing import (
    FUSED_SCAN_MAX,
    FUSED_SCAN_TOTAL,
    SCAN_CB,
    SCAN_EC,
    _block_offsets,
    _scan_blocks_kernel,
)

# Largest expert count / top-k the kernels take (the launcher falls back to the multi-launch
# composite beyond: dense scores with torch ops, then ``index_shuffling``).
ROUTE_MAX_E = 512
ROUTE_MAX_K = 16
# The split path (more than ``settings.route_fused_max_t`` tokens): blocks of tokens side by side,
# at least ``SPLIT_TARGET`` of them while a block is one token, sub-tiles of about
# ``ROUTE_SPLIT_TILE`` (tokens x experts) elements on at most ``ROUTE_SPLIT_WARPS`` warps (a
# token's top-k rounds are row reductions: across warps they go through shared memory and
# barriers), at most ``SPLIT_MAX_BLOCKS`` blocks before a block takes several sub-tiles. The
# placing programs scan the blocks' count rows themselves while all of them together read at most
# ``routing.FUSED_SCAN_TOTAL`` entries, else a column-scan launch runs between. Tests pin these as
# the knobs of the same names (``moekit.settings``).
SPLIT_TARGET = 64
ROUTE_SPLIT_TILE = 2048
ROUTE_SPLIT_WARPS = 8
SPLIT_MAX_BLOCKS = 1024
# Elements of one sub-tile (tokens x experts) on the one-program path, and of one zeroing program.
ROUTE_TILE = 2048
ZERO_BLOCK = 8192
# Largest buffer the routing launch zeroes with extra programs; larger ones take a memset before
# it. The extra programs share the routing programs' registers (one 8-warp program per SM), so a
# big buffer took many waves: DeepSeek-V3 TP8's 8192 x 7168 bf16 output made the launch 329 µs
# against 52 µs without it (H200, session 14).
ZERO_RIDE_MAX = 128 * ZERO_BLOCK
# A row's rank within its token block is packed into 15 bits (``rank << 16 | expert``).
_PACKED_RANK_LIMIT = 1 << 15


@triton.jit
def _place_rows(packed_ptr, pw_ptr, eidx_ptr, tidx_ptr, rw_ptr, srow_ptr, off, r_begin, r_end, N, n_rows, start,
                K: tl.constexpr, RB: tl.constexpr):  # fmt: skip
    """Selections ``[r_begin, min(r_end, N))``: each packed ``rank << 16 | expert`` to sorted row
    ``off[expert] + rank`` (expert, token, weight; the selection's row in ``srow``), and the ``-1``
    / 0 tail at the rows ``>= n_rows`` of the range. Loads and stores in this helper alone (the
    mutation analysis of torch.compile follows stores through helpers; see ``routing``)."""
    for r0 in range(r_begin, r_end, RB):
        r = r0 + tl.arange(0, RB)
        m = (r < N) & (r < r_end)
        p = tl.load(packed_ptr + r, mask=m, other=-1)
        wv = tl.load(pw_ptr + r, mask=m, other=0.0)
        ok = p >= 0
        e = tl.where(ok, p & 65535, 0)
        dest = tl.gather(off, e, 0) + (p >> 16)
        tl.store(eidx_ptr + dest, e - start, mask=ok)
        tl.store(tidx_ptr + dest, r // K, mask=ok)
        tl.store(rw_ptr + dest, wv, mask=ok)
        tl.store(srow_ptr + r, tl.where(ok, dest, -1), mask=m)
        tail = m & (r >= n_rows)
        tl.store(eidx_ptr + r, -1, mask=tail)
        tl.store(tidx_ptr + r, -1, mask=tail)
        tl.store(rw_ptr + r, 0.0, mask=tail)


@triton.jit
def _zero_chunk(zero_ptr, chunk, zero_numel, ZB: tl.constexpr):
    """Zero elements ``[chunk * ZB, (chunk + 1) * ZB)`` of ``zero_ptr`` (the programs past the
    routing ones: the routed output's memset rides along)."""
    offs = chunk.to(tl.int64) * ZB + tl.arange(0, ZB)
    tl.store(zero_ptr + offs, tl.zeros([ZB], dtype=zero_ptr.dtype.element_ty), mask=offs < zero_numel)


@triton.jit
def _finish_routing(carry, cols, col_ok, pid, bcounts_ptr, counts_ptr, packed_ptr, pw_ptr, eidx_ptr, tidx_ptr,
                    rw_ptr, srow_ptr, T, E, HS, start, SPLIT: tl.constexpr, K: tl.constexpr, RB: tl.constexpr):  # fmt: skip
    """After a routing program's tokens: ``SPLIT``, its expert counts ``carry`` as row ``pid`` of
    ``bcounts [blocks, HS]`` (``HS``: E rounded up to 16, zeros past E; ``_route_place_kernel``
    places the rows); else (one program for every token) the counts, then every row placed at its
    expert's base plus its rank."""
    if SPLIT:
        tl.store(bcounts_ptr + pid.to(tl.int64) * HS + cols, carry, mask=cols < HS)
    else:
        n_rows = tl.sum(carry, axis=0)
        tl.store(counts_ptr + cols, carry, mask=col_ok)
        tl.store(counts_ptr + E, T)
        tl.store(counts_ptr + E + 1, n_rows)
        base = tl.cumsum(carry, axis=0) - carry
        tl.debug_barrier()  # every scratch row written before any is read back
        _place_rows(packed_ptr, pw_ptr, eidx_ptr, tidx_ptr, rw_ptr, srow_ptr, base, 0, T * K, T * K, n_rows,
                    start, K, RB)  # fmt: skip


@triton.jit(do_not_specialize=["T", "start", "end", "zero_numel", "n_route", "tokens_per_block", "n_zero", "q_rows",
                               "q_cols", "q_stride"])  # fmt: skip
def _route_fused_kernel(
    logits_ptr,
    bias_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    rw_ptr,
    srow_ptr,
    packed_ptr,
    pw_ptr,
    bcounts_ptr,
    zero_ptr,
    qx_ptr,
    qq_ptr,
    qs_ptr,
    T,
    E,
    start,
    end,
    stride_t,
    stride_e,
    scale,
    zero_numel,
    n_route,
    tokens_per_block,
    HS,
    n_zero,
    q_rows,
    q_cols,
    q_stride,
    q_eps,
    K: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    NG: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SPLIT: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_PAD: tl.constexpr,
    RB: tl.constexpr,
    ZB: tl.constexpr,
    HAS_QUANT: tl.constexpr = False,
    QC: tl.constexpr = 16,
    MAX_FP8: tl.constexpr = 448.0,
    EMULATE: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """``SPLIT`` False: program 0 routes every token and places the rows (the one-launch path);
    True: program ``b < n_route`` routes tokens ``[b * tokens_per_block, (b + 1) *
    tokens_per_block)`` only (sub-tiles of ``BT``), its ranks counting from 0, and stores its
    expert counts as row ``b`` of ``bcounts [n_route, HS]`` (``_route_place_kernel`` places the
    rows). The programs after them, in this order: ``n_zero`` zero ``zero_ptr`` (``HAS_ZERO``),
    ``q_rows`` quantize one row of ``qx_ptr`` each into ``qq_ptr`` / ``qs_ptr`` (``HAS_QUANT``:
    ``quantize_fp8_row``'s bits)."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    extra = pid - n_route
    if HAS_ZERO:
        if (extra >= 0) & (extra < n_zero):
            _zero_chunk(zero_ptr, extra, zero_numel, ZB)
        extra -= n_zero
    if HAS_QUANT:
        if (extra >= 0) & (extra < q_rows):
            _quant_row(qx_ptr, qq_ptr, qs_ptr, extra, q_cols, q_stride, tl.cast(q_eps, tl.float32), QC, MAX_FP8,
                       EMULATE)  # fmt: skip
    if pid < n_route:
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        in_range = (cols >= start) & (cols < end)
        slots = tl.arange(0, K_PAD)
        slot_ok = slots < K
        bias = tl.zeros([BLOCK_E], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        carry = tl.zeros([BLOCK_E], dtype=tl.int32)
        if SPLIT:
            t_begin = pid * tokens_per_block
            t_end = tl.minimum(t_begin + tokens_per_block, T)
        else:
            t_begin = 0
            t_end = T
        for t0 in range(t_begin, t_end, BT):
            rows = t0 + tl.arange(0, BT)
            row_ok = rows < t_end
            ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_e
            l = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            key, thr, ids, w, ok = _select_topk(l, cols, col_ok, bias, slots, slot_ok, row_ok, scale, K, SCORE,
                                                HAS_BIAS, RENORM, NG, TOPK_GROUP, BT, BLOCK_E, K - 1, True)  # fmt: skip
            picked = (key >= thr[:, None]) & row_ok[:, None] & in_range[None, :]
            one = picked.to(tl.int32)
            before = tl.cumsum(one, axis=0) - one + carry[None, :]
            rank = tl.gather(before, ids, 1)
            valid = ok & (ids >= start) & (ids < end)
            r = rows.to(tl.int64)[:, None] * K + slots[None, :]
            tl.store(packed_ptr + r, tl.where(valid, (rank << 16) | ids, -1), mask=ok)
            tl.store(pw_ptr + r, w, mask=ok)
            carry += tl.sum(one, axis=0)
        _finish_routing(carry, cols, col_ok, pid, bcounts_ptr, counts_ptr, packed_ptr, pw_ptr, eidx_ptr, tidx_ptr,
                        rw_ptr, srow_ptr, T, E, HS, start, SPLIT, K, RB)  # fmt: skip


@triton.jit(do_not_specialize=["T", "start", "n_blocks", "tokens_per_block"])
def _route_place_kernel(
    bcounts_ptr,
    packed_ptr,
    pw_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    rw_ptr,
    srow_ptr,
    T,
    E,
    HS,
    start,
    n_blocks,
    tokens_per_block,
    K: tl.constexpr,
    FUSED_SCAN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CB: tl.constexpr,
    RB: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """The last launch of the split path, program ``b`` for token block ``b``: the expert totals
    (their exclusive scan = the expert bases) and the rows of the blocks before ``b`` (its offset
    in each expert), then block ``b``'s selections placed at ``base[e] + offset[e] + rank`` and the
    ``-1`` tail of its own range of rows. ``FUSED_SCAN``: summed here from the ``n_blocks`` count
    rows (program 0 stores the counts); else ``_scan_blocks_kernel`` left the offsets in
    ``bcounts`` and the totals in ``counts``. Program 0 stores ``counts[E:E + 2]``."""
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    tot, pre = _block_offsets(bcounts_ptr, counts_ptr, n_blocks, HS, b, cols, col_ok, FUSED_SCAN, BLOCK_E, CB)
    n_rows = tl.sum(tot, axis=0)
    if b == 0:
        tl.store(counts_ptr + E, T)
        tl.store(counts_ptr + E + 1, n_rows)
    off = tl.cumsum(tot, axis=0) - tot + pre
    r_begin = b * (tokens_per_block * K)
    _place_rows(packed_ptr, pw_ptr, eidx_ptr, tidx_ptr, rw_ptr, srow_ptr, off, r_begin,
                r_begin + tokens_per_block * K, T * K, n_rows, start, K, RB)  # fmt: skip


@triton.jit(do_not_specialize=["T", "start", "end", "zero_numel", "n_route", "tokens_per_block"])
def _topk_rows_kernel(
    ids_ptr,
    w_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    rw_ptr,
    srow_ptr,
    packed_ptr,
    pw_ptr,
    bcounts_ptr,
    zero_ptr,
    T,
    E,
    start,
    end,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    zero_numel,
    n_route,
    tokens_per_block,
    HS,
    K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SPLIT: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_PAD: tl.constexpr,
    RB: tl.constexpr,
    ZB: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """``shuffle_top_k``'s first launch: a given choice (ids and weights ``[T, K]``) instead of
    scores. As ``_route_fused_kernel`` otherwise: ``SPLIT`` False, program 0 takes every token
    and places the rows; True, program ``b < n_route`` takes ``tokens_per_block`` tokens and
    stores its expert counts as row ``b`` of ``bcounts`` (``_route_place_kernel`` places them).
    A slot is a row when its id lies in ``[start, end)``; a token naming an expert twice gets
    two rows, the later slot ranked after the earlier one. Programs from ``n_route`` on zero
    ``zero_ptr``."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if HAS_ZERO and pid >= n_route:
        _zero_chunk(zero_ptr, pid - n_route, zero_numel, ZB)
    if pid < n_route:
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        slots = tl.arange(0, K_PAD)
        slot_ok = slots < K
        carry = tl.zeros([BLOCK_E], dtype=tl.int32)
        if SPLIT:
            t_begin = pid * tokens_per_block
            t_end = tl.minimum(t_begin + tokens_per_block, T)
        else:
            t_begin = 0
            t_end = T
        for t0 in range(t_begin, t_end, BT):
            rows = t0 + tl.arange(0, BT)
            r64 = rows.to(tl.int64)
            ok = (rows < t_end)[:, None] & slot_ok[None, :]
            raw = tl.load(ids_ptr + r64[:, None] * stride_it + slots[None, :] * stride_ik, mask=ok, other=-1)
            valid = ok & (raw >= start) & (raw < end)
            ids = tl.where(valid, raw, -1).to(tl.int32)  # -1 matches no expert column
            w = tl.load(w_ptr + r64[:, None] * stride_wt + slots[None, :] * stride_wk, mask=ok, other=0.0)
            # Rows per (token, expert) in this sub-tile (2 where a token names an expert twice).
            cnt = tl.zeros([BT, BLOCK_E], dtype=tl.int32)
            for j in tl.static_range(K):
                idj = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
                cnt += (idj[:, None] == cols[None, :]).to(tl.int32)
            # The token's earlier slots naming the same expert rank before this one.
            same = (ids[:, :, None] == ids[:, None, :]) & (slots[None, None, :] < slots[None, :, None])
            dup = tl.sum(same.to(tl.int32), axis=2)
            before = tl.cumsum(cnt, axis=0) - cnt + carry[None, :]
            rank = tl.gather(before, tl.where(valid, ids, 0), 1) + dup
            r = r64[:, None] * K + slots[None, :]
            tl.store(packed_ptr + r, tl.where(valid, (rank << 16) | ids, -1), mask=ok)
            tl.store(pw_ptr + r, w.to(tl.float32), mask=ok)
            carry += tl.sum(cnt, axis=0)
        _finish_routing(carry, cols, col_ok, pid, bcounts_ptr, counts_ptr, packed_ptr, pw_ptr, eidx_ptr, tidx_ptr,
                        rw_ptr, srow_ptr, T, E, HS, start, SPLIT, K, RB)  # fmt: skip


def quant_rides(T: int, E: int, top_k: int, rows: int, cols: int) -> bool:
    """Whether ``route_and_shuffle``'s launch for ``[T, E]`` logits quantizes ``[rows, cols]`` token
    rows with extra programs (else a ``quantize_fp8_row`` launch of its own pays more; see
    ``QUANT_RIDE_MAX_CHUNKS``)."""
    if rows == 0 or cols == 0 or rows * cols > QUANT_RIDE_MAX:
        return False
    return cdiv(cols, quant_chunk(cols, _route_warps(T, E, top_k))) <= QUANT_RIDE_MAX_CHUNKS


def _route_warps(T: int, E: int, top_k: int) -> int:
    """Warps of the routing launch's programs (``route_and_shuffle``'s rule)."""
    if T > settings.get().route_fused_max_t:
        return split_plan(T, E, top_k).warps
    return _one_program_plan(T, E)[1]


def _one_program_plan(T: int, E: int) -> tuple[int, int]:
    """``(tokens per sub-tile, warps)`` of the one-program path: one warp for a single token's row
    (no cross-warp reductions on the decode critical path)."""
    block_e = max(16, next_pow2(E))
    bt = max(1, min(next_pow2(max(T, 1)), ROUTE_TILE // block_e))
    return bt, max(1, min(8, bt * block_e // 256))


class SplitPlan(NamedTuple):
    """Launch shape of the split path: ``bt`` tokens per sub-tile, ``tpb`` per block (program),
    ``n`` blocks, ``warps`` per routing program, ``hs`` (E rounded up to 16: the count rows'
    stride), and whether the placing programs scan the count rows themselves (``fused_scan``)."""

    bt: int
    tpb: int
    n: int
    warps: int
    hs: int
    fused_scan: bool


def split_plan(T: int, E: int, top_k: int) -> SplitPlan:
    """The split path's shape (a pure function of the sizes and the pinned knobs). Sub-tiles of a
    power of two tokens, as small as keeps at least ``SPLIT_TARGET`` blocks while a block is one
    sub-tile (the per-block work is a few rounds of row reductions whose latency hardly depends on
    the sub-tile: more programs, less time) and at most ``ROUTE_SPLIT_TILE`` elements; past
    ``SPLIT_MAX_BLOCKS`` sub-tiles a block takes several (a power of two, fewer where a block's
    rows would not fit the packed 15-bit rank)."""
    knob = settings.get().knob
    block_e = max(16, next_pow2(E))
    tile = knob("ROUTE_SPLIT_TILE", ROUTE_SPLIT_TILE)
    bt = max(1, min(tile // block_e, next_pow2(max(1, cdiv(T, SPLIT_TARGET)))))
    iters = next_pow2(max(1, cdiv(cdiv(T, bt), knob("SPLIT_MAX_BLOCKS", SPLIT_MAX_BLOCKS))))
    while iters > 1 and bt * iters * top_k >= _PACKED_RANK_LIMIT:
        iters //= 2
    tpb = bt * iters
    n = cdiv(max(T, 1), tpb)
    hs = cdiv(E, 16) * 16
    warps = max(1, min(knob("ROUTE_SPLIT_WARPS", ROUTE_SPLIT_WARPS), bt * block_e // 256))
    return SplitPlan(bt, tpb, n, warps, hs, _fused_scan(n, hs))


def _fused_scan(n: int, hs: int) -> bool:
    """Whether the placing programs scan ``n`` count rows of ``hs`` entries themselves: while all
    of them together read at most ``FUSED_SCAN_TOTAL`` entries (else a column-scan launch)."""
    return n * hs <= settings.get().knob("FUSED_SCAN_MAX", FUSED_SCAN_MAX) and n * n * hs <= FUSED_SCAN_TOTAL


def kernel_supports(T: int, E: int, top_k: int, n_group: Optional[int]) -> bool:
    """Shapes the kernels take: ``E <= ROUTE_MAX_E``, ``top_k <= ROUTE_MAX_K``, and grouped
    routing with power-of-two groups filling E (any number of tokens)."""
    if E > ROUTE_MAX_E or top_k > ROUTE_MAX_K:
        return False
    if n_group is not None and n_group > 1:
        return E >= 16 and E == next_pow2(E) and n_group == next_pow2(n_group) and n_group <= E
    return True


def _outputs(E: int, N: int, dev: torch.device) -> tuple:
    """``(counts [E + 2], expert, token, weight, selection rows [N], packed scratch, weight scratch)``."""
    i32, f32 = torch.int32, torch.float32
    return (torch.empty(E + 2, dtype=i32, device=dev), torch.empty(N, dtype=i32, device=dev),
            torch.empty(N, dtype=i32, device=dev), torch.empty(N, dtype=f32, device=dev),
            torch.empty(N, dtype=i32, device=dev), torch.empty(N, dtype=i32, device=dev),
            torch.empty(N, dtype=f32, device=dev))  # fmt: skip


def _memset_if_large(zero_buffer: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A buffer past ``ZERO_RIDE_MAX`` elements zeroed here (None returned: no zeroing programs),
    a smaller one returned for the routing launch's extra programs."""
    if zero_buffer is not None and zero_buffer.numel() > settings.get().knob("ZERO_RIDE_MAX", ZERO_RIDE_MAX):
        zero_buffer.zero_()
        return None
    return zero_buffer


def _place(bcounts, packed, pw, counts, eidx, tidx, rw, srow, T: int, E: int, start: int, top_k: int,
           p: SplitPlan) -> None:  # fmt: skip
    """The split path's placing launch (``_route_place_kernel``, one program per token block),
    after the column scan of the count rows where ``p.fused_scan`` is false."""
    block_e = max(16, next_pow2(E))
    if not p.fused_scan:
        cb = min(settings.get().knob("SCAN_CB", SCAN_CB), max(16, next_pow2(p.n)))
        launch(_scan_blocks_kernel)[(p.hs // SCAN_EC,)](bcounts, counts, p.n, E, p.hs, EC=SCAN_EC, CB=cb, num_warps=4)
    launch(_route_place_kernel)[(p.n,)](
        bcounts, packed, pw, counts, eidx, tidx, rw, srow, T, E, p.hs, start, p.n, p.tpb,
        K=top_k, FUSED_SCAN=p.fused_scan, BLOCK_E=block_e, CB=max(1, min(next_pow2(p.n), 4096 // block_e)),
        RB=min(1024, max(16, next_pow2(p.tpb * top_k))), num_warps=4,
    )  # fmt: skip


def route_and_shuffle(
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    scale: float,
    start: int,
    end: int,
    zero_buffer: Optional[torch.Tensor],
    quant: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (validated arguments, shapes ``kernel_supports``). ``quant``: ``(x [R, C] 16-bit,
    q [R, C] e4m3fn, scale [R] float32)``, x's rows quantized into q / scale by extra programs
    (``quantize_fp8_row``'s bits, its default eps; any sizes, ``quant_rides`` says where it pays)."""
    T, E = (int(d) for d in logits.shape)
    dev = logits.device
    N = T * top_k
    counts, eidx, tidx, rw, srow, packed, pw = _outputs(E, N, dev)
    block_e = max(16, next_pow2(E))
    k_pad = next_pow2(top_k)
    split = T > settings.get().route_fused_max_t
    if split:
        p = split_plan(T, E, top_k)
        bt, tpb, n_route, warps = p.bt, p.tpb, p.n, p.warps
    else:
        (bt, warps), n_route, tpb = _one_program_plan(T, E), 1, T
    bcounts = torch.empty((n_route * p.hs) if split else (1,), dtype=torch.int32, device=dev)
    zero_buffer = _memset_if_large(zero_buffer)
    zero_numel = 0 if zero_buffer is None else zero_buffer.numel()
    ng = 1 if n_group is None else int(n_group)
    n_zero = cdiv(zero_numel, ZERO_BLOCK)
    qx, qq, qs = quant if quant is not None else (None, None, None)
    q_rows, q_cols = (int(qx.shape[0]), int(qx.shape[1])) if quant is not None else (0, 0)
    launch(_route_fused_kernel)[(n_route + n_zero + q_rows,)](
        logits, bias, counts, eidx, tidx, rw, srow, packed, pw, bcounts, zero_buffer, qx, qq, qs,
        T, E, start, end, logits.stride(0), logits.stride(1), float(scale), zero_numel, n_route, tpb,
        p.hs if split else 16, n_zero, q_rows, q_cols, qx.stride(0) if quant is not None else 0, DEFAULT_EPS,
        K=top_k, SCORE=SCORE_CODES[score_func], HAS_BIAS=bias is not None, RENORM=bool(renormalize),
        NG=ng, TOPK_GROUP=int(topk_group or 1), HAS_ZERO=zero_buffer is not None, SPLIT=split,
        BT=bt, BLOCK_E=block_e, K_PAD=k_pad, RB=min(1024, max(16, next_pow2(N))), ZB=ZERO_BLOCK,
        HAS_QUANT=q_rows > 0, QC=quant_chunk(q_cols, warps),
        MAX_FP8=FP8_MAX, EMULATE=EMULATE_FP8, num_warps=warps,
    )  # fmt: skip
    if split:
        _place(bcounts, packed, pw, counts, eidx, tidx, rw, srow, T, E, start, top_k, p)
    return counts, eidx, tidx, rw, srow


# shuffle_top_k: sub-tiles that one program takes in one launch (beyond: blocks of tokens side by
# side, then the placing launch); ranks within a block must fit the packed 15 bits.
TOPK_ROWS_FUSED_TILES = 4
# shuffle_top_k's split path: token blocks aimed at (knob TOPK_ROWS_BLOCKS). H100, session 30 run 3,
# `bench_routing.py --op shuffle_top_k` with 64 / 128 / 256 / 512 / 1024 / 2048, µs at T=16384:
# E=128 k=8 108.2 / 71.7 / 74.1 / 73.7 / 75.7 / 75.6, E=256 k=8 204.8 / 119.4 / 123.7 / 124.1 /
# 126.1 / 132.5, E=128 k=4 93.1 / 62.0 / 53.5 / 53.3 / 53.9 / 54.1, E=8 k=2 31.0 / 34.2 / 33.7 /
# 33.6 / 33.5 / 33.4 (its blocks are 2 sub-tiles at 64, one from 128); at T=2048 E=256 k=8 33.6
# -> 21.4-23.9, E=128 k=8 19.5 -> 15.3-15.6, E=128 k=4 17.3 -> 13.7, E=8 k=2 level.
TOPK_ROWS_TARGET = 256


@functools.lru_cache(maxsize=1024)
def _topk_rows_plan(T: int, E: int, top_k: int) -> tuple[int, bool, int, int]:
    """(sub-tile tokens, split, tokens per block, blocks) of ``shuffle_top_k`` for ``[T, top_k]``
    ids over ``E`` experts. Sub-tiles hold about ``ROUTE_TILE`` (token, expert) counts and at most
    4096 (token, slot, slot) comparisons; blocks of a power of two sub-tiles, about
    ``TOPK_ROWS_TARGET`` of them (knob ``TOPK_ROWS_BLOCKS``). At 64 blocks (sessions 11-29) 16384
    tokens left SMs idle behind 16 serial sub-tiles a block and ran slower than torch (H200,
    session 11: 160-243 µs against 130-168)."""
    block_e = max(16, next_pow2(E))
    k_pad = next_pow2(top_k)
    bt = max(1, min(next_pow2(max(T, 1)), ROUTE_TILE // block_e, 4096 // (k_pad * k_pad)))
    if T <= TOPK_ROWS_FUSED_TILES * bt:
        return bt, False, max(T, 1), 1
    tpb = max(bt, next_pow2(cdiv(T, settings.get().knob("TOPK_ROWS_BLOCKS", TOPK_ROWS_TARGET))))
    return bt, True, tpb, cdiv(T, tpb)


# Knobs feed the plan: a change drops its cached choices.
settings.on_change(_topk_rows_plan.cache_clear)


def topk_rows_supported(T: int, E: int, top_k: int) -> bool:
    """Shapes ``shuffle_top_k``'s kernels take: ``E <= ROUTE_MAX_E``, ``top_k <= ROUTE_MAX_K``, and
    every block's rows countable in the packed rank (about 4M rows)."""
    if E > ROUTE_MAX_E or top_k > ROUTE_MAX_K or T * top_k == 0:
        return False
    _, split, tpb, n = _topk_rows_plan(T, E, top_k)
    return tpb * top_k < _PACKED_RANK_LIMIT


def shuffle_top_k(
    ids: torch.Tensor,
    weights: torch.Tensor,
    E: int,
    start: int,
    end: int,
    zero_buffer: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher of ``shuffle_top_k`` (validated arguments, shapes ``topk_rows_supported``)."""
    T, top_k = (int(d) for d in ids.shape)
    dev = ids.device
    N = T * top_k
    counts, eidx, tidx, rw, srow, packed, pw = _outputs(E, N, dev)
    block_e = max(16, next_pow2(E))
    bt, split, tpb, n_route = _topk_rows_plan(T, E, top_k)
    hs = cdiv(E, 16) * 16
    bcounts = torch.empty((n_route * hs) if split else (1,), dtype=torch.int32, device=dev)
    zero_buffer = _memset_if_large(zero_buffer)
    zero_numel = 0 if zero_buffer is None else zero_buffer.numel()
    launch(_topk_rows_kernel)[(n_route + cdiv(zero_numel, ZERO_BLOCK),)](
        ids, weights, counts, eidx, tidx, rw, srow, packed, pw, bcounts, zero_buffer,
        T, E, start, end, ids.stride(0), ids.stride(1), weights.stride(0), weights.stride(1), zero_numel, n_route,
        tpb, hs, K=top_k, HAS_ZERO=zero_buffer is not None, SPLIT=split, BT=bt, BLOCK_E=block_e,
        K_PAD=next_pow2(top_k), RB=min(1024, max(16, next_pow2(N))), ZB=ZERO_BLOCK,
        num_warps=max(1, min(8, bt * block_e // 256)),
    )  # fmt: skip
    if split:
        _place(bcounts, packed, pw, counts, eidx, tidx, rw, srow, T, E, start, top_k,
               SplitPlan(bt, tpb, n_route, 0, hs, _fused_scan(n_route, hs)))  # fmt: skip
    return counts, eidx, tidx, rw, srow
