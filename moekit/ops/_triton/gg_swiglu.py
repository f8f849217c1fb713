"""Triton kernels of ``grouped_gemm_swiglu``: the gate|up grouped GEMM with the SwiGLU fused into
its epilogue, reading its rows from the token matrix by index (no gathered copy, no ``[M, 2F]``
intermediate).

A program owns ``BLOCK_N`` columns ``f`` of the output ``z [M, F]`` and computes both halves that
make them: the gate rows ``g*2F + f`` and the up rows ``g*2F + F + f`` of its expert's weights, two
accumulators over the whole K, then ``z = silu(gate) * up`` once, in float32. Row ``i`` reads token
row ``x[gather_indices[i]]`` (a negative or out-of-range index leaves row ``i`` unwritten).

- ``_swiglu_gemv_kernel`` (a handful of rows per expert: decode): one program = one row and a
  ``BLOCK_N``-column slice, CUDA-core FMAs into elementwise float32 accumulators (as the grouped
  GEMM's GEMV kernel), one reduction over K at the end. Rows of one expert run side by side, so
  their shared weight tiles come from L2.
- ``_swiglu_stream_kernel`` (a few to 32-48 rows per expert): swap-AB tensor-core tiles
  ``[BLOCK_N, BLOCK_M] = w[f-slice] @ x_rows.T`` per (non-empty expert, column slice), as the
  grouped GEMM's streaming kernel, with the weight tiles through TMA when the strides allow.

Numerics: FP8 x (``x_scale`` per token row) with FP8 weights (``w_scale`` per weight row) uses the
FP8 tensor-core product; 16-bit x with FP8 weights is weight-only FP8: the weight tile is
converted to x's dtype in registers (16-bit MMA / float32 FMAs) and ``w_scale`` applied after the
reduction, so activations are never quantized. ``row_scales`` (the router weight on the expert's
input) multiplies both accumulators before the SiLU.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit._validate import FP8_DTYPE, FP8_MAX
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gg_config import (
    _STREAM_SMEM,
    GemmConfig,
    expected_groups_hit,
    gemv_config,
    heuristic_config,
    use_gemv,
    widest_slice,
)
from moekit.ops._triton.gg_kernels import _group_table, _make_descriptors, _pick, _tile_at, _tile_table
from moekit.ops._triton.quantize import _store_fp8, max_nan, row_amax, row_scales


@triton.jit
def _swiglu_store(g_acc, u_acc, offs_m, row_ok, offs_n, n_mask, z_ptr, stride_zm, xs, ws_g, ws_u, rs,
                  HAS_XS: tl.constexpr, HAS_WS: tl.constexpr, HAS_RS: tl.constexpr):  # fmt: skip
    """Scale the [BM, BN] float32 gate / up accumulators, z = silu(gate) * up, store."""
    z = _swiglu_value(g_acc, u_acc, xs, ws_g, ws_u, rs, HAS_XS, HAS_WS, HAS_RS)
    ptrs = z_ptr + offs_m.to(tl.int64)[:, None] * stride_zm + offs_n[None, :]
    tl.store(ptrs, z.to(z_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])


@triton.jit
def _swiglu_value(g_acc, u_acc, xs, ws_g, ws_u, rs, HAS_XS: tl.constexpr, HAS_WS: tl.constexpr,
                  HAS_RS: tl.constexpr):  # fmt: skip
    """``silu(gate) * up`` in float32 of the scaled ``[BM, BN]`` gate / up accumulators."""
    if HAS_XS:
        g_acc = g_acc * xs[:, None]
        u_acc = u_acc * xs[:, None]
    if HAS_WS:
        g_acc = g_acc * ws_g[None, :]
        u_acc = u_acc * ws_u[None, :]
    if HAS_RS:
        g_acc = g_acc * rs[:, None]
        u_acc = u_acc * rs[:, None]
    return g_acc / (1.0 + tl.exp(-g_acc)) * u_acc


@triton.jit
def _gate_up_scales(ws_ptr, gate, up, n_mask, HAS_WS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The FP8 weight rows' scales of a program's gate and up columns (ones without ``HAS_WS``)."""
    ws_g = tl.full((BLOCK_N,), 1.0, tl.float32)
    ws_u = ws_g
    if HAS_WS:
        ws_g = tl.load(ws_ptr + gate, mask=n_mask, other=0.0)
        ws_u = tl.load(ws_ptr + up, mask=n_mask, other=0.0)
    return ws_g, ws_u


