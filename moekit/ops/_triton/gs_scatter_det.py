"""Triton kernels: the deterministic scatter-add (``scatter_add_dense_tokens_deterministic``, no
atomics on the data; bitwise reproducible). Conventions: ``gs_common``.

One launch up to ``_SCAN_MAX_ROWS`` rows (every program scans the indices); above, an int32-atomic
bucket kernel builds the token -> rows map (no sort) and the sum kernel sorts each token's small
bucket in registers. Both add a token's rows in ascending row order and give the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gs_common import _MIN_PROGRAMS_PER_SM, _row_count, _tiles


# ----------------------------------------------------------------------------------------------
# scatter-add, dense, deterministic (no atomics on the data)
# ----------------------------------------------------------------------------------------------

# Bucket padding: sorts after every row index (rows are < 2**31 - 1, checked by the launcher).
_NO_ROW = tl.constexpr(2**31 - 1)


@triton.jit
def _add_hits_in_order(acc, hit, a0, in_ptr, stride_in, cols, cm, BLOCK_A: tl.constexpr):
    """``acc[t] += in[a0 + j]`` for every ``hit[t, j]`` (``[BLOCK_T, BLOCK_A]``), in ascending
    ``j``, two rows per step; a token without a row in a step adds +0.0 (an exact no-op: a sum
    that starts at +0.0 never becomes -0.0). The order of additions is the one of every other
    deterministic path, so all of them give the same bits."""
    j = tl.arange(0, BLOCK_A)
    n = tl.max(tl.sum(hit.to(tl.int32), axis=1), axis=0)
    for _ in range(0, n, 2):
        j0 = tl.min(tl.where(hit, j[None, :], BLOCK_A), axis=1)
        hit = hit & (j[None, :] != j0[:, None])
        j1 = tl.min(tl.where(hit, j[None, :], BLOCK_A), axis=1)
        hit = hit & (j[None, :] != j1[:, None])
        h0 = j0 < BLOCK_A
        h1 = j1 < BLOCK_A
        r0 = (a0 + j0).to(tl.int64)
        r1 = (a0 + j1).to(tl.int64)
        p0 = in_ptr + (r0 * (stride_in // 8) * 8)[:, None] + cols[None, :]
        p1 = in_ptr + (r1 * (stride_in // 8) * 8)[:, None] + cols[None, :]
        v0 = tl.load(p0, mask=h0[:, None] & cm, other=0.0, eviction_policy="evict_first")
        v1 = tl.load(p1, mask=h1[:, None] & cm, other=0.0, eviction_policy="evict_first")
        acc += v0.to(tl.float32)
        acc += v1.to(tl.float32)
    return acc


@triton.jit
def _scan_sum_kernel(
    out_ptr,
    in_ptr,
    tok_ptr,
    valid_ptr,
    A,
    T,
    D,
    stride_out,
    stride_in,
    stride_tok,
    n_db,
    HAS_VALID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_A: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Few rows (``A <= BLOCK_A``): one launch, no inverse map. Every program reads all of
    ``token_indices`` (at most a few KB, from the L2) and adds the rows that hit its tokens in
    ascending row order, then does one read-modify-write of ``out``."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    tb = pid // n_db
    db = pid - tb * n_db
    toks = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tin = toks < T
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = (cols < (D // 8) * 8)[None, :]
    n_rows = _row_count(valid_ptr, A, HAS_VALID).to(tl.int32)
    a = tl.arange(0, BLOCK_A)
    idx = tl.load(tok_ptr + a.to(tl.int64) * stride_tok, mask=a < n_rows, other=-1)
    # Indices outside [0, T) become -1 (before the narrowing): they never equal a token.
    idx = tl.where((idx >= 0) & (idx < T), idx, -1).to(tl.int32)
    hit = (idx[None, :] == toks.to(tl.int32)[:, None]) & tin[:, None]  # [BLOCK_T, BLOCK_A]
    cnt = tl.sum(hit.to(tl.int32), axis=1)
    # Tokens that receive rows: their output tile is read while their rows are located.
    m = (cnt > 0)[:, None] & cm
    o_ptr = out_ptr + (toks * (stride_out // 8) * 8)[:, None] + cols[None, :]
    o = tl.load(o_ptr, mask=m, other=0.0)
    acc = _add_hits_in_order(
        tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), hit, 0, in_ptr, stride_in, cols, cm, BLOCK_A
    )
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bucket_rows_kernel(
    counts_ptr,
    buckets_ptr,
    tok_ptr,
    valid_ptr,
    A,
    T,
    stride_tok,
    HAS_VALID: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Token -> rows map without a sort: every row that is added takes the next slot of its
    token with an int32 atomic (``counts[t]`` ends as the token's number of rows, exact) and,
    when the slot is below ``CAP``, records its index in ``buckets[t, slot]``. Slots fill in an
    arbitrary order; the sum kernel sorts each bucket, so the result does not depend on it."""
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < _row_count(valid_ptr, A, HAS_VALID)
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T)
    slot = tl.atomic_add(counts_ptr + tok, tl.full((BLOCK,), 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(buckets_ptr + tok * CAP + slot, rows.to(tl.int32), mask=ok & (slot < CAP))


@triton.jit
def _bucket_sum_kernel(
    out_ptr,
    in_ptr,
    counts_ptr,
    buckets_ptr,
    tok_ptr,
    valid_ptr,
    A,
    T,
    D,
    stride_out,
    stride_in,
    stride_tok,
    n_db,
    HAS_VALID: tl.constexpr,
    CAP: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_A: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """One program per (token block, column block): each token's rows, in ascending row order,
    summed in float32 and added to ``out[t]`` with one read-modify-write.

    A token with at most ``CAP`` rows finds them all in its bucket, sorted here in registers.
    A token with more (indices that are not a top-k routing, e.g. every row to one token) is
    summed by scanning ``token_indices`` in row order, ``BLOCK_A`` rows at a time; only programs
    that own such a token take that branch."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    tb = pid // n_db
    db = pid - tb * n_db
    toks = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tin = toks < T
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = (cols < (D // 8) * 8)[None, :]
    slots = tl.arange(0, CAP)
    # Count and bucket come in one round trip; slots at or past the count (stale memory) are
    # padded with _NO_ROW, which sorts last. (So the load reads slots the bucket kernel did not
    # write: uninitialized memory by design, which compute-sanitizer's initcheck reports.)
    cnt = tl.load(counts_ptr + toks, mask=tin, other=0)
    bkt = tl.load(buckets_ptr + toks[:, None] * CAP + slots[None, :], mask=tin[:, None], other=_NO_ROW)
    bkt = tl.sort(tl.where(slots[None, :] < cnt[:, None], bkt, _NO_ROW), dim=1)
    n = tl.where(cnt <= CAP, cnt, 0)
    # Tokens that receive rows: their output tile is read while their rows are.
    m = (cnt > 0)[:, None] & cm
    o_ptr = out_ptr + (toks * (stride_out // 8) * 8)[:, None] + cols[None, :]
    o = tl.load(o_ptr, mask=m, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # STEP rows per step (4 when tokens get about 4 rows: a top-4 token in one step), all in
    # flight together; the additions stay in row order.
    for k in range(0, tl.max(n, axis=0), STEP):
        h0 = k < n
        h1 = k + 1 < n
        r0 = tl.sum(tl.where(slots[None, :] == k, bkt, 0), axis=1).to(tl.int64)
        r1 = tl.sum(tl.where(slots[None, :] == k + 1, bkt, 0), axis=1).to(tl.int64)
        v0 = tl.load(
            in_ptr + (r0 * (stride_in // 8) * 8)[:, None] + cols[None, :],
            mask=h0[:, None] & cm,
            other=0.0,
            eviction_policy="evict_first",
        )
        v1 = tl.load(
            in_ptr + (r1 * (stride_in // 8) * 8)[:, None] + cols[None, :],
            mask=h1[:, None] & cm,
            other=0.0,
            eviction_policy="evict_first",
        )
        if STEP == 4:
            h2 = k + 2 < n
            h3 = k + 3 < n
            r2 = tl.sum(tl.where(slots[None, :] == k + 2, bkt, 0), axis=1).to(tl.int64)
            r3 = tl.sum(tl.where(slots[None, :] == k + 3, bkt, 0), axis=1).to(tl.int64)
            v2 = tl.load(
                in_ptr + (r2 * (stride_in // 8) * 8)[:, None] + cols[None, :],
                mask=h2[:, None] & cm,
                other=0.0,
                eviction_policy="evict_first",
            )
            v3 = tl.load(
                in_ptr + (r3 * (stride_in // 8) * 8)[:, None] + cols[None, :],
                mask=h3[:, None] & cm,
                other=0.0,
                eviction_policy="evict_first",
            )
        acc += v0.to(tl.float32)
        acc += v1.to(tl.float32)
        if STEP == 4:
            acc += v2.to(tl.float32)
            acc += v3.to(tl.float32)
    if tl.max(cnt, axis=0) > CAP:
        over = tin & (cnt > CAP)
        n_rows = _row_count(valid_ptr, A, HAS_VALID)
        for a0 in range(0, n_rows, BLOCK_A):
            a = a0 + tl.arange(0, BLOCK_A)
            idx = tl.load(tok_ptr + a.to(tl.int64) * stride_tok, mask=a < n_rows, other=-1).to(tl.int64)
            hit = (idx[None, :] == toks[:, None]) & over[:, None]  # idx is never a token >= T here
            acc = _add_hits_in_order(acc, hit, a0, in_ptr, stride_in, cols, cm, BLOCK_A)
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=m)


# Up to this many rows the deterministic scatter-add is one launch (``_scan_sum_kernel``, which
# holds all the indices at once); above it, a memset, the bucket kernel and the bucket sum. Tests
# pin it as the knob ``SCAN_MAX_ROWS`` (``moekit.settings``; the default scatter-add reads it too).
_SCAN_MAX_ROWS = 1024
# Bucket-sum tile: 1024 elements (one token's 1024 columns at D >= 1024), 16 per lane (two
# 16-byte bf16 vectors per row: 2 warps, ~96 registers), so about ten programs are resident per
# SM and their index round trips and bucket sorts overlap the others' data; the per-program
# index work is paid once per 2 KB of each row.
_BUCKET_TILE = 1024
_BUCKET_PER_LANE = 16
# Bucket capacity bounds (slots per token; powers of two).
_MIN_CAP, _MAX_CAP = 4, 256


def _bucket_cap(A: int, T: int) -> int:
    """Slots per token: twice the mean number of rows per token, as a power of two. A top-k
    routing (k <= 128) puts exactly k rows on a token, so no token overflows. Indices drawn at
    random do overflow (about 5% of the tokens for A = 2T: Poisson(2) > 4); those tokens take the
    exact in-kernel scan, which costs a pass over all A indices per overflowing program."""
    return max(_MIN_CAP, min(_MAX_CAP, next_pow2(2 * cdiv(A, T))))


def _bucket_tiles(T: int, D: int, device: torch.device, cap: int = _MIN_CAP) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_D, number of column blocks, num_warps, BLOCK_A) of the bucket sum."""
    block_d = min(next_pow2(D), 1024)
    n_db = cdiv(D, block_d)
    block_t = max(1, min(_BUCKET_TILE // block_d, next_pow2(T)))
    target = _MIN_PROGRAMS_PER_SM * num_sms(device)
    # At most 4096 bucket slots sorted per program (tiny D with a large fan-in would spill).
    while block_t > 1 and (cdiv(T, block_t) * n_db < target or block_t * cap > 4096):
        block_t //= 2
    warps = max(1, min(4, block_t * block_d // (32 * _BUCKET_PER_LANE)))
    # Overflow scan: a [BLOCK_T, BLOCK_A] hit matrix of about 8 entries per lane.
    block_a = max(16, min(1024, warps * 256 // block_t))
    return block_t, block_d, n_db, warps, block_a


def scatter_add_dense_tokens_deterministic(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    """Few rows: one launch that scans the indices. Otherwise three launches with static shapes
    and no host sync: zeroed per-token counts, the bucket kernel (token -> rows with int32
    atomics), then one program per (token block, column block) sums each token's rows in
    ascending row order. Every path gives the same bits."""
    A, D = in_tokens.shape
    T = out_tokens.shape[0]
    if A == 0 or D == 0 or T == 0:
        return
    if A >= 2**31 - 1:  # row indices are int32 in the buckets
        raise ValueError(f"in_tokens must have fewer than 2**31 - 1 rows for the deterministic scatter-add, got {A}")
    device = in_tokens.device
    has_valid = valid_token_count is not None
    valid = valid_token_count if has_valid else token_indices  # unused placeholder when absent
    if A <= settings.get().knob("SCAN_MAX_ROWS", _SCAN_MAX_ROWS):
        block_t, block_d, n_db, warps = _tiles(T, D, device)
        launch(_scan_sum_kernel)[(cdiv(T, block_t) * n_db,)](
            out_tokens,
            in_tokens,
            token_indices,
            valid,
            A,
            T,
            D,
            out_tokens.stride(0),
            in_tokens.stride(0),
            token_indices.stride(0),
            n_db,
            HAS_VALID=has_valid,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            BLOCK_A=128 if A <= 128 else max(1024, next_pow2(A)),  # two buckets: few compilations
            num_warps=warps,
        )
        return
    counts, buckets = _build_buckets(token_indices, valid, has_valid, A, T)
    _sum_buckets(out_tokens, in_tokens, counts, buckets, token_indices, valid, has_valid)


def _build_buckets(
    token_indices: torch.Tensor, valid: torch.Tensor, has_valid: bool, A: int, T: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts ``[T]`` int32, buckets ``[T, cap]`` int32): a memset and the bucket kernel."""
    cap = _bucket_cap(A, T)
    counts = torch.zeros((T,), dtype=torch.int32, device=token_indices.device)
    buckets = torch.empty((T, cap), dtype=torch.int32, device=token_indices.device)
    launch(_bucket_rows_kernel)[(cdiv(A, 256),)](
        counts,
        buckets,
        token_indices,
        valid,
        A,
        T,
        token_indices.stride(0),
        HAS_VALID=has_valid,
        CAP=cap,
        BLOCK=256,
        num_warps=4,
    )
    return counts, buckets


def _sum_buckets(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    counts: torch.Tensor,
    buckets: torch.Tensor,
    token_indices: torch.Tensor,
    valid: torch.Tensor,
    has_valid: bool,
) -> None:
    A, D = in_tokens.shape
    T, cap = buckets.shape
    block_t, block_d, n_db, warps, block_a = _bucket_tiles(T, D, in_tokens.device, cap)
    launch(_bucket_sum_kernel)[(cdiv(T, block_t) * n_db,)](
        out_tokens,
        in_tokens,
        counts,
        buckets,
        token_indices,
        valid,
        A,
        T,
        D,
        out_tokens.stride(0),
        in_tokens.stride(0),
        token_indices.stride(0),
        n_db,
        HAS_VALID=has_valid,
        CAP=cap,
        STEP=4 if A >= 3 * T else 2,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_A=block_a,
        num_warps=warps,
    )
