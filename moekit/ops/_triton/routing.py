"""Triton kernels: ``index_shuffling`` (fused top-k + per-expert count + stable sort).

Keys. Every score becomes one integer that orders by (value descending, expert ascending): the
float32 bits read as sign-magnitude and turned into two's complement (monotone; ``-0.0`` and
``+0.0`` both 0; every NaN magnitude clamped to one value above ``+inf`` and kept positive, as
``torch.sort`` orders them), shifted left by 16 bits, with ``65535 - expert`` in the low 16 bits.
Keys are unique within a row, so ``K`` rounds of "largest key below the previous round's" give
the top-k with ties to the lower expert index, and each round's expert comes back out of the low
bits. A round costs two integer operations per key: the smallest *unsigned* distance
``thr - 1 - key`` (keys at or above ``thr`` wrap around to huge distances). bf16 scores fit the
key in int32 (a bf16 value is a float32 with 16 zero low bits); fp16/fp32 scores use int64 keys.
The multi-program path loads padding (experts >= E, tokens past the valid count) as ``-inf``:
those keys rank below every real expert, so the keys need no mask.

Ranks. The ``K`` experts of one token are distinct, so a selection's row inside its expert is the
number of *earlier tokens* that picked the same expert. No atomics decide any order: the outputs
are bitwise deterministic.

Paths (chosen by :func:`plan` from the shapes only; no host sync, CUDA-graph safe):

- ``single``: one program holds all ``T`` tokens in one tile and does everything in one launch:
  top-k, histogram, exclusive scans (over experts for the bases, down the tokens for the ranks),
  a masked scatter of the selection tile, counts, the ``-1`` tail.
- ``multi``: (A) ``NB`` one-warp programs, each over ``ITERS`` sub-tiles of ``BT`` tokens (the next
  sub-tile's scores prefetched): top-k, then each selection's rank inside the program = the
  program's running count of its expert (kept in the program's own histogram row in global
  memory, read back after a barrier) + a pairwise count over the sub-tile's ``BT * K``
  selections; the rank is packed with the expert into one int32 per (token, slot). (B) only when
  ``NB * E`` is large: a column scan of the histograms into per-program offsets and expert totals.
  (C) ``NB`` programs place their rows at ``base[e] + offset[b, e] + rank`` and write the ``-1``
  tail (when B is skipped, C scans the few histograms itself). A fallback for (A),
  ``pairwise=False``, ranks with a cumulative sum down the selection tile and ``tl.gather``.
  When ``E <= 3/4`` of its power of two (E = 384 of 512), (A) keeps a token's keys in three
  chunks of ``BLOCK_E / 4`` experts, so no key work is spent on the padding.

torch.compile. ``torch.library.triton_op`` traces the launches; functionalization clones every
tensor argument that torch's TTIR analysis finds written, and that analysis follows a store's
address back through calls of ``@triton.jit`` helpers, so (1) no output tensor is ever passed as
a stand-in for an absent input (an absent valid-token count is ``None``): the two clones would
be different tensors and the traced op would return the unwritten one; (2) helpers never return
loaded values (they compute pointers; kernels load in their own body), else the scores / count
would be counted as written and cloned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue

# Largest E the kernels take (the key holds the expert in 16 bits; a tile row must fit the
# registers). Larger E falls back to the (sync-free) PyTorch reference. Tests pin it as the knob
# ``MAX_KERNEL_E`` (``moekit.settings``; ``moekit.ops.routing`` reads it).
MAX_KERNEL_E = 4096
# Elements of one [tokens, experts] tile (halved for int64 keys): the single-program path; the
# multi-program sub-tile (pairwise ranks: one warp, more elements per thread for wide rows; the
# tile+gather fallback: MULTI_TILE over several warps). H200 (bf16): one program took 3.5 us at
# 128 x 16 = 2048 elements and 16.3 us at 128 x 128 = 16384 (about 1.9 us + 0.85 ns per element),
# the 2-launch multi path about 4.5 us: single up to 2048 elements.
SINGLE_TILE = 2048
PAIR_TILE_NARROW = 1024  # BLOCK_E <= 128
PAIR_TILE_WIDE = 2048
MULTI_TILE = 4096
# Above this many histogram entries (programs x experts rounded up to 16), a separate scan kernel
# runs. (T=128, E=256, k=8: 32 programs x 256 fused took 8.1 us; E=384: 32 x 512 unfused 11.3.)
FUSED_SCAN_MAX = 16384
FUSED_SCAN_TOTAL = 1 << 20  # entries read by all programs together
# Sub-tile selections (BT * K_PAD) of the pairwise in-program rank (a PAIR_M^2 matrix per warp).
PAIR_M = 32
# Programs of the multi-program path per SM before they loop over sub-tiles (one-warp programs
# of the pairwise kernel need several per SM), and a cap on the histogram entries they write.
# The chunked one-warp kernel (E <= 3/4 of its power of two, e.g. 384) takes the same 8: at 11
# (3 sub-tiles instead of 4 at T=16384 / E=384, 1366 programs) it was faster while the scan ran
# in 8 x 512 tiles, but with the one-pass scan 1024 programs win, 24.5 against 26.1 µs (H200,
# RESULTS.md session 6).
PROGRAMS_PER_SM = 8
PROGRAMS_PER_SM_GATHER = 2
MAX_HIST = 3 << 18
# Kernel B tile: up to SCAN_CB programs' histograms (all of them when they fit: one pass, no
# carried sum between passes) x SCAN_EC experts. H200 (RESULTS.md session 6): 4 x 1024 against
# 8 x 512 takes T = 16384 top-8 from 23.4 to 21.3 µs at E = 256 and 27.4 to 26.3 at E = 384, and
# E = 128 top-4 from 14.2 to 12.7; at T = 2048 (512 programs) 4 x 512 gives 7.7 against 8.5.
# Tests pin SCAN_CB as the knob ``SCAN_CB`` (``moekit.settings``).
SCAN_EC = 4
SCAN_CB = 1024
# Ranks are packed into the top 15 bits of an int32 next to the 16-bit expert.
MAX_TOKENS_PER_PROGRAM = 32767


@triton.jit
def _score_ptrs(scores_ptr, rows, cols, stride_t, stride_e, COL64: tl.constexpr):
    """Pointers of a [rows, cols] tile of scores. (Kernels load in their own body: a helper that
    returned loaded values would make torch's kernel-mutation analysis, which follows a store's
    address back through helper calls, count the scores as written.)"""
    row_ptrs = scores_ptr + rows.to(tl.int64) * stride_t
    if COL64:
        col_offs = cols.to(tl.int64) * stride_e
    else:
        col_offs = cols * stride_e
    return row_ptrs[:, None] + col_offs[None, :]


@triton.jit
def _score_keys(v, cols, KEY64: tl.constexpr):
    """Unique sortable keys of a score tile (no masking).

    The float32 bits in sign-magnitude become two's complement (monotone; -0.0 and +0.0 both 0)
    after every NaN magnitude is clamped to one value just above +inf; a NaN of either sign stays
    positive (only bits <= the bits of -inf, read as int32, are negative non-NaN values)."""
    bits = v.to(tl.float32).to(tl.int32, bitcast=True)  # exact for bf16/fp16 (subnormals too)
    if KEY64:
        mag = tl.minimum(bits & 0x7FFFFFFF, 0x7F800001)
    else:
        mag = tl.minimum(bits & 0x7FFFFFFF, 0x7F810000)  # bf16: the low 16 bits stay 0
    ordered = tl.where(bits <= -8388608, -mag, mag)  # -8388608 = int32 bits of -inf
    low = (65535 - cols)[None, :]
    if KEY64:
        key = (ordered.to(tl.int64) << 16) | low.to(tl.int64)
    else:
        key = ordered | low
    return key


@triton.jit
def _row_max(k0, k1, k2, NCH: tl.constexpr):
    """Largest key of each row over the NCH (1 or 3) key tiles of a row."""
    if NCH == 3:
        return tl.max(tl.maximum(tl.maximum(k0, k1), k2), axis=1)
    else:
        return tl.max(k0, axis=1)


@triton.jit
def _row_below(k0, k1, k2, thr, NCH: tl.constexpr, KEY64: tl.constexpr):
    """Largest key below ``thr`` in each row: the smallest unsigned distance ``thr - 1 - key``
    (keys >= thr wrap around to distances above every key below thr). Two operations per key.
    A row without a key below thr (only the all-minimum rows of the single path) keeps thr."""
    t = (thr - 1)[:, None]
    if KEY64:
        d = (t - k0).to(tl.uint64, bitcast=True)
        if NCH == 3:
            d = tl.minimum(d, (t - k1).to(tl.uint64, bitcast=True))
            d = tl.minimum(d, (t - k2).to(tl.uint64, bitcast=True))
        return thr - 1 - tl.min(d, axis=1).to(tl.int64, bitcast=True)
    else:
        d = (t - k0).to(tl.uint32, bitcast=True)
        if NCH == 3:
            d = tl.minimum(d, (t - k1).to(tl.uint32, bitcast=True))
            d = tl.minimum(d, (t - k2).to(tl.uint32, bitcast=True))
        return thr - 1 - tl.min(d, axis=1).to(tl.int32, bitcast=True)


@triton.jit(do_not_specialize=["T", "K", "start", "end"])
def _shuffle_single_kernel(
    scores_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    vtc_ptr,  # None without a valid-token count (never a stand-in tensor: see the module doc)
    T,
    E,
    K,
    start,
    end,
    stride_t,
    stride_e,
    HAS_VTC: tl.constexpr,
    KEY64: tl.constexpr,
    COL64: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RB: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    n_valid = T
    if HAS_VTC:
        n_valid = tl.maximum(tl.minimum(tl.load(vtc_ptr), T), 0).to(tl.int32)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    # Load every real row (no wait on the valid count), ignore rows past it in the keys.
    ptrs = _score_ptrs(scores_ptr, rows, cols, stride_t, stride_e, COL64)
    v = tl.load(ptrs, mask=(rows < T)[:, None] & col_ok[None, :], other=0.0)
    m = (rows < n_valid)[:, None] & col_ok[None, :]
    if KEY64:
        key = tl.where(m, _score_keys(v, cols, KEY64), -9223372036854775808)
    else:
        key = tl.where(m, _score_keys(v, cols, KEY64), -2147483648)
    thr = _row_max(key, key, key, 1)
    for s in range(1, K):
        thr = _row_below(key, key, key, thr, 1, KEY64)
    # Rows of only masked keys end with thr = the minimum: they pick nothing.
    picked = (key >= thr[:, None]) & m
    in_range = (cols >= start) & (cols < end)
    one = (picked & in_range[None, :]).to(tl.int32)
    hist = tl.sum(one, axis=0)
    base = tl.cumsum(hist, axis=0) - hist
    n_rows = tl.sum(hist, axis=0)
    dest = base[None, :] + tl.cumsum(one, axis=0) - one
    picked = one != 0
    tl.store(eidx_ptr + dest, (cols - start)[None, :] + 0 * dest, mask=picked)
    tl.store(tidx_ptr + dest, rows[:, None] + 0 * dest, mask=picked)
    tl.store(counts_ptr + cols, hist, mask=col_ok)
    tl.store(counts_ptr + E, T)
    tl.store(counts_ptr + E + 1, n_rows)
    N = T * K
    for r0 in range(0, N, RB):
        r = r0 + tl.arange(0, RB)
        tail = (r >= n_rows) & (r < N)
        tl.store(eidx_ptr + r, -1, mask=tail)
        tl.store(tidx_ptr + r, -1, mask=tail)


@triton.jit(do_not_specialize=["T", "K", "start", "end", "ITERS"])
def _route_blocks_kernel(
    scores_ptr,
    packed_ptr,
    hist_ptr,
    vtc_ptr,  # None without a valid-token count
    T,
    E,
    K,
    start,
    end,
    stride_t,
    stride_e,
    ITERS,
    HS,
    HAS_VTC: tl.constexpr,
    KEY64: tl.constexpr,
    COL64: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_PAD: tl.constexpr,
    PAIRWISE: tl.constexpr,
    NCH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Top-k of each token over NCH (1 or 3) column chunks of BLOCK_C experts (3 chunks of
    BLOCK_E / 4 when E <= 3/4 of BLOCK_E: no key work on the padding), ranks, packed rows."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    n_valid = T
    if HAS_VTC:
        n_valid = tl.maximum(tl.minimum(tl.load(vtc_ptr), T), 0).to(tl.int32)
    cols = tl.arange(0, BLOCK_E)
    in_range = (cols >= start) & (cols < end)
    c0 = tl.arange(0, BLOCK_C)
    c1 = c0 + BLOCK_C
    c2 = c0 + 2 * BLOCK_C
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < K
    hist_row = hist_ptr + pid * HS  # HS: E rounded up to 16 (the histogram row stride)
    M: tl.constexpr = BT * K_PAD
    if PAIRWISE:
        # The running per-expert count lives in this program's own histogram row (global
        # memory, read back by the same CTA after a barrier): no per-expert register tensor.
        tl.store(hist_row + cols, tl.zeros([BLOCK_E], dtype=tl.int32), mask=cols < HS)
        tl.debug_barrier()
        pos = tl.arange(0, M)  # selection (token pos // K_PAD, slot pos % K_PAD) of a sub-tile
        pos_tok = pos // K_PAD
        pos_slot = pos % K_PAD
        tok_r = pos_tok[:, None]
        tok_c = pos_tok[None, :]
        # Pair weights of selection r (row) for selection c (column): 1 when r's token is
        # earlier, 65536 when later (two counts in one sum, taken down the columns).
        w = tl.where(tok_r < tok_c, 1, tl.where(tok_r > tok_c, 65536, 0))
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    # Scores outside the tile (padding experts, tokens past the valid count) load as -inf: their
    # keys sit below every real expert's (ties go to the lower index), so no mask on the keys.
    rows = pid * ITERS * BT + tl.arange(0, BT)
    ld_ok = (rows < n_valid)[:, None]
    n0 = tl.load(
        _score_ptrs(scores_ptr, rows, c0, stride_t, stride_e, COL64),
        mask=ld_ok & (c0 < E)[None, :],
        other=float("-inf"),
    )
    if NCH == 3:
        n1 = tl.load(
            _score_ptrs(scores_ptr, rows, c1, stride_t, stride_e, COL64),
            mask=ld_ok & (c1 < E)[None, :],
            other=float("-inf"),
        )
        n2 = tl.load(
            _score_ptrs(scores_ptr, rows, c2, stride_t, stride_e, COL64),
            mask=ld_ok & (c2 < E)[None, :],
            other=float("-inf"),
        )
    for it in range(ITERS):
        rows = (pid * ITERS + it) * BT + tl.arange(0, BT)
        tok_ok = rows < n_valid
        k0 = _score_keys(n0, c0, KEY64)
        if NCH == 3:
            k1 = _score_keys(n1, c1, KEY64)
            k2 = _score_keys(n2, c2, KEY64)
        else:
            k1 = k0
            k2 = k0
        # Prefetch the next sub-tile: its load overlaps this one's top-k.
        ahead = rows + BT
        ld_ok = ((ahead < n_valid) & (it + 1 < ITERS))[:, None]
        n0 = tl.load(
            _score_ptrs(scores_ptr, ahead, c0, stride_t, stride_e, COL64),
            mask=ld_ok & (c0 < E)[None, :],
            other=float("-inf"),
        )
        if NCH == 3:
            n1 = tl.load(
                _score_ptrs(scores_ptr, ahead, c1, stride_t, stride_e, COL64),
                mask=ld_ok & (c1 < E)[None, :],
                other=float("-inf"),
            )
            n2 = tl.load(
                _score_ptrs(scores_ptr, ahead, c2, stride_t, stride_e, COL64),
                mask=ld_ok & (c2 < E)[None, :],
                other=float("-inf"),
            )
        # K rounds of "largest key below the previous one"; slot s gets round s's expert.
        thr = _row_max(k0, k1, k2, NCH)
        ids = tl.where(slots[None, :] == 0, (65535 - (thr & 65535)).to(tl.int32)[:, None], 0)
        for s in range(1, K):
            thr = _row_below(k0, k1, k2, thr, NCH, KEY64)
            ids = tl.where(slots[None, :] == s, (65535 - (thr & 65535)).to(tl.int32)[:, None], ids)
        if PAIRWISE:
            # Everything per selection in the flat [M] layout (one value per lane for M = 32):
            # only the expert ids change layout.
            # Rank = selections of the same expert in earlier sub-tiles (the histogram row) +
            # in earlier tokens of this sub-tile (pairwise over the BT * K_PAD selections).
            # Invalid selections get unique negative ids, so they match nothing.
            flat_ids = tl.reshape(ids, [M])
            row_f = (pid * ITERS + it) * BT + pos_tok
            ok_f = (row_f < n_valid) & (pos_slot < K) & (flat_ids >= start) & (flat_ids < end)
            flat_e = tl.where(ok_f, flat_ids, -1 - pos)
            flat_r = row_f.to(tl.int64) * K + pos_slot
            flat_store = (row_f < T) & (pos_slot < K)
            # Summed down the columns: each thread adds up its own column (no cross-lane sum).
            pair = tl.sum(tl.where(flat_e[:, None] == flat_e[None, :], w, 0), axis=0)
            valid = flat_e >= 0
            e_safe = tl.where(valid, flat_e, 0)
            rank = tl.load(hist_row + e_safe, mask=valid, other=0) + (pair & 65535)
            tl.debug_barrier()  # every read of the row before any update of it
            tl.store(packed_ptr + flat_r, tl.where(valid, (rank << 16) | e_safe, -1), mask=flat_store)
            # The last selection of an expert in this sub-tile writes the expert's new count.
            tl.store(hist_row + e_safe, rank + 1, mask=valid & ((pair >> 16) == 0))
            tl.debug_barrier()  # updates visible to the next sub-tile's reads
        else:
            # (NCH == 1 here.) The top-k keys are exactly those >= the last round's threshold.
            ok = tok_ok[:, None] & slot_ok[None, :] & (ids >= start) & (ids < end)
            r = rows.to(tl.int64)[:, None] * K + slots[None, :]
            store_ok = (rows < T)[:, None] & slot_ok[None, :]
            one = ((k0 >= thr[:, None]) & in_range[None, :] & tok_ok[:, None]).to(tl.int32)
            # Rank inside this program: earlier sub-tiles (carry) + earlier tokens of this sub-tile.
            before = tl.cumsum(one, axis=0) - one + carry[None, :]
            rank = tl.gather(before, tl.where(tok_ok[:, None] & slot_ok[None, :], ids, 0), 1)
            packed = tl.where(ok, (rank << 16) | ids, -1)
            tl.store(packed_ptr + r, packed, mask=store_ok)
            carry += tl.sum(one, axis=0)
    if not PAIRWISE:
        tl.store(hist_row + cols, carry, mask=cols < HS)


@triton.jit
def _block_offsets(hist_ptr, counts_ptr, NB, HS, b, cols, col_ok, FUSED_SCAN: tl.constexpr, BLOCK_E: tl.constexpr,
                   CB: tl.constexpr):  # fmt: skip
    """Block ``b``'s placing program: per expert, the total rows (``tot``) and the rows of the
    blocks before ``b`` (``pre``). ``FUSED_SCAN``: summed here from the ``NB`` count rows (stride
    ``HS``; program 0 stores the totals in ``counts``); else read where ``_scan_blocks_kernel`` left
    them (totals in ``counts``, exclusive prefixes in place of the count rows)."""
    if FUSED_SCAN:
        tot = tl.zeros([BLOCK_E], dtype=tl.int32)
        pre = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, NB, CB):
            blk = c0 + tl.arange(0, CB)
            h = tl.load(hist_ptr + blk.to(tl.int64)[:, None] * HS + cols[None, :],
                        mask=(blk < NB)[:, None] & col_ok[None, :], other=0)  # fmt: skip
            tot += tl.sum(h, axis=0)
            pre += tl.sum(tl.where((blk < b)[:, None], h, 0), axis=0)
        if b == 0:
            tl.store(counts_ptr + cols, tot, mask=col_ok)
    else:
        tot = tl.load(counts_ptr + cols, mask=col_ok, other=0)
        pre = tl.load(hist_ptr + b.to(tl.int64) * HS + cols, mask=col_ok, other=0)
    return tot, pre


@triton.jit(do_not_specialize=["NB"])
def _scan_blocks_kernel(hist_ptr, counts_ptr, NB, E, HS, EC: tl.constexpr, CB: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """Column scan of the [NB, HS] histograms, in place, into exclusive per-program offsets;
    the column totals are the expert counts. (HS // EC programs.)"""
    pdl_prologue(USE_PDL)
    cols = tl.program_id(0) * EC + tl.arange(0, EC)
    carry = tl.zeros([EC], dtype=tl.int32)
    for c0 in range(0, NB, CB):
        rows = c0 + tl.arange(0, CB)
        m = (rows < NB)[:, None]
        ptrs = hist_ptr + rows[:, None] * HS + cols[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + cols, carry, mask=cols < E)


@triton.jit(do_not_specialize=["T", "K", "start", "NB", "ROWS_PER_PROG"])
def _place_kernel(
    packed_ptr,
    hist_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    T,
    E,
    K,
    start,
    NB,
    ROWS_PER_PROG,
    HS,
    FUSED_SCAN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CB: tl.constexpr,
    R: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    tot, pre = _block_offsets(hist_ptr, counts_ptr, NB, HS, pid, cols, col_ok, FUSED_SCAN, BLOCK_E, CB)
    off = tl.cumsum(tot, axis=0) - tot + pre
    n_rows = tl.sum(tot, axis=0)
    if pid == 0:
        tl.store(counts_ptr + E, T)
        tl.store(counts_ptr + E + 1, n_rows)
    N = T * K
    r_begin = pid * ROWS_PER_PROG
    r_end = tl.minimum(r_begin + ROWS_PER_PROG, N)
    for r0 in range(r_begin, r_end, R):
        r = r0 + tl.arange(0, R)
        m = r < r_end
        p = tl.load(packed_ptr + r, mask=m, other=-1)
        ok = p >= 0
        e = tl.where(ok, p & 65535, 0)
        dest = tl.gather(off, e, 0) + (p >> 16)
        tl.store(eidx_ptr + dest, e - start, mask=ok)
        tl.store(tidx_ptr + dest, r // K, mask=ok)
        tail = m & (r >= n_rows)
        tl.store(eidx_ptr + r, -1, mask=tail)
        tl.store(tidx_ptr + r, -1, mask=tail)


@dataclass(frozen=True)
class Plan:
    """Launch configuration of one ``index_shuffling`` call (a pure function of the shapes)."""

    path: str  # "single" | "multi"
    block_e: int
    k_pad: int
    key64: bool
    bt: int  # tokens per tile (single: all of them)
    iters: int = 1  # sub-tiles per program (multi)
    programs: int = 1  # NB (multi)
    fused_scan: bool = True
    num_warps: int = 4
    pairwise: bool = True  # in-program ranks: pairwise over a sub-tile's selections, else tile+gather
    chunks: int = 1  # multi: column chunks of a token's keys (1, or 3 of block_e // 4)
    hs: int = 16  # multi: histogram row stride (E rounded up to 16)

    @property
    def launches(self) -> int:
        if self.path == "single":
            return 1
        return 2 if self.fused_scan else 3

    @property
    def block_c(self) -> int:
        return self.block_e // 4 if self.chunks == 3 else self.block_e


def _warps(elements: int, key64: bool, most: int) -> int:
    """Warps for a tile: about 16 keys per thread (8 int64 keys), at most ``most`` warps."""
    return max(1, min(most, elements * (2 if key64 else 1) // 512))


def plan(
    T: int,
    E: int,
    top_k: int,
    dtype: torch.dtype,
    sms: int,
    *,
    force: Optional[str] = None,
    block_tokens: Optional[int] = None,
    pairwise: Optional[bool] = None,
    chunks: Optional[int] = None,
) -> Plan:
    """Pick the path and tile sizes from the shapes (cheap buckets, no tuning).

    ``force`` ("single" / "multi" / "multi3"), ``block_tokens`` (a power of two), ``pairwise``
    and ``chunks`` (1 or 3) override the choice; tests and benchmarks use them to reach every
    path with small shapes.
    """
    block_e = max(16, next_pow2(E))
    k_pad = next_pow2(top_k)
    key64 = dtype != torch.bfloat16
    shrink = 2 if key64 else 1
    bt_single = next_pow2(max(T, 1))
    if force == "single" or (force is None and bt_single * block_e <= SINGLE_TILE // shrink):
        return Plan("single", block_e, k_pad, key64, bt_single, num_warps=_warps(bt_single * block_e, key64, 16))
    pairwise = True if pairwise is None else pairwise
    if pairwise:  # one warp; the pairwise rank matrix at most PAIR_M x PAIR_M
        tile = PAIR_TILE_NARROW if block_e <= 128 else PAIR_TILE_WIDE
        bt = max(1, min((tile // shrink) // block_e, PAIR_M // k_pad))
        # One warp, unless a single row is wider than a warp should hold (E > 2048 bf16).
        warps, per_sm = max(1, min(8, bt * block_e * shrink // PAIR_TILE_WIDE)), PROGRAMS_PER_SM
        # Three chunks of block_e / 4 experts when they hold E: a quarter less key work.
        if chunks is None:
            chunks = 3 if block_e >= 64 and 4 * E <= 3 * block_e else 1
    else:
        bt = max(1, (MULTI_TILE // shrink) // block_e)
        warps, per_sm = _warps(bt * block_e, key64, 8), PROGRAMS_PER_SM_GATHER
        chunks = 1  # the tile+gather ranks need the whole row in one tile
    if chunks not in (1, 3) or (chunks == 3 and 4 * E > 3 * block_e):
        raise ValueError(f"chunks must be 1, or 3 when E <= 3/4 of {block_e}, got {chunks} for E={E}")
    bt = block_tokens or bt
    hs = cdiv(E, 16) * 16
    subtiles = cdiv(max(T, 1), bt)
    target = max(1, min(per_sm * sms, MAX_HIST // hs))
    iters = cdiv(subtiles, target)
    iters = max(1, min(iters, MAX_TOKENS_PER_PROGRAM // bt))
    programs = cdiv(subtiles, iters)
    # Kernel C scans the histograms itself when every program can afford reading all of them.
    fused = (
        programs * hs <= settings.get().knob("FUSED_SCAN_MAX", FUSED_SCAN_MAX)
        and programs * programs * hs <= FUSED_SCAN_TOTAL
    )
    if force == "multi3":
        fused = False
    elif force == "multi":
        fused = True
    return Plan("multi", block_e, k_pad, key64, bt, iters, programs, fused, warps, pairwise, chunks, hs)


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    top_k: int = 1,
    *,
    force: Optional[str] = None,
    block_tokens: Optional[int] = None,
    pairwise: Optional[bool] = None,
    chunks: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (arguments already validated by ``moekit.ops.routing.index_shuffling``).

    The plan needs concrete sizes: under symbolic tracing they are specialized (guarded).
    Every tensor a kernel receives is a distinct tensor (no output doubles as a placeholder for
    an absent input): see the module docstring."""
    T, E = (int(d) for d in routing_scores.shape)
    start = 0 if expert_index_start is None else expert_index_start
    end = E if expert_index_end is None else expert_index_end
    device = routing_scores.device
    N = T * top_k
    if T == 0:
        return (
            torch.zeros(E + 2, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
        )
    counts = torch.empty(E + 2, dtype=torch.int32, device=device)
    eidx = torch.empty(N, dtype=torch.int32, device=device)
    tidx = torch.empty(N, dtype=torch.int32, device=device)
    has_vtc = valid_token_count is not None
    st, se = (int(d) for d in routing_scores.stride())
    col64 = (E - 1) * se >= 2**31
    sms = num_sms(device)
    p = plan(
        T, E, top_k, routing_scores.dtype, sms,
        force=force, block_tokens=block_tokens, pairwise=pairwise, chunks=chunks,
    )  # fmt: skip
    if p.path == "single":
        launch(_shuffle_single_kernel)[(1,)](
            routing_scores, counts, eidx, tidx, valid_token_count,
            T, E, top_k, start, end, st, se,
            HAS_VTC=has_vtc, KEY64=p.key64, COL64=col64, BT=p.bt, BLOCK_E=p.block_e,
            RB=min(2048, max(16, p.bt * p.k_pad)),
            num_warps=p.num_warps,
        )  # fmt: skip
        return counts, eidx, tidx

    packed = torch.empty(N, dtype=torch.int32, device=device)
    hist = torch.empty(p.programs * p.hs, dtype=torch.int32, device=device)
    launch(_route_blocks_kernel)[(p.programs,)](
        routing_scores, packed, hist, valid_token_count,
        T, E, top_k, start, end, st, se, p.iters, p.hs,
        HAS_VTC=has_vtc, KEY64=p.key64, COL64=col64, BT=p.bt, BLOCK_E=p.block_e, K_PAD=p.k_pad,
        PAIRWISE=p.pairwise, NCH=p.chunks, BLOCK_C=p.block_c, num_warps=p.num_warps,
    )  # fmt: skip
    if not p.fused_scan:
        cb = min(settings.get().knob("SCAN_CB", SCAN_CB), max(16, next_pow2(p.programs)))
        launch(_scan_blocks_kernel)[(p.hs // SCAN_EC,)](
            hist, counts, p.programs, E, p.hs, EC=SCAN_EC, CB=cb, num_warps=4
        )
    rows_per_prog = p.iters * p.bt * top_k
    launch(_place_kernel)[(p.programs,)](
        packed, hist, counts, eidx, tidx,
        T, E, top_k, start, p.programs, rows_per_prog, p.hs,
        FUSED_SCAN=p.fused_scan, BLOCK_E=p.block_e, CB=max(1, min(64, 8192 // p.block_e)),
        R=min(1024, max(256, p.bt * p.k_pad)),
        num_warps=4,
    )  # fmt: skip
    return counts, eidx, tidx
