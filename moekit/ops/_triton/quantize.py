"""Triton kernel: FP8 e4m3fn row-wise quantization (``quantize_fp8_row``), and the row-tiling
helpers shared by moekit's row-wise kernels (activation, quantization, RMSNorm).

``quantize_fp8_row`` on inputs over ``PIPE_MIN_BYTES`` is persistent: a grid of a few programs
per SM walks the row blocks, and ``tl.range(..., num_stages=S)`` turns the loads into ``cp.async``
copies into shared memory issued ``S - 1`` row blocks ahead. Bytes in flight per SM then no
longer depend on registers, and the reduction, division and store of one row block overlap the
loads of the next ones. A row that is not a power of two long is covered by two power-of-two
tiles where that saves lanes (5120 = 4096 + 1024). Smaller inputs, and ``silu_mul_quant`` except
on long rows of large problems, run one row block per program (``np_row_config``): measured
faster there. Rows longer than
``ONE_PASS_BYTES`` take two passes over the row (the second read mostly hits L2).

Float scalars (``eps``) are cast to float32 inside the kernels: Triton's launcher passes Python
floats as fp32, torch.compile (inductor) as fp64.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8
from moekit.ops._triton._pdl import pdl_prologue

# A row of at most this many input bytes is held in registers (bf16: 16384 values).
ONE_PASS_BYTES = 32768
# Chunk of a long row per loop step in the two-pass path (bytes of input).
TWO_PASS_CHUNK_BYTES = 16384
# Input bytes a program of a (non-pipelined) row-wise kernel aims to cover.
ROW_TILE_BYTES = 16384

# Pipelined (persistent) kernels. Shared memory an SM gives to their stage buffers (an H100/H200
# SM has 228 KB; the rest covers reduction scratch and the 1 KB per block the driver keeps).
PIPE_SMEM_BYTES = 192 * 1024
# Largest stage (all inputs of one row block, padded to the power-of-two tile) worth pipelining.
PIPE_MAX_STAGE_BYTES = 32768
# Input bytes of one row block when rows are short (several rows per stage).
PIPE_STAGE_BYTES = 16384
# Programs per SM of a persistent kernel: measured on the H200, four programs of three stages beat
# six of four (fp8 quantization of [16384, 5120]: 63 vs 68 µs).
PIPE_MAX_PROGS = 4
# Inputs up to this many bytes take one row block per program, no pipelining (``np_row_config``):
# at these sizes the persistent kernel's ramp (every program filling its pipeline before the
# first store) costs more than it saves ([2048, 5120] fp8 quantization: 9.1 vs 11.2 µs). Tests pin
# it as the knob ``PIPE_MIN_BYTES`` (``moekit.settings``).
PIPE_MIN_BYTES = 64 * 1024 * 1024
# Rows index in int32 inside the kernels (offsets are int64).
MAX_ROWS = 2**31 - 2**16


class RowConfig(NamedTuple):
    block_t: int  # rows per program
    block_c: int  # columns per register tile (>= the row length when one_pass)
    one_pass: bool
    num_warps: int


class PipeConfig(NamedTuple):
    """Launch of a persistent row kernel: ``grid`` programs walk ``cdiv(rows, block_t)`` row blocks;
    ``stages > 1`` pipelines the loads (``stages - 1`` row blocks ahead). A row is covered by
    ``block_c`` columns plus, when ``block_c2 > 0``, a second tile of ``block_c2`` columns (a row
    of 5120 is 4096 + 1024 instead of one 8192-wide tile that leaves 37% of the lanes idle)."""

    block_t: int
    block_c: int
    one_pass: bool
    stages: int
    num_warps: int
    grid: int
    block_c2: int = 0


def prev_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def pipe_stages(stage_bytes: int) -> Optional[tuple[int, int]]:
    """``(stages, programs per SM)`` for a pipelined kernel whose stage takes ``stage_bytes`` of
    shared memory, or None when fewer than two programs would fit: three stages (two row blocks
    in flight while one is reduced), up to ``PIPE_MAX_PROGS`` programs."""
    progs = min(PIPE_MAX_PROGS, PIPE_SMEM_BYTES // (2 * max(stage_bytes, 1)))
    return (3, progs) if progs >= 2 else None


def row_config(
    n_rows: int, n_cols: int, elem_bytes: int, device: torch.device, tile_bytes: int = ROW_TILE_BYTES
) -> RowConfig:
    """Tiling of a (non-pipelined) row-wise reduction kernel over ``[n_rows, n_cols]`` (RMSNorm,
    and the fallbacks of the pipelined kernels).

    Rows up to ``ONE_PASS_BYTES`` are held whole; short rows are packed ``block_t`` per program,
    keeping at least two programs per SM when there are enough rows. Warps are sized so that
    each thread loads about two 16-byte vectors per input.
    """
    vec = max(1, 16 // elem_bytes)
    full = max(next_pow2(n_cols), vec)
    if full * elem_bytes <= ONE_PASS_BYTES:
        block_c, one_pass = full, True
        block_t = max(1, tile_bytes // (full * elem_bytes))
        enough = max(1, prev_pow2(cdiv(max(n_rows, 1), 2 * num_sms(device))))
        block_t = min(block_t, enough, next_pow2(max(n_rows, 1)))
    else:
        block_c, one_pass, block_t = TWO_PASS_CHUNK_BYTES // elem_bytes, False, 1
    warps = (block_t * block_c) // (32 * vec * 2)
    return RowConfig(block_t, block_c, one_pass, int(min(16, max(1, prev_pow2(warps)))))


def row_tiles(n_cols: int, vec: int, split: bool) -> tuple[int, int]:
    """Power-of-two column tiles covering a row: ``(next_pow2(n_cols), 0)``, or with ``split`` the
    largest power of two not above ``n_cols`` plus a power-of-two tail tile when that wastes fewer
    lanes (5120 -> 4096 + 1024, 2880 -> 2048 + 1024, 7168 -> 8192 + 0). Rows under 1024 values
    stay one tile (several of them share a row block, and two small tiles cost more registers
    than the idle lanes)."""
    full = max(next_pow2(n_cols), vec)
    head = max(prev_pow2(n_cols), vec)
    if not split or head >= n_cols or head < 1024:
        return full, 0
    tail = max(next_pow2(n_cols - head), vec)
    return (head, tail) if head + tail < full else (full, 0)


def np_row_config(
    n_rows: int, n_cols: int, elem_bytes: int, n_inputs: int, warp_elems: int, device: torch.device
) -> PipeConfig:
    """One row block per program, no pipelining (``stages == 1``): whole rows of ``n_cols`` held
    in registers as one power-of-two tile (rows up to ``ONE_PASS_BYTES``; longer rows take the
    two-pass ``row_config``, up to 16 warps). About 2048 values of each input per program (one
    row when rows are that long), one warp per ``warp_elems`` values of one input, at most 8
    warps. Measured on the
    H200: silu_mul_quant [2048, 2048] 7.0 µs (4 warps) vs 8.5 for the persistent kernel, [2048,
    8192] 20.9 (8 warps) vs 26.0, [16384, 2048] 41.8 vs 46.8; quantize_fp8_row [2048, 5120] 9.1
    (one 8192-wide tile, 4 warps) vs 11.2."""
    vec = max(1, 16 // elem_bytes)
    full = max(next_pow2(n_cols), vec)
    if full * elem_bytes > ONE_PASS_BYTES:
        cfg = row_config(n_rows, n_cols, elem_bytes, device, tile_bytes=ROW_TILE_BYTES // n_inputs)
        return PipeConfig(cfg.block_t, cfg.block_c, cfg.one_pass, 1, cfg.num_warps, _grid(n_rows, cfg.block_t))
    block_t = min(max(1, 2048 // full), next_pow2(max(n_rows, 1)))
    warps = int(min(8, max(1, prev_pow2(block_t * full // warp_elems))))
    return PipeConfig(block_t, full, True, 1, warps, _grid(n_rows, block_t))


# Grid cap of the one-block-per-program kernels (past it, programs stride over the blocks).
MAX_GRID = 1 << 22


def _grid(n_rows: int, block_t: int) -> int:
    return max(1, min(cdiv(max(n_rows, 1), block_t), MAX_GRID))


def pipe_row_config(
    n_rows: int, n_cols: int, elem_bytes: int, n_inputs: int, device: torch.device, split: bool = False
) -> PipeConfig:
    """Launch of a persistent row-wise quantizing kernel over ``[n_rows, n_cols]`` reading
    ``n_inputs`` tensors (a cheap shape bucket: one compiled variant per row-length bucket).

    A row block (``block_t`` whole rows, about ``PIPE_STAGE_BYTES`` of input) is one pipeline
    stage when it takes at most ``PIPE_MAX_STAGE_BYTES`` of shared memory (bf16 rows up to
    8192 values for two inputs, 16384 for one). Warps are sized for about four 16-byte vectors
    per thread and input (at least 4 warps when the block has that many vectors, at most 16):
    the per-block work (index math, reduction, two divisions, barriers) is then spread over
    enough values to keep the instruction issue well under the SM's rate at full HBM bandwidth.
    ``grid`` fills the SMs with the programs that fit. ``split`` allows a second column tile
    (``row_tiles``).
    """
    sms = num_sms(device)
    vec = max(1, 16 // elem_bytes)
    rows = max(n_rows, 1)
    c1, c2 = row_tiles(n_cols, vec, split)
    row_smem = n_inputs * (c1 + c2) * elem_bytes
    plan = pipe_stages(row_smem) if row_smem <= PIPE_MAX_STAGE_BYTES else None
    if plan is None:
        cfg = row_config(n_rows, n_cols, elem_bytes, device, tile_bytes=ROW_TILE_BYTES // n_inputs)
        return PipeConfig(cfg.block_t, cfg.block_c, cfg.one_pass, 1, cfg.num_warps, cdiv(rows, cfg.block_t))
    block_t = prev_pow2(max(1, PIPE_STAGE_BYTES // row_smem))
    # Keep every SM busy when rows are few: at most ceil(rows / SMs) rows per block.
    block_t = min(block_t, prev_pow2(cdiv(rows, sms)), next_pow2(rows))
    stages, progs = pipe_stages(block_t * row_smem)
    # Fewer than 4 row blocks per program (the whole problem is in flight at once): halve the
    # blocks, down to 8 KB stages, so the last block's math after the last bytes land is short.
    while block_t > 1 and block_t * row_smem > 8192 and cdiv(rows, block_t) < 4 * progs * sms:
        block_t //= 2
        stages, progs = pipe_stages(block_t * row_smem)
    vectors = block_t * (c1 + c2) // vec  # 16-byte vectors per input and row block
    warps = min(16, max(prev_pow2(max(1, vectors // (32 * 4))), min(4, prev_pow2(max(1, vectors // 32)))))
    return PipeConfig(block_t, c1, True, stages, warps, min(cdiv(rows, block_t), progs * sms), c2)


class RowLayout(NamedTuple):
    """Row ``r`` of a ``[..., C]`` tensor starts at ``(r // inner) * s_outer + (r % inner) * s_inner``;
    ``inner == 1`` means one stride: row ``r`` starts at ``r * s_outer``."""

    inner: int
    s_outer: int
    s_inner: int


def row_layout(t: torch.Tensor) -> Optional[RowLayout]:
    """Row addressing of ``t`` (unit last stride): one stride when its leading dims collapse to
    one, else two levels (outer, inner), or None when they do not collapse to two either (then
    the caller makes it contiguous)."""
    lead, st = t.shape[:-1], t.stride()[:-1]
    if len(lead) == 0:
        return RowLayout(1, 0, 0)
    inner, s_inner = int(lead[-1]), int(st[-1])
    s_outer, expect = 0, None
    for size, stride in zip(reversed(lead[:-1]), reversed(st[:-1])):
        if size == 1:
            continue
        if expect is not None and stride != expect:
            return None
        if expect is None:
            s_outer = int(stride)
        expect = stride * size
    if expect is None or s_outer == inner * s_inner or inner == 1:
        # No outer dim (or it continues the inner stride, or the inner dim is 1): one stride.
        return RowLayout(1, s_inner if inner > 1 or expect is None else s_outer, 0)
    return RowLayout(inner, s_outer, s_inner)


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, RowLayout]:
    """``t`` (or a contiguous copy when its rows cannot be addressed in two levels) and its layout."""
    layout = row_layout(t)
    if layout is None:
        t = t.contiguous()
        layout = RowLayout(1, t.shape[-1], 0)
    return t, layout


@triton.jit
def row_offsets(rows, INNER, S_OUTER, S_INNER, TWO_LEVEL: tl.constexpr):
    """int64 element offset of each row (``rows`` int32, < 2**31) under a ``RowLayout``. The
    int32 division only runs for two-level layouts."""
    if TWO_LEVEL:
        return (rows // INNER).to(tl.int64) * S_OUTER + (rows % INNER).to(tl.int64) * S_INNER
    else:
        return rows.to(tl.int64) * S_OUTER


@triton.jit
def max_nan(a, b):
    """``max(a, b)`` that keeps a NaN, as ``torch.amax`` does (``tl.maximum``'s default lowers to
    ``max.f32``, which returns the other operand; this is ``max.NaN.f32``, the same cost)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_amax(v):
    """Per-row ``max |v|`` of a 2-D tile, NaN if the row holds one (the reference's amax)."""
    return tl.reduce(tl.abs(v), 1, max_nan)


@triton.jit
def row_scales(amax, ub, eps, HAS_UB: tl.constexpr, MAX_FP8: tl.constexpr):
    """Per-row ``(inv, dequant scale)`` from the row max: ``amax`` floored at ``eps``, clamped to
    ``ub`` (the loaded ``scale_ub`` when ``HAS_UB``); ``inv = 448 / amax`` and ``scale = 1 / inv``,
    both correctly rounded float32 divisions (``div_rn``, not the approximate ``/``) as in the
    float32 reference, so scales match it bit for bit. ``eps`` must be float32 (or constexpr).
    A NaN ``amax`` stays NaN (``torch.clamp`` keeps it): the row's scale and values come out NaN."""
    amax = tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL)
    if HAS_UB:
        amax = tl.minimum(amax, ub, propagate_nan=tl.PropagateNan.ALL)
    inv = tl.div_rn(tl.full(amax.shape, MAX_FP8, tl.float32), amax)
    scale = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv)
    return inv, scale


