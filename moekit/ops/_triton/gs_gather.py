"""Triton kernels: token gather + scale (``gather_scale_dense_tokens``) and gather + scale + FP8
row-wise quantization (``gather_scale_quant_dense_tokens``). Conventions: ``gs_common``.

The bf16 gather moves rows of up to 8192 columns whole (a power-of-two head and a tail chunk) on a
persistent, software-pipelined grid when there are 8-64 rows per SM (each step loads the next
unit's rows and the indices of the one after, then stores the current unit); column-block tiles
otherwise. On CUDA the FP8 conversions saturate by themselves (no clamp instructions).
The FP8 gather holds a whole row in registers in its own dtype as power-of-two chunks (D = 5120
is 5 x 1024, no masked lanes) with 2 warps per row, takes the amax on the bit patterns and
quantizes chunk by chunk: 64 registers per lane, 16 rows in flight per SM.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gs_common import _MIN_PROGRAMS_PER_SM, _pow2_floor, _row_count, _tiles, _warps
from moekit.ops._triton.quantize import row_scales
from moekit.reference.quantize import FUSED_EPS


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
def _row_scores(scores_ptr, tok, exp, ok, stride_st, stride_se, HAS_SCORES: tl.constexpr):
    """The rows' scores in float32 (``scores[tok, exp]``), ones without ``HAS_SCORES``."""
    if HAS_SCORES:
        return tl.load(scores_ptr + tok * stride_st + exp * stride_se, mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, 1.0, 0.0)


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
    HAS_SCORES: tl.constexpr = True,
    USE_PDL: tl.constexpr = 0,
):
    """A ``[BLOCK_R, BLOCK_D]`` tile (``n_db`` column blocks per row block), one per program.
    Without ``HAS_SCORES`` the rows are copied (a scale of 1)."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    rb = pid // n_db
    db = pid - rb * n_db
    n_rows = _row_count(valid_ptr, A, HAS_VALID)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok, exp, ok = _gather_index(rows, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
    s = _row_scores(scores_ptr, tok, exp, ok, stride_st, stride_se, HAS_SCORES)
    d_lim = (D // 8) * 8
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    m = ok[:, None] & (cols < d_lim)[None, :]
    x_row = x_ptr + (tok * (stride_x // 8) * 8)[:, None]
    o_row = out_ptr + (rows * (stride_out // 8) * 8)[:, None]
    v = tl.load(x_row + cols[None, :], mask=m, other=0.0)
    tl.store(o_row + cols[None, :], (v.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gather_row(
    x_ptr, scores_ptr, tok, exp, ok, d_lim, stride_x, stride_st, stride_se, BLOCK_D: tl.constexpr, W_TAIL: tl.constexpr,
    HAS_SCORES: tl.constexpr,
):  # fmt: skip
    """The rows' ``BLOCK_D`` head and ``W_TAIL`` tail columns (raw dtype) and their scores."""
    s = _row_scores(scores_ptr, tok, exp, ok, stride_st, stride_se, HAS_SCORES)
    x_row = x_ptr + (tok * (stride_x // 8) * 8)[:, None]
    cols = tl.arange(0, BLOCK_D)
    v = tl.load(
        x_row + cols[None, :], mask=ok[:, None] & (cols < d_lim)[None, :], other=0.0, eviction_policy="evict_first"
    )
    if W_TAIL > 0:
        tcols = BLOCK_D + tl.arange(0, W_TAIL)
        tv = tl.load(
            x_row + tcols[None, :],
            mask=ok[:, None] & (tcols < d_lim)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
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
    HAS_SCORES: tl.constexpr = True,
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
    v, tv, s = _gather_row(x_ptr, scores_ptr, tok, exp, ok, d_lim, stride_x, stride_st, stride_se, BLOCK_D, W_TAIL,
                           HAS_SCORES)  # fmt: skip
    rows_n = rows + step
    tok_n, exp_n, ok_n = _gather_index(rows_n, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
    for _u in range(pid, n_units, nprog):
        v_n, tv_n, s_n = _gather_row(
            x_ptr, scores_ptr, tok_n, exp_n, ok_n, d_lim, stride_x, stride_st, stride_se, BLOCK_D, W_TAIL, HAS_SCORES
        )
        rows_nn = rows_n + step
        tok_nn, exp_nn, ok_nn = _gather_index(rows_nn, n_rows, tok_ptr, exp_ptr, T, E, stride_tok, stride_exp)
        o_row = out_ptr + (rows * (stride_out // 8) * 8)[:, None]
        tl.store(
            o_row + cols[None, :], (v.to(tl.float32) * s[:, None]).to(odt), mask=ok[:, None] & (cols < d_lim)[None, :]
        )
        if W_TAIL > 0:
            tcols = BLOCK_D + tl.arange(0, W_TAIL)
            tl.store(
                o_row + tcols[None, :],
                (tv.to(tl.float32) * s[:, None]).to(odt),
                mask=ok[:, None] & (tcols < d_lim)[None, :],
            )
        rows, ok, v, tv, s = rows_n, ok_n, v_n, tv_n, s_n
        rows_n, tok_n, exp_n, ok_n = rows_nn, tok_nn, exp_nn, ok_nn


# Whole rows (head + tail chunks, ``_gather_scale_stream_kernel``) from _MIN to _MAX rows per
# SM; below, column-block tiles spread a few rows over more programs, and above, column blocks
# measured faster too (H200, D = 5120 bf16, run 24: T = 16384 83.3 µs column blocks vs 89.7 for
# the best streamed whole rows). Set _MIN (or the programs per SM below) to 0 to always use
# column blocks. Tests pin these three as the knobs ``GATHER_WHOLE_ROW_MIN_ROWS_PER_SM``,
# ``GATHER_WHOLE_ROW_MAX_ROWS_PER_SM``, ``GATHER_STREAM_PROGRAMS_PER_SM`` (``moekit.settings``).
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
    s = settings.get()
    min_rows = s.knob("GATHER_WHOLE_ROW_MIN_ROWS_PER_SM", _GATHER_WHOLE_ROW_MIN_ROWS_PER_SM)
    max_rows = s.knob("GATHER_WHOLE_ROW_MAX_ROWS_PER_SM", _GATHER_WHOLE_ROW_MAX_ROWS_PER_SM)
    stream = s.knob("GATHER_STREAM_PROGRAMS_PER_SM", _GATHER_STREAM_PROGRAMS_PER_SM)
    if (
        min_rows
        and stream
        and D <= s.knob("ONE_PASS_MAX_D", _ONE_PASS_MAX_D)
        and min_rows * num_sms(device) <= rows < max_rows * num_sms(device)
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
        return block_r, block_d, w_tail, 1, warps, stream
    block_r, block_d, n_db, warps = _tiles(rows, D, device)
    return block_r, block_d, 0, n_db, warps, 0


def _score_args(scores: Optional[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(pointer, E, stride_st, stride_se)`` of the gathers' scores; without scores ``x`` stands in
    for the pointer (never read) and every expert index ``>= 0`` is in range (nothing is indexed
    with it)."""
    if scores is None:
        return x, 2**31 - 1, 0, 0
    return scores, int(scores.shape[1]), scores.stride(0), scores.stride(1)


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: Optional[torch.Tensor],
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launcher (arguments validated by the public op). ``scores`` None: a scale of 1 (any expert
    index >= 0 is in range). ``out`` (tests): a preallocated ``[a, D]`` output whose unwritten
    rows stay as they are."""
    T, D = x.shape
    A = token_indices.shape[0]
    if out is None:
        out = torch.empty((A, D), dtype=x.dtype, device=x.device)
    if A == 0 or D == 0 or T == 0:
        return out
    block_r, block_d, w_tail, n_db, warps, stream = _gather_tiles(A, D, x.device)
    has_valid = valid_token_count is not None
    scores_arg, E, stride_st, stride_se = _score_args(scores, x)
    args = (
        out,
        x,
        token_indices,
        expert_indices,
        scores_arg,
        valid_token_count if has_valid else token_indices,
        A,
        T,
        E,
        D,
        x.stride(0),
        out.stride(0),
        token_indices.stride(0),
        expert_indices.stride(0),
        stride_st,
        stride_se,
    )
    has_scores = scores is not None
    if stream:
        grid = (max(1, min(cdiv(A, block_r), stream * num_sms(x.device))),)
        launch(_gather_scale_stream_kernel)[grid](
            *args, HAS_VALID=has_valid, BLOCK_R=block_r, BLOCK_D=block_d, W_TAIL=w_tail, HAS_SCORES=has_scores,
            num_warps=warps,
        )  # fmt: skip
    else:
        grid = (cdiv(A, block_r) * n_db,)
        launch(_gather_scale_kernel)[grid](
            *args, n_db, HAS_VALID=has_valid, BLOCK_R=block_r, BLOCK_D=block_d, HAS_SCORES=has_scores,
            num_warps=warps,
        )  # fmt: skip
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
    HAS_SCORES: tl.constexpr = True,
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
    s = _row_scores(scores_ptr, tok, exp, ok, stride_st, stride_se, HAS_SCORES)
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
# Rows up to this many elements are quantized from registers in one pass (also the bf16 gather's
# whole-row and the locked scatter-add's limit). Tests pin it as the knob ``ONE_PASS_MAX_D``.
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
    one_pass = D <= settings.get().knob("ONE_PASS_MAX_D", _ONE_PASS_MAX_D)
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
    scores: Optional[torch.Tensor],
    scale_ub: Optional[torch.Tensor] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. ``scores`` None: a scale of 1. ``out``/``out_scale`` (tests): preallocated outputs
    left untouched where unwritten."""
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
    scores_arg, E, stride_st, stride_se = _score_args(scores, x)
    launch(_gather_scale_quant_kernel)[(cdiv(A, block_r),)](
        out,
        out_scale,
        x,
        token_indices,
        expert_indices,
        scores_arg,
        valid_token_count if has_valid else token_indices,
        scale_ub if scale_ub is not None else x,  # unused placeholder: an input, never an output
        A,
        T,
        E,
        D,
        x.stride(0),
        out.stride(0),
        token_indices.stride(0),
        expert_indices.stride(0),
        stride_st,
        stride_se,
        HAS_SCORES=scores is not None,
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
