"""Triton kernels: scatter-add of rows onto their tokens, dense (``scatter_add_dense_tokens``:
atomics, or the per-token locked read-add-write, or the deterministic bucket sum where faster) and
padded (``scatter_add_padded_tokens``, the static expert-parallel layout). Conventions:
``gs_common``.

The top-1 scatter-add (fewer than two rows per token) reads, adds and writes each output row under
a per-token int32 lock instead of atomics on the data.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gs_common import _MIN_PROGRAMS_PER_SM, _TILE, _pow2_floor, _row_count, _tiles, _warps
from moekit.ops._triton.gs_gather import _ONE_PASS_MAX_D, _quant_chunk
from moekit.ops._triton.gs_scatter_det import _SCAN_MAX_ROWS, scatter_add_dense_tokens_deterministic


# ----------------------------------------------------------------------------------------------
# scatter-add, dense (atomics)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scatter_add_kernel(
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
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPECULATE: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    rb = pid // n_db
    db = pid - rb * n_db
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T)
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = (cols < (D // 8) * 8)[None, :]
    m = ok[:, None] & cm
    i_off = rows * (stride_in // 8) * 8
    # SPECULATE (a few rows): the row's mask does not wait for its token index, so both loads
    # are in flight together (one memory latency instead of two). Rows whose index is outside
    # [0, T) are then read and dropped; with many rows (e.g. the -1 tail of an expert range)
    # those reads would cost bandwidth, so there the index gates the load.
    if SPECULATE:
        lm = live[:, None] & cm
    else:
        lm = m
    v = tl.load(in_ptr + i_off[:, None] + cols[None, :], mask=lm, other=0.0, eviction_policy="evict_first")
    o_off = tok * (stride_out // 8) * 8
    tl.atomic_add(out_ptr + o_off[:, None] + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=m, sem="relaxed")


@triton.jit
def _scatter_add_locked_kernel(
    out_ptr,
    in_ptr,
    tok_ptr,
    lock_ptr,
    valid_ptr,
    A,
    T,
    D,
    stride_out,
    stride_in,
    stride_tok,
    HAS_VALID: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """One input row per program, no atomics on the data: the row is loaded (``N_CHUNKS`` chunks
    of ``BLOCK_D``), the token's lock taken (an int32 compare-and-swap, acquire), the output row
    read from the L2, added in float32 and stored, the lock released (after a barrier, so every
    lane's store precedes it). Rows of one token serialize on its lock, so any indices are
    correct; the locks are left as found (zero)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    tok = tl.load(tok_ptr + row * stride_tok).to(tl.int64)
    if (row < n_rows) & (tok >= 0) & (tok < T):
        d_lim = (D // 8) * 8
        cols = tl.arange(0, BLOCK_D)
        i_row = in_ptr + row * (stride_in // 8) * 8
        o_row = out_ptr + tok * (stride_out // 8) * 8
        vs = ()
        for i in tl.static_range(N_CHUNKS):
            c = i * BLOCK_D + cols
            vs = vs + (tl.load(i_row + c, mask=c < d_lim, other=0.0, eviction_policy="evict_first"),)
        lock = lock_ptr + tok
        while tl.atomic_cas(lock, 0, 1, sem="acquire") != 0:
            pass
        for i in tl.static_range(N_CHUNKS):
            c = i * BLOCK_D + cols
            cur = tl.load(o_row + c, mask=c < d_lim, other=0.0, cache_modifier=".cg")
            tl.store(
                o_row + c, (cur.to(tl.float32) + vs[i].to(tl.float32)).to(out_ptr.dtype.element_ty), mask=c < d_lim
            )
        tl.debug_barrier()
        tl.atomic_xchg(lock, 0, sem="release")


# Per-device int32 token locks of the locked scatter-add, all zero between launches (every lock
# taken is released); grown, never shrunk. A replaced buffer is kept alive in ``_RETIRED_LOCKS``:
# a CUDA graph captured with it still takes its locks there, and freeing it would hand that
# memory to another tensor under the graph. ``_LOCKS_ZEROED`` holds, per device, the event that
# follows a new buffer's memset until the host has seen it complete: until then a launch on any
# stream waits for it (or, while capturing, takes the atomics), so a stream other than the one
# that zeroed the buffer never sees it uninitialised.
_LOCKS: dict = {}
_RETIRED_LOCKS: list = []
_LOCKS_ZEROED: dict = {}
# The locked scatter-add from this many rows (H200, D = 5120 bf16, top-1: T = 2048 18.6 vs 19.1-19.5
# µs atomic, T = 4096 34.6 vs 37.7-38.2, T = 16384 129 vs 144; below, the compare-and-swap round
# trip is not hidden and atomics stay). Tests pin it as the knob ``LOCKED_MIN_ROWS`` (``moekit.settings``).
_LOCKED_MIN_ROWS = 1024


def _token_locks(out: torch.Tensor, T: int) -> Optional[torch.Tensor]:
    """``T`` zeroed int32 locks on ``out``'s device, or None where the locked path must not run:
    under tracing (torch.compile: a hidden buffer is not an input) and while a CUDA graph is being
    captured with a buffer too small (growing it there would bake a memset into the graph)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(out) or torch.compiler.is_compiling():
        return None
    key = (out.device.type, out.device.index)
    buf = _LOCKS.get(key)
    capturing = out.is_cuda and torch.cuda.is_current_stream_capturing()
    if buf is None or buf.numel() < T:
        if capturing:
            return None
        if buf is not None:
            _RETIRED_LOCKS.append(buf)
        buf = torch.zeros(max(T, 2 * (0 if buf is None else buf.numel()), 4096), dtype=torch.int32, device=out.device)
        _LOCKS[key] = buf
        if out.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(out.device))
            _LOCKS_ZEROED[key] = done
    done = _LOCKS_ZEROED.get(key)
    if done is not None:
        if done.query():  # the memset has completed: every stream may use the buffer from now on
            del _LOCKS_ZEROED[key]
        elif capturing:  # a captured graph cannot wait on an event recorded outside it
            return None
        else:
            torch.cuda.current_stream(out.device).wait_event(done)
    return buf


def _prefer_locked(A: int, T: int, D: int) -> bool:
    """Top-1-like fan-ins (fewer than two rows per token on average) of many rows with rows that
    fit the one-pass register budget: the locked read-add-write instead of atomics. A token hit by
    many rows would serialize them on its lock; two per token on average at most keeps that rare
    (top-1 routing gives each token one row)."""
    s = settings.get()
    return s.knob("LOCKED_MIN_ROWS", _LOCKED_MIN_ROWS) <= A < 2 * T and D <= s.knob("ONE_PASS_MAX_D", _ONE_PASS_MAX_D)


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    """Atomic adds, or, where it is faster, the deterministic scatter-add (top-k > 1, see
    ``_prefer_bucket_sum``) or the locked read-add-write (top-1, see ``_prefer_locked``): all
    honour the same contract; only the rounding order of a token's rows differs."""
    A, D = in_tokens.shape
    T = out_tokens.shape[0]
    if A == 0 or D == 0 or T == 0:
        return
    if _prefer_bucket_sum(A, T):
        scatter_add_dense_tokens_deterministic(out_tokens, in_tokens, token_indices, valid_token_count)
        return
    has_valid = valid_token_count is not None
    locks = _token_locks(out_tokens, T) if _prefer_locked(A, T, D) else None
    if locks is not None:
        block_d = _quant_chunk(D)
        launch(_scatter_add_locked_kernel)[(A,)](
            out_tokens,
            in_tokens,
            token_indices,
            locks,
            valid_token_count if has_valid else token_indices,
            A,
            T,
            D,
            out_tokens.stride(0),
            in_tokens.stride(0),
            token_indices.stride(0),
            HAS_VALID=has_valid,
            BLOCK_D=block_d,
            N_CHUNKS=cdiv(D, block_d),
            # 4 warps for a row of 5120 (measured best: 8 warps 55%, column blocks 66-75% of the
            # floor at T = 2048), fewer for short rows.
            num_warps=max(1, min(4, _pow2_floor(max(D // 1024, 1)))),
        )
        return
    block_r, block_d, n_db, _ = _tiles(A, D, in_tokens.device)
    # One 16-byte vector per lane (bf16): 4 warps for a 1024-column slice of one row (measured
    # 1.53 vs 1.64 µs for one row of 5120 with 2 warps; equal within 1% at T = 2048).
    warps = max(1, min(8, block_r * block_d // 256))
    launch(_scatter_add_kernel)[(cdiv(A, block_r) * n_db,)](
        out_tokens,
        in_tokens,
        token_indices,
        valid_token_count if has_valid else token_indices,
        A,
        T,
        D,
        out_tokens.stride(0),
        in_tokens.stride(0),
        token_indices.stride(0),
        n_db,
        HAS_VALID=has_valid,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        SPECULATE=A <= _SPECULATE_MAX_ROWS,
        num_warps=warps,
    )


# Up to this many rows the atomic scatter reads each row without waiting for its index (at most
# 64 rows of reads that an invalid index wastes; T = 1: 1.45-1.52 vs 1.60-1.64 µs with the wait).
_SPECULATE_MAX_ROWS = 64


def _prefer_bucket_sum(A: int, T: int) -> bool:
    """Tokens receiving two or more rows on average (top-k > 1), past the one-launch scan's size:
    the deterministic bucket sum reads and writes each output row once, where atomics make a
    read-modify-write of it in the L2 per row (H200, D = 5120 bf16: T = 2048, top-4: 37.1 vs
    45.4 µs; T = 16384, top-4: 250 vs 558 µs). Top-1 keeps the atomics (19.7 vs 22.4 µs), and
    so do fan-ins above 64 rows per token on average (a few tokens with thousands of rows: the
    overflow scan would serialize them)."""
    return settings.get().knob("SCAN_MAX_ROWS", _SCAN_MAX_ROWS) < A < 2**31 - 1 and 2 * T <= A <= 64 * T


# ----------------------------------------------------------------------------------------------
# scatter-add, padded (static expert-parallel path)
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_cnt"])  # see _shuffle_kernel: keeps the scan's layout plain
def _scatter_add_padded_kernel(
    out_ptr,
    in_ptr,
    counts_ptr,
    tok_ptr,
    T_K,
    T,
    E,
    EP,
    EPR,
    D,
    stride_in_r,
    stride_in_t,
    stride_out,
    stride_tok,
    stride_cnt,
    BLOCK_EP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Send row ``o`` (expert ``e``, rank ``e // EPR``) adds ``in[rank, o]`` into
    ``out[token_indices[o]]``. Rank boundaries come from the ``[E]`` counts, summed here."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_EP)
    per_rank = tl.zeros((BLOCK_EP,), dtype=tl.int64)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        c = tl.load(counts_ptr + e * stride_cnt, mask=e < E, other=0).to(tl.int64)
        same = (e // EPR)[None, :] == r[:, None]
        per_rank += tl.sum(tl.where(same, c[None, :], 0), axis=1)
    rank_end = tl.cumsum(per_rank, axis=0)  # [BLOCK_EP]; ranks >= EP add nothing
    total = tl.minimum(tl.sum(per_rank, axis=0), T_K)

    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < total
    rank = tl.sum((rank_end[None, :] <= rows[:, None]).to(tl.int64), axis=1)
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T) & (rank < EP)
    i_row = in_ptr + (rank * (stride_in_r // 8) * 8 + rows * (stride_in_t // 8) * 8)[:, None]
    o_row = out_ptr + (tok * (stride_out // 8) * 8)[:, None]
    d_lim = (D // 8) * 8
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (cols < d_lim)[None, :]
        v = tl.load(i_row + cols[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        tl.atomic_add(o_row + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=m, sem="relaxed")


def scatter_add_padded_tokens(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> None:
    EP, T_K, D = in_tokens.shape
    E = token_counts.shape[0]
    T = out_tokens.shape[0]
    if T_K == 0 or D == 0 or T == 0 or E == 0:
        return
    block_d = min(next_pow2(D), 1024)
    block_r = max(1, min(_TILE // block_d, next_pow2(T_K)))
    target = _MIN_PROGRAMS_PER_SM * num_sms(in_tokens.device)
    while block_r > 1 and cdiv(T_K, block_r) < target:
        block_r //= 2
    block_ep = next_pow2(EP)
    launch(_scatter_add_padded_kernel)[(cdiv(T_K, block_r),)](
        out_tokens,
        in_tokens,
        token_counts,
        token_indices,
        T_K,
        T,
        E,
        EP,
        E // EP,
        D,
        in_tokens.stride(0),
        in_tokens.stride(1),
        out_tokens.stride(0),
        token_indices.stride(0),
        token_counts.stride(0),
        BLOCK_EP=block_ep,
        BLOCK_E=min(next_pow2(E), max(16, 4096 // block_ep)),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=_warps(block_r * block_d),
    )
