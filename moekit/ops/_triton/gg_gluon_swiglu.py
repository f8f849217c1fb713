"""The gate/up GEMM with its SwiGLU epilogue in Gluon for Hopper (experimental, session 33):
``z[m, f] = silu(x[src_m] @ wg_f) * (x[src_m] @ wu_f) * rs[m]`` for the rows ``m`` of each group
``g`` (``wg`` and ``wu`` the gate and up rows of ``w13 [G, 2F, K]``), the rows read by index
(``src_m = gather[m]``) or in place.

The warp-specialized structure of ``gg_gluon``'s down-projection kernel (``halves`` form):

- two loader warps: each step's row tile gathered into shared memory with ``cp.async`` (16-byte
  pieces, rows by index, masked at the group's end and at K), the gate and up weight tiles by TMA
  into the two halves of one ``[2 BN, BK]`` buffer, all landing on one barrier (the copies'
  arrivals and the TMA's bytes);
- two MMA warpgroups, one per 64-row half of a 128-row tile (a half whose rows all lie past the
  group's end issues no MMAs), each with a gate and an up accumulator (two wgmma of N = BN on
  the buffer's halves), the scales and SwiGLU in the epilogue, the ``[128, BN]`` result left in a
  staging buffer;
- two store warps writing it while the next tile's MMAs run.

GPU only (Gluon has no interpreter), reached only through ``grouped_gemm_swiglu_gluon`` (GPU
tests and ``benchmarks/sweep_gluon.py``): ``moekit.ops._triton.gg_swiglu`` stays the library's
path. H100, session 33 (HISTORY run 1; rows by index, T=8192, µs, Triton -> this kernel):
Qwen3-30B bf16 775.2 -> 923.2, DeepSeek-V3 TP8 bf16 1045.8 -> 1630.2, Qwen3-30B FP8 445.2 ->
446.8 (433.1 with 128 x 128 x 64 x 7 stages). In bf16 the two N = 128 MMAs a step read the row
tile from shared memory twice, past what shared memory feeds at the full MMA rate (FP8 does
twice the FLOPs per byte). The ``pair`` form (session 34 run 1) issues one N = 256 MMA over the
stage's gate and up halves and splits the accumulator in registers: Qwen3-30B bf16 T=8192 934.3
-> 816.5 µs (Triton 766.5), DeepSeek-V3 TP8 1626.0 -> 1410.9 (Triton 1048.7), Qwen3-30B FP8
449.0 -> 436.1 and 424.3 with four stages (Triton 446.5). The layer reaches it through knob
``GLUON_SWIGLU`` (``moekit.layers.experts``).
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moekit.ops._common import next_pow2, num_sms
from moekit.ops._triton.gg_gluon import (
    _GL_DTYPES,
    _acc_layout,
    _idle_half,
    _table_smem,
    _ws_barriers,
    _ws_invalidate,
    _tile_from,
    _tiles_of,
    _ws_store,
)


@gluon.jit
def _sw_load(x_ptr, gather_ptr, w_desc, a_bufs, b_bufs, tab, ready, empty, F, K, T_IN, stride_xm, GATHER):
    """The loader warps: per step the row tile (by index with ``GATHER``, else rows in place)
    through ``cp.async`` and the gate / up weight tiles through TMA, into the next free stage."""
    NUM_BUF: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    NW: gl.constexpr = 2  # (the loader warps: the ready barriers count their threads)
    VEC: gl.constexpr = 128 // a_bufs.dtype.primitive_bitwidth  # elements per 16-byte piece
    TPK: gl.constexpr = BLOCK_K // VEC  # threads across a row's K tile
    ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPK, TPK], [NW, 1], [1, 0])
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    s = 0
    for j in range(_tiles_of(tab, NW)):
        g, m0, m_end, n0 = _tile_from(tab, pid + j * progs, BLOCK_M, BLOCK_N, NW)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        ok = offs_m < m_end
        src = offs_m
        if GATHER:
            src = gl.load(gather_ptr + offs_m, mask=ok, other=0)
        ok = ok & (src >= 0) & (src < T_IN)
        rows = x_ptr + gl.where(ok, src, 0).to(gl.int64)[:, None] * stride_xm
        gate = g * 2 * F + n0
        for kk in range(k_steps):
            buf = s % NUM_BUF
            mbarrier.wait(empty.index(buf), ((s // NUM_BUF) & 1) ^ 1)  # (a fresh barrier passes phase 1)
            bar = ready.index(buf)
            mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            b = b_bufs.index(buf)
            tma.async_copy_global_to_shared(w_desc, [gate, kk * BLOCK_K], bar, b.slice(0, BLOCK_N))
            tma.async_copy_global_to_shared(w_desc, [gate + F, kk * BLOCK_K], bar, b.slice(BLOCK_N, BLOCK_N))
            k = kk * BLOCK_K + offs_k
            async_copy.async_copy_global_to_shared(a_bufs.index(buf), rows + k[None, :],
                                                   mask=ok[:, None] & (k < K)[None, :])  # fmt: skip
            # each thread's arrival once its copies have landed (counted: the barrier expects them)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            s += 1


@gluon.jit
def _sw_lo(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
           FLAGS):  # fmt: skip
    _sw_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
            FLAGS, 0)  # fmt: skip


@gluon.jit
def _sw_hi(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
           FLAGS):  # fmt: skip
    _sw_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
            FLAGS, 1)  # fmt: skip


@gluon.jit
def _sw_lo_pair(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F,
                K, FLAGS):  # fmt: skip
    _sw_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
            FLAGS, 0, True)  # fmt: skip


@gluon.jit
def _sw_hi_pair(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F,
                K, FLAGS):  # fmt: skip
    _sw_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
            FLAGS, 1, True)  # fmt: skip


@gluon.jit
def _sw_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
            FLAGS, H: gl.constexpr, PAIR: gl.constexpr = False):  # fmt: skip
    """One MMA warpgroup: rows ``[64 H, 64 H + 64)`` of each 128-row tile, gate and up
    accumulators; the epilogue scales them (FP8: the rows' ``xs`` by source row, the weight rows'
    ``ws``; ``rs`` by routed row where given), ``z = silu(gate) * up`` into its half of the
    staging buffer. ``FLAGS`` (a runtime int: worker partitions take no constexprs): bit 0 rows by
    index, bit 1 ``rs`` given."""
    NW: gl.constexpr = gl.num_warps()
    NUM_BUF: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1] // 2
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] // 2
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    dtype: gl.constexpr = a_bufs.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    # PAIR: one accumulator over the stage's gate | up columns (one N = 2 BN MMA a step, the row
    # tile read once), split into gate and up in the epilogue; else one accumulator each.
    WIDTH: gl.constexpr = 2 * BLOCK_N if PAIR else BLOCK_N
    mma: gl.constexpr = _acc_layout(BLOCK_M, WIDTH, NW, dtype.primitive_bitwidth)
    zero = gl.zeros((BLOCK_M, WIDTH), dtype=gl.float32, layout=mma)
    acc_g = warpgroup_mma_init(zero)
    if not PAIR:
        acc_u = warpgroup_mma_init(zero)
    s = 0
    g, m0, m_end, n0 = _tile_from(tab, pid, 2 * BLOCK_M, BLOCK_N, NW)
    for j in range(_tiles_of(tab, NW)):
        ng, nm0, nm_end, nn0 = g, m0, m_end, n0
        m0 = m0 + H * BLOCK_M
        if m0 < m_end:
            for kk in range(k_steps):
                buf = s % NUM_BUF
                mbarrier.wait(ready.index(buf), (s // NUM_BUF) & 1)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads async
                a = a_bufs.index(buf).slice(H * BLOCK_M, BLOCK_M)
                b = b_bufs.index(buf)
                if PAIR:
                    acc_g = warpgroup_mma(a, b.permute((1, 0)), acc_g, is_async=True)
                    acc_g = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(acc_g,)))
                else:
                    acc_g = warpgroup_mma(a, b.slice(0, BLOCK_N).permute((1, 0)), acc_g, is_async=True)
                    acc_u = warpgroup_mma(a, b.slice(BLOCK_N, BLOCK_N).permute((1, 0)), acc_u, is_async=True)
                    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                    acc_g = warpgroup_mma_init(acc_g)
                    acc_u = warpgroup_mma_init(acc_u)
                mbarrier.arrive(empty.index((s + NUM_BUF - 1) % NUM_BUF), count=1, pred=kk > 0)
                if kk == k_steps // 2:  # the next tile's coordinates under this tile's MMAs
                    ng, nm0, nm_end, nn0 = _tile_from(tab, pid + (j + 1) * progs, 2 * BLOCK_M, BLOCK_N, NW)
                s += 1
            # the epilogue's scales under the last MMA group
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
            m_ok = offs_m < m_end
            row_s = gl.full((BLOCK_M,), 1.0, gl.float32, layout=gl.SliceLayout(1, mma))
            if (FLAGS & 2) != 0:
                row_s = row_s * gl.load(rs_ptr + offs_m, mask=m_ok, other=0.0)
            if FP8:
                src = offs_m
                if (FLAGS & 1) != 0:
                    src = gl.load(gather_ptr + offs_m, mask=m_ok, other=0)
                row_s = row_s * gl.load(xs_ptr + src, mask=m_ok & (src >= 0), other=0.0)
                cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, mma))
                col = n0 + cols % BLOCK_N  # (PAIR: columns [gate | up])
                w_row = g.to(gl.int64) * 2 * F + col + gl.where(cols >= BLOCK_N, F, 0)
                ws_g = gl.load(ws_ptr + w_row, mask=col < F, other=0.0)
                if not PAIR:
                    ws_u = gl.load(ws_ptr + w_row + F, mask=col < F, other=0.0)
            if PAIR:
                res = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
            else:
                gv, uv = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((s + NUM_BUF - 1) % NUM_BUF), count=1)
            if PAIR:
                if FP8:
                    res = res * ws_g[None, :]
                res = res * row_s[:, None]
                gv, uv = gl.split(gl.permute(gl.reshape(res, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            else:
                if FP8:
                    gv = gv * ws_g[None, :]
                    uv = uv * ws_u[None, :]
                gv = gv * row_s[:, None]
                uv = uv * row_s[:, None]
            out = (gv / (1.0 + gl.exp(-gv)) * uv).to(c_smem.dtype)
            mbarrier.wait(c_empty, (j & 1) ^ 1)
            c_smem.slice(H * BLOCK_M, BLOCK_M).store(out)
            mbarrier.arrive(c_ready, count=1)
            acc_g = warpgroup_mma_init(zero)
            if not PAIR:
                acc_u = warpgroup_mma_init(zero)
        else:  # no rows in this half: the buffers released as they fill, nothing staged
            ng, nm0, nm_end, nn0 = _tile_from(tab, pid + (j + 1) * progs, 2 * BLOCK_M, BLOCK_N, NW)
            s = _idle_half(ready, empty, c_ready, c_empty, s, k_steps, j)
        g, m0, m_end, n0 = ng, nm0, nm_end, nn0


@gluon.jit
def _gg_swiglu_gluon_kernel(
    x_ptr,
    w_desc,
    z_ptr,
    gather_ptr,
    xs_ptr,
    ws_ptr,
    rs_ptr,
    m_sizes_ptr,
    M,
    F,
    K,
    G,
    T_IN,
    stride_xm,
    stride_zm,
    FLAGS,
    G_BLOCK: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_BUF: gl.constexpr,
    PAIR: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = w_desc.dtype
    z_dtype: gl.constexpr = z_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(
        dtype, [NUM_BUF, BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    )
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    c_smem = gl.allocate_shared_memory(
        z_dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], z_dtype)
    )
    # ready: the TMA's arrival (with its bytes) and every loader thread's cp.async arrival; both
    # MMA warpgroups release each stage and stage their rows
    ready, empty, c_ready, c_empty = _ws_barriers(NUM_BUF, 1 + 32 * 2, 2)
    tab = _table_smem(m_sizes_ptr, M, F, G, G_BLOCK, BLOCK_M, BLOCK_N, num_warps)
    mma_args = (a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, gather_ptr, xs_ptr, ws_ptr, rs_ptr, F, K,
                FLAGS)  # fmt: skip
    load = (x_ptr, gather_ptr, w_desc, a_bufs, b_bufs, tab, ready, empty, F, K, T_IN, stride_xm, FLAGS & 1)
    store = (c_smem, tab, c_ready, c_empty, z_ptr, F, stride_zm)
    if PAIR:
        gl.warp_specialize([(_sw_lo_pair, mma_args), (_sw_hi_pair, mma_args), (_sw_load, load), (_ws_store, store)],
                           [4, 2, 2], [232, 80, 48])  # fmt: skip
    else:
        gl.warp_specialize([(_sw_lo, mma_args), (_sw_hi, mma_args), (_sw_load, load), (_ws_store, store)],
                           [4, 2, 2], [232, 80, 48])  # fmt: skip
    _ws_invalidate(ready, empty, c_ready, c_empty)


def grouped_gemm_swiglu_gluon(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    gather: Optional[torch.Tensor] = None,
    row_scales: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    block: Optional[tuple[int, int, int]] = None,
    num_buf: int = 3,
    pair: bool = False,
) -> torch.Tensor:
    """``z [M, F]`` (``out`` when given): ``z[m] = silu(x[src] @ wg.T) * (x[src] @ wu.T) *
    row_scales[m]`` for the rows ``m`` of group ``g`` (``m_sizes [G]`` int32, rows in group order;
    ``src = gather[m]``, ``gather [M]`` int32 token rows of ``x [T, K]``, or ``src = m``), ``wg``
    and ``wu`` the first and second ``F`` rows of ``w13[g]`` (``[G, 2F, K]`` or ``[G * 2F, K]``).
    Rows past ``sum(m_sizes)`` are left unwritten. CUDA sm_90. 16-bit ``x`` and ``w13`` of one
    dtype (``z`` in it), or FP8 e4m3 both with row-wise scales ``x_scale [T]`` (by token row)
    and ``w_scale [G * 2F]`` (``z`` bf16). ``block``: ``(128, BN, BK)``, default 128 x 128 x 64
    (16-bit) or x 128 (FP8): ``BN`` output columns (a ``2 BN``-row weight stage). ``pair``: one
    MMA of N = 2 BN a step over the stage's gate and up rows (the row tile read from shared memory
    once), the accumulator split in the epilogue; else two of N = BN."""
    fp8 = x.dtype == torch.float8_e4m3fn
    if fp8:
        if w13.dtype != x.dtype:
            raise TypeError(f"grouped_gemm_swiglu_gluon: FP8 x takes FP8 (e4m3) w13, got {w13.dtype}")
        if x_scale is None or w_scale is None:
            raise ValueError("grouped_gemm_swiglu_gluon: FP8 x and w13 need x_scale [T] and w_scale [G * 2F]")
    elif x.dtype not in _GL_DTYPES or w13.dtype != x.dtype:
        raise TypeError(
            "grouped_gemm_swiglu_gluon takes bf16 or fp16 x and w13 of one dtype, or FP8 e4m3 both, got "
            f"{x.dtype} and {w13.dtype}"
        )
    T_IN, K = (int(d) for d in x.shape)
    G = int(m_sizes.shape[0])
    w = w13.reshape(-1, w13.shape[-1])
    if G == 0 or int(w.shape[0]) % (2 * G) or int(w.shape[1]) != K:
        raise ValueError(
            f"grouped_gemm_swiglu_gluon: w13 must be [G, 2F, K] or [G * 2F, K] with G = {G}, K = {K}; "
            f"got {tuple(w13.shape)}"
        )
    F = int(w.shape[0]) // (2 * G)
    M = int(gather.shape[0]) if gather is not None else T_IN
    if gather is not None and gather.dtype != torch.int32:
        raise TypeError(f"grouped_gemm_swiglu_gluon: gather must be int32, got {gather.dtype}")
    if fp8 and (tuple(x_scale.shape) != (T_IN,) or tuple(w_scale.reshape(-1).shape) != (G * 2 * F,)):
        raise ValueError(
            f"grouped_gemm_swiglu_gluon: x_scale must be [{T_IN}] and w_scale [{G * 2 * F}], got "
            f"{tuple(x_scale.shape)} and {tuple(w_scale.shape)}"
        )
    bm, bn, bk = block or ((128, 128, 128) if fp8 else (128, 128, 64))
    if bm != 128:
        raise ValueError(f"grouped_gemm_swiglu_gluon: 128-row tiles (one warpgroup per half), got block={block}")
    z = out if out is not None else torch.empty((M, F), dtype=torch.bfloat16 if fp8 else x.dtype, device=x.device)
    if M == 0 or F == 0:
        return z
    w = w.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    dt = gl.float8e4nv if fp8 else _GL_DTYPES[x.dtype]
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    ph = torch.empty((1,), dtype=torch.float32, device=x.device)
    iph = torch.empty((1,), dtype=torch.int32, device=x.device)
    flags = (1 if gather is not None else 0) | (2 if row_scales is not None else 0)
    _gg_swiglu_gluon_kernel[(num_sms(x.device),)](
        x, w_desc, z, gather if gather is not None else iph, x_scale if fp8 else ph,
        w_scale.reshape(-1) if fp8 else ph, row_scales if row_scales is not None else ph, m_sizes, M, F, K, G, T_IN,
        x.stride(0), z.stride(0), flags, G_BLOCK=max(32, next_pow2(G)), BLOCK_M=bm, BLOCK_K=bk, NUM_BUF=num_buf,
        PAIR=bool(pair), num_warps=4,
    )  # fmt: skip
    return z


__all__ = ["grouped_gemm_swiglu_gluon"]
