"""Triton kernels: ``index_shuffling`` (fused top-k + per-expert count + stable sort).

Keys. Every score becomes one integer that orders by (value descending, expert ascending): the
float32 bits made monotone (``-0.0`` folded into ``+0.0``, every NaN above ``+inf``, as
``torch.sort`` orders them), shifted left by 16 bits, with ``65535 - expert`` in the low 16 bits.
Keys are unique within a row, so ``K`` rounds of "largest key below the previous round's" give
the top-k with ties to the lower expert index, and each round's expert comes back out of the low
bits. bf16 scores fit the key in int32 (a bf16 value is a float32 with 16 zero low bits);
fp16/fp32 scores use int64 keys.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, launch, next_pow2, num_sms

# Largest E the kernels take (the key holds the expert in 16 bits; a tile row must fit the
# registers). Larger E falls back to the (sync-free) PyTorch reference.
MAX_KERNEL_E = 4096
# Elements of one [tokens, experts] tile (halved for int64 keys): the single-program path; the
# multi-program sub-tile (pairwise ranks: one warp, more elements per thread for wide rows; the
# tile+gather fallback: MULTI_TILE over several warps).
SINGLE_TILE = 16384
PAIR_TILE_NARROW = 1024  # BLOCK_E <= 128
PAIR_TILE_WIDE = 2048
MULTI_TILE = 4096
# Above this many histogram entries (programs x padded experts), a separate scan kernel runs.
FUSED_SCAN_MAX = 8192
FUSED_SCAN_TOTAL = 1 << 20  # entries read by all programs together
# Sub-tile selections (BT * K_PAD) of the pairwise in-program rank (a PAIR_M^2 matrix per warp).
PAIR_M = 32
# Programs of the multi-program path per SM before they loop over sub-tiles (one-warp programs
# of the pairwise kernel need several per SM), and a cap on the histogram entries they write.
PROGRAMS_PER_SM = 8
PROGRAMS_PER_SM_GATHER = 2
MAX_HIST = 1 << 19
# Kernel B tile: SCAN_CB programs' histograms x SCAN_EC experts.
SCAN_EC = 8
SCAN_CB = 512
# Ranks are packed into the top 15 bits of an int32 next to the 16-bit expert.
MAX_TOKENS_PER_PROGRAM = 32767


@triton.jit
def _load_scores(scores_ptr, rows, cols, row_ok, col_ok, stride_t, stride_e, COL64: tl.constexpr):
    """A [rows, cols] tile of scores in their own dtype (0 where masked)."""
    row_ptrs = scores_ptr + rows.to(tl.int64) * stride_t
    if COL64:
        col_offs = cols.to(tl.int64) * stride_e
    else:
        col_offs = cols * stride_e
    return tl.load(row_ptrs[:, None] + col_offs[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _score_keys(v, m, cols, KEY64: tl.constexpr):
    """Unique sortable keys of a score tile; entries outside ``m`` get the type's minimum."""
    bits = v.to(tl.float32).to(tl.int32, bitcast=True)  # exact for bf16/fp16 (subnormals too)
    mag = bits & 0x7FFFFFFF  # integer tests: immune to flush-to-zero
    bits = tl.where(mag == 0, 0, bits)  # -0.0 ties with +0.0
    bits = tl.where(mag > 0x7F800000, 0x7FFFFFFF, bits)  # NaN above +inf, like torch.sort
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float value
    low = (65535 - cols)[None, :]
    if KEY64:
        key = (ordered.to(tl.int64) << 16) | low.to(tl.int64)
        key = tl.where(m, key, -9223372036854775808)
    else:
        # bf16 values: the low 16 bits of `ordered` are all 0 (or all 1 once flipped): keep the top.
        key = (ordered & -65536) | low
        key = tl.where(m, key, -2147483648)
    return key