@triton.jit
def _gemv_pair(wg_rows, wu_rows, x_row, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """One row's gate and up products ``[1, BLOCK_N]`` over the whole K: CUDA-core FMAs into
    elementwise float32 accumulators, one reduction over K at the end (the GEMV kernels here and
    in ``moekit.ops._triton.decode``)."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            wg = tl.load(wg_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            wu = tl.load(wu_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            xv = tl.load(x_row + offs_k)
        else:
            k_mask = offs_k < K
            wg = tl.load(wg_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            wu = tl.load(wu_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        xf = xv.to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * xf
        acc_u += wu.to(tl.float32) * xf
    return tl.sum(acc_g, axis=1)[None, :], tl.sum(acc_u, axis=1)[None, :]


@triton.jit
def _swiglu_gemv_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    m_sizes_ptr,
    gather_ptr,
    xs_ptr,
    ws_ptr,
    rs_ptr,
    M,
    F,
    K,
    G,
    T_IN,
    stride_xm,
    stride_wn,
    stride_zm,
    GATHER: tl.constexpr,
    HAS_XS: tl.constexpr,
    HAS_WS: tl.constexpr,
    HAS_RS: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    m = pid % M
    nb = pid // M
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, True, G_BLOCK)
    g = _pick(gi + 1, (m >= starts) & (m < starts + rows)) - 1
    src = m
    if GATHER:
        src = tl.load(gather_ptr + m)
    if (g >= 0) & (src >= 0) & (src < T_IN):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < F
        gate = g.to(tl.int64) * 2 * F + offs_n
        up = gate + F
        wg_rows = w_ptr + gate[:, None] * stride_wn
        wu_rows = w_ptr + up[:, None] * stride_wn
        x_row = x_ptr + src.to(tl.int64) * stride_xm
        # Epilogue operands first: their latency hides under the weight stream.
        xs = tl.full((1,), 1.0, tl.float32)
        if HAS_XS:
            xs = tl.load(xs_ptr + src + tl.zeros((1,), tl.int32))
        ws_g, ws_u = _gate_up_scales(ws_ptr, gate, up, n_mask, HAS_WS, BLOCK_N)
        rs = tl.full((1,), 1.0, tl.float32)
        if HAS_RS:
            rs = tl.load(rs_ptr + m + tl.zeros((1,), tl.int32)).to(tl.float32)
        hg, hu = _gemv_pair(wg_rows, wu_rows, x_row, n_mask, K, BLOCK_N, BLOCK_K, EVEN_K, STAGES)
        offs_m = m + tl.zeros((1,), tl.int32)
        _swiglu_store(hg, hu, offs_m, offs_m >= 0, offs_n, n_mask, z_ptr, stride_zm, xs, ws_g, ws_u, rs,
                      HAS_XS, HAS_WS, HAS_RS)  # fmt: skip


@triton.jit
def _gate_up_tiles(w_ptr, gate, F, gate_row0, up_row0, n_mask, offs_k, k_mask, k0, stride_wn,
                   USE_TMA: tl.constexpr):  # fmt: skip
    """One K step's ``[BLOCK_N, BLOCK_K]`` gate and up weight tiles: through the weights' TMA
    descriptor (``w_ptr``; rows ``gate_row0`` / ``up_row0``) or masked pointers (rows ``gate`` /
    ``gate + F``)."""
    if USE_TMA:
        wg = w_ptr.load([gate_row0, k0])
        wu = w_ptr.load([up_row0, k0])
    else:
        wmask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(w_ptr + gate[:, None] * stride_wn + offs_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(w_ptr + (gate + F)[:, None] * stride_wn + offs_k[None, :], mask=wmask, other=0.0)
    return wg, wu


@triton.jit
def _swiglu_stream_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    m_sizes_ptr,
    gather_ptr,
    xs_ptr,
    ws_ptr,
    rs_ptr,
    M,
    F,
    K,
    G,
    T_IN,
    stride_xm,
    stride_wn,
    stride_zm,
    GATHER: tl.constexpr,
    HAS_XS: tl.constexpr,
    HAS_WS: tl.constexpr,
    HAS_RS: tl.constexpr,
    W_CAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DEV_TMA: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """``DEV_TMA``: ``w_ptr`` is the tensor and its descriptor (``USE_TMA``) is made here."""
    pdl_prologue(USE_PDL)
    x_ptr, w_ptr = _make_descriptors(x_ptr, w_ptr, T_IN, K, G * 2 * F, stride_xm, stride_wn, USE_TMA, False,
                                     DEV_TMA, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    n_blocks = tl.cdiv(F, BLOCK_N)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, True, G_BLOCK)
    nonempty = rows > 0
    rank = tl.cumsum(nonempty.to(tl.int32), axis=0) - 1
    n_items = tl.sum(nonempty.to(tl.int32), axis=0) * n_blocks
    for item in tl.range(pid, n_items, n_progs):
        j = item // n_blocks
        nb = item % n_blocks
        sel = nonempty & (rank == j)
        g = _pick(gi, sel)
        m_begin = _pick(starts, sel)
        m_end = m_begin + _pick(rows, sel)
        n0 = nb * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < F
        gate_row0 = g * 2 * F + n0  # < G * 2F < 2**31 (checked by the launcher)
        up_row0 = gate_row0 + F
        gate = gate_row0.to(tl.int64) + tl.arange(0, BLOCK_N)
        ws_g, ws_u = _gate_up_scales(ws_ptr, gate, gate + F, n_mask, HAS_WS, BLOCK_N)
        for m0 in range(m_begin, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < m_end
            src = offs_m
            if GATHER:
                src = tl.load(gather_ptr + offs_m, mask=m_mask, other=-1)
            row_ok = m_mask & (src >= 0) & (src < T_IN)
            xs = tl.full((BLOCK_M,), 1.0, tl.float32)
            if HAS_XS:
                xs = tl.load(xs_ptr + src, mask=row_ok, other=0.0)
            rs = tl.full((BLOCK_M,), 1.0, tl.float32)
            if HAS_RS:
                rs = tl.load(rs_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
            x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                wg, wu = _gate_up_tiles(w_ptr, gate, F, gate_row0, up_row0, n_mask, offs_k, k_mask, k0, stride_wn,
                                        USE_TMA)  # fmt: skip
                x_t = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_mask[None, :], other=0.0)
                if W_CAST:  # weight-only FP8: the weights in x's dtype, in registers
                    wg = wg.to(x_t.dtype)
                    wu = wu.to(x_t.dtype)
                acc_g = tl.dot(wg, tl.trans(x_t), acc_g)
                acc_u = tl.dot(wu, tl.trans(x_t), acc_u)
            _swiglu_store(tl.trans(acc_g), tl.trans(acc_u), offs_m, row_ok, offs_n, n_mask, z_ptr, stride_zm,
                          xs, ws_g, ws_u, rs, HAS_XS, HAS_WS, HAS_RS)  # fmt: skip


@triton.jit
def _gate_up_acc(x_ptr, x_rows, w_ptr, row_ok, g, m0, n0, F, K, stride_wn, gate, gate_row0, up_row0, n_mask,
                 W_CAST: tl.constexpr, USE_TMA: tl.constexpr, FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, X_TMA: tl.constexpr,
                 PAIR: tl.constexpr, MIX: tl.constexpr = False):  # fmt: skip
    """A tiled tile's float32 gate and up accumulators ``[BLOCK_M, BLOCK_N]`` over the whole K:
    the row tile (``x_rows`` pointers, or rows from ``m0`` through the descriptor ``x_ptr`` with
    ``X_TMA``) against the gate and up weight tiles (one ``[2 BN, BK]`` descriptor load and one
    MMA with ``PAIR``, split at the end). ``MIX`` (with ``PAIR``): the paired tile's rows in
    blocks of ``BLOCK_N // 2`` gate rows then the same columns' up rows (``_pair_order``), not all
    gate rows then all up rows: a column's gate and up sums then sit in one thread's registers
    and the split moves no data."""
    if PAIR:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        # Without TMA the same tile through masked pointers: each of its 2 BN rows is the weight
        # row gate_row0 + j (gate) or gate_row0 + F + j (up), the columns j past F masked.
        j, up_half = _pair_order(BLOCK_N, MIX)
        pair_rows = gate_row0.to(tl.int64) + j + up_half * F
        pair_ok = (n0 + j) < F
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if X_TMA:
            a = x_ptr.load([m0, k0])
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_mask[None, :], other=0.0)
        if PAIR:  # gate and up rows in one tile, one MMA
            if USE_TMA and MIX:  # [G, F / (BN/2), 2, BN/2, K] view: (column block, gate|up, row)
                wgu = tl.reshape(w_ptr.load([g, n0 // (BLOCK_N // 2), 0, 0, k0]), [2 * BLOCK_N, BLOCK_K])
            elif USE_TMA:
                wgu = tl.reshape(w_ptr.load([g, 0, n0, k0]), [2 * BLOCK_N, BLOCK_K])
            else:
                wgu = tl.load(w_ptr + pair_rows[:, None] * stride_wn + offs_k[None, :],
                              mask=pair_ok[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            if W_CAST:
                wgu = wgu.to(a.dtype)
            if FAST_ACCUM:
                acc = tl.dot(a, tl.trans(wgu), acc)
            else:
                acc = tl.dot(a, tl.trans(wgu), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            wg, wu = _gate_up_tiles(w_ptr, gate, F, gate_row0, up_row0, n_mask, offs_k, k_mask, k0, stride_wn,
                                    USE_TMA)  # fmt: skip
            if W_CAST:  # weight-only FP8: the weights in x's dtype, in registers
                wg = wg.to(a.dtype)
                wu = wu.to(a.dtype)
            if FAST_ACCUM:
                acc_g = tl.dot(a, tl.trans(wg), acc_g)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
            else:
                acc_g = tl.dot(a, tl.trans(wg), acc_g, max_num_imprecise_acc=BLOCK_K)
                acc_u = tl.dot(a, tl.trans(wu), acc_u, max_num_imprecise_acc=BLOCK_K)
    if PAIR and MIX:  # columns (block b, gate|up h, j) -> output column b * BN/2 + j, h last
        acc = tl.permute(tl.reshape(acc, [BLOCK_M, 2, 2, BLOCK_N // 2]), [0, 1, 3, 2])
        acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    elif PAIR:  # columns [gate | up] of the one accumulator
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    return acc_g, acc_u


@triton.jit
def _pair_order(BLOCK_N: tl.constexpr, MIX: tl.constexpr):
    """The paired tile's ``2 * BLOCK_N`` rows: per row, its column ``j`` (< ``BLOCK_N``) and
    whether it is the up row (1) or the gate row (0). Plain: ``[gate 0..BN-1 | up 0..BN-1]``.
    ``MIX``: ``[gate 0..h-1 | up 0..h-1 | gate h..2h-1 | up h..2h-1]`` (h = BN/2). The MMA's
    accumulator spreads its columns over registers within 64-column spans and over the two
    warpgroups of an 8-warp 64-row tile across them, so only the mixed order keeps a column's
    gate and up sums in one thread (sm_90 TTGIR: no ``convert_layout`` before the split)."""
    i = tl.arange(0, 2 * BLOCK_N)
    if MIX:
        h: tl.constexpr = BLOCK_N // 2
        return (i // BLOCK_N) * h + i % h, (i // h) % 2
    return i % BLOCK_N, i // BLOCK_N


@triton.jit
def _pair_descriptor(w_ptr, F, K, G, stride_wn, MAKE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MIX: tl.constexpr = False):  # fmt: skip
    """With ``MAKE`` (``DEV_TMA`` and a paired tile through TMA) the descriptor ``_tiled_operands``
    would have made on the host for the paired tile, made here: the weights viewed ``[G, 2, F, K]``
    in ``[1, 2, BLOCK_N, BLOCK_K]`` tiles (``MIX``: ``[G, F / h, 2, h, K]``, h = BLOCK_N / 2, in
    ``[1, 2, 2, h, BLOCK_K]`` tiles); else ``w_ptr`` unchanged."""
    if MAKE:
        fk = tl.cast(stride_wn, tl.int64) * F  # (not .to: a stride traced as a constant is a Python int)
        if MIX:
            h: tl.constexpr = BLOCK_N // 2
            w_ptr = tl.make_tensor_descriptor(w_ptr, [G, F // h, 2, h, K], [2 * fk, h * stride_wn, fk, stride_wn, 1],
                                              [1, 2, 2, h, BLOCK_K])  # fmt: skip
        else:
            w_ptr = tl.make_tensor_descriptor(w_ptr, [G, 2, F, K], [2 * fk, fk, stride_wn, 1],
                                              [1, 2, BLOCK_N, BLOCK_K])  # fmt: skip
    return w_ptr


@triton.jit
def _swiglu_tiled_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    m_sizes_ptr,
    gather_ptr,
    xs_ptr,
    ws_ptr,
    rs_ptr,
    M,
    F,
    K,
    G,
    T_IN,
    stride_xm,
    stride_wn,
    stride_zm,
    GATHER: tl.constexpr,
    HAS_XS: tl.constexpr,
    HAS_WS: tl.constexpr,
    HAS_RS: tl.constexpr,
    W_CAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    FLATTEN: tl.constexpr = False,
    X_TMA: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    DEV_TMA: tl.constexpr = False,
    MIX: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """Persistent ``[BLOCK_M, BLOCK_N]`` output tiles (expert, row tile, column tile): the rows'
    x tiles (read by index with ``GATHER``) against the expert's gate and up weight tiles, two
    tensor-core accumulators, the SwiGLU in the epilogue. Tiles in bands of ``GROUP_M`` row tiles
    per column sweep (as the grouped GEMM's tiled kernel), so neighbours share x rows in L2.
    ``X_TMA`` (rows not gathered): ``x_ptr`` is a TMA descriptor and the row tile is read whole
    from ``m0`` (rows of the next group come along and are never stored; rows past M read as
    zeros), as the grouped GEMM's tiled kernel reads its x. ``PAIR``: ``w_ptr`` is a descriptor
    of the weights viewed ``[G, 2, F, K]``: one load brings a tile's gate and up rows together
    (``[2 * BLOCK_N, BLOCK_K]``), one MMA of twice the width computes both halves into one
    accumulator, split in the epilogue (the plain GEMM's 128 x 256 tile for a 128-column pair).
    ``DEV_TMA``: ``x_ptr`` / ``w_ptr`` are the tensors, their descriptors made here
    (``gg_kernels._make_descriptors``, ``_pair_descriptor``)."""
    pdl_prologue(USE_PDL)
    x_ptr, w_ptr = _make_descriptors(x_ptr, w_ptr, T_IN, K, G * 2 * F, stride_xm, stride_wn, USE_TMA and not PAIR,
                                     X_TMA, DEV_TMA, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    w_ptr = _pair_descriptor(w_ptr, F, K, G, stride_wn, DEV_TMA and USE_TMA and PAIR, BLOCK_N, BLOCK_K, MIX)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, True, G_BLOCK)
    n_tiles_n = tl.cdiv(F, BLOCK_N)
    pack_gt, pack_sr, tiles_begin, tiles_end, total = _tile_table(gi, starts, rows, n_tiles_n, BLOCK_M)
    for t in tl.range(pid, total, n_progs, flatten=FLATTEN):
        g, m0, m_end, n0 = _tile_at(t, pack_gt, pack_sr, tiles_begin, tiles_end, n_tiles_n, GROUP_M, BLOCK_M,
                                    BLOCK_N)  # fmt: skip
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_mask = offs_m < m_end
        n_mask = offs_n < F
        src = offs_m
        if GATHER:
            src = tl.load(gather_ptr + offs_m, mask=m_mask, other=-1)
        row_ok = m_mask & (src >= 0) & (src < T_IN)
        x_rows = x_ptr  # (X_TMA: x_ptr is the rows' descriptor)
        if not X_TMA:
            x_rows = x_ptr + tl.where(row_ok, src, 0).to(tl.int64)[:, None] * stride_xm
        gate_row0 = g * 2 * F + n0  # < G * 2F < 2**31 (checked by the launcher)
        up_row0 = gate_row0 + F
        gate = gate_row0.to(tl.int64) + tl.arange(0, BLOCK_N)
        acc_g, acc_u = _gate_up_acc(x_ptr, x_rows, w_ptr, row_ok, g, m0, n0, F, K, stride_wn, gate, gate_row0, up_row0,
                                    n_mask, W_CAST, USE_TMA, FAST_ACCUM, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, X_TMA,
                                    PAIR, MIX)  # fmt: skip
        xs = tl.full((BLOCK_M,), 1.0, tl.float32)
        if HAS_XS:
            xs = tl.load(xs_ptr + src, mask=row_ok, other=0.0)
        ws_g, ws_u = _gate_up_scales(ws_ptr, gate, gate + F, n_mask, HAS_WS, BLOCK_N)
        rs = tl.full((BLOCK_M,), 1.0, tl.float32)
        if HAS_RS:
            rs = tl.load(rs_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
        _swiglu_store(acc_g, acc_u, offs_m, row_ok, offs_n, n_mask, z_ptr, stride_zm, xs, ws_g, ws_u, rs,
                      HAS_XS, HAS_WS, HAS_RS)  # fmt: skip


@triton.jit
def _swiglu_tiled_quant_kernel(
    x_ptr,
    w_ptr,
    zq_ptr,
    zs_ptr,
    scr_ptr,
    m_sizes_ptr,
    gather_ptr,
    xs_ptr,
    ws_ptr,
    rs_ptr,
    M,
    F,
    K,
    G,
    T_IN,
    stride_xm,
    stride_wn,
    eps,
    GATHER: tl.constexpr,
    HAS_XS: tl.constexpr,
    HAS_WS: tl.constexpr,
    HAS_RS: tl.constexpr,
    W_CAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    X_TMA: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    MIX: tl.constexpr = False,
    MAX_FP8: tl.constexpr = 448.0,
    EMULATE: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """``_swiglu_tiled_kernel``'s tiles with the SwiGLU rows quantized to FP8 row-wise in the same
    launch (``zq [M, F]`` e4m3, ``zs [M]``: exactly ``quantize_fp8_row`` of the 16-bit rows the
    plain kernel writes). A program owns whole row tiles (``pid, pid + P, ...``) and sweeps their
    column tiles in order, keeping each row's running max of its 16-bit values; the tiles wait in
    the program's own ``[BLOCK_M, F]`` bf16 scratch (``scr_ptr``: written and read back by the
    same SM while it is in L2) until the row tile's last column is done, then go out as FP8. The
    16-bit rows are not read back from DRAM by a quantization pass. Off the layer's path (knob
    ``SWIGLU_QUANT``): H100, session 34, Qwen3-30B FP8 T=8192 883.8 -> 1020.1 µs, the row tiles of
    132 programs at once (35 MB of rows) no longer share L2 as the plain kernel's bands do."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    eps32 = tl.cast(eps, tl.float32)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, True, G_BLOCK)
    pack_gt, pack_sr, tiles_begin, tiles_end, total = _tile_table(gi, starts, rows, 1, BLOCK_M)  # row tiles
    offs_r = tl.arange(0, BLOCK_M)
    for t in tl.range(pid, total, n_progs):
        g, m0, m_end, _n = _tile_at(t, pack_gt, pack_sr, tiles_begin, tiles_end, 1, 1, BLOCK_M, BLOCK_N)
        offs_m = m0 + offs_r
        m_mask = offs_m < m_end
        src = offs_m
        if GATHER:
            src = tl.load(gather_ptr + offs_m, mask=m_mask, other=-1)
        row_ok = m_mask & (src >= 0) & (src < T_IN)
        x_rows = x_ptr  # (X_TMA: x_ptr is the rows' descriptor)
        if not X_TMA:
            x_rows = x_ptr + tl.where(row_ok, src, 0).to(tl.int64)[:, None] * stride_xm
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, F, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < F
            gate_row0 = g * 2 * F + n0  # < G * 2F < 2**31 (checked by the launcher)
            up_row0 = gate_row0 + F
            gate = gate_row0.to(tl.int64) + tl.arange(0, BLOCK_N)
            acc_g, acc_u = _gate_up_acc(x_ptr, x_rows, w_ptr, row_ok, g, m0, n0, F, K, stride_wn, gate, gate_row0,
                                        up_row0, n_mask, W_CAST, USE_TMA, FAST_ACCUM, BLOCK_M, BLOCK_N, BLOCK_K,
                                        STAGES, X_TMA, PAIR, MIX)  # fmt: skip
            # (the rows' scales loaded per column tile, from L1: nothing but the running max held
            # across the sweep, which keeps the 128 x 256 FP8 tiles free of spills)
            xs = tl.full((BLOCK_M,), 1.0, tl.float32)
            if HAS_XS:
                xs = tl.load(xs_ptr + src, mask=row_ok, other=0.0)
            rs = tl.full((BLOCK_M,), 1.0, tl.float32)
            if HAS_RS:
                rs = tl.load(rs_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
            ws_g, ws_u = _gate_up_scales(ws_ptr, gate, gate + F, n_mask, HAS_WS, BLOCK_N)
            z = _swiglu_value(acc_g, acc_u, xs, ws_g, ws_u, rs, HAS_XS, HAS_WS, HAS_RS).to(tl.bfloat16)
            live = row_ok[:, None] & n_mask[None, :]
            amax = max_nan(amax, row_amax(tl.where(live, z.to(tl.float32), 0.0)))
            scr_rows = scr_ptr + (pid * BLOCK_M + offs_r).to(tl.int64)[:, None] * F
            tl.store(scr_rows + offs_n[None, :], z, mask=n_mask[None, :])
        tl.debug_barrier()  # the tile's scratch rows, written by every thread, read back by others
        inv, scale = row_scales(amax, eps32, eps32, False, MAX_FP8)
        tl.store(zs_ptr + offs_m, scale, mask=row_ok)
        q_rows = zq_ptr + offs_m.to(tl.int64) * F
        scr_rows = scr_ptr + (pid * BLOCK_M + offs_r).to(tl.int64)[:, None] * F
        for n0 in range(0, F, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            v = tl.load(scr_rows + cols[None, :], mask=(cols < F)[None, :], other=0.0).to(tl.float32)
            _store_fp8(q_rows, cols, row_ok, F, v * inv[:, None], MAX_FP8, EMULATE)
        tl.debug_barrier()  # read before the next row tile overwrites the scratch


# Rows per expert from which the tiled kernel loads a column block's gate and up rows as one pair
# (``swiglu_pair``).
SWIGLU_PAIR_MIN_ROWS = 128

# Knob SWIGLU_PAIR_MIX (off): the paired tile's gate and up rows in ``_pair_order``'s mixed
# order, so the epilogue's split is a renaming of registers. In the [gate | up] order an 8-warp
# 64-row tile's two warpgroups hold the gate and the up half (the MMA's warps split N), and the
# split goes through shared memory (sm_90 TTGIR: a convert_layout of the 64 x 256 float32 tile,
# 64 KB stored and loaded back per tile while no MMA runs). Predicted from session 49's ncu run
# (H100: Qwen3-30B's FP8 gate/up at T=2048 196.6 µs against 181.5-182.5 for the plain grouped GEMM
# on the same 64 x 256 x 128 tile, whose epilogue is a plain store): most of that gap. Measured
# (H100, session 49): the kernel alone 196.4 µs (sweep_swiglu, another call than the 199.6
# before), the layer from logits level (bench_layer --alt-knobs SWIGLU_PAIR_MIX=0, one process,
# Qwen3-30B / gpt-oss-120b / DeepSeek-V3 TP8 at T = 1024 / 2048 / 8192, bf16 and FP8: 0.994-1.02,
# errors against the reference the same). So that round trip is not what holds the kernel. It
# does free 16 KB of the 64-row FP8 tile's shared memory (196.6 -> 180.3 KB): only with it do 5
# stages fit a block (221.2 KB; 237.6 without; a block may take 232.4), knob SWIGLU_SMALL_STAGES
# (3 -> 4 stages was worth 7% on this stage in session 49's sweep: 231.3 -> 216.1). 4 -> 5 was not
# (H100, session 51, bench_layer.py --lean --quick --models qwen3-30b-a3b,gpt-oss-120b --tokens
# 1024,2048 --dtype fp8,bf16 --alt-knobs SWIGLU_PAIR_MIX=1,SWIGLU_SMALL_STAGES=5, one process, µs,
# off -> on, two passes: Qwen3-30B FP8 T=1024 274.1 / 273.6 -> 269.6 / 271.4, T=2048 355.5 / 358.6
# -> 367.0 / 365.2, bf16 T=1024 459.5 / 461.6 -> 464.9 / 466.4; gpt-oss-120b level): both off.
SWIGLU_PAIR_MIX = False


# Knob SWIGLU_PTR_PAIR: the tiled kernel's paired gate|up tile (``swiglu_pair``) also where the
# weights are read through pointers, not a TMA descriptor (torch.compile's traced graphs, whose
# tracing takes no descriptors; weights whose strides TMA cannot take). Without it those tiles
# ran two MMAs into two accumulators, and on the fused tile loop (``SWIGLU_FLATTEN``, the 64-row
# tiles) sm_90's ptxas then serializes every wgmma (C7515: "non wgmma instructions defining
# accumulator registers of a wgmma between start and end of the pipeline stage"): each 64 x 64 x
# 32 MMA waited for before the next issued (CPU-side compile, session 43; the TMA path's paired
# tiles and every unfused tile keep their MMAs in flight). H100, session 44, the layer on the
# pointer path: Qwen3-30B 2.7-12.2% faster with it, gpt-oss-120b level.
SWIGLU_PTR_PAIR = True


def swiglu_pair(M: int, G: int, small: bool = False) -> bool:
    """Whether the tiled kernel takes its gate and up tiles through one descriptor of the weights
    viewed ``[G, 2, F, K]`` and one m64n256 MMA instead of two m64n128 (``PAIR``; the sm_90
    compile keeps the reshaped tile in shared memory): knob ``SWIGLU_PAIR`` (True / False), else
    from ``SWIGLU_PAIR_MIN_ROWS`` rows per expert. H100, session 28 runs 4-5, layer from logits,
    same call, two MMAs -> one (µs): Qwen3-30B bf16 T = 2048 / 8192 (128 / 512 rows per expert)
    547.3 / 1262.2 -> 535.9 / 1231.6, FP8 369.5 / 931.7 -> 363.2 / 905.5; DeepSeek-V3 TP8
    (T=2048: 64 rows) bf16 1159.7 / 2231.3 -> 1156.0 / 2192.0, FP8 737.8 / 1694.5 -> 732.7 /
    1664.7; but Qwen3 at T=1024 (64 rows per expert, K = 2048) bf16 470.8 -> 532.1, FP8 286.0 ->
    316.5 (run 5). ``small``: the tile is ``swiglu_tiled_config``'s 64-row one, paired at any size
    (session 29: the 64-row paired tiles on the fused loop, Qwen3 T=1024 bf16 473.5 -> 461.9 µs)."""
    pinned = settings.get().knob("SWIGLU_PAIR", None)
    if pinned is not None:
        return bool(pinned)
    hits = max(1.0, min(expected_groups_hit(M, G), float(min(G, M))))
    return M >= SWIGLU_PAIR_MIN_ROWS * hits or small


def swiglu_tiled_config(M: int, F: int, K: int, hits: float, elem: int, sms: int, by_index: bool = True) -> GemmConfig:
    """Tensor-core tiles for many rows per expert: 128 rows x 128 columns of each half (gate and
    up: two accumulators, the registers of a 128 x 256 tile), three stages (~147 KB). Measured
    best or within 3% of the best of 64x128 s4, 128x64 s4, 64x64 s4 and 128x128 s2 on every model
    of the layer benchmark at T = 2048 and 8192, bf16 and FP8 (H100, session 13
    ``sweep_swiglu.py``: e.g. Qwen3-30B bf16 T=8192 788 µs vs 1038-1300)."""
    block_n = min(128, max(16, next_pow2(F)))
    block_k = 128 if elem == 1 else (64 if elem == 2 else 32)
    # Knob SWIGLU_SMALL_TILES (default: the rule below): below 192 rows per expert 64-row tiles,
    # the grouped GEMM's rule. Each expert's last row tile is partly empty: at 64 rows per expert
    # (Qwen3-30B T=1024, DeepSeek-V3 TP8 T=2048) 128-row tiles hold 50% routed rows, 64-row ones
    # 68-69% (scripts/tile_use.py); session 22's sweep had 64 x 128 x 4 stages 2.5-5% faster on
    # this stage in 4 of 5 cells.
    # Knob SWIGLU_FLATTEN (default: the 64-row tiles only): the tile loop fused into the K loop
    # (one software pipeline across tiles). sm_90 compile (session 29): 16-bit tiles and FP8 64 x
    # 128 x 4 stages without spills, FP8 128 x 128 x 3 paired tiles spill 168 bytes (so FP8 128-row
    # tiles never take it). H100, session 29, sweep_swiglu.py (the kernel alone, bf16, µs):
    # Qwen3-30B T=1024 312.3 -> 302.6 (128 x 128 paired) / 304.9 (64 x 128 paired), T=2048 348.9
    # -> 345.5 / 341.9; DeepSeek-V3 TP8 T=1024 693.7 -> 685.0 / 685.6, T=2048 711.0 -> 703.5 / 713.3.
    # The rule (session 29, H100, layer from logits, same call, µs: 128 x 128 x 3 tiles -> 64 x 128
    # x 4 paired tiles on the fused loop): below 192 rows per expert, rows read by index
    # (``by_index``), where K < 4F, the small tiles, paired (``swiglu_pair``), on the fused loop:
    # Qwen3-30B bf16 T = 1024 / 2048 471.2 / 534.5 -> 460.8 / 526.7, FP8 285.8 / 364.5 -> 272.7 /
    # 358.0 (run 5; run 4: 473.5 / 535.1 -> 461.9 / 526.7, 284.8 / 365.2 -> 272.1 / 360.8). Not
    # DeepSeek-V3 TP8's deep, narrow gate/up (run 4, T=1024: bf16 1063.4 -> 1089.0, FP8 614.3 ->
    # 623.3), nor the gathered rows through TMA (run 5: gpt-oss-120b bf16 T=2048 2353.9 -> 2501.6;
    # Mixtral-8x7B bf16 T=512 1244.7 -> 1200.7).
    s = settings.get()
    small = s.knob("SWIGLU_SMALL_TILES", None)
    if small is None:
        small = by_index and K < 4 * F
    if small and M < s.knob("SWIGLU_SMALL_MAX_ROWS", 192) * hits:
        stages = int(s.knob("SWIGLU_SMALL_STAGES", 4))  # (above 4 in the mixed order only: _fit_stages)
        return GemmConfig("tiled", 64, block_n, block_k, stages, 8, flatten=bool(s.knob("SWIGLU_FLATTEN", True)))
    stages = int(s.knob("SWIGLU_TILED_STAGES", 3))
    flatten = bool(s.knob("SWIGLU_FLATTEN", False)) and elem != 1
    return GemmConfig("tiled", 128, block_n, block_k, stages, 8, flatten=flatten)


# Float32 accumulator elements of one FP8 gate/up GEMV program (gate and up tiles each
# ``BLOCK_N x BLOCK_K``), at 4 warps: 4096 per tile keeps a program at <= 128 registers (4
# programs per SM); 8192 per tile (~200 registers, 2 per SM) only where the grid is at most two
# programs per SM anyway. sm_90 ptxas (tests/ops/_sm90.py): 16x256 and 8x512 125-128 registers,
# 16x512 and 8x1024 198-206.
_FP8_GEMV_TILE = 4096


def _fp8_gemv_config(M: int, F: int, K: int, sms: int) -> GemmConfig:
    """The FP8 gate/up GEMV: ``block_n`` the widest (up to 16) that still gives ~1.8 programs per
    SM (no short-row limit), the K tile from the accumulator budget (``_FP8_GEMV_TILE``: the grid
    in one wave of resident programs), ~32 KB of weights in flight per program. Measured on the
    H200 (session 18, moe_decode from logits at T=1, µs, same call, two passes each): Qwen3-30B
    (K=2048) 16x256x5 19.5 vs the old 8x512x5 20.8 and 16x512x3 21.5 (206 registers: 2 programs
    per SM, 384 programs in 1.45 waves); gpt-oss-120b (K=2880) 16x256x5 39.2 vs 4x512x7 43.4;
    DeepSeek-V3 TP8 (K=7168, 256 programs) 8x1024x3 20.4 vs 8x512x5 23.5 and 16x256x5 29.8."""
    block_n = widest_slice(M, F, sms)
    tile = 2 * _FP8_GEMV_TILE if M * cdiv(F, block_n) <= 2 * sms else _FP8_GEMV_TILE
    block_k = min(1024, max(16, tile // block_n), max(16, next_pow2(K)))
    div = K & -K  # the largest power of two dividing K: no K masks where one of >= 128 does
    if div >= 128:
        block_k = min(block_k, div)
    stages = 1 + max(2, min(6, (32 * 1024) // (2 * block_n * block_k)))
    return GemmConfig("gemv", 1, block_n, block_k, stages, 4, use_tma=False)


def swiglu_gemv_config(M: int, F: int, K: int, w_elem: int, sms: int) -> GemmConfig:
    """The gate/up GEMV's configuration (here and in ``moe_decode``'s routing GEMV): FP8 weights
    ``_fp8_gemv_config`` (knob ``SWIGLU_GEMV_FP8_WAVE`` False: the 16-bit rule), else
    ``gemv_config``'s with two weight tiles per stage: ~32 KB in flight per program, as the plain
    GEMV."""
    if w_elem == 1 and settings.get().knob("SWIGLU_GEMV_FP8_WAVE", True):
        return _fp8_gemv_config(M, F, K, sms)
    cfg = gemv_config(M, F, K, w_elem, sms)
    return replace(cfg, stages=1 + max(2, min(6, (16 * 1024) // (cfg.block_n * cfg.block_k * w_elem))))


@functools.lru_cache(maxsize=4096)
def swiglu_config(M: int, F: int, K: int, G: int, fp8: bool, elem: int, sms: int, w_elem: int = 0,
                  by_index: bool = True) -> GemmConfig:  # fmt: skip
    """The grouped GEMM's rules for an ``[M, F]`` output (GEMV when rows rarely share an expert,
    else streaming), with pipelines resized for two weight tiles per stage. ``elem``: bytes of the
    MMA operands (x's), ``w_elem``: of the weights the GEMV streams (default ``elem``). Cached per
    shape (cleared when the settings change: ``settings.on_change``). ``by_index``: the rows are
    read from the token matrix by index (else given in order)."""
    hits = max(1.0, min(expected_groups_hit(M, G), float(min(G, M))))
    if use_gemv(M, hits):
        return swiglu_gemv_config(M, F, K, w_elem or elem, sms)
    cfg = heuristic_config(M, F, K, G, fp8, elem, sms, persist=False)  # no persistent stream loop here
    if cfg.kind != "stream":  # many rows per expert: persistent tensor-core tiles
        return swiglu_tiled_config(M, F, K, hits, elem, sms, by_index)
    if fp8 or settings.get().knob("BF16_STREAM_SWIGLU", True):
        # FP8 rows (the sorted pipeline's, knob FP8_STREAM_SWIGLU) and 16-bit ones (knob
        # BF16_STREAM_SWIGLU; before it, the tile below): the plain GEMM's streaming tile over the
        # 2F gate|up rows, split into its gate and up halves: the same weight bytes per stage,
        # stages and programs per SM as the unfused GEMM it replaces.
        plain = heuristic_config(M, 2 * F, K, G, fp8, elem, sms, persist=False)
        if plain.kind == "stream" and plain.block_n >= 32:
            return replace(plain, block_n=plain.block_n // 2)
    stage = (2 * cfg.block_n + cfg.block_m) * cfg.block_k * elem
    budget = _STREAM_SMEM if cfg.block_n >= 64 and cfg.warps == 4 else 128 * 1024
    return replace(cfg, stages=max(2, min(cfg.stages, budget // stage)))


def _tiled_operands(x, w13, cfg: GemmConfig, gathered: bool, M: int, G: int, allow_dev: bool = True,
                    allow_mix: bool = True):  # fmt: skip
    """The tiled kernels' operands: ``(x_arg, w_arg, use_tma, x_tma, pair, dev, mix)``. The weights
    through a TMA descriptor where the strides allow (``[G, 2, F, K]``: a tile's gate and up rows
    in one load, ``swiglu_pair``; ``mix``: in ``_pair_order``'s mixed order, the ``[G, F / h, 2,
    h, K]`` view, h = BLOCK_N / 2); rows given in order (not gathered) whole row tiles through one
    too, as the grouped GEMM's tiled kernel reads them. ``dev`` (``grouped_gemm.device_tma``,
    where ``allow_dev``): the kernel makes those descriptors itself (``DEV_TMA``) from the
    tensors, which are then the arguments. ``allow_mix`` False: never the mixed order."""
    from moekit.ops._triton.grouped_gemm import _descriptor, _tma_fits, _tma_ok, device_tma, ensure_allocator

    K = int(x.shape[1])
    F = int(w13.shape[0]) // (2 * G)
    dev = allow_dev and device_tma(w13)
    ok = _tma_fits if dev else _tma_ok
    w_block = [cfg.block_n, cfg.block_k]
    use_tma = cfg.use_tma and ok(w13, tuple(w_block))
    x_block = [cfg.block_m, cfg.block_k]
    x_tma = use_tma and not gathered and ok(x, tuple(x_block))
    # through the [G, 2, F, K] view's descriptor, else through pointers (knob SWIGLU_PTR_PAIR)
    through = w13.is_contiguous() if use_tma else bool(settings.get().knob("SWIGLU_PTR_PAIR", SWIGLU_PTR_PAIR))
    pair = through and swiglu_pair(M, G, cfg.block_m == 64)
    # the mixed order's view needs whole h-column blocks (else its last block's rows would run
    # past F into the up rows, and past the tensor's end for the last expert)
    h = cfg.block_n // 2
    mix = allow_mix and pair and h >= 8 and (F % h == 0 or not use_tma)
    mix = mix and bool(settings.get().knob("SWIGLU_PAIR_MIX", SWIGLU_PAIR_MIX))
    dev = dev and use_tma
    if dev:
        ensure_allocator()
        return x, w13, use_tma, x_tma, pair, True, mix
    w_arg = _descriptor(w13, w_block) if use_tma else w13
    x_arg = _descriptor(x, x_block) if x_tma else x
    if pair and use_tma and mix:  # (column block, gate|up, row): strides 2FK, hK, FK, K, 1
        w_arg = _descriptor(w13.view(G, 2, F // h, h, K).permute(0, 2, 1, 3, 4), [1, 2, 2, h, cfg.block_k])
    elif pair and use_tma:
        w_arg = _descriptor(w13.view(G, 2, F, K), [1, 2, cfg.block_n, cfg.block_k])
    return x_arg, w_arg, use_tma, x_tma, pair, False, mix


# Pipeline stages of the 64-row tiles that fit a block in the [gate | up] order, whose epilogue
# splits the accumulator through shared memory (sm_90, FP8 and bf16: 4 stages 196.6 KB, 5 stages
# 237.6 KB against a block's 232.4; in the mixed order 5 stages take 221.2 KB).
_PLAIN_SMALL_STAGES = 4


def _fit_stages(cfg: GemmConfig, mix: bool) -> GemmConfig:
    """``cfg`` with the 64-row tiles' stages cut to what fits a block where the launch does not
    take the mixed order (``SWIGLU_SMALL_STAGES`` above ``_PLAIN_SMALL_STAGES`` asks for it; the
    quantizing kernel and weights whose F is not a multiple of BLOCK_N / 2 never take it)."""
    if cfg.block_m == 64 and not mix and cfg.stages > _PLAIN_SMALL_STAGES:
        return replace(cfg, stages=_PLAIN_SMALL_STAGES)
    return cfg


def grouped_gemm_swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_indices: Optional[torch.Tensor],
    row_scales: Optional[torch.Tensor],
    x_scale: Optional[torch.Tensor],
    w_scale: Optional[torch.Tensor],
    config: Optional[GemmConfig] = None,
    out: Optional[torch.Tensor] = None,
    fast_accum: bool = True,
) -> torch.Tensor:
    """Launcher (validated arguments): ``z [M, F]`` (``out`` when given: contiguous, the output
    dtype), rows not computed left unwritten. ``fast_accum`` False: the FP8 tensor-core tiles
    promote their sums to float32 every K step (the other kernels accumulate in float32 anyway)."""
    from moekit.ops._triton.grouped_gemm import (
        _descriptor,
        _tma_fits,
        _tma_ok,
        _unit_last,
        device_tma,
        ensure_allocator,
        traced_host,
    )

    T_IN, K = (int(d) for d in x.shape)
    M = int(gather_indices.shape[0]) if gather_indices is not None else T_IN
    G = int(m_sizes.shape[0])
    F = int(w13.shape[0]) // (2 * G)
    fp8_x = x.dtype == FP8_DTYPE
    z = out if out is not None else torch.empty((M, F), dtype=torch.bfloat16 if fp8_x else x.dtype, device=x.device)
    if M == 0 or F == 0:
        return z
    if G * 2 * F >= 2**31 or M >= 2**31:
        raise ValueError(f"grouped_gemm_swiglu supports G * 2F and M below 2**31, got G*2F={G * 2 * F}, M={M}")
    x = _unit_last(x)
    w13 = _unit_last(w13)
    sms = num_sms(x.device)
    cfg = config or swiglu_config(M, F, K, G, fp8_x, x.element_size(), sms, w_elem=w13.element_size(),
                                  by_index=gather_indices is not None)  # fmt: skip
    ph = torch.empty((1,), dtype=torch.int32, device=x.device)
    optional = [t if t is not None else ph for t in (gather_indices, x_scale, w_scale, row_scales)]
    flags = dict(
        GATHER=gather_indices is not None, HAS_XS=x_scale is not None, HAS_WS=w_scale is not None,
        HAS_RS=row_scales is not None, G_BLOCK=max(16, next_pow2(G)),
    )  # fmt: skip
    if cfg.kind == "gemv":
        bk = cfg.block_k
        launch(_swiglu_gemv_kernel)[(M * cdiv(F, cfg.block_n),)](
            x, w13, z, m_sizes, *optional, M, F, K, G, T_IN, x.stride(0), w13.stride(0), z.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_K=bk, EVEN_K=K % bk == 0, STAGES=cfg.stages,
            num_warps=cfg.warps, num_stages=cfg.stages, **flags,
        )  # fmt: skip
        return z
    if cfg.kind == "tiled":
        if cfg.use_tma and traced_host(x, config) and _tma_fits(w13, (cfg.block_n, cfg.block_k)):
            # the trace records the run-time launch (knob GG_TRACED_HOST): host descriptors there
            torch.ops.moekit._grouped_gemm_swiglu_launch(x, w13, m_sizes, gather_indices, row_scales, x_scale,
                                                         w_scale, z, bool(fast_accum))  # fmt: skip
            return z
        tiles = (cdiv(M, cfg.block_m) + min(G, M)) * cdiv(F, cfg.block_n)  # at most, over any m_sizes
        x_arg, w_arg, use_tma, x_tma, pair, dev, mix = _tiled_operands(x, w13, cfg, gather_indices is not None, M, G)
        cfg = cfg if config is not None else _fit_stages(cfg, mix)
        launch(_swiglu_tiled_kernel)[(max(1, min(tiles, sms)),)](
            x_arg, w_arg, z, m_sizes, *optional, M, F, K, G, T_IN, x.stride(0), w13.stride(0), z.stride(0),
            W_CAST=w13.dtype != x.dtype, USE_TMA=use_tma, FAST_ACCUM=fast_accum, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages,
            FLATTEN=cfg.flatten, X_TMA=x_tma, PAIR=pair, DEV_TMA=dev, MIX=mix, num_warps=cfg.warps,
            num_stages=cfg.stages,
            **flags,
        )  # fmt: skip
        return z
    w_block = [cfg.block_n, cfg.block_k]
    dev = device_tma(w13, tiled=False)
    use_tma = cfg.use_tma and (_tma_fits if dev else _tma_ok)(w13, tuple(w_block))
    dev = dev and use_tma
    if dev:
        ensure_allocator()
    w_arg = _descriptor(w13, w_block) if use_tma and not dev else w13
    grid = (max(1, min(min(G, M) * cdiv(F, cfg.block_n), 4 * sms)),)
    launch(_swiglu_stream_kernel)[grid](
        x, w_arg, z, m_sizes, *optional, M, F, K, G, T_IN, x.stride(0), w13.stride(0), z.stride(0),
        W_CAST=w13.dtype != x.dtype, USE_TMA=use_tma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, STAGES=cfg.stages, DEV_TMA=dev, num_warps=cfg.warps, num_stages=cfg.stages, **flags,
    )  # fmt: skip
    return z


@torch.library.custom_op("moekit::_grouped_gemm_swiglu_launch", mutates_args=("z",))
def _grouped_gemm_swiglu_launch(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_indices: Optional[torch.Tensor],
    row_scales: Optional[torch.Tensor],
    x_scale: Optional[torch.Tensor],
    w_scale: Optional[torch.Tensor],
    z: torch.Tensor,
    fast_accum: bool,
) -> None:
    """``grouped_gemm_swiglu`` at run time into ``z`` (knob ``GG_TRACED_HOST``, see
    ``grouped_gemm.traced_host``)."""
    grouped_gemm_swiglu(x, w13, m_sizes, gather_indices, row_scales, x_scale, w_scale, out=z, fast_accum=fast_accum)


@_grouped_gemm_swiglu_launch.register_fake
def _(x, w13, m_sizes, gather_indices, row_scales, x_scale, w_scale, z, fast_accum) -> None:
    return None


def grouped_gemm_swiglu_quant(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_indices: Optional[torch.Tensor],
    row_scales: Optional[torch.Tensor],
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    fast_accum: bool = True,
    eps: float = 1.0 / 512.0,
    config: Optional[GemmConfig] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Launcher (validated FP8 operands, as ``grouped_gemm_swiglu``'s): ``quantize_fp8_row`` of
    the ``z`` that ``grouped_gemm_swiglu`` returns, ``(zq [M, F] e4m3, zs [M])``, in one launch
    (``_swiglu_tiled_quant_kernel``), where the rules pick its tiled kernel; ``None`` elsewhere
    (the caller quantizes ``z`` itself). Rows not computed are left unwritten in both."""
    from moekit.ops._triton._fp8 import EMULATE_FP8
    from moekit.ops._triton.grouped_gemm import _unit_last

    T_IN, K = (int(d) for d in x.shape)
    M = int(gather_indices.shape[0]) if gather_indices is not None else T_IN
    G = int(m_sizes.shape[0])
    F = int(w13.shape[0]) // (2 * G)
    if x.dtype != FP8_DTYPE or M == 0 or F == 0 or G * 2 * F >= 2**31 or M >= 2**31:
        return None
    x = _unit_last(x)
    w13 = _unit_last(w13)
    sms = num_sms(x.device)
    cfg = config or swiglu_config(M, F, K, G, True, 1, sms, w_elem=1, by_index=gather_indices is not None)
    if cfg.kind != "tiled":
        return None
    # (host descriptors only: the quantizing kernel, off the layer's path, takes no DEV_TMA; nor
    # the mixed pair order, with which its 128 x 256 FP8 tiles spill 24 bytes on sm_90)
    x_arg, w_arg, use_tma, x_tma, pair, _, mix = _tiled_operands(x, w13, cfg, gather_indices is not None, M, G,
                                                                 False, False)  # fmt: skip
    cfg = cfg if config is not None else _fit_stages(cfg, mix)
    units = cdiv(M, cfg.block_m) + min(G, M)  # row tiles, at most, over any m_sizes
    progs = max(1, min(units, sms))
    zq = torch.empty((M, F), dtype=FP8_DTYPE, device=x.device)
    zs = torch.empty((M,), dtype=torch.float32, device=x.device)
    scratch = torch.empty((progs * cfg.block_m, F), dtype=torch.bfloat16, device=x.device)
    ph = torch.empty((1,), dtype=torch.int32, device=x.device)
    optional = [t if t is not None else ph for t in (gather_indices, x_scale, w_scale, row_scales)]
    launch(_swiglu_tiled_quant_kernel)[(progs,)](
        x_arg, w_arg, zq, zs, scratch, m_sizes, *optional, M, F, K, G, T_IN, x.stride(0), w13.stride(0), float(eps),
        GATHER=gather_indices is not None, HAS_XS=True, HAS_WS=True, HAS_RS=row_scales is not None, W_CAST=False,
        USE_TMA=use_tma, FAST_ACCUM=fast_accum, G_BLOCK=max(16, next_pow2(G)), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, X_TMA=x_tma, PAIR=pair, MIX=mix, MAX_FP8=FP8_MAX,
        EMULATE=EMULATE_FP8, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return zq, zs


# Settings (GEMV bounds, knobs) feed swiglu_config: a change drops its cached choices.
settings.on_change(swiglu_config.cache_clear)
