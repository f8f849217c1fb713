"""A Gluon (Triton's explicit-layout dialect) grouped GEMM for Hopper: ``y[m] = (x[m] @ w_g.T) *
rs[m]`` for the rows ``m`` of each group ``g``, rows in group order (the sorted pipeline's down
projection with its rows stored, or any GEMM whose row tiles TMA can read whole).

Experimental (session 32): written to measure how far the compute-bound prefill cells can move
past ``tl.dot``'s code generation. On the H100, cuBLAS runs the layer's GEMMs flattened to one
dense product at 610-755 TFLOP/s (Qwen3-30B T=8192: gate|up 755, down 610) where moekit's Triton
tiles run 540-560 with their tensor cores active 66-68% of the time (ncu). The kernel here
schedules every step by hand:

- persistent programs (one per SM) walk their tiles ``t = pid, pid + P, ...``; a tile's group,
  rows and columns come from the group table (an inclusive scan of ``m_sizes``) at each tile
  boundary only;
- one flat producer / consumer step counter across tiles: the TMA loads of ``x`` and ``w`` tiles
  run ``NUM_BUF - 2`` steps ahead of the MMAs, through the epilogue of a tile into the next, so
  no tile restarts its pipeline;
- ``warpgroup_mma`` asynchronously, one group in flight (waited before the next is issued: the
  buffer the next load overwrites was read two steps back);
- the epilogue scales the rows, casts and stores with masks (a tile's rows end at its group's
  end; TMA stores would overwrite the next group's rows).

GPU only (Gluon has no interpreter): ``moekit.ops._triton.grouped_gemm`` stays the library's path;
this one is reached only through ``grouped_gemm_gluon`` (benchmarks, GPU tests).

Where it stands (H100, session 32 runs 5-6, ``benchmarks/sweep_gluon.py``, µs; rows bit-identical
to the Triton kernel's): Qwen3-30B's down projection at T=8192 (65536 rows, N 2048, K 768) 440.8
with the coalesced epilogue (535.5 storing from the MMA layout; 547.0 waiting for each MMA group
before the next) against the Triton kernel's 384.3 and cuBLAS's 301.1 on the same FLOPs; its
gate|up GEMM 854.2 against 731.1 and 564.9; DeepSeek-V3 TP8's down 820.4 against 738.1 and 435.9.
The epilogue is what it lacks: no program overlaps its stores with MMAs. Next: a producer warp
and two consumer warpgroups taking turns (one's epilogue under the other's MMAs), TMA stores for
tiles whose rows are all their group's.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moekit.ops._common import next_pow2, num_sms


@gluon.constexpr_function
def _mma_warps(BLOCK_M, num_warps):
    """``warps_per_cta`` of the accumulator: warps down the rows (16 rows each, at least 4 warps
    of a warpgroup), then across the columns."""
    w = [4, 1]
    while w[0] * w[1] != num_warps:
        if BLOCK_M > 16 * w[0]:
            w[0] *= 2
        else:
            w[1] *= 2
    return w


@gluon.constexpr_function
def _mma_n(BLOCK_M, BLOCK_N, num_warps):
    """The widest wgmma N (a multiple of 8 up to 256) that divides each warp column's share."""
    reps_m = triton.cdiv(BLOCK_M, 16)
    reps_n = triton.cdiv(num_warps, reps_m)
    max_n = max(BLOCK_N // reps_n, 8)
    n = 256
    while n > max_n or BLOCK_N % n != 0:
        n -= 8
    return n


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tile_at(t, gi, starts, sizes, tbeg, tend, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile ``t`` of the group table: (group, first row, the group's row end, first column).
    Inside a group the row tiles of one column block are neighbours (they share its weights in
    L2). A ``t`` past the last tile gives an empty row range."""
    sel = (tbeg <= t) & (t < tend)
    g = gl.sum(gl.where(sel, gi, 0), 0)
    local = t - gl.sum(gl.where(sel, tbeg, 0), 0)
    first = gl.sum(gl.where(sel, starts, 0), 0)
    rows = gl.sum(gl.where(sel, sizes, 0), 0)
    row_tiles = gl.maximum(gl.cdiv(rows, BLOCK_M), 1)
    m0 = first + (local % row_tiles) * BLOCK_M
    n0 = (local // row_tiles) * BLOCK_N
    return g, m0, first + rows, n0


@gluon.jit
def _load_at(t, gi, starts, sizes, tbeg, tend, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(group, first row, first column) of tile ``t``: where its loads start."""
    g, m0, _, n0 = _tile_at(t, gi, starts, sizes, tbeg, tend, BLOCK_M, BLOCK_N)
    return g, m0, n0


@gluon.jit
def _produce(p, pk, pg, pm0, pn0, n_steps, k_steps, pid, progs, gi, starts, sizes, tbeg, tend, x_desc, w_desc, a_bufs,
             b_bufs, bars, N, NUM_BUF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_K: gl.constexpr):  # fmt: skip
    """Issue the TMA loads of step ``p`` (its x and w tiles, on its buffer's barrier; none past
    the program's last step) and advance the producer state ``(p, pk, pg, pm0, pn0)``: the step,
    its K step within the tile and the tile's group, first row and first column (looked up when
    ``p`` starts a tile)."""
    if pk == 0:
        pg, pm0, pn0 = _load_at(pid + (p // k_steps) * progs, gi, starts, sizes, tbeg, tend, BLOCK_M, BLOCK_N)
    ok = p < n_steps
    bar = bars.index(p % NUM_BUF)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(x_desc, [pm0, pk * BLOCK_K], bar, a_bufs.index(p % NUM_BUF), ok)
    tma.async_copy_global_to_shared(w_desc, [pg * N + pn0, pk * BLOCK_K], bar, b_bufs.index(p % NUM_BUF), ok)
    pk += 1
    if pk == k_steps:
        pk = 0
    return p + 1, pk, pg, pm0, pn0


@gluon.jit
def _gg_gluon_kernel(
    x_desc,
    w_desc,
    y_ptr,
    rs_ptr,
    m_sizes_ptr,
    M,
    N,
    K,
    G,
    stride_ym,
    HAS_RS: gl.constexpr,
    G_BLOCK: gl.constexpr,
    NUM_BUF: gl.constexpr,
    COALESCE: gl.constexpr,
    DEPTH: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    gl.static_assert(NUM_BUF >= 3, "the loads run NUM_BUF - 2 steps ahead of the MMAs")

    # The group table: rows [starts, starts + sizes) per group, tiles [tbeg, tend).
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gi = gl.arange(0, G_BLOCK, layout=vec)
    sizes = gl.maximum(gl.load(m_sizes_ptr + gi, mask=gi < G, other=0), 0)
    ends = gl.associative_scan(sizes, 0, _add)
    starts = gl.minimum(ends - sizes, M)
    sizes = gl.minimum(ends, M) - starts
    tiles = gl.cdiv(sizes, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    tend = gl.associative_scan(tiles, 0, _add)
    tbeg = tend - tiles
    total = gl.sum(tiles, 0)

    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = gl.cdiv(gl.maximum(total - pid, 0), progs) * k_steps

    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(bars.index(i), count=1)

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_mma_warps(BLOCK_M, num_warps),
        instr_shape=[16, _mma_n(BLOCK_M, BLOCK_N, num_warps), 256 // dtype.primitive_bitwidth],
    )
    acc = warpgroup_mma_init(gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma))

    # Producer: the tile and K offset of step p (coordinates looked up when p starts a tile).
    p = gl.to_tensor(0)
    pg = gl.to_tensor(0)
    pm0 = gl.to_tensor(0)
    pn0 = gl.to_tensor(0)
    pk = gl.to_tensor(0)
    for _ in gl.static_range(NUM_BUF - 2 + DEPTH):
        p, pk, pg, pm0, pn0 = _produce(p, pk, pg, pm0, pn0, n_steps, k_steps, pid, progs, gi, starts, sizes, tbeg,
                                       tend, x_desc, w_desc, a_bufs, b_bufs, bars, N, NUM_BUF, BLOCK_M, BLOCK_N,
                                       BLOCK_K)  # fmt: skip

    for s in range(n_steps):
        if DEPTH == 0:
            # Load step s + NUM_BUF - 2 into the buffer step s - 2 read (its MMA is complete: step
            # s - 1 waited for every group in flight before it issued its own).
            p, pk, pg, pm0, pn0 = _produce(p, pk, pg, pm0, pn0, n_steps, k_steps, pid, progs, gi, starts, sizes,
                                           tbeg, tend, x_desc, w_desc, a_bufs, b_bufs, bars, N, NUM_BUF, BLOCK_M,
                                           BLOCK_N, BLOCK_K)  # fmt: skip
        kk = s % k_steps
        buf = s % NUM_BUF
        mbarrier.wait(bars.index(buf), (s // NUM_BUF) & 1)
        if DEPTH == 0:
            done = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = warpgroup_mma(a_bufs.index(buf), b_bufs.index(buf).permute((1, 0)), done, use_acc=kk > 0,
                                is_async=True)  # fmt: skip
        else:
            # Issue step s behind step s - 1, then wait for s - 1 alone: the tensor cores always have
            # the next group queued; the buffer s - 1 read takes step s + NUM_BUF - 1's loads.
            acc = warpgroup_mma(a_bufs.index(buf), b_bufs.index(buf).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(acc,)))
            p, pk, pg, pm0, pn0 = _produce(p, pk, pg, pm0, pn0, n_steps, k_steps, pid, progs, gi, starts, sizes,
                                           tbeg, tend, x_desc, w_desc, a_bufs, b_bufs, bars, N, NUM_BUF, BLOCK_M,
                                           BLOCK_N, BLOCK_K)  # fmt: skip
        if kk == k_steps - 1:
            res = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            g, m0, m_end, n0 = _tile_at(pid + (s // k_steps) * progs, gi, starts, sizes, tbeg, tend, BLOCK_M, BLOCK_N)
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
            m_ok = offs_m < m_end
            out = res
            if HAS_RS:
                out = out * gl.load(rs_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
            out = out.to(y_ptr.dtype.element_ty)
            if COALESCE:  # through shared memory to 16-byte row pieces per thread
                rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
                out = gl.convert_layout(out, rows_l)
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_l))
                offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_l))
                m_ok = offs_m < m_end
            ptrs = y_ptr + offs_m.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
            gl.store(ptrs, out, mask=m_ok[:, None] & (offs_n < N)[None, :])

    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(bars.index(i))


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def grouped_gemm_gluon(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    row_scales: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block: tuple[int, int, int] = (128, 256, 64),
    num_buf: int = 3,
    num_warps: int = 8,
    coalesce: bool = True,
    depth: int = 1,
) -> torch.Tensor:
    """``y [M, N]`` (``out`` when given): ``y[m] = (x[m] @ w_g.T) * row_scales[m]`` for the rows of
    group ``g`` (``m_sizes [G]`` int32 row counts, rows in group order), ``w [G * N, K]``; rows past
    ``sum(m_sizes)`` left unwritten. 16-bit ``x`` and ``w`` of one dtype, CUDA sm_90. ``coalesce``: the
    epilogue's rows through shared memory to 16-byte stores (its scratch takes one operand stage
    of shared memory: ``num_buf`` 3 at 128 x 256 x 64). ``depth``: MMA groups left in flight
    when the next is issued (0: each waited for first, the Gluon tutorials' form; 1: the next
    group queued behind the running one). Defaults: the best measured (session 32 run 6)."""
    if x.dtype not in _GL_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"grouped_gemm_gluon takes bf16 or fp16 x and w of one dtype, got {x.dtype} and {w.dtype}")
    M, K = (int(d) for d in x.shape)
    G = int(m_sizes.shape[0])
    if G == 0 or int(w.shape[0]) % G or int(w.shape[1]) != K:
        raise ValueError(f"grouped_gemm_gluon: w must be [G * N, K] with G = {G}, K = {K}; got {tuple(w.shape)}")
    N = int(w.shape[0]) // G
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk = block
    dt = _GL_DTYPES[x.dtype]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt))
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    rs = row_scales if row_scales is not None else torch.empty((1,), dtype=torch.float32, device=x.device)
    _gg_gluon_kernel[(num_sms(x.device),)](
        x_desc, w_desc, y, rs, m_sizes, M, N, K, G, y.stride(0),
        HAS_RS=row_scales is not None, G_BLOCK=max(32, next_pow2(G)), NUM_BUF=num_buf, COALESCE=bool(coalesce),
        DEPTH=int(depth), num_warps=num_warps,
    )  # fmt: skip
    return y


__all__ = ["grouped_gemm_gluon"]