@triton.jit
def _topk_rounds(key, K, BT: tl.constexpr, K_PAD: tl.constexpr, KEY64: tl.constexpr, NEED_IDS: tl.constexpr):
    """Top-k of each row of unique keys by K rounds of "largest key below the previous one".

    Returns ``picked`` (bool ``[BT, BLOCK_E]``) and, when ``NEED_IDS``, the picked experts per
    slot ``[BT, K_PAD]`` (slot order = descending score). Rows of only masked keys pick nothing.
    Only the key tile stays live across rounds (no knocked-out copy).
    """
    if KEY64:
        lowest = -9223372036854775808
    else:
        lowest = -2147483648
    slots = tl.arange(0, K_PAD)[None, :]
    thr = tl.max(key, axis=1)
    ids = tl.zeros([BT, K_PAD], dtype=tl.int32)
    if NEED_IDS:
        ids = tl.where(slots == 0, (65535 - (thr & 65535)).to(tl.int32)[:, None], ids)
    for s in range(1, K):
        thr = tl.max(tl.where(key < thr[:, None], key, lowest), axis=1)
        if NEED_IDS:
            ids = tl.where(slots == s, (65535 - (thr & 65535)).to(tl.int32)[:, None], ids)
    picked = (key >= thr[:, None]) & (key != lowest)
    return picked, ids


@triton.jit
def _valid_tokens(vtc_ptr, T, HAS_VTC: tl.constexpr):
    n = T
    if HAS_VTC:
        n = tl.maximum(tl.minimum(tl.load(vtc_ptr), T), 0).to(tl.int32)
    return n


