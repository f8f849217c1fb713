"""Triton kernels: grouped GEMM (BF16/FP16/FP32 and FP8 row-wise) with a fused epilogue
(FP8 scales, bias, token weights, scatter-add), and the dense FP8 row-wise GEMM.

Three kernels (the last two share one epilogue):

- ``_gg_gemv_kernel`` (the *GEMV* path, at most ``GEMV_MAX_M`` = 4 rows in all: decode of one
  token, top-1 or a few). One program = one row and a ``BLOCK_N``-row slice (1..16 rows) of its
  expert's weights over the whole K, on CUDA cores: an elementwise float32 accumulator that
  every thread owns (no MMA dependency chain), cp.async-pipelined 16-byte loads, one reduction
  over K at the end. ``BLOCK_N`` is chosen so that there are about two programs per SM (and,
  on short rows, about 16 KB of weights per program): all of them resident at once, each with
  ~32 KB of weights in flight, no split-K reduction and no second launch (the tensor-core tile of 16 rows per MMA would leave one or two chained
  programs per SM streaming at a third of HBM bandwidth).
- ``_gg_stream_kernel`` (the *streaming* path, rows per expert small: decode, and prefill of
  models with many experts). Operands are swapped: the tile is ``[BLOCK_N, BLOCK_M]`` =
  ``w_g[n-slice] @ x_g.T``, so the expert's N dim fills the MMA's wide side and the few rows of
  the group sit in a 16..128-wide side. One program = one (non-empty group, N slice); the grid is
  ``min(G, M) * cdiv(N, BLOCK_N)`` and programs past the number of non-empty groups exit at once,
  so empty groups cost nothing and every SM streams a slice of the weights that are needed.
  The program loops over the group's row tiles (usually one). Slices are 128 or 64 weight rows
  (warpgroup MMA, asynchronous, pipelined) whenever that still gives every SM a slice, with
  pipelines sized so that two programs share an SM (one streams while the other drains).
- ``_gg_tiled_kernel`` (the *tiled* path, many rows per expert: compute-bound prefill): a
  persistent kernel (one program per SM) walking the output tiles of all groups in a grouped
  (L2-friendly) order, with TMA tensor descriptors for x and w on Hopper when the strides allow.

All read ``m_sizes`` on the device: every program loads the ``[G]`` sizes, computes the group
offsets with a cumulative sum and clips them to ``M`` (so rows past ``M`` are never touched
when ``sum(m_sizes) > M``, and negative sizes count as 0). No host synchronization anywhere.

Scatter-add: with ``SCATTER`` the rows are atomically added (relaxed ``atomic_add`` in the output
dtype, bf16 for FP8 inputs, as MSLK does) into ``out[idx[row]]``; negative or out-of-range
indices are skipped. ``deterministic=True`` instead stores the rows into a scratch ``[M, N]``
buffer and the deterministic scatter-add's kernels (``gather_scatter``) add them to the output
token by token: each token's rows summed in float32 in ascending row order, then added to the
output once (bitwise reproducible, and bitwise equal to ``scatter_add_dense_tokens(...,
deterministic=True)`` applied to the GEMM's rows).

``use_fast_accum``: FP8 ``tl.dot`` on Hopper accumulates in the tensor core's reduced-precision
accumulator by default (fast accumulation, Triton's sm_90 default); ``use_fast_accum=False``
promotes the accumulator to float32 after every ``BLOCK_K`` slice (tiled path only; the streaming
path has short K slices per dot and always uses the default; the GEMV path always accumulates
exact float32 products). Ignored for 16-bit inputs.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from moekit._checks import FP8_DTYPE
from moekit.ops._common import _capability_major, cdiv, interpreting, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue

# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _group_table(m_sizes_ptr, G, M, HAS_MSIZES: tl.constexpr, G_BLOCK: tl.constexpr):
    """Per group: (index, first row, row count), the rows clipped to [0, M)."""
    gi = tl.arange(0, G_BLOCK)
    if HAS_MSIZES:
        sizes = tl.load(m_sizes_ptr + gi, mask=gi < G, other=0).to(tl.int64)
    else:  # one group holding every row (dense GEMM)
        sizes = tl.where(gi == 0, M, 0).to(tl.int64)
    sizes = tl.maximum(sizes, 0)
    ends = tl.cumsum(sizes, axis=0)
    starts = tl.minimum(ends - sizes, M)
    ends = tl.minimum(ends, M)
    return gi, starts.to(tl.int32), (ends - starts).to(tl.int32)


@triton.jit
def _pick(vec, sel):
    """The element of ``vec`` where ``sel`` is true (0 when none)."""
    return tl.sum(tl.where(sel, vec, 0), axis=0)


@triton.jit
def _epilogue(
    acc,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    g,
    N,
    y_ptr,
    stride_ym,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    tw_ptr,
    idx_ptr,
    T_OUT,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """``acc`` [BM, BN] float32 for rows ``offs_m`` and expert columns ``offs_n`` of group ``g``:
    scale (FP8), add bias, weight by token, then store or scatter-add. One helper on purpose:
    inductor's mutation analysis (torch.compile) follows pointers into called @triton.jit
    functions coarsely; computing the store address from values loaded in another helper made it
    count every input pointer of the kernel as written (tests/ops/test_grouped_gemm.py checks)."""
    col = g.to(tl.int64) * N + offs_n
    if FP8:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        ws = tl.load(ws_ptr + col, mask=n_mask, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + col, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    if HAS_TW:
        tw = tl.load(tw_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
    val = acc.to(y_ptr.dtype.element_ty)
    if SCATTER:
        dst = tl.load(idx_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        ok = m_mask & (dst >= 0) & (dst < T_OUT)
        ptrs = y_ptr + dst[:, None] * stride_ym + offs_n[None, :]
        tl.atomic_add(ptrs, val, mask=ok[:, None] & n_mask[None, :], sem="relaxed")
    else:
        ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, val, mask=m_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Streaming (swap-AB) kernel: few rows per group
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gg_stream_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_sizes_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    tw_ptr,
    idx_ptr,
    M,
    N,
    K,
    G,
    T_OUT,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_MSIZES: tl.constexpr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    SCATTER: tl.constexpr,
    USE_TMA: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, HAS_MSIZES, G_BLOCK)
    nonempty = rows > 0
    rank = tl.cumsum(nonempty.to(tl.int32), axis=0) - 1
    n_items = tl.sum(nonempty.to(tl.int32), axis=0) * n_blocks
    # Usually one item per program (the grid covers min(G, M) groups); capped grids loop.
    for item in tl.range(pid, n_items, n_progs):
        j = item // n_blocks  # rank of the group among the non-empty ones
        nb = item % n_blocks
        sel = nonempty & (rank == j)
        g = _pick(gi, sel)
        m_begin = _pick(starts, sel)
        m_end = m_begin + _pick(rows, sel)
        n0 = nb * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_row0 = g * N + n0  # < G * N < 2**31 (checked by the launcher)
        w_rows = w_row0.to(tl.int64) + tl.arange(0, BLOCK_N)
        for m0 in range(m_begin, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < m_end
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                if USE_TMA:
                    w_t = w_ptr.load([w_row0, k0])
                else:
                    w_t = tl.load(
                        w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0,
                    )
                # x through pointers: masked rows (other groups, past M) cost no traffic.
                x_t = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                acc = tl.dot(w_t, tl.trans(x_t), acc)
            _epilogue(
                tl.trans(acc), offs_m, m_mask, offs_n, n_mask, g, N, y_ptr, stride_ym,
                xs_ptr, ws_ptr, bias_ptr, tw_ptr, idx_ptr, T_OUT, FP8, HAS_BIAS, HAS_TW, SCATTER,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# GEMV kernel: a handful of rows in all (decode of one or a few tokens)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gg_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_sizes_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    tw_ptr,
    idx_ptr,
    M,
    N,
    K,
    G,
    T_OUT,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_MSIZES: tl.constexpr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    SCATTER: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """One program = one row of x and ``BLOCK_N`` rows of its expert's weights, over all of K.
    CUDA-core FMAs into a ``[BLOCK_N, BLOCK_K]`` float32 accumulator (every thread owns its
    elements: no dependency chain but the K loop), one reduction over K at the end. The grid is
    ``M * cdiv(N, BLOCK_N)`` (a few hundred short programs, several resident per SM), rows of a
    same expert run side by side so that their shared weight tiles come from L2."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    m = pid % M
    nb = pid // M
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, HAS_MSIZES, G_BLOCK)
    # The group holding row m (the ranges are disjoint), -1 for rows past sum(m_sizes): those are
    # left untouched. One reduction: it sits between the sizes load and the first weight load.
    g = _pick(gi + 1, (m >= starts) & (m < starts + rows)) - 1
    if g >= 0:
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        col = g.to(tl.int64) * N + offs_n
        w_rows = w_ptr + col[:, None] * stride_wn
        x_row = x_ptr + m.to(tl.int64) * stride_xm
        # Epilogue operands are loaded before the K loop: their latency hides under the weight
        # stream instead of adding a dependent round trip after the reduction.
        post = tl.full((BLOCK_N,), 1.0, tl.float32)
        if FP8:
            post = post * tl.load(xs_ptr + m) * tl.load(ws_ptr + col, mask=n_mask, other=0.0)
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + col, mask=n_mask, other=0.0).to(tl.float32)
        tw = 1.0
        if HAS_TW:
            tw = tl.load(tw_ptr + m).to(tl.float32)
        dst = m.to(tl.int64)
        if SCATTER:
            dst = tl.load(idx_ptr + m).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w_t = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
                x_t = tl.load(x_row + offs_k)
            else:
                k_mask = offs_k < K
                w_t = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                x_t = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
            acc += w_t.to(tl.float32) * x_t.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)
        if FP8:
            out = out * post
        if HAS_BIAS:
            out = out + bias
        if HAS_TW:
            out = out * tw
        val = out.to(y_ptr.dtype.element_ty)
        if SCATTER:
            ok = (dst >= 0) & (dst < T_OUT)
            tl.atomic_add(y_ptr + dst * stride_ym + offs_n, val, mask=n_mask & ok, sem="relaxed")
        else:
            tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs_n, val, mask=n_mask)


