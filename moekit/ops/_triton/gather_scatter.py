"""Triton kernels: token gather + scale (+ FP8 row-wise quant) and scatter-add (dense, padded,
deterministic).

All kernels move whole rows of ``D`` elements (``D % 8 == 0``, validated by the public ops). A
program owns a ``[BLOCK_R, BLOCK_D]`` tile: several rows when ``D`` is small, a column slice of one
or a few rows when it is large. Row offsets are computed in int64 and written as
``row * (stride // 8) * 8`` so the compiler can prove 8-element alignment and emit 16-byte vector
accesses (bf16) for any ``D`` that is a multiple of 8; the column bound is written the same way so
the mask stays constant over 8 lanes.

Rows are skipped (left untouched) when they are at or past ``valid_token_count[0]`` or when an
index is negative or out of range (the ``-1`` tail of ``index_shuffling``), so nothing is read or
written out of bounds whatever the index values.

The FP8 gather holds a whole row in registers as two power-of-two chunks (D = 5120 is 4096 +
1024, no masked lanes) with 2 warps per row, so about ten rows are in flight per SM. The
deterministic scatter-add is one launch up to ``_SCAN_MAX_ROWS`` rows (every program scans the
indices); above, a stable sort builds the token -> rows map first. Both add a token's rows in
ascending row order and give the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.reference.quantize import FUSED_EPS

# Elements a program moves per tile (8 KB of bf16): large enough for 16-byte vectors on every lane
# of 8 warps, small enough that several programs fit on an SM and keep loads in flight.
_TILE = 4096
# Below this many programs per SM, row blocks shrink (more, smaller programs).
_MIN_PROGRAMS_PER_SM = 4


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_count(valid_ptr, n, HAS_VALID: tl.constexpr):
    """``min(valid_ptr[0], n)`` when a valid count is given, else ``n``."""
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_ptr).to(tl.int64), n)
    return n


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _warps(elems: int) -> int:
    return max(1, min(8, elems // 512))


def _tiles(rows: int, D: int, device: torch.device, max_block_d: int = 1024) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_D, number of column blocks, num_warps) for a row-copy kernel over ``rows``
    rows of ``D`` elements. Shape buckets only: powers of two, no autotuning."""
    block_d = min(next_pow2(D), max_block_d)
    n_db = cdiv(D, block_d)
    block_r = max(1, min(_TILE // block_d, next_pow2(rows)))
    target = _MIN_PROGRAMS_PER_SM * num_sms(device)
    while block_r > 1 and cdiv(rows, block_r) * n_db < target:
        block_r //= 2
    return block_r, block_d, n_db, _warps(block_r * block_d)


# ----------------------------------------------------------------------------------------------
# gather + scale
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_scale_kernel(
    out_ptr,
    x_ptr,
    tok_ptr,
    exp_ptr,
    scores_ptr,
    valid_ptr,
    A,
    T,
    E,
    D,
    stride_x,
    stride_out,
    stride_tok,
    stride_exp,
    stride_st,
    stride_se,
    n_db,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rb = pid // n_db
    db = pid - rb * n_db
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    exp = tl.load(exp_ptr + rows * stride_exp, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T) & (exp >= 0) & (exp < E)
    s = tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=ok, other=0.0).to(tl.float32)

    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    m = ok[:, None] & (cols < (D // 8) * 8)[None, :]
    x_off = tok * (stride_x // 8) * 8
    v = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = v * s[:, None]
    o_off = rows * (stride_out // 8) * 8
    tl.store(out_ptr + o_off[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launcher (arguments validated by the public op). ``out`` (tests): a preallocated
    ``[a, D]`` output whose unwritten rows stay as they are."""
    T, D = x.shape
    A = token_indices.shape[0]
    if out is None:
        out = torch.empty((A, D), dtype=x.dtype, device=x.device)
    if A == 0 or D == 0 or T == 0:
        return out
    block_r, block_d, n_db, warps = _tiles(A, D, x.device)
    has_valid = valid_token_count is not None
    grid = (cdiv(A, block_r) * n_db,)
    launch(_gather_scale_kernel)[grid](
        out,
        x,
        token_indices,
        expert_indices,
        scores,
        valid_token_count if has_valid else token_indices,
        A,
        T,
        scores.shape[1],
        D,
        x.stride(0),
        out.stride(0),
        token_indices.stride(0),
        expert_indices.stride(0),
        scores.stride(0),
        scores.stride(1),
        n_db,
        HAS_VALID=has_valid,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out


# ----------------------------------------------------------------------------------------------
# gather + scale + FP8 row-wise quantization
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gather_scale_quant_kernel(
    out_ptr,
    scale_ptr,
    x_ptr,
    tok_ptr,
    exp_ptr,
    scores_ptr,
    valid_ptr,
    ub_ptr,
    A,
    T,
    E,
    D,
    stride_x,
    stride_out,
    stride_tok,
    stride_exp,
    stride_st,
    stride_se,
    HAS_VALID: tl.constexpr,
    HAS_UB: tl.constexpr,
    EPS: tl.constexpr,
    MAX_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    W_TAIL: tl.constexpr,
):
    """One pass (``ONE_PASS``): a row is ``[BLOCK_D]`` columns plus ``W_TAIL`` tail columns
    (``BLOCK_D + W_TAIL >= D``; D = 5120 is 4096 + 1024), all loaded at once and held in
    registers. Otherwise two passes over ``BLOCK_D`` column blocks (amax, then quantize; the
    second read mostly hits the L2)."""
    pid = tl.program_id(0)
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    exp = tl.load(exp_ptr + rows * stride_exp, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T) & (exp >= 0) & (exp < E)
    s = tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=ok, other=0.0).to(tl.float32)
    x_row = x_ptr + (tok * (stride_x // 8) * 8)[:, None]
    o_row = out_ptr + (rows * (stride_out // 8) * 8)[:, None]
    d_lim = (D // 8) * 8
    cols = tl.arange(0, BLOCK_D)

    if ONE_PASS:
        # Both loads are issued before either reduction: a whole row is in flight at once.
        m = ok[:, None] & (cols < d_lim)[None, :]
        v = tl.load(x_row + cols[None, :], mask=m, other=0.0)
        if W_TAIL > 0:
            tcols = BLOCK_D + tl.arange(0, W_TAIL)
            tm = ok[:, None] & (tcols < d_lim)[None, :]
            tv = tl.load(x_row + tcols[None, :], mask=tm, other=0.0)
        # max_i |x_i * s| == max_i |x_i| * |s| bit for bit (float32 rounding is monotone and
        # sign-symmetric), so the row stays in registers in its own dtype until it is quantized.
        xmax = tl.max(tl.abs(v), axis=1).to(tl.float32)
        if W_TAIL > 0:
            xmax = tl.maximum(xmax, tl.max(tl.abs(tv), axis=1).to(tl.float32))
        amax = xmax * tl.abs(s)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for d0 in tl.range(0, D, BLOCK_D):
            c = d0 + cols
            m = ok[:, None] & (c < d_lim)[None, :]
            v = tl.load(x_row + c[None, :], mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc = tl.maximum(acc, tl.abs(v * s[:, None]))
        amax = tl.max(acc, axis=1)

    # As the float32 reference: amax floored at eps, clamped to scale_ub; inv = 448 / amax and
    # the dequant scale 1 / inv, both correctly rounded divisions (div_rn: the GPU's `/` may
    # lower to an approximate division).
    amax = tl.maximum(amax, EPS)
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(ub_ptr).to(tl.float32))
    inv = tl.div_rn(tl.full(amax.shape, MAX_FP8, tl.float32), amax)
    tl.store(scale_ptr + rows, tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv), mask=ok)

    if ONE_PASS:
        q = tl.clamp((v.to(tl.float32) * s[:, None]) * inv[:, None], -MAX_FP8, MAX_FP8)
        tl.store(o_row + cols[None, :], to_fp8(q, out_ptr.dtype.element_ty, EMULATE), mask=m)
        if W_TAIL > 0:
            tq = tl.clamp((tv.to(tl.float32) * s[:, None]) * inv[:, None], -MAX_FP8, MAX_FP8)
            tl.store(o_row + tcols[None, :], to_fp8(tq, out_ptr.dtype.element_ty, EMULATE), mask=tm)
    else:
        for d0 in tl.range(0, D, BLOCK_D):
            c = d0 + cols
            m = ok[:, None] & (c < d_lim)[None, :]
            v = tl.load(x_row + c[None, :], mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            q = tl.clamp((v * s[:, None]) * inv[:, None], -MAX_FP8, MAX_FP8)
            tl.store(o_row + c[None, :], to_fp8(q, out_ptr.dtype.element_ty, EMULATE), mask=m)


# Rows up to this many elements are quantized from registers in one pass.
_ONE_PASS_MAX_D = 8192
# Elements of x one quant program holds at most (several rows when D is small).
_QUANT_TILE = 8192


def _quant_tiles(rows: int, D: int, device: torch.device) -> tuple[int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_D, W_TAIL, one_pass, num_warps). One pass: BLOCK_D is the largest power of
    two <= D and W_TAIL the power of two covering the rest (0 when D is a power of two), so a row
    of D = 5120 takes 4096 + 1024 lanes, none masked."""
    one_pass = D <= _ONE_PASS_MAX_D
    if one_pass:
        block_d = _pow2_floor(max(D, 8))
        rem = D - block_d
        w_tail = next_pow2(rem) if rem else 0
    else:
        block_d, w_tail = 4096, 0
    width = block_d + w_tail
    block_r = max(1, min(_QUANT_TILE // width, next_pow2(rows)))
    target = _MIN_PROGRAMS_PER_SM * num_sms(device)
    while block_r > 1 and cdiv(rows, block_r) < target:
        block_r //= 2
    # 2 warps for a row of D = 5120 (80 elements per lane in 16-byte vectors; ~96 registers), so
    # ~10 rows are in flight per SM; more warps would add a layout conversion through shared
    # memory for the FP8 store and more instructions per row.
    warps = _pow2_floor(max(1, min(4, block_r * width // 2048))) if one_pass else _warps(block_r * width)
    return block_r, block_d, w_tail, one_pass, warps


def gather_scale_quant_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. ``out``/``out_scale`` (tests): preallocated outputs left untouched where unwritten."""
    T, D = x.shape
    A = token_indices.shape[0]
    if out is None:
        out = torch.empty((A, D), dtype=FP8_DTYPE, device=x.device)
    if out_scale is None:
        out_scale = torch.empty((A,), dtype=torch.float32, device=x.device)
    if A == 0 or T == 0:
        return out, out_scale
    block_r, block_d, w_tail, one_pass, warps = _quant_tiles(A, D, x.device)
    has_valid = valid_token_count is not None
    launch(_gather_scale_quant_kernel)[(cdiv(A, block_r),)](
        out,
        out_scale,
        x,
        token_indices,
        expert_indices,
        scores,
        valid_token_count if has_valid else token_indices,
        scale_ub if scale_ub is not None else x,  # unused placeholder: an input, never an output
        A,
        T,
        scores.shape[1],
        D,
        x.stride(0),
        out.stride(0),
        token_indices.stride(0),
        expert_indices.stride(0),
        scores.stride(0),
        scores.stride(1),
        HAS_VALID=has_valid,
        HAS_UB=scale_ub is not None,
        EPS=FUSED_EPS,
        MAX_FP8=FP8_MAX,
        EMULATE=EMULATE_FP8,
        ONE_PASS=one_pass,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        W_TAIL=w_tail,
        num_warps=warps,
    )
    return out, out_scale


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
):
    pid = tl.program_id(0)
    rb = pid // n_db
    db = pid - rb * n_db
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T)
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    m = ok[:, None] & (cols < (D // 8) * 8)[None, :]
    i_off = rows * (stride_in // 8) * 8
    v = tl.load(in_ptr + i_off[:, None] + cols[None, :], mask=m, other=0.0, eviction_policy="evict_first")
    o_off = tok * (stride_out // 8) * 8
    tl.atomic_add(out_ptr + o_off[:, None] + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=m, sem="relaxed")


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    A, D = in_tokens.shape
    T = out_tokens.shape[0]
    if A == 0 or D == 0 or T == 0:
        return
    block_r, block_d, n_db, warps = _tiles(A, D, in_tokens.device)
    has_valid = valid_token_count is not None
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
        num_warps=warps,
    )


# ----------------------------------------------------------------------------------------------
# scatter-add, dense, deterministic (no atomics)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _token_keys_kernel(
    key_ptr,
    tok_ptr,
    valid_ptr,
    A,
    T,
    stride_tok,
    HAS_VALID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``key[r] = token_indices[r]`` for rows that are added, ``T`` (sorts last) for the others."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    inb = rows < A
    tok = tl.load(tok_ptr + rows * stride_tok, mask=inb, other=-1).to(tl.int64)
    ok = (rows < n_rows) & (tok >= 0) & (tok < T)
    tl.store(key_ptr + rows, tl.where(ok, tok, T).to(tl.int32), mask=inb)


@triton.jit
def _segment_sum_kernel(
    out_ptr,
    in_ptr,
    perm_ptr,
    bounds_ptr,
    T,
    D,
    stride_out,
    stride_in,
    n_db,
    STEP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token t owns sorted rows ``[bounds[t], bounds[t + 1])`` (ascending original row order):
    their sum in float32, in that order, is added to ``out[t]`` with one read-modify-write."""
    pid = tl.program_id(0)
    tb = pid // n_db
    db = pid - tb * n_db
    toks = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tin = toks < T
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = (cols < (D // 8) * 8)[None, :]
    lo = tl.load(bounds_ptr + toks, mask=tin, other=0).to(tl.int64)
    hi = tl.load(bounds_ptr + toks + 1, mask=tin, other=0).to(tl.int64)
    n = hi - lo
    # Tokens that receive rows: their output tile is read while the row map is.
    m = (n > 0)[:, None] & cm
    o_ptr = out_ptr + (toks * (stride_out // 8) * 8)[:, None] + cols[None, :]
    o = tl.load(o_ptr, mask=m, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    max_n = tl.max(n, axis=0)
    # STEP rows per step (4 when tokens get about 4 rows: a top-4 token in one step): their map
    # entries, then their data, are all in flight together; the additions stay in row order.
    for k in range(0, max_n, STEP):
        h0 = k < n
        h1 = k + 1 < n
        r0 = tl.load(perm_ptr + lo + k, mask=h0, other=0).to(tl.int64)
        r1 = tl.load(perm_ptr + lo + k + 1, mask=h1, other=0).to(tl.int64)
        if STEP == 4:
            h2 = k + 2 < n
            h3 = k + 3 < n
            r2 = tl.load(perm_ptr + lo + k + 2, mask=h2, other=0).to(tl.int64)
            r3 = tl.load(perm_ptr + lo + k + 3, mask=h3, other=0).to(tl.int64)
        v0 = tl.load(in_ptr + (r0 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h0[:, None] & cm,
                     other=0.0, eviction_policy="evict_first")
        v1 = tl.load(in_ptr + (r1 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h1[:, None] & cm,
                     other=0.0, eviction_policy="evict_first")
        if STEP == 4:
            v2 = tl.load(in_ptr + (r2 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h2[:, None] & cm,
                         other=0.0, eviction_policy="evict_first")
            v3 = tl.load(in_ptr + (r3 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h3[:, None] & cm,
                         other=0.0, eviction_policy="evict_first")
        acc += v0.to(tl.float32)
        acc += v1.to(tl.float32)
        if STEP == 4:
            acc += v2.to(tl.float32)
            acc += v3.to(tl.float32)
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=m)


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
):
    """Few rows (``A <= BLOCK_A``): no inverse map. Every program reads all of ``token_indices``
    (at most a few KB, from the L2), and adds the rows that hit its tokens in ascending row order
    (two per step): the same float32 additions in the same order as ``_segment_sum_kernel``
    (masked-off rows add +0.0, an exact no-op), so both paths give the same bits."""
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
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for _ in range(0, tl.max(cnt, axis=0), 2):
        r0 = tl.min(tl.where(hit, a[None, :], BLOCK_A), axis=1)
        hit = hit & (a[None, :] != r0[:, None])
        r1 = tl.min(tl.where(hit, a[None, :], BLOCK_A), axis=1)
        hit = hit & (a[None, :] != r1[:, None])
        h0 = r0 < BLOCK_A
        h1 = r1 < BLOCK_A
        p0 = in_ptr + (r0.to(tl.int64) * (stride_in // 8) * 8)[:, None] + cols[None, :]
        p1 = in_ptr + (r1.to(tl.int64) * (stride_in // 8) * 8)[:, None] + cols[None, :]
        v0 = tl.load(p0, mask=h0[:, None] & cm, other=0.0, eviction_policy="evict_first")
        v1 = tl.load(p1, mask=h1[:, None] & cm, other=0.0, eviction_policy="evict_first")
        acc += v0.to(tl.float32)
        acc += v1.to(tl.float32)
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=m)


# Up to this many rows the deterministic scatter-add is one launch (``_scan_sum_kernel``, which
# holds all the indices at once); above it, a stable sort builds the inverse map (4 launches
# plus the sum).
_SCAN_MAX_ROWS = 1024


def scatter_add_dense_tokens_deterministic(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: Optional[torch.Tensor] = None,
) -> None:
    """Few rows: one launch that scans the indices. Otherwise: inverse map token -> rows with a
    stable sort (static shapes, no host sync), then one program per (token block, column block)
    sums each token's rows in ascending row order. Both give the same bits."""
    A, D = in_tokens.shape
    T = out_tokens.shape[0]
    if A == 0 or D == 0 or T == 0:
        return
    device = in_tokens.device
    has_valid = valid_token_count is not None
    block_t, block_d, n_db, warps = _tiles(T, D, device)
    if A <= _SCAN_MAX_ROWS:
        launch(_scan_sum_kernel)[(cdiv(T, block_t) * n_db,)](
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
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            BLOCK_A=128 if A <= 128 else max(1024, next_pow2(A)),  # two buckets: few compilations
            num_warps=warps,
        )
        return
    keys = torch.empty((A,), dtype=torch.int32, device=device)
    kblock = min(1024, max(16, next_pow2(A)))
    launch(_token_keys_kernel)[(cdiv(A, kblock),)](
        keys,
        token_indices,
        valid_token_count if has_valid else token_indices,
        A,
        T,
        token_indices.stride(0),
        HAS_VALID=has_valid,
        BLOCK=kblock,
        num_warps=4,
    )
    sorted_keys, perm = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(
        sorted_keys, torch.arange(T + 1, dtype=torch.int32, device=device), out_int32=True
    )
    launch(_segment_sum_kernel)[(cdiv(T, block_t) * n_db,)](
        out_tokens,
        in_tokens,
        perm,
        bounds,
        T,
        D,
        out_tokens.stride(0),
        in_tokens.stride(0),
        n_db,
        STEP=4 if A >= 3 * T else 2,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=warps,
    )


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
):
    """Send row ``o`` (expert ``e``, rank ``e // EPR``) adds ``in[rank, o]`` into
    ``out[token_indices[o]]``. Rank boundaries come from the ``[E]`` counts, summed here."""
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
