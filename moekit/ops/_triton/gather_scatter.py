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

The bf16 gather moves rows of up to 8192 columns whole (a power-of-two head and a tail chunk) on a
persistent, software-pipelined grid when there are 8-64 rows per SM (each step loads the next
unit's rows and the indices of the one after, then stores the current unit); column-block tiles
otherwise. On CUDA the FP8 conversions saturate by themselves (no clamp instructions).
The FP8 gather holds a whole row in registers in its own dtype as power-of-two chunks (D = 5120
is 5 x 1024, no masked lanes) with 2 warps per row, takes the amax on the bit patterns and
quantizes chunk by chunk: 64 registers per lane, 16 rows in flight per SM. The top-1 scatter-add
(fewer than two rows per token) reads, adds and writes each output row under a per-token int32
lock instead of atomics on the data. The deterministic scatter-add is one launch up to
``_SCAN_MAX_ROWS`` rows (every program scans the indices); above, an int32-atomic bucket kernel
builds the token -> rows map (no sort) and the sum kernel sorts each token's small bucket in
registers. Both add a token's rows in ascending row order and give the same bits.

Every kernel starts with ``pdl_prologue`` (programmatic dependent launch, ``moekit.ops._common``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.quantize import row_scales
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
def _gather_index(rows, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp):
    """Token and expert of each row (int64) and whether the row moves."""
    live = rows < n_rows
    tok = tl.load(tok_ptr + rows * stride_tok, mask=live, other=-1).to(tl.int64)
    exp = tl.load(exp_ptr + rows * stride_exp, mask=live, other=-1).to(tl.int64)
    ok = live & (tok >= 0) & (tok < T) & (exp >= 0) & (exp < E)
    return tok, exp, ok


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
    USE_PDL: tl.constexpr = 0,
):
    """A ``[BLOCK_R, BLOCK_D]`` tile (``n_db`` column blocks per row block), one per program."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    rb = pid // n_db
    db = pid - rb * n_db
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok, exp, ok = _gather_index(rows, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
    s = tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=ok, other=0.0).to(tl.float32)
    d_lim = (D // 8) * 8
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    m = ok[:, None] & (cols < d_lim)[None, :]
    x_row = x_ptr + (tok * (stride_x // 8) * 8)[:, None]
    o_row = out_ptr + (rows * (stride_out // 8) * 8)[:, None]
    v = tl.load(x_row + cols[None, :], mask=m, other=0.0)
    tl.store(o_row + cols[None, :], (v.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gather_row(x_ptr, scores_ptr, tok, exp, ok, d_lim, stride_x, stride_st, stride_se,
                BLOCK_D: tl.constexpr, W_TAIL: tl.constexpr):
    """The rows' ``BLOCK_D`` head and ``W_TAIL`` tail columns (raw dtype) and their scores."""
    s = tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=ok, other=0.0).to(tl.float32)
    x_row = x_ptr + (tok * (stride_x // 8) * 8)[:, None]
    cols = tl.arange(0, BLOCK_D)
    v = tl.load(x_row + cols[None, :], mask=ok[:, None] & (cols < d_lim)[None, :], other=0.0,
                eviction_policy="evict_first")
    if W_TAIL > 0:
        tcols = BLOCK_D + tl.arange(0, W_TAIL)
        tv = tl.load(x_row + tcols[None, :], mask=ok[:, None] & (tcols < d_lim)[None, :], other=0.0,
                     eviction_policy="evict_first")
    else:
        tv = v
    return v, tv, s


@triton.jit
def _gather_scale_stream_kernel(
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
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    W_TAIL: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    """Whole rows (``BLOCK_D`` head + ``W_TAIL`` tail, ``BLOCK_D + W_TAIL >= D``), a persistent
    grid over units of ``BLOCK_R`` rows, software-pipelined: each step loads the next unit's rows
    (their indices arrived during the previous step) and the indices of the unit after, then
    scales and stores the current unit. Same results as ``_gather_scale_kernel``."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    n_units = tl.cdiv(n_rows, BLOCK_R)
    step = nprog.to(tl.int64) * BLOCK_R
    d_lim = (D // 8) * 8
    cols = tl.arange(0, BLOCK_D)
    odt = out_ptr.dtype.element_ty
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok, exp, ok = _gather_index(rows, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
    v, tv, s = _gather_row(x_ptr, scores_ptr, tok, exp, ok, d_lim, stride_x, stride_st, stride_se, BLOCK_D, W_TAIL)
    rows_n = rows + step
    tok_n, exp_n, ok_n = _gather_index(rows_n, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
    for _u in range(pid, n_units, nprog):
        v_n, tv_n, s_n = _gather_row(x_ptr, scores_ptr, tok_n, exp_n, ok_n, d_lim, stride_x, stride_st, stride_se,
                                     BLOCK_D, W_TAIL)
        rows_nn = rows_n + step
        tok_nn, exp_nn, ok_nn = _gather_index(rows_nn, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
        o_row = out_ptr + (rows * (stride_out // 8) * 8)[:, None]
        tl.store(o_row + cols[None, :], (v.to(tl.float32) * s[:, None]).to(odt), mask=ok[:, None] & (cols < d_lim)[None, :])
        if W_TAIL > 0:
            tcols = BLOCK_D + tl.arange(0, W_TAIL)
            tl.store(o_row + tcols[None, :], (tv.to(tl.float32) * s[:, None]).to(odt),
                     mask=ok[:, None] & (tcols < d_lim)[None, :])
        rows, ok, v, tv, s = rows_n, ok_n, v_n, tv_n, s_n
        rows_n, tok_n, exp_n, ok_n = rows_nn, tok_nn, exp_nn, ok_nn


# Whole rows (head + tail chunks, ``_gather_scale_stream_kernel``) from _MIN to _MAX rows per
# SM; below, column-block tiles spread a few rows over more programs, and above, column blocks
# measured faster too (H200, D = 5120 bf16, run 24: T = 16384 83.3 µs column blocks vs 89.7 for
# the best streamed whole rows). Set _MIN (or the programs per SM below) to 0 to always use
# column blocks.
_GATHER_WHOLE_ROW_MIN_ROWS_PER_SM = 8
_GATHER_WHOLE_ROW_MAX_ROWS_PER_SM = 64
# Whole rows run on a persistent, software-pipelined grid of this many programs per SM, 4 warps
# for a row of 5120 (run 24: T = 2048 10.7 µs vs 11.5 one row per program; T = 4096 equal).
_GATHER_STREAM_PROGRAMS_PER_SM = 8


def _gather_tiles(rows: int, D: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_R, BLOCK_D, W_TAIL, number of column blocks, num_warps, streamed programs per SM)
    for the bf16/fp16/fp32 gather. Whole rows (the FP8 gather's head + tail split) on the
    persistent pipelined kernel from 8 to 64 rows per SM; one column-block tile per program
    otherwise (streamed programs per SM: 0). Measured; see the constants above."""
    if (
        _GATHER_WHOLE_ROW_MIN_ROWS_PER_SM
        and _GATHER_STREAM_PROGRAMS_PER_SM
        and D <= _ONE_PASS_MAX_D
        and _GATHER_WHOLE_ROW_MIN_ROWS_PER_SM * num_sms(device)
        <= rows
        < _GATHER_WHOLE_ROW_MAX_ROWS_PER_SM * num_sms(device)
    ):
        block_d = _pow2_floor(max(D, 8))
        rem = D - block_d
        w_tail = next_pow2(rem) if rem else 0
        width = block_d + w_tail
        block_r = _pow2_floor(max(1, min(_QUANT_TILE // width, next_pow2(rows))))  # tl.arange: a power of two
        target = _MIN_PROGRAMS_PER_SM * num_sms(device)
        while block_r > 1 and cdiv(rows, block_r) < target:
            block_r //= 2
        warps = _pow2_floor(max(1, min(8, block_r * width // 1024)))
        return block_r, block_d, w_tail, 1, warps, _GATHER_STREAM_PROGRAMS_PER_SM
    block_r, block_d, n_db, warps = _tiles(rows, D, device)
    return block_r, block_d, 0, n_db, warps, 0


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
    block_r, block_d, w_tail, n_db, warps, stream = _gather_tiles(A, D, x.device)
    has_valid = valid_token_count is not None
    args = (
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
    )
    if stream:
        grid = (max(1, min(cdiv(A, block_r), stream * num_sms(x.device))),)
        launch(_gather_scale_stream_kernel)[grid](
            *args, HAS_VALID=has_valid, BLOCK_R=block_r, BLOCK_D=block_d, W_TAIL=w_tail, num_warps=warps
        )
    else:
        grid = (cdiv(A, block_r) * n_db,)
        launch(_gather_scale_kernel)[grid](*args, n_db, HAS_VALID=has_valid, BLOCK_R=block_r, BLOCK_D=block_d,
                                           num_warps=warps)
    return out


# ----------------------------------------------------------------------------------------------
# gather + scale + FP8 row-wise quantization
# ----------------------------------------------------------------------------------------------


@triton.jit
def _abs_bits(v):
    """``|v|`` as an integer with the same order: the bit pattern with the sign cleared (for
    non-NaN floats the magnitude order is the integer order; a NaN sorts above every magnitude,
    so a max propagates it as ``torch.amax`` does). Taking the row max on these integers makes no
    float32 copy of the row that the compiler could keep alive until the row is quantized: the
    registers that bound how many rows are in flight per SM."""
    if v.dtype.primitive_bitwidth == 16:
        bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    else:
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return bits


@triton.jit
def _abs_from_bits(bits, dtype: tl.constexpr):
    """Inverse of ``_abs_bits`` (float32 result)."""
    if dtype.primitive_bitwidth == 16:
        a = bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    else:
        a = bits.to(tl.float32, bitcast=True)
    return a


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
    N_CHUNKS: tl.constexpr,
    UNMASKED: tl.constexpr = False,
    CLAMP: tl.constexpr = True,
    USE_PDL: tl.constexpr = 0,
):
    """``CLAMP``: clamp to +-448 before the FP8 conversion; without, the conversion saturates
    (CUDA's ``cvt.rn.satfinite``: ~80 fewer instructions per lane for a row of 5120, and a NaN
    element stays NaN as in the reference).

    One pass (``ONE_PASS``): a row is ``N_CHUNKS`` chunks of ``BLOCK_D`` columns
    (``N_CHUNKS * BLOCK_D >= D``), all loaded at once and held in registers in the input dtype;
    the amax is taken on the chunks' bit patterns (``_abs_bits``), then each chunk is scaled,
    quantized and stored on its own, so few float32 values are live at a time (64 registers for
    D = 5120 on 2 warps, against 96 for one float32 pass: 16 rows in flight per SM instead of 10).
    ``UNMASKED`` (one row per program, ``D == N_CHUNKS * BLOCK_D``): a dropped row returns early
    and the row moves without masks. Otherwise two passes over ``BLOCK_D`` column blocks (amax,
    then quantize; the second read mostly hits the L2)."""
    pdl_prologue(USE_PDL)
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
        if UNMASKED:
            # One row, whole chunks: a dropped row leaves here and the rest runs without masks
            # (predicated loads and stores cost ~30 registers per lane: 96 instead of 64).
            if tl.max(ok.to(tl.int32), axis=0) == 0:
                return
        # Every chunk's load is issued before the reduction: the whole row is in flight at once.
        chunks = ()
        for i in tl.static_range(N_CHUNKS):
            c = i * BLOCK_D + cols
            if UNMASKED:
                v = tl.load(x_row + c[None, :])
            else:
                v = tl.load(x_row + c[None, :], mask=ok[:, None] & (c < d_lim)[None, :], other=0.0)
            chunks = chunks + (v,)
        bits = _abs_bits(chunks[0])
        for i in tl.static_range(1, N_CHUNKS):
            bits = tl.maximum(bits, _abs_bits(chunks[i]))
        # max_i |x_i * s| == max_i |x_i| * |s| bit for bit (float32 rounding is monotone and
        # sign-symmetric), so the row stays in its own dtype until it is quantized.
        amax = _abs_from_bits(tl.max(bits, axis=1), x_ptr.dtype.element_ty) * tl.abs(s)
    else:
        # The running max on bit patterns as well: a float max (max.f32) drops a NaN, and the
        # reference's torch.amax keeps it.
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.int32)
        for d0 in tl.range(0, D, BLOCK_D):
            c = d0 + cols
            m = ok[:, None] & (c < d_lim)[None, :]
            v = tl.load(x_row + c[None, :], mask=m, other=0.0, eviction_policy="evict_last")
            acc = tl.maximum(acc, _abs_bits(v))
        amax = _abs_from_bits(tl.max(acc, axis=1), x_ptr.dtype.element_ty) * tl.abs(s)

    ub = 0.0
    if HAS_UB:
        ub = tl.load(ub_ptr).to(tl.float32)
    inv, scale = row_scales(amax, ub, EPS, HAS_UB, MAX_FP8)
    tl.store(scale_ptr + rows, scale, mask=ok)

    if ONE_PASS:
        for i in tl.static_range(N_CHUNKS):
            c = i * BLOCK_D + cols
            q = (chunks[i].to(tl.float32) * s[:, None]) * inv[:, None]
            if CLAMP:
                q = tl.clamp(q, -MAX_FP8, MAX_FP8)
            q = to_fp8(q, out_ptr.dtype.element_ty, EMULATE)
            if UNMASKED:
                tl.store(o_row + c[None, :], q)
            else:
                tl.store(o_row + c[None, :], q, mask=ok[:, None] & (c < d_lim)[None, :])
    else:
        for d0 in tl.range(0, D, BLOCK_D):
            c = d0 + cols
            m = ok[:, None] & (c < d_lim)[None, :]
            v = tl.load(x_row + c[None, :], mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            q = (v * s[:, None]) * inv[:, None]
            if CLAMP:
                q = tl.clamp(q, -MAX_FP8, MAX_FP8)
            tl.store(o_row + c[None, :], to_fp8(q, out_ptr.dtype.element_ty, EMULATE), mask=m)


# The FP8 conversion saturates on its own on CUDA (``cvt.rn.satfinite.e4m3x2.f32``, sm_89+); the
# interpreter's emulation and other backends get an explicit clamp.
_CLAMP_FP8 = EMULATE_FP8 or torch.version.hip is not None
# Rows up to this many elements are quantized from registers in one pass.
_ONE_PASS_MAX_D = 8192
# Elements of x one quant program holds at most (several rows when D is small).
_QUANT_TILE = 8192
# Widest chunk of the one-pass quant (1024: 16 elements, two 16-byte vectors per lane on 2 warps).
_QUANT_CHUNK = 1024
_QUANT_MAX_CHUNKS = 16


def _quant_chunk(D: int, max_chunk: int = _QUANT_CHUNK) -> int:
    """Chunk width for a one-pass row of ``D``: the power of two <= ``max_chunk`` (at most
    ``_QUANT_MAX_CHUNKS`` chunks) that wastes the fewest masked lanes, the widest among equals."""
    best = c = min(next_pow2(max(D, 8)), max_chunk)
    while c >= 8 and cdiv(D, c) <= _QUANT_MAX_CHUNKS:
        if cdiv(D, c) * c < cdiv(D, best) * best:
            best = c
        c //= 2
    return best


def _quant_tiles(rows: int, D: int, device: torch.device) -> tuple[int, int, int, bool, int]:
    """(BLOCK_R, BLOCK_D, N_CHUNKS, one_pass, num_warps). One pass: a row is N_CHUNKS chunks of
    BLOCK_D columns (``_quant_chunk``; D = 5120 is 5 x 1024, no masked lanes); two passes over
    4096-column blocks above ``_ONE_PASS_MAX_D``. (A persistent pipelined variant, as the bf16
    gather's, measured 4-10% slower at T = 2048 / 4096: 95-136 registers for two rows in flight
    per program against 64 for one; RESULTS.md run 26.)"""
    one_pass = D <= _ONE_PASS_MAX_D
    if one_pass:
        block_d = _quant_chunk(D)
        n_chunks = max(1, cdiv(D, block_d))  # D = 0: one masked chunk (the rows get the eps scale)
    else:
        block_d, n_chunks = 4096, 1
    width = block_d * n_chunks
    block_r = _pow2_floor(max(1, min(_QUANT_TILE // width, next_pow2(rows))))  # tl.arange: a power of two
    target = _MIN_PROGRAMS_PER_SM * num_sms(device)
    while block_r > 1 and cdiv(rows, block_r) < target:
        block_r //= 2
    # 2 warps for a row of D = 5120 (80 elements per lane in 16-byte vectors, 64 registers), so
    # 16 rows are in flight per SM; more warps would add a layout conversion through shared
    # memory for the FP8 store and more instructions per row.
    warps = _pow2_floor(max(1, min(4, block_r * width // 2048))) if one_pass else _warps(block_r * width)
    return block_r, block_d, n_chunks, one_pass, warps


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
    block_r, block_d, n_chunks, one_pass, warps = _quant_tiles(A, D, x.device)
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
        CLAMP=_CLAMP_FP8,
        ONE_PASS=one_pass,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        N_CHUNKS=n_chunks,
        UNMASKED=one_pass and block_r == 1 and D == n_chunks * block_d and D > 0,
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
            tl.store(o_row + c, (cur.to(tl.float32) + vs[i].to(tl.float32)).to(out_ptr.dtype.element_ty),
                     mask=c < d_lim)
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
# trip is not hidden and atomics stay).
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
        buf = torch.zeros(max(T, 2 * (0 if buf is None else buf.numel()), 4096), dtype=torch.int32,
                          device=out.device)
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
    return _LOCKED_MIN_ROWS <= A < 2 * T and D <= _ONE_PASS_MAX_D


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
    return _SCAN_MAX_ROWS < A < 2**31 - 1 and 2 * T <= A <= 64 * T


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
    acc = _add_hits_in_order(tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), hit, 0, in_ptr, stride_in, cols, cm,
                             BLOCK_A)
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
        v0 = tl.load(in_ptr + (r0 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h0[:, None] & cm,
                     other=0.0, eviction_policy="evict_first")
        v1 = tl.load(in_ptr + (r1 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h1[:, None] & cm,
                     other=0.0, eviction_policy="evict_first")
        if STEP == 4:
            h2 = k + 2 < n
            h3 = k + 3 < n
            r2 = tl.sum(tl.where(slots[None, :] == k + 2, bkt, 0), axis=1).to(tl.int64)
            r3 = tl.sum(tl.where(slots[None, :] == k + 3, bkt, 0), axis=1).to(tl.int64)
            v2 = tl.load(in_ptr + (r2 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h2[:, None] & cm,
                         other=0.0, eviction_policy="evict_first")
            v3 = tl.load(in_ptr + (r3 * (stride_in // 8) * 8)[:, None] + cols[None, :], mask=h3[:, None] & cm,
                         other=0.0, eviction_policy="evict_first")
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
# holds all the indices at once); above it, a memset, the bucket kernel and the bucket sum.
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
    if A <= _SCAN_MAX_ROWS:
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