# ----------------------------------------------------------------------------------------------
# Tiled persistent kernel: many rows per group
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gg_tiled_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_sizes_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    tw_ptr,
    idx_ptr,
    M,
    N,
    K,
    G,
    T_OUT,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_MSIZES: tl.constexpr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    SCATTER: tl.constexpr,
    USE_TMA: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    FLATTEN: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, HAS_MSIZES, G_BLOCK)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    m_tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * n_tiles_n
    tiles_end = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    band_tiles = GROUP_M * n_tiles_n
    for t in tl.range(pid, total, n_progs, flatten=FLATTEN):
        g = tl.sum((tiles_end <= t).to(tl.int32), axis=0)
        sel = gi == g
        local = t - (_pick(tiles_end, sel) - _pick(tiles, sel))
        m_begin = _pick(starts, sel)
        m_end = m_begin + _pick(rows, sel)
        mt_g = _pick(m_tiles, sel)
        # Grouped order inside the expert: bands of GROUP_M row tiles sweep the N tiles, so the
        # tiles that run together share their x rows and w columns in L2.
        first_m = (local // band_tiles) * GROUP_M
        band_m = tl.minimum(mt_g - first_m, GROUP_M)
        in_band = local % band_tiles
        tile_m = first_m + in_band % band_m
        tile_n = in_band // band_m
        m0 = m_begin + tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        w_row0 = g * N + n0
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_mask = offs_m < m_end
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if USE_TMA:
                a = x_ptr.load([m0, k0])
                b = w_ptr.load([w_row0, k0])
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(
                    x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + (w_row0.to(tl.int64) + tl.arange(0, BLOCK_N))[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            if FAST_ACCUM:
                acc = tl.dot(a, tl.trans(b), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        _epilogue(
            acc, offs_m, m_mask, offs_n, n_mask, g, N, y_ptr, stride_ym,
            xs_ptr, ws_ptr, bias_ptr, tw_ptr, idx_ptr, T_OUT, FP8, HAS_BIAS, HAS_TW, SCATTER,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Configurations (shape buckets; no autotuning at call time)
# ----------------------------------------------------------------------------------------------


# Tiled kernel: let Triton fuse the persistent tile loop with the K loop (one software pipeline
# across tiles, as Triton's persistent Hopper matmul does). $MOEKIT_GG_FLATTEN=0 turns it off.
_FLATTEN_DEFAULT = os.environ.get("MOEKIT_GG_FLATTEN", "1") != "0"


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. ``kind``: "gemv" (CUDA cores, per row and N slice; ``block_m``
    is ignored), "stream" (swap-AB, per group and N slice) or "tiled" (persistent). ``use_tma``:
    ask for TMA descriptors (used only when the strides allow; never by "gemv")."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    use_tma: bool = True
    flatten: bool = _FLATTEN_DEFAULT


def expected_groups_hit(M: int, G: int) -> float:
    """Expected number of non-empty groups when M rows land uniformly on G groups."""
    if M <= 0:
        return 0.0
    return G * (1.0 - (1.0 - 1.0 / G) ** M) if G > 1 else 1.0


def _m_bucket(M: int) -> int:
    return next_pow2(max(M, 1))


# Ahead-of-time tuned table: {"<key>": {GemmConfig fields}}, read from $MOEKIT_GG_TUNED, else
# from grouped_gemm_tuned.json next to this file when present (written by ``tune``).
_DEFAULT_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grouped_gemm_tuned.json")
_TUNED: Optional[dict] = None


def _tuned_table() -> dict:
    global _TUNED
    if _TUNED is None:
        path = os.environ.get("MOEKIT_GG_TUNED") or _DEFAULT_TABLE
        _TUNED = {}
        if os.path.exists(path):
            with open(path) as f:
                _TUNED = json.load(f)
    return _TUNED


def save_table(table: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)


def use_table(table: Optional[dict]) -> None:
    """Install a tuned table for this process (None: re-read $MOEKIT_GG_TUNED / the default)."""
    global _TUNED
    _TUNED = table
    select_config.cache_clear()


def config_key(M: int, N: int, K: int, G: int, fp8: bool, elem: int) -> str:
    return f"m{_m_bucket(M)}_n{N}_k{K}_g{G}_{'fp8' if fp8 else f'b{elem}'}"


@functools.lru_cache(maxsize=4096)
def select_config(M: int, N: int, K: int, G: int, fp8: bool, elem: int, sms: int) -> GemmConfig:
    """The launch configuration for a shape: a tuned entry when $MOEKIT_GG_TUNED names a table
    holding this shape bucket, else the heuristic below. Cheap (cached per shape)."""
    tuned = _tuned_table().get(config_key(M, N, K, G, fp8, elem))
    if tuned:
        return GemmConfig(**tuned)
    return heuristic_config(M, N, K, G, fp8, elem, sms)


# Problems of at most this many rows in all run the GEMV kernel ($MOEKIT_GG_GEMV_MAX_M; 0: never).
GEMV_MAX_M = int(os.environ.get("MOEKIT_GG_GEMV_MAX_M", "4"))
# Shared memory one streaming program may use: two programs per SM (228 KB per SM, 1 KB each
# reserved), so that one streams while the other fills or drains its pipeline.
_STREAM_SMEM = 110 * 1024


def gemv_config(M: int, N: int, K: int, elem: int, sms: int) -> GemmConfig:
    """GEMV kernel: weight slices of ``block_n`` rows, K tiles of about 8 KB of weights (at most
    512 FP8 values; a power of two dividing K when one of at least 128 elements does: no K masks),
    about 32 KB of them in flight. ``block_n``: the widest (up to 16) that still gives about two programs per SM; on
    short rows (K under 4 KB of weights) no wider than 16 KB of weights per program. Measured on
    the H200 (one row, routings rotated past the L2): Scout TP8 w13 bf16 8 rows 5.5 µs vs 6.2 at
    4; Maverick TP8 w2 16 KB programs (bf16 8 rows 5.9 vs 6.4 at 16; FP8 16 rows 4.1 vs 4.6 at
    8); DeepSeek w2 FP8 8 rows 7.8 vs 8.8 at 16; Llama 4 w2 FP8 (K = 8192) 16 rows 13.8 vs 14.7."""
    block_n = 1
    row_bytes = K * elem
    for bn in (16, 8, 4, 2):
        if M * cdiv(N, bn) >= (9 * sms) // 5 and (row_bytes >= 4096 or bn * row_bytes <= 16384):
            block_n = bn
            break
    # K tiles of ~8 KB of weights, at most 512 wide for FP8 (run 6: DeepSeek w2 8 x 512 7.8 µs vs
    # 8 x 1024 8.9; Maverick / Qwen3 / Llama 4 at or within 5% of their best with 512).
    target = max(64, 8192 // (block_n * elem))
    if elem == 1:
        target = min(target, 512)
    div = K & -K  # the largest power of two dividing K
    block_k = min(target, div) if div >= 128 else min(target, max(16, next_pow2(K)))
    # Pipeline depth: about 32 KB of weights in flight per program (num_stages - 1 tiles).
    stages = 1 + max(2, min(6, (32 * 1024) // (block_n * block_k * elem)))
    return GemmConfig("gemv", 1, block_n, block_k, stages, 4, use_tma=False)


def heuristic_config(M: int, N: int, K: int, G: int, fp8: bool, elem: int, sms: int) -> GemmConfig:
    if M <= GEMV_MAX_M:
        return gemv_config(M, N, K, elem, sms)
    hits = max(1.0, min(expected_groups_hit(M, G), float(min(G, M))))
    rows_per_group = M / hits
    kpow = next_pow2(K)
    # 48+ rows per group take the tiled kernel (64 x 256 tiles), unless it would leave SMs idle
    # (few groups: e.g. one group of 64 rows is 2 x cdiv(N, 256) tiles) where the streaming
    # kernel still spreads the weights over every SM.
    tiled_tiles = (M / 64 + hits) * cdiv(N, 256)
    if rows_per_group < 48 or (rows_per_group <= 64 and tiled_tiles < sms):
        # Streaming: the weights of the hit experts are the traffic. Rows tile: room for about
        # twice the mean group size, so a group rarely needs a second pass over its weights.
        block_m = min(128, max(16, next_pow2(int(math.ceil(2 * rows_per_group - 1e-3)))))
        # N slice: 128 or 64 rows (warpgroup MMA tiles, asynchronous and pipelined) when that
        # still gives every SM a slice: the slices then run in one wave (two programs per SM)
        # or in many, and the weights stream at the HBM rate. Narrower (synchronous MMA)
        # slices only when even 64-row slices leave SMs idle.
        block_n = 0
        for bn in (128, 64):
            if bn <= max(16, next_pow2(N)) and hits * cdiv(N, bn) >= sms:
                block_n = bn
                break
        if block_n == 0:
            block_n = 32 if N > 16 and hits * cdiv(N, 32) >= sms else 16
        # 16x16 tiles: 4 warps would duplicate the MMA work (warps beyond the tile replicate).
        warps = 8 if block_n * block_m >= 128 * 128 else (2 if block_n * block_m <= 256 else 4)
        # K slice: about 16 KB of weights per pipeline stage (32 KB for FP8 with 16-row x tiles:
        # 128 x 256 slices, 3 stages, measured 5-10% faster than 128 x 128 x 6 on Maverick / Qwen3
        # shapes at M = 16 and 128), x slice at most 16 KB (8 KB for the 2-warp 16x16 tiles, whose pointer loads
        # would otherwise run out of registers).
        cap = 32 if elem == 4 else (512 if warps == 2 else 1024) // elem
        w_stage = 32768 if elem == 1 and block_m <= 16 else 16384
        block_k = min(w_stage // (block_n * elem), 16384 // (block_m * elem), cap, max(kpow, 16))
        block_k = max(16, block_k)
        stage_bytes = (block_n + block_m) * block_k * elem
        if block_n >= 64 and warps == 4:  # two programs per SM (registers allow it too)
            stages = max(2, min(6, _STREAM_SMEM // stage_bytes))
        else:
            stages = max(2, min(8 if warps == 2 else 6, (128 * 1024) // stage_bytes))
        return GemmConfig("stream", block_m, block_n, block_k, stages, warps)
    # Tiled persistent: compute-bound (or nearly) tiles. Groups of under ~200 rows waste less of
    # their last row tile with 64-row tiles; 64 x 256 with four stages was the measured best from
    # 64 to 128 rows per group (DeepSeek w2 FP8 at M = 16384: 999 µs vs 1113 for 128 x 256 and
    # 1211 for the streaming kernel; Llama 4 w13 / w2 at M = 1024: 652 / 341 µs vs 683 / 373).
    block_m = 64 if rows_per_group < 192 else 128
    block_k = 128 if elem == 1 else (64 if elem == 2 else 32)
    block_n = 256 if N >= 256 else max(16, next_pow2(N))
    est_tiles = (M / block_m + hits) * cdiv(N, block_n)
    if block_n == 256 and est_tiles < 4 * sms:
        block_n = 128
    stage_bytes = (block_m + block_n) * block_k * elem
    stages = max(2, min(4, (176 * 1024) // stage_bytes))
    # The fused (flattened) loop keeps a second epilogue buffer: FP8 128x256 would spill with it,
    # and with float32 tiles the stages plus that buffer pass the 227 KB a block may use.
    out_elem = 4 if elem == 4 else 2
    flatten = (
        _FLATTEN_DEFAULT
        and not (elem == 1 and block_m * block_n >= 128 * 256)
        and stages * stage_bytes + block_m * block_n * out_elem <= 220 * 1024
    )
    return GemmConfig("tiled", block_m, block_n, block_k, stages, 8, flatten=flatten)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_ALLOW_TMA = os.environ.get("MOEKIT_GG_TMA", "1") != "0"
# Streaming grid cap, in programs per SM (beyond it, programs loop over their items).
STREAM_PROGRAMS_PER_SM = int(os.environ.get("MOEKIT_GG_STREAM_PPS", "4"))


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _tma_ok(t: torch.Tensor, block: tuple[int, int]) -> bool:
    """Host TMA descriptor usable for ``t`` (2-D, unit last stride, 16-byte aligned rows/base)?
    Never under tracing (torch.compile): non-dynamo tracing of ``wrap_triton`` does not capture
    descriptors, so traced graphs use the pointer path."""
    if not _ALLOW_TMA or _is_fake(t):
        return False
    if not (t.is_cuda or interpreting()):
        return False
    if t.is_cuda and _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) < 9:
        return False
    es = t.element_size()
    if t.stride(-1) != 1 or (t.stride(0) * es) % 16 or (t.storage_offset() * es) % 16:
        return False
    if block[1] * es < 16 or block[0] > 256:
        return False
    return t.shape[0] > 0 and t.shape[1] > 0


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: Optional[torch.Tensor],
    *,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    scatter_indices: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    fast_accum: bool = True,
    config: Optional[GemmConfig] = None,
) -> Optional[torch.Tensor]:
    """Launch the grouped GEMM on validated inputs.

    ``m_sizes`` None means one group of all M rows (dense GEMM; ``w`` is then ``[N, K]``).
    FP8 when ``x`` is e4m3fn (``x_scale`` [M], ``w_scale`` [G*N] float32 dequant scales).
    Without ``out``: returns ``y [M, N]`` (bf16 for FP8, else ``x.dtype``), rows past
    ``sum(m_sizes)`` left unwritten. With ``out`` [T, N] and ``scatter_indices`` [M]: adds the
    rows into ``out`` (atomics, or stored rows and the deterministic scatter-add) and returns None.
    """
    M, K = x.shape
    G = 1 if m_sizes is None else m_sizes.shape[0]
    N = w.shape[0] // G
    fp8 = x.dtype == FP8_DTYPE
    y_dtype = torch.bfloat16 if fp8 else x.dtype
    if out is not None and deterministic:
        rows = torch.empty((M, N), dtype=out.dtype, device=x.device)
        _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, None, None, fast_accum,
                config, M, N, K, G, fp8, out.dtype, rows_out=rows)  # fmt: skip
        _deterministic_scatter(out, rows, m_sizes, scatter_indices, M)
        return None
    return _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, out, scatter_indices, fast_accum,
                   config, M, N, K, G, fp8, y_dtype)  # fmt: skip


def _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, out, scatter_indices, fast_accum,
            config, M, N, K, G, fp8, y_dtype, rows_out=None):  # fmt: skip
    # Configs are chosen per concrete shape: symbolic sizes (torch.compile dynamic shapes) are
    # specialized here.
    M, N, K, G = int(M), int(N), int(K), int(G)
    scatter = out is not None
    if scatter:
        y = out
    elif rows_out is not None:
        y = rows_out
    else:
        y = torch.empty((M, N), dtype=y_dtype, device=x.device)
    if M == 0 or N == 0:
        return None if scatter else y
    if G * N >= 2**31 or M >= 2**31:
        raise ValueError(f"grouped_gemm supports G * N and M below 2**31, got G*N={G * N}, M={M}")
    x = _unit_last(x)
    w = _unit_last(w)
    sms = num_sms(x.device)
    cfg = config or select_config(M, N, K, G, fp8, x.element_size(), sms)
    if fp8 and not fast_accum and cfg.kind == "tiled" and cfg.block_n > 128:
        cfg = replace(cfg, block_n=128)  # the promoted accumulator needs registers: 128x256 spills
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    out_rows = out.shape[0] if scatter else M
    # Placeholder for the pointer arguments a launch does not use: never the output. Under
    # torch.compile, inductor's mutation analysis counts every pointer passed to a @triton.jit
    # helper (the epilogue) as written; an output passed twice then gets two functionalized
    # copies, and the untouched one is written back over the result.
    ph = torch.empty((1,), dtype=torch.int32, device=x.device)
    optional = [
        t if t is not None else ph for t in (m_sizes, x_scale, w_scale, bias, token_weights, scatter_indices)
    ]
    if cfg.kind == "gemv":
        launch(_gg_gemv_kernel)[(M * cdiv(N, bn),)](
            x, w, y, *optional, M, N, K, G, out_rows, x.stride(0), w.stride(0), y.stride(0),
            HAS_MSIZES=m_sizes is not None, FP8=fp8, HAS_BIAS=bias is not None,
            HAS_TW=token_weights is not None, SCATTER=scatter, G_BLOCK=max(16, next_pow2(G)),
            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, STAGES=cfg.stages,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        return None if scatter else y
    x_block, w_block = [bm, bk], [bn, bk]
    stream = cfg.kind == "stream"
    # The streaming kernel reads x through masked pointers (only the group's rows move).
    use_tma = cfg.use_tma and _tma_ok(w, tuple(w_block)) and (stream or _tma_ok(x, tuple(x_block)))
    x_arg = _descriptor(x, x_block) if use_tma and not stream else x
    w_arg = _descriptor(w, w_block) if use_tma else w
    common = dict(
        HAS_MSIZES=m_sizes is not None,
        FP8=fp8,
        HAS_BIAS=bias is not None,
        HAS_TW=token_weights is not None,
        SCATTER=scatter,
        USE_TMA=use_tma,
        G_BLOCK=max(16, next_pow2(G)),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=cfg.stages,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    args = (
        x_arg,
        w_arg,
        y,
        *optional,
        M,
        N,
        K,
        G,
        out_rows,
        x.stride(0),
        w.stride(0),
        y.stride(0),
    )
    if stream:
        # One program per (possibly non-empty group, N slice), capped: programs past the
        # non-empty groups exit at once, and a capped grid loops over the items.
        grid = (max(1, min(min(G, M) * cdiv(N, bn), STREAM_PROGRAMS_PER_SM * sms)),)
        launch(_gg_stream_kernel)[grid](*args, **common)
    else:
        upper = (cdiv(M, bm) + min(G, M)) * cdiv(N, bn)
        grid = (max(1, min(sms, upper)),)
        launch(_gg_tiled_kernel)[grid](
            *args,
            FAST_ACCUM=bool(fast_accum) or not fp8,
            FLATTEN=cfg.flatten,
            GROUP_M=cfg.group_m,
            **common,
        )
    return None if scatter else y


def _deterministic_scatter(out, rows, m_sizes, indices, M):
    """``out[idx[r]] += rows[r]`` for the computed rows (``r < sum(m_sizes)``): the deterministic
    scatter-add's kernels (each token's rows summed in float32 in ascending row order, then added
    to ``out`` once), so the result is bitwise that of ``scatter_add_dense_tokens(...,
    deterministic=True)`` on the GEMM's rows. The row count stays on the device."""
    from moekit.ops._triton.gather_scatter import scatter_add_dense_tokens_deterministic

    valid = None
    if m_sizes is not None:  # summed in int64 and clipped to M before the narrowing
        valid = m_sizes.clamp(min=0).sum().clamp(max=M).to(torch.int32).reshape(1)
    # Those kernels address rows as ``row * (stride // 8) * 8`` (the public scatter-add requires
    # a row stride that is a multiple of 8); the GEMM accepts any row stride of its output, so an
    # odd one goes through a contiguous copy.
    if out.shape[0] > 1 and out.stride(0) % 8:
        tmp = out.contiguous()
        scatter_add_dense_tokens_deterministic(tmp, rows, indices, valid)
        out.copy_(tmp)
        return
    scatter_add_dense_tokens_deterministic(out, rows, indices, valid)


def f8f8bf16_rowwise(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """Dense FP8 row-wise GEMM as one group of the grouped kernel."""
    out = grouped_gemm(
        XQ, WQ, None, x_scale=x_scale.reshape(-1), w_scale=w_scale.reshape(-1), bias=bias,
        fast_accum=use_fast_accum, config=config,
    )  # fmt: skip
    assert out is not None
    return out


# ----------------------------------------------------------------------------------------------
# Optional ahead-of-time tuning (never called at run time)
# ----------------------------------------------------------------------------------------------


def candidate_configs(M: int, N: int, K: int, G: int, fp8: bool, elem: int, sms: int) -> list[GemmConfig]:
    """A dozen configurations around the heuristic's choice (same kind first, then the other)."""
    h = heuristic_config(M, N, K, G, fp8, elem, sms)
    kpow = max(16, next_pow2(K))
    out = [h]
    if h.kind == "gemv":
        for bn in sorted({max(1, h.block_n // 2), h.block_n, min(16, h.block_n * 2)}):
            for bk in sorted({max(16, h.block_k // 2), h.block_k, min(kpow, h.block_k * 2)}):
                stages = 1 + max(2, min(6, (32 * 1024) // (bn * bk * elem)))
                out.append(GemmConfig("gemv", 1, bn, bk, stages, 4, use_tma=False))
        h = replace(h, kind="stream", block_m=16, block_n=64, block_k=max(16, min(kpow, 256 // elem)), stages=5,
                    use_tma=True)
        out.append(h)
    if h.kind == "stream":
        for bn in sorted({max(16, h.block_n // 2), h.block_n, min(128, h.block_n * 2)}):
            for bk in sorted({max(16, h.block_k // 2), h.block_k, min(kpow, h.block_k * 2)}):
                stage = (bn + h.block_m) * bk * elem
                stages = max(2, min(6, (128 * 1024) // stage))
                warps = 8 if bn * h.block_m >= 16384 else (2 if bn * h.block_m <= 256 else 4)
                for tma in (True, False):
                    out.append(GemmConfig("stream", h.block_m, bn, bk, stages, warps, use_tma=tma))
    bk = 128 if elem == 1 else (64 if elem == 2 else 32)
    for bm, bn, k, stages in ((128, 128, bk, 4), (128, 128, 2 * bk, 3), (128, 256, bk, 3), (64, 256, bk, 3),
                              (64, 256, bk, 4), (64, 128, bk, 4)):
        for flatten in (True, False):
            if flatten and elem == 1 and bm * bn >= 128 * 256:
                continue  # spills
            out.append(GemmConfig("tiled", bm, bn, k, stages, 8, flatten=flatten))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def tune(shapes, path: Optional[str] = None, *, top_k: int = 1, device: str = "cuda", log=print) -> dict:
    """Time ``candidate_configs`` for each ``(M, N, K, G, dtype)`` in ``shapes`` (rows spread by
    a random routing) and return {config_key: best config}; written as JSON to ``path`` when
    given (point $MOEKIT_GG_TUNED at it, or save it as ``grouped_gemm_tuned.json`` here)."""
    from moekit.benchmarking import bench_us, rotations
    from moekit.testing import random_m_sizes

    table = {}
    sms = num_sms(torch.device(device))
    for M, N, K, G, dtype in shapes:
        fp8 = dtype == FP8_DTYPE
        x = torch.randn(M, K, device=device).to(dtype)
        w = (torch.randn(G * N, K, device=device) / K**0.5).to(dtype)
        # Several routings, cycled: the weights one call touches must not all sit in the L2.
        touched = expected_groups_hit(M, G) * N * K * x.element_size()
        ms_sets = [random_m_sizes(M, G, top_k=1, device=device, seed=i) for i in range(rotations(touched))]
        xs = torch.rand(M, device=device) if fp8 else None
        ws = torch.rand(G * N, device=device) if fp8 else None
        best = None
        for cfg in candidate_configs(M, N, K, G, fp8, x.element_size(), sms):
            calls = [lambda ms=ms: grouped_gemm(x, w, ms, x_scale=xs, w_scale=ws, config=cfg) for ms in ms_sets]
            try:
                t = bench_us(calls, replays=10)
            except Exception as e:  # a config that does not compile or launch is skipped
                log(f"  skip {cfg}: {type(e).__name__}")
                continue
            log(f"  {t:9.2f} us  {cfg}")
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            key = config_key(M, N, K, G, fp8, x.element_size())
            table[key] = asdict(best[1])
            log(f"{key}: {best[0]:.1f} us {best[1]}")
    if path:
        save_table(table, path)
    return table