@triton.jit
def fp8_saturate(v, MAX_FP8: tl.constexpr, EMULATE: tl.constexpr):
    """``clamp(v, -448, 448)`` ahead of the e4m3 conversion. On the GPU the conversion
    (``cvt.rn.satfinite.e4m3x2.f32``) already saturates finite and infinite values to +-448 and
    keeps NaN, so the clamp is skipped (one instruction per value); the interpreter's emulated
    rounding needs it."""
    if EMULATE:
        v = tl.clamp(v, -MAX_FP8, MAX_FP8)
    return v


@triton.jit
def _load_cols(a_row, cols, live, K):
    m_in = live[:, None] & (cols < K)[None, :]
    x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0, eviction_policy="evict_first")
    return x.to(tl.float32)


@triton.jit
def _store_fp8(q_row, cols, row_ok, K_OUT, v, MAX_FP8: tl.constexpr, EMULATE: tl.constexpr):
    m_out = row_ok[:, None] & (cols < K_OUT)[None, :]
    q = to_fp8(fp8_saturate(v, MAX_FP8, EMULATE), q_row.dtype.element_ty, EMULATE)
    tl.store(q_row[:, None] + cols[None, :], q, mask=m_out)


@triton.jit
def _quantize_fp8_row_kernel(
    q_ptr,
    scale_ptr,
    a_ptr,
    ub_ptr,
    zsi_ptr,
    R,
    K,
    K_OUT,
    eps,
    INNER,
    S_OUTER,
    S_INNER,
    ROWS_PER_GROUP,
    HAS_UB: tl.constexpr,
    JAGGED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    ONE_PASS: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    MAX_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Python floats arrive as fp64 under torch.compile (inductor), fp32 from Triton's launcher.
    eps32 = tl.cast(eps, tl.float32)
    ub = 0.0
    if HAS_UB:
        ub = tl.load(ub_ptr).to(tl.float32)
    n_blocks = tl.cdiv(R, BLOCK_T)
    for blk in tl.range(pid, n_blocks, nprog, num_stages=STAGES):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < R
        a_row = a_ptr + row_offsets(rows, INNER, S_OUTER, S_INNER, TWO_LEVEL)
        q_row = q_ptr + rows.to(tl.int64) * K_OUT
        live = row_ok
        if JAGGED:
            # Rows at or past zero_start_index_M[group] are quantized as zeros (not read).
            start = tl.load(zsi_ptr + rows // ROWS_PER_GROUP, mask=row_ok, other=0)
            live = row_ok & ((rows % ROWS_PER_GROUP) < start)
        if ONE_PASS:
            # Columns [0, BLOCK_K) and, when BLOCK_K2 > 0, [BLOCK_K, BLOCK_K + BLOCK_K2).
            cols = tl.arange(0, BLOCK_K)
            x = _load_cols(a_row, cols, live, K)
            amax = row_amax(x)
            if BLOCK_K2 > 0:
                cols2 = BLOCK_K + tl.arange(0, BLOCK_K2)
                x2 = _load_cols(a_row, cols2, live, K)
                amax = max_nan(amax, row_amax(x2))
            inv, scale = row_scales(amax, ub, eps32, HAS_UB, MAX_FP8)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            _store_fp8(q_row, cols, row_ok, K_OUT, x * inv[:, None], MAX_FP8, EMULATE)
            if BLOCK_K2 > 0:
                _store_fp8(q_row, cols2, row_ok, K_OUT, x2 * inv[:, None], MAX_FP8, EMULATE)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m_in = live[:, None] & (cols < K)[None, :]
                x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0, eviction_policy="evict_last")
                acc = max_nan(acc, tl.abs(x.to(tl.float32)))  # the row is read again below
            inv, scale = row_scales(tl.reduce(acc, 1, max_nan), ub, eps32, HAS_UB, MAX_FP8)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
            for k0 in tl.range(0, K_OUT, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m_in = live[:, None] & (cols < K)[None, :]
                x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0).to(tl.float32)
                _store_fp8(q_row, cols, row_ok, K_OUT, x * inv[:, None], MAX_FP8, EMULATE)


def quantize_config(R: int, C: int, elem_bytes: int, device: torch.device) -> PipeConfig:
    """Launch of ``quantize_fp8_row`` over ``R`` rows of ``C`` output columns (a cheap shape
    bucket): one row block per program up to ``PIPE_MIN_BYTES`` of input, else the persistent
    pipelined kernel with split row tiles."""
    if R * C * elem_bytes <= settings.get().knob("PIPE_MIN_BYTES", PIPE_MIN_BYTES):
        return np_row_config(R, C, elem_bytes, 1, 2048, device)
    return pipe_row_config(R, C, elem_bytes, 1, device, split=True)


def quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: Optional[torch.Tensor] = None,
    zero_start_index_M: Optional[torch.Tensor] = None,
    eps: float = 1.0 / 512.0,
    k_out: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (arguments already validated). ``a`` ``[..., K]`` with unit last stride;
    ``zero_start_index_M`` holds one count per ``[shape[-2], K]`` matrix (``numel`` =
    ``prod(shape[:-2])``); ``k_out >= K`` pads each output row with zeros. Returns
    ``(q [..., k_out] e4m3fn, scale [...] float32)``."""
    K = a.shape[-1]
    k_out = K if k_out is None else int(k_out)
    lead = tuple(a.shape[:-1])
    q = torch.empty(lead + (k_out,), dtype=FP8_DTYPE, device=a.device)
    scale = torch.empty(lead, dtype=torch.float32, device=a.device)
    R = scale.numel()
    if R == 0:
        return q, scale
    if R > MAX_ROWS:
        raise ValueError(f"a must have at most {MAX_ROWS} rows (prod(a.shape[:-1])), got {R}")
    a, lay = rows_of(a)
    jagged = zero_start_index_M is not None
    zsi = zero_start_index_M.reshape(-1) if jagged else None
    cfg = quantize_config(R, max(k_out, 1), a.element_size(), a.device)
    launch(_quantize_fp8_row_kernel)[(cfg.grid,)](
        q,
        scale,
        a,
        scale_ub if scale_ub is not None else a,  # unused placeholders: an input, never an output
        zsi if jagged else a,
        R,
        K,
        k_out,
        float(eps),
        lay.inner,
        lay.s_outer,
        lay.s_inner,
        int(a.shape[-2]) if a.dim() >= 2 else 1,
        HAS_UB=scale_ub is not None,
        JAGGED=jagged,
        TWO_LEVEL=lay.inner != 1,
        ONE_PASS=cfg.one_pass,
        STAGES=cfg.stages,
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_c,
        BLOCK_K2=cfg.block_c2,
        MAX_FP8=FP8_MAX,
        EMULATE=EMULATE_FP8,
        num_warps=cfg.num_warps,
    )
    return q, scale