@triton.jit(do_not_specialize=["T", "K", "start", "end"])
def _shuffle_single_kernel(
    scores_ptr,
    counts_ptr,
    eidx_ptr,
    tidx_ptr,
    vtc_ptr,
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
):
    n_valid = _valid_tokens(vtc_ptr, T, HAS_VTC)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    # Load every real row (no wait on the valid count), ignore rows past it in the keys.
    v = _load_scores(scores_ptr, rows, cols, rows < T, col_ok, stride_t, stride_e, COL64)
    key = _score_keys(v, (rows < n_valid)[:, None] & col_ok[None, :], cols, KEY64)
    picked, _ids = _topk_rounds(key, K, BT, 1, KEY64, False)
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
    vtc_ptr,
    T,
    E,
    K,
    start,
    end,
    stride_t,
    stride_e,
    ITERS,
    HAS_VTC: tl.constexpr,
    KEY64: tl.constexpr,
    COL64: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_PAD: tl.constexpr,
    PAIRWISE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = _valid_tokens(vtc_ptr, T, HAS_VTC)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    in_range = (cols >= start) & (cols < end)
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < K
    hist_row = hist_ptr + pid * BLOCK_E
    M: tl.constexpr = BT * K_PAD
    if PAIRWISE:
        # The running per-expert count lives in this program's own histogram row (global
        # memory, read back by the same CTA after a barrier): no per-expert register tensor.
        tl.store(hist_row + cols, tl.zeros([BLOCK_E], dtype=tl.int32))
        tl.debug_barrier()
        pos = tl.arange(0, M)
        tok_i = (pos // K_PAD)[:, None]
        tok_j = (pos // K_PAD)[None, :]
        # Pair weights: 1 for an earlier token, 65536 for a later one (two counts, one sum).
        w = tl.where(tok_j < tok_i, 1, tl.where(tok_j > tok_i, 65536, 0))
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    rows = pid * ITERS * BT + tl.arange(0, BT)
    v_next = _load_scores(scores_ptr, rows, cols, rows < n_valid, col_ok, stride_t, stride_e, COL64)
    for it in range(ITERS):
        rows = (pid * ITERS + it) * BT + tl.arange(0, BT)
        tok_ok = rows < n_valid
        v = v_next
        # Prefetch the next sub-tile: its load overlaps this one's top-k.
        ahead = rows + BT
        ahead_ok = (ahead < n_valid) & (it + 1 < ITERS)
        v_next = _load_scores(scores_ptr, ahead, cols, ahead_ok, col_ok, stride_t, stride_e, COL64)
        key = _score_keys(v, tok_ok[:, None] & col_ok[None, :], cols, KEY64)
        picked, ids = _topk_rounds(key, K, BT, K_PAD, KEY64, True)
        ok = tok_ok[:, None] & slot_ok[None, :] & (ids >= start) & (ids < end)
        r = rows.to(tl.int64)[:, None] * K + slots[None, :]
        store_ok = (rows < T)[:, None] & slot_ok[None, :]
        if PAIRWISE:
            # Rank = selections of the same expert in earlier sub-tiles (the histogram row) +
            # in earlier tokens of this sub-tile (pairwise over the BT * K_PAD selections).
            # Invalid selections get unique negative ids, so they match nothing.
            unique_neg = -1 - (tl.arange(0, BT)[:, None] * K_PAD + slots[None, :])
            flat_e = tl.reshape(tl.where(ok, ids, unique_neg), [M])
            flat_r = tl.reshape(r, [M])
            flat_store = tl.reshape(store_ok, [M])
            pair = tl.sum(tl.where(flat_e[:, None] == flat_e[None, :], w, 0), axis=1)
            valid = flat_e >= 0
            e_safe = tl.where(valid, flat_e, 0)
            rank = tl.load(hist_row + e_safe, mask=valid, other=0) + (pair & 65535)
            tl.debug_barrier()  # every read of the row before any update of it
            tl.store(packed_ptr + flat_r, tl.where(valid, (rank << 16) | e_safe, -1), mask=flat_store)
            # The last selection of an expert in this sub-tile writes the expert's new count.
            tl.store(hist_row + e_safe, rank + 1, mask=valid & ((pair >> 16) == 0))
            tl.debug_barrier()  # updates visible to the next sub-tile's reads
        else:
            one = (picked & in_range[None, :]).to(tl.int32)
            # Rank inside this program: earlier sub-tiles (carry) + earlier tokens of this sub-tile.
            before = tl.cumsum(one, axis=0) - one + carry[None, :]
            rank = tl.gather(before, tl.where(tok_ok[:, None] & slot_ok[None, :], ids, 0), 1)
            packed = tl.where(ok, (rank << 16) | ids, -1)
            tl.store(packed_ptr + r, packed, mask=store_ok)
            carry += tl.sum(one, axis=0)
    if not PAIRWISE:
        tl.store(hist_row + cols, carry)


@triton.jit(do_not_specialize=["NB"])
def _scan_blocks_kernel(hist_ptr, counts_ptr, NB, E, BLOCK_E: tl.constexpr, EC: tl.constexpr, CB: tl.constexpr):
    """Column scan of the [NB, BLOCK_E] histograms, in place, into exclusive per-program offsets;
    the column totals are the expert counts."""
    cols = tl.program_id(0) * EC + tl.arange(0, EC)
    carry = tl.zeros([EC], dtype=tl.int32)
    for c0 in range(0, NB, CB):
        rows = c0 + tl.arange(0, CB)
        m = (rows < NB)[:, None]
        ptrs = hist_ptr + rows[:, None] * BLOCK_E + cols[None, :]
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
    FUSED_SCAN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CB: tl.constexpr,
    R: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    if FUSED_SCAN:
        tot = tl.zeros([BLOCK_E], dtype=tl.int32)
        pre = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, NB, CB):
            rows = c0 + tl.arange(0, CB)
            h = tl.load(hist_ptr + rows[:, None] * BLOCK_E + cols[None, :], mask=(rows < NB)[:, None], other=0)
            tot += tl.sum(h, axis=0)
            pre += tl.sum(tl.where((rows < pid)[:, None], h, 0), axis=0)
        if pid == 0:
            tl.store(counts_ptr + cols, tot, mask=col_ok)
    else:
        tot = tl.load(counts_ptr + cols, mask=col_ok, other=0)
        pre = tl.load(hist_ptr + pid * BLOCK_E + cols)
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

    @property
    def launches(self) -> int:
        if self.path == "single":
            return 1
        return 2 if self.fused_scan else 3


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
) -> Plan:
    """Pick the path and tile sizes from the shapes (cheap buckets, no tuning).

    ``force`` ("single" / "multi" / "multi3"), ``block_tokens`` (a power of two) and ``pairwise``
    override the choice; tests and benchmarks use them to reach every path with small shapes.
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
    else:
        bt = max(1, (MULTI_TILE // shrink) // block_e)
        warps, per_sm = _warps(bt * block_e, key64, 8), PROGRAMS_PER_SM_GATHER
    bt = block_tokens or bt
    subtiles = cdiv(max(T, 1), bt)
    target = max(1, min(per_sm * sms, MAX_HIST // block_e))
    iters = cdiv(subtiles, target)
    iters = max(1, min(iters, MAX_TOKENS_PER_PROGRAM // bt))
    programs = cdiv(subtiles, iters)
    # Kernel C scans the histograms itself when every program can afford reading all of them.
    fused = programs * block_e <= FUSED_SCAN_MAX and programs * programs * block_e <= FUSED_SCAN_TOTAL
    if force == "multi3":
        fused = False
    elif force == "multi":
        fused = True
    return Plan("multi", block_e, k_pad, key64, bt, iters, programs, fused, warps, pairwise)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (arguments already validated by ``moekit.ops.routing.index_shuffling``).

    The plan needs concrete sizes: under symbolic tracing they are specialized (guarded)."""
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
    vtc = valid_token_count if has_vtc else counts
    st, se = (int(d) for d in routing_scores.stride())
    col64 = (E - 1) * se >= 2**31
    sms = num_sms(device)
    p = plan(T, E, top_k, routing_scores.dtype, sms, force=force, block_tokens=block_tokens, pairwise=pairwise)
    if p.path == "single":
        launch(_shuffle_single_kernel)[(1,)](
            routing_scores, counts, eidx, tidx, vtc,
            T, E, top_k, start, end, st, se,
            HAS_VTC=has_vtc, KEY64=p.key64, COL64=col64, BT=p.bt, BLOCK_E=p.block_e,
            RB=min(2048, max(16, p.bt * p.k_pad)),
            num_warps=p.num_warps,
        )  # fmt: skip
        return counts, eidx, tidx

    packed = torch.empty(N, dtype=torch.int32, device=device)
    hist = torch.empty(p.programs * p.block_e, dtype=torch.int32, device=device)
    launch(_route_blocks_kernel)[(p.programs,)](
        routing_scores, packed, hist, vtc,
        T, E, top_k, start, end, st, se, p.iters,
        HAS_VTC=has_vtc, KEY64=p.key64, COL64=col64, BT=p.bt, BLOCK_E=p.block_e, K_PAD=p.k_pad,
        PAIRWISE=p.pairwise, num_warps=p.num_warps,
    )  # fmt: skip
    if not p.fused_scan:
        launch(_scan_blocks_kernel)[(p.block_e // SCAN_EC,)](
            hist, counts, p.programs, E, BLOCK_E=p.block_e, EC=SCAN_EC, CB=SCAN_CB, num_warps=4
        )
    rows_per_prog = p.iters * p.bt * top_k
    launch(_place_kernel)[(p.programs,)](
        packed, hist, counts, eidx, tidx,
        T, E, top_k, start, p.programs, rows_per_prog,
        FUSED_SCAN=p.fused_scan, BLOCK_E=p.block_e, CB=max(1, min(64, 8192 // p.block_e)),
        R=min(1024, max(256, p.bt * p.k_pad)),
        num_warps=4,
    )  # fmt: skip
    return counts, eidx, tidx
