"""Triton kernel: FP8 e4m3fn row-wise quantization (``quantize_fp8_row``), and the row-tiling
helpers shared by moekit's row-wise kernels (activation, quantization, RMSNorm).

Row-wise kernels here hold a whole row in registers when it fits (``ONE_PASS``: one read of
the input, one write of the output); several rows share a program when rows are short, and
rows longer than ``ONE_PASS_BYTES`` take two passes (the second read mostly hits L2).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE, FP8_MAX
from moekit.ops._common import launch, next_pow2, num_sms
from moekit.ops._triton._fp8 import EMULATE_FP8, to_fp8

# A row of at most this many input bytes is held in registers (bf16: 16384 values).
ONE_PASS_BYTES = 32768
# Chunk of a long row per loop step in the two-pass path (bytes of input).
TWO_PASS_CHUNK_BYTES = 16384
# Input bytes a program of a row-wise kernel aims to cover (several short rows per program).
ROW_TILE_BYTES = 16384


class RowConfig(NamedTuple):
    block_t: int  # rows per program
    block_c: int  # columns per register tile (>= the row length when one_pass)
    one_pass: bool
    num_warps: int


def prev_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def row_config(
    n_rows: int, n_cols: int, elem_bytes: int, device: torch.device, tile_bytes: int = ROW_TILE_BYTES
) -> RowConfig:
    """Tiling of a row-wise reduction kernel over ``[n_rows, n_cols]`` (a cheap shape bucket).

    Rows up to ``ONE_PASS_BYTES`` are held whole; short rows are packed ``block_t`` per program,
    keeping at least two programs per SM when there are enough rows. Warps are sized so that
    each thread loads about two 16-byte vectors per input.
    """
    vec = max(1, 16 // elem_bytes)
    full = max(next_pow2(n_cols), vec)
    if full * elem_bytes <= ONE_PASS_BYTES:
        block_c, one_pass = full, True
        block_t = max(1, tile_bytes // (full * elem_bytes))
        enough = max(1, prev_pow2(triton.cdiv(max(n_rows, 1), 2 * num_sms(device))))
        block_t = min(block_t, enough, next_pow2(max(n_rows, 1)))
    else:
        block_c, one_pass, block_t = TWO_PASS_CHUNK_BYTES // elem_bytes, False, 1
    warps = (block_t * block_c) // (32 * vec * 2)
    return RowConfig(block_t, block_c, one_pass, int(min(16, max(1, prev_pow2(warps)))))


class RowLayout(NamedTuple):
    """Row ``r`` of a ``[..., C]`` tensor starts at ``(r // inner) * s_outer + (r % inner) * s_inner``."""

    inner: int
    s_outer: int
    s_inner: int


def row_layout(t: torch.Tensor) -> Optional[RowLayout]:
    """Two-level row addressing of ``t`` (unit last stride), or None when its leading dims do not
    collapse to (outer, inner) with one stride each (then the caller makes it contiguous)."""
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
    return RowLayout(max(inner, 1), s_outer, s_inner)


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, RowLayout]:
    """``t`` (or a contiguous copy when its rows cannot be addressed in two levels) and its layout."""
    layout = row_layout(t)
    if layout is None:
        t = t.contiguous()
        inner = int(t.shape[-2]) if t.dim() >= 2 else 1
        layout = RowLayout(max(inner, 1), max(inner, 1) * t.shape[-1], t.shape[-1])
    return t, layout


@triton.jit
def row_offsets(rows64, INNER, S_OUTER, S_INNER):
    """int64 element offset of each row (``rows64`` int64) under a ``RowLayout``."""
    return (rows64 // INNER) * S_OUTER + (rows64 % INNER) * S_INNER


@triton.jit
def row_scales(amax, ub_ptr, eps, HAS_UB: tl.constexpr, MAX_FP8: tl.constexpr):
    """Per-row ``(inv, dequant scale)`` from the row max: ``amax`` floored at ``eps``, clamped to
    ``scale_ub``; ``inv = 448 / amax`` and ``scale = 1 / inv``, both correctly rounded float32
    divisions (``div_rn``, not the approximate ``/``) as in the float32 reference, so scales
    match it bit for bit."""
    amax = tl.maximum(amax, eps)
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(ub_ptr).to(tl.float32))
    inv = tl.div_rn(tl.full(amax.shape, MAX_FP8, tl.float32), amax)
    scale = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv)
    return inv, scale


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
    ONE_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < R
    r64 = rows.to(tl.int64)
    a_row = a_ptr + row_offsets(r64, INNER, S_OUTER, S_INNER)
    q_row = q_ptr + r64 * K_OUT
    live = row_ok
    if JAGGED:
        # Rows at or past zero_start_index_M[group] are quantized as zeros (not read).
        group = r64 // ROWS_PER_GROUP
        start = tl.load(zsi_ptr + group, mask=row_ok, other=0)
        live = row_ok & ((r64 % ROWS_PER_GROUP) < start)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_K)
        m_in = live[:, None] & (cols < K)[None, :]
        x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)
        inv, scale = row_scales(tl.max(tl.abs(x), axis=1), ub_ptr, eps, HAS_UB, MAX_FP8)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        q = tl.clamp(x * inv[:, None], -MAX_FP8, MAX_FP8)
        m_out = row_ok[:, None] & (cols < K_OUT)[None, :]
        tl.store(q_row[:, None] + cols[None, :], to_fp8(q, q_ptr.dtype.element_ty, EMULATE), mask=m_out)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m_in = live[:, None] & (cols < K)[None, :]
            x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0, eviction_policy="evict_last")
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))  # the row is read again below
        inv, scale = row_scales(tl.max(acc, axis=1), ub_ptr, eps, HAS_UB, MAX_FP8)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        for k0 in tl.range(0, K_OUT, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m_in = live[:, None] & (cols < K)[None, :]
            x = tl.load(a_row[:, None] + cols[None, :], mask=m_in, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv[:, None], -MAX_FP8, MAX_FP8)
            m_out = row_ok[:, None] & (cols < K_OUT)[None, :]
            tl.store(q_row[:, None] + cols[None, :], to_fp8(q, q_ptr.dtype.element_ty, EMULATE), mask=m_out)


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
    a, lay = rows_of(a)
    jagged = zero_start_index_M is not None
    zsi = zero_start_index_M.reshape(-1) if jagged else None
    cfg = row_config(R, max(k_out, 1), a.element_size(), a.device)
    launch(_quantize_fp8_row_kernel)[(triton.cdiv(R, cfg.block_t),)](
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
        ONE_PASS=cfg.one_pass,
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_c,
        MAX_FP8=FP8_MAX,
        EMULATE=EMULATE_FP8,
        num_warps=cfg.num_warps,
    )
    return q, scale
