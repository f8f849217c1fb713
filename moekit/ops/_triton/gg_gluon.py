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
- ``warpgroup_mma`` asynchronously (``depth`` 1: the next group queued behind the running one;
  0: each waited for before the next is issued);
- the epilogue scales the rows, casts and stores with masks (a tile's rows end at its group's
  end; TMA stores would overwrite the next group's rows);
- the warp-specialized kernel (``ws=True``, the default) splits those roles: TMA warps fill a
  ring of operand stages, the two MMA warpgroups leave each finished tile in a staging buffer,
  store warps write it out while the next tile's MMAs run. It also takes FP8 e4m3 rows and
  weights with row-wise scales (applied in the epilogue). Its ``halves`` form (session 33) gives
  each MMA warpgroup a partition of its own with 64 rows of the 128-row tile, so a group's last
  row tile with at most 64 rows runs half its MMAs.

GPU only (Gluon has no interpreter): ``moekit.ops._triton.grouped_gemm`` stays the library's path
for everything but the layer's stored FP8 down rows on Hopper, which take this kernel by default
since session 33 where the output fills whole 256-column tiles (session 34: gpt-oss-120b's 2880
columns were slower on it; ``moekit.layers.experts._gluon_rows``, knob ``GLUON_DOWN``); otherwise it is
reached through ``grouped_gemm_gluon`` (benchmarks, GPU tests).

Where it stands (H100, session 32 runs 5-8, ``benchmarks/sweep_gluon.py``, µs; rows bit-identical
to the Triton kernel's): the single-partition kernel, its epilogue not overlapped, ran 4-15% behind
the Triton kernel; the warp-specialized one (``ws=True``, the default: TMA warps, the two MMA
warpgroups, store warps writing a finished tile while the next one's MMAs run) is level with it
(Qwen3-30B's down projection at T=8192, 65536 rows, N 2048, K 768: 383.3 against 382.8; its gate|up
GEMM 744.0 against 733.3) and 4.4% faster on DeepSeek-V3 TP8's down projection (713.8 against
746.4). cuBLAS stays 22-40% ahead of both on the same FLOPs (297.9, 565.1, 473.3): the next
candidate is the operands' traffic, clusters of two CTAs sharing one operand by TMA multicast.
Session 33 (H100, HISTORY run 1): FP8 rows 7.1% ahead of the Triton kernel (Qwen3-30B's FP8 down
projection at T=8192: 250.3 against 269.5 µs; cuBLAS 213.9); the halves form 1.4% ahead of the
cooperative one on Qwen3's bf16 down GEMM (364.2 against 369.2) but 3.8% behind on DeepSeek's
(K = 256: 743.9 against 716.5), so it stays a choice (``halves=True``, knob ``GLUON_DOWN=2``).

Scatter-add (``scatter_indices``, session 48): the store warps add a finished tile's rows into
their tokens' rows (relaxed 16-byte bf16 reductions) while the MMA warps run the next tile. Written
to test whether the Triton kernel's scatter-add epilogue, which stops its MMAs, is what keeps the
FP8 down GEMMs at T=2048 at about half their floor. It is not: the adds cost the same ~20% (21-24
µs) in both kernels (H100, ``sweep_gluon.py``, µs, stored rows -> added rows: Qwen3-30B FP8 T=2048 Triton
108.2 -> 129.1, Gluon 112.1 -> 135.8; DeepSeek-V3 TP8 FP8 Triton 296.0 added, Gluon 318.6, halves
308.1), and the layer with it was level to 6% slower, so the layer keeps the Triton kernel.
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


@gluon.constexpr_function
def _acc_layout(BLOCK_M, BLOCK_N, num_warps, bits):
    """The wgmma accumulator's layout for a ``BLOCK_M x BLOCK_N`` tile of ``bits``-bit operands."""
    return gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_mma_warps(BLOCK_M, num_warps),
        instr_shape=[16, _mma_n(BLOCK_M, BLOCK_N, num_warps), 256 // bits],
    )


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
def _table(m_sizes_ptr, M, N, G, G_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           NW: gl.constexpr):  # fmt: skip
    """The group table in a partition of ``NW`` warps: ``(gi, starts, sizes, tbeg, tend, total)``."""
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    gi = gl.arange(0, G_BLOCK, layout=vec)
    sizes = gl.maximum(gl.load(m_sizes_ptr + gi, mask=gi < G, other=0), 0)
    ends = gl.associative_scan(sizes, 0, _add)
    starts = gl.minimum(ends - sizes, M)
    sizes = gl.minimum(ends, M) - starts
    tiles = gl.cdiv(sizes, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    tend = gl.associative_scan(tiles, 0, _add)
    return gi, starts, sizes, tend - tiles, tend, gl.sum(tiles, 0)


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
    gi, starts, sizes, tbeg, tend, total = _table(m_sizes_ptr, M, N, G, G_BLOCK, BLOCK_M, BLOCK_N, num_warps)

    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = gl.cdiv(gl.maximum(total - pid, 0), progs) * k_steps

    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(bars.index(i), count=1)

    mma: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_N, num_warps, dtype.primitive_bitwidth)
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


# ---------------------------------------------------------------------------------------------
# Warp-specialized form: TMA warps, two MMA warpgroups on one 128 x 256 tile, store warps (2 + 8 + 2
# warps; the workers at 48 registers, the MMA warpgroups at 232: 384 threads in 64K registers).
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _ws_barriers(NUM_BUF: gl.constexpr, READY: gl.constexpr, PARTS: gl.constexpr):
    """The warp-specialized kernels' barriers: per operand stage ``ready`` (``READY`` arrivals
    with the TMA's bytes) and ``empty`` (one release from each of the ``PARTS`` MMA partitions),
    and the staging buffer's ``c_ready`` (``PARTS`` arrivals) and ``c_empty`` (the store warps)."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=PARTS)
    mbarrier.init(c_ready, count=PARTS)
    mbarrier.init(c_empty, count=1)
    return ready, empty, c_ready, c_empty


@gluon.jit
def _ws_invalidate(ready, empty, c_ready, c_empty):
    NUM_BUF: gl.constexpr = ready.type.shape[0]
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(c_ready)
    mbarrier.invalidate(c_empty)


@gluon.jit
def _idle_half(ready, empty, c_ready, c_empty, s, k_steps, j):
    """An MMA partition whose half of tile ``j`` holds no rows: each of its ``k_steps`` stages
    released as it fills (keeping the buffers' phases: every stage waits for both halves), nothing
    staged for the store warps. Returns the step counter past the tile."""
    NUM_BUF: gl.constexpr = ready.type.shape[0]
    for kk in range(k_steps):
        buf = s % NUM_BUF
        mbarrier.wait(ready.index(buf), (s // NUM_BUF) & 1)
        mbarrier.arrive(empty.index(buf), count=1)
        s += 1
    mbarrier.wait(c_empty, (j & 1) ^ 1)
    mbarrier.arrive(c_ready, count=1)
    return s


@gluon.jit
def _table_smem(m_sizes_ptr, M, N, G, G_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                NW: gl.constexpr):  # fmt: skip
    """The group table (``_table``) left in shared memory for every partition of a
    warp-specialized kernel (worker partitions take no tensors): starts, sizes, first tiles, tile
    ends, ``[G_BLOCK]`` each, written and fenced by all the kernel's warps."""
    gi, starts, sizes, tbeg, tend, total = _table(m_sizes_ptr, M, N, G, G_BLOCK, BLOCK_M, BLOCK_N, NW)
    tab_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    tab = (
        gl.allocate_shared_memory(gl.int32, [G_BLOCK], tab_l, starts),
        gl.allocate_shared_memory(gl.int32, [G_BLOCK], tab_l, sizes),
        gl.allocate_shared_memory(gl.int32, [G_BLOCK], tab_l, tbeg),
        gl.allocate_shared_memory(gl.int32, [G_BLOCK], tab_l, tend),
    )
    gl.thread_barrier()
    return tab


@gluon.jit
def _read_table(tab, NW: gl.constexpr):
    """The group table the kernel left in shared memory (``tab``: four ``[G_BLOCK]`` buffers,
    starts, sizes, first tiles, tile ends), read by a partition of ``NW`` warps (worker partitions take no
    tensors, and no constexpr arguments either: the table's width comes from its shape)."""
    t_starts, t_sizes, t_tbeg, t_tend = tab
    G_BLOCK: gl.constexpr = t_starts.type.shape[0]
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    gi = gl.arange(0, G_BLOCK, layout=vec)
    tend = t_tend.load(vec)
    return gi, t_starts.load(vec), t_sizes.load(vec), t_tbeg.load(vec), tend, gl.max(tend, 0)


@gluon.jit
def _tile_from(tab, t, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr):
    """``_tile_at`` over the table in shared memory, read for this one lookup (a worker partition
    holds none of it across its loop: 5 x G_BLOCK / (32 NW) registers it does not have)."""
    gi, starts, sizes, tbeg, tend, total = _read_table(tab, NW)
    return _tile_at(t, gi, starts, sizes, tbeg, tend, BLOCK_M, BLOCK_N)


@gluon.jit
def _tiles_of(tab, NW: gl.constexpr):
    """How many tiles this program walks (``pid, pid + P, ...`` below the table's total)."""
    t_starts, t_sizes, t_tbeg, t_tend = tab
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    total = gl.max(t_tend.load(vec), 0)
    return gl.cdiv(gl.maximum(total - gl.program_id(0), 0), gl.num_programs(0))


@gluon.jit
def _ws_load(x_desc, w_desc, a_bufs, b_bufs, tab, ready, empty, N, K):
    """The TMA warps: every step's x and w tiles into the next free buffer (``empty`` waited, the
    copies landing on ``ready``)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    NUM_BUF: gl.constexpr = a_bufs.type.shape[0]
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    s = 0
    for j in range(_tiles_of(tab, 2)):
        g, m0, _, n0 = _tile_from(tab, pid + j * progs, BLOCK_M, BLOCK_N, 2)
        for kk in range(k_steps):
            buf = s % NUM_BUF
            mbarrier.wait(empty.index(buf), ((s // NUM_BUF) & 1) ^ 1)  # (a fresh barrier passes phase 1)
            bar = ready.index(buf)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, kk * BLOCK_K], bar, a_bufs.index(buf))
            tma.async_copy_global_to_shared(w_desc, [g * N + n0, kk * BLOCK_K], bar, b_bufs.index(buf))
            s += 1


@gluon.jit
def _ws_out(c_smem, tab, c_ready, c_empty, y_ptr, idx_ptr, N, stride_ym, SCATTER: gl.constexpr):
    """The store warps: each finished tile from the staging buffer to its rows, masked at its
    group's end, 8 rows (one swizzle period) at a time; then the buffer is the MMA warps' again.
    ``SCATTER`` (``_ws_store_add``): row ``m`` is added (relaxed atomics, 16 bytes a thread) into
    output row ``idx[m]`` instead, rows with a negative index dropped, the adds of one tile running
    under the next tile's MMAs."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    NW: gl.constexpr = 2
    CH: gl.constexpr = 8
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    for j in range(_tiles_of(tab, NW)):
        g, m0, m_end, n0 = _tile_from(tab, pid + j * progs, BLOCK_M, BLOCK_N, NW)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_l))
        n_ok = (offs_n < N)[None, :]
        mbarrier.wait(c_ready, j & 1)
        for r in gl.static_range(0, BLOCK_M, CH):
            if m0 + r < m_end:  # (chunks past the group's end: nothing to write, maybe nothing staged)
                v = c_smem.slice(r, CH).load(rows_l)
                offs_m = m0 + r + gl.arange(0, CH, layout=gl.SliceLayout(1, rows_l))
                m_ok = offs_m < m_end
                if SCATTER:
                    dst = gl.load(idx_ptr + offs_m, mask=m_ok, other=-1)
                    ptrs = y_ptr + dst.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
                    gl.atomic_add(ptrs, v, mask=(dst >= 0)[:, None] & n_ok, sem="relaxed")
                else:
                    ptrs = y_ptr + offs_m.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
                    gl.store(ptrs, v, mask=m_ok[:, None] & n_ok)
        mbarrier.arrive(c_empty, count=1)


@gluon.jit
def _ws_store(c_smem, tab, c_ready, c_empty, y_ptr, N, stride_ym):
    _ws_out(c_smem, tab, c_ready, c_empty, y_ptr, y_ptr, N, stride_ym, False)


@gluon.jit
def _ws_store_add(c_smem, tab, c_ready, c_empty, y_ptr, idx_ptr, N, stride_ym):
    _ws_out(c_smem, tab, c_ready, c_empty, y_ptr, idx_ptr, N, stride_ym, True)


@gluon.jit
def _ws_mma_scaled(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, True, 0, False)


@gluon.jit
def _ws_mma_plain(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, False, 0, False)


@gluon.jit
def _ws_lo_scaled(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, True, 0, True)


@gluon.jit
def _ws_lo_plain(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, False, 0, True)


@gluon.jit
def _ws_hi_scaled(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, True, 1, True)


@gluon.jit
def _ws_hi_plain(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K):
    _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K, False, 1, True)


@gluon.jit
def _ws_mma(a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K,
            HAS_RS: gl.constexpr, H: gl.constexpr, HALVES: gl.constexpr):  # fmt: skip
    """The MMA warps: each step's group issued behind the running one, the buffer of the one
    before released; a finished tile's rows scaled, cast and left in the staging buffer for the
    store warps, so the next tile's MMAs start at once. (Arguments through ``warp_specialize``
    arrive as IR values: ``HAS_RS``, ``H`` and ``HALVES`` are fixed by the wrappers above, the
    warps read from ``gl.num_warps``, FP8 from the operands' dtype.) FP8: e4m3 rows and weights,
    the rows' scales ``xs`` and the weights' per-column ``ws`` applied in the epilogue (row-wise
    scaling, float32).

    ``HALVES``: this partition is one warpgroup with rows ``[64 H, 64 H + 64)`` of each 128-row
    tile (the other half is another partition's). A half whose rows all lie past its group's end
    (the last row tile of a group holding at most 64 rows) issues no MMAs: it only keeps the
    buffers' phases (each buffer waits for both halves' release) and leaves its staging rows
    unwritten, which the store warps skip."""
    NW: gl.constexpr = gl.num_warps()
    NUM_BUF: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1] // 2 if HALVES else a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    dtype: gl.constexpr = a_bufs.dtype
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    k_steps = gl.cdiv(K, BLOCK_K)
    mma: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_N, NW, dtype.primitive_bitwidth)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    acc = warpgroup_mma_init(zero)
    TM: gl.constexpr = 2 * BLOCK_M if HALVES else BLOCK_M
    s = 0
    # A tile's coordinates are looked up under the MMAs of the tile before (the lookup reduces
    # over the group table: a few hundred cycles with the tensor cores idle at a tile's start).
    g, m0, m_end, n0 = _tile_from(tab, pid, TM, BLOCK_N, NW)
    for j in range(_tiles_of(tab, NW)):
        ng, nm0, nm_end, nn0 = g, m0, m_end, n0
        m0 = m0 + H * BLOCK_M
        if m0 < m_end:
            for kk in range(k_steps):
                buf = s % NUM_BUF
                mbarrier.wait(ready.index(buf), (s // NUM_BUF) & 1)
                a = a_bufs.index(buf)
                if HALVES:
                    a = a.slice(H * BLOCK_M, BLOCK_M)
                # (the accumulator is zeroed after each epilogue: a constant use_acc, and the finished
                # tile's registers free for its scaled rows)
                acc = warpgroup_mma(a, b_bufs.index(buf).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=1, deps=(acc,)))
                # the step before is complete: its buffer goes back to the TMA warp (within the tile)
                mbarrier.arrive(empty.index((s + NUM_BUF - 1) % NUM_BUF), count=1, pred=kk > 0)
                if kk == k_steps // 2:
                    ng, nm0, nm_end, nn0 = _tile_from(tab, pid + (j + 1) * progs, TM, BLOCK_N, NW)
                s += 1
            if HAS_RS or FP8:  # the epilogue's scales loaded under the last MMA group
                offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
                m_ok = offs_m < m_end
                row_s = gl.full((BLOCK_M,), 1.0, gl.float32, layout=gl.SliceLayout(1, mma))
                if HAS_RS:
                    row_s = row_s * gl.load(rs_ptr + offs_m, mask=m_ok, other=0.0)
                if FP8:
                    row_s = row_s * gl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
                    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                    col_s = gl.load(ws_ptr + g.to(gl.int64) * N + offs_n, mask=offs_n < N, other=0.0)
            res = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((s + NUM_BUF - 1) % NUM_BUF), count=1)
            if FP8:
                res = res * row_s[:, None] * col_s[None, :]
            elif HAS_RS:
                res = res * row_s[:, None]
            out = res.to(c_smem.dtype)
            mbarrier.wait(c_empty, (j & 1) ^ 1)
            if HALVES:
                c_smem.slice(H * BLOCK_M, BLOCK_M).store(out)
            else:
                c_smem.store(out)
            mbarrier.arrive(c_ready, count=1)
            acc = warpgroup_mma_init(zero)
        else:  # (HALVES only: no rows here) the buffers released as they fill, nothing staged
            ng, nm0, nm_end, nn0 = _tile_from(tab, pid + (j + 1) * progs, TM, BLOCK_N, NW)
            s = _idle_half(ready, empty, c_ready, c_empty, s, k_steps, j)
        g, m0, m_end, n0 = ng, nm0, nm_end, nn0


@gluon.jit
def _gg_gluon_ws_kernel(
    x_desc,
    w_desc,
    y_ptr,
    rs_ptr,
    xs_ptr,
    ws_ptr,
    idx_ptr,
    m_sizes_ptr,
    M,
    N,
    K,
    G,
    stride_ym,
    HAS_RS: gl.constexpr,
    G_BLOCK: gl.constexpr,
    NUM_BUF: gl.constexpr,
    HALVES: gl.constexpr,
    SCATTER: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    y_dtype: gl.constexpr = y_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
    c_smem = gl.allocate_shared_memory(
        y_dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], y_dtype)
    )
    # (the MMA partitions, one or two: each releases buffers and stages rows)
    ready, empty, c_ready, c_empty = _ws_barriers(NUM_BUF, 1, 2 if HALVES else 1)
    # The group table, once, for every partition.
    tab = _table_smem(m_sizes_ptr, M, N, G, G_BLOCK, BLOCK_M, BLOCK_N, num_warps)
    worker = (x_desc, w_desc, a_bufs, b_bufs, tab, ready, empty, N, K)
    mma_args = (a_bufs, b_bufs, c_smem, tab, ready, empty, c_ready, c_empty, rs_ptr, xs_ptr, ws_ptr, N, K)
    # The store warps: rows stored, or added at their indices (one function each: a worker partition
    # takes no constexpr, nor can a function be chosen into a variable, so each launch is spelled out).
    st = (c_smem, tab, c_ready, c_empty, y_ptr, N, stride_ym)
    add = (c_smem, tab, c_ready, c_empty, y_ptr, idx_ptr, N, stride_ym)
    if HALVES:  # one warpgroup per 64-row half: this one (4 warps) and a worker of 4 at the same budget
        if HAS_RS:
            if SCATTER:
                gl.warp_specialize([(_ws_lo_scaled, mma_args), (_ws_hi_scaled, mma_args), (_ws_load, worker),
                                    (_ws_store_add, add)], [4, 2, 2], [232, 48, 48])  # fmt: skip
            else:
                gl.warp_specialize([(_ws_lo_scaled, mma_args), (_ws_hi_scaled, mma_args), (_ws_load, worker),
                                    (_ws_store, st)], [4, 2, 2], [232, 48, 48])  # fmt: skip
        else:
            if SCATTER:
                gl.warp_specialize([(_ws_lo_plain, mma_args), (_ws_hi_plain, mma_args), (_ws_load, worker),
                                    (_ws_store_add, add)], [4, 2, 2], [232, 48, 48])  # fmt: skip
            else:
                gl.warp_specialize([(_ws_lo_plain, mma_args), (_ws_hi_plain, mma_args), (_ws_load, worker),
                                    (_ws_store, st)], [4, 2, 2], [232, 48, 48])  # fmt: skip
    elif HAS_RS:
        if SCATTER:
            gl.warp_specialize([(_ws_mma_scaled, mma_args), (_ws_load, worker), (_ws_store_add, add)], [2, 2], [48, 48])
        else:
            gl.warp_specialize([(_ws_mma_scaled, mma_args), (_ws_load, worker), (_ws_store, st)], [2, 2], [48, 48])
    elif SCATTER:
        gl.warp_specialize([(_ws_mma_plain, mma_args), (_ws_load, worker), (_ws_store_add, add)], [2, 2], [48, 48])
    else:
        gl.warp_specialize([(_ws_mma_plain, mma_args), (_ws_load, worker), (_ws_store, st)], [2, 2], [48, 48])
    _ws_invalidate(ready, empty, c_ready, c_empty)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def grouped_gemm_gluon(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    row_scales: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block: Optional[tuple[int, int, int]] = None,
    num_buf: int = 3,
    num_warps: int = 8,
    coalesce: bool = True,
    depth: int = 1,
    ws: bool = True,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    halves: bool = False,
    scatter_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y [M, N]`` (``out`` when given): ``y[m] = (x[m] @ w_g.T) * row_scales[m]`` for the rows of
    group ``g`` (``m_sizes [G]`` int32 row counts, rows in group order), ``w [G * N, K]``; rows past
    ``sum(m_sizes)`` left unwritten. CUDA sm_90. 16-bit ``x`` and ``w`` of one dtype (``y`` in it),
    or FP8 e4m3 ``x`` and ``w`` with row-wise scales ``x_scale [M]`` and ``w_scale [G * N]``
    (float32; ``y`` bf16; the warp-specialized kernel only). ``block``: ``(BM, BN, BK)``, default
    128 x 256 x 64 (16-bit) or x 128 (FP8: 128-byte K tiles). ``coalesce``: the epilogue's rows
    through shared memory to 16-byte stores (its scratch takes one operand stage of shared memory:
    ``num_buf`` 3 at 128 x 256 x 64). ``depth``: MMA groups left in flight when the next is issued
    (0: each waited for first, the Gluon tutorials' form; 1: the next group queued behind the
    running one). Defaults: the best measured (session 32 runs 6 and 8). ``ws``: the
    warp-specialized kernel (TMA warps, the two MMA warpgroups, store warps; ``num_buf`` operand
    stages, 3 at most at 128 x 256 x 64; ``coalesce`` and ``depth`` do not apply). ``halves``
    (warp-specialized, 128-row tiles): each MMA warpgroup its own partition with one 64-row half
    of the tile, so a group's last row tile with at most 64 rows runs half its MMAs.

    ``scatter_indices [M]`` (int32, warp-specialized kernel): row ``m`` is added into row
    ``scatter_indices[m]`` of ``out [T, N]`` (required; bf16 for FP8 rows, else ``x``'s dtype)
    by relaxed atomics, negative indices dropped (the layer's down projection summed into its
    tokens; the order of the adds, and so the rounding, is not fixed). ``out`` is returned."""
    fp8 = x.dtype == torch.float8_e4m3fn
    if fp8:
        if w.dtype != x.dtype:
            raise TypeError(f"grouped_gemm_gluon: FP8 x takes FP8 (e4m3) w, got {w.dtype}")
        if x_scale is None or w_scale is None:
            raise ValueError("grouped_gemm_gluon: FP8 x and w need x_scale [M] and w_scale [G * N]")
        if not ws:
            raise ValueError("grouped_gemm_gluon: FP8 runs on the warp-specialized kernel only (ws=True)")
    elif x.dtype not in _GL_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"grouped_gemm_gluon takes bf16 or fp16 x and w of one dtype, or FP8 e4m3 both, got {x.dtype} and {w.dtype}"
        )
    M, K = (int(d) for d in x.shape)
    G = int(m_sizes.shape[0])
    if G == 0 or int(w.shape[0]) % G or int(w.shape[1]) != K:
        raise ValueError(f"grouped_gemm_gluon: w must be [G * N, K] with G = {G}, K = {K}; got {tuple(w.shape)}")
    N = int(w.shape[0]) // G
    if fp8 and (tuple(x_scale.shape) != (M,) or tuple(w_scale.shape) != (G * N,)):
        raise ValueError(
            f"grouped_gemm_gluon: x_scale must be [{M}] and w_scale [{G * N}], got "
            f"{tuple(x_scale.shape)} and {tuple(w_scale.shape)}"
        )
    y_dtype = torch.bfloat16 if fp8 else x.dtype
    if scatter_indices is not None:
        if not ws:
            raise ValueError("grouped_gemm_gluon: scatter_indices runs on the warp-specialized kernel only (ws=True)")
        if out is None or out.dim() != 2 or out.shape[1] != N or out.dtype != y_dtype or out.stride(1) != 1:
            got = None if out is None else f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}"
            raise ValueError(
                f"grouped_gemm_gluon: scatter_indices needs out [T, {N}] {y_dtype} with unit column stride, got {got}"
            )
        if scatter_indices.dtype != torch.int32 or tuple(scatter_indices.shape) != (M,):
            raise ValueError(
                f"grouped_gemm_gluon: scatter_indices must be int32 [{M}], got {scatter_indices.dtype} "
                f"{tuple(scatter_indices.shape)}"
            )
    y = out if out is not None else torch.empty((M, N), dtype=y_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk = block or ((128, 256, 128) if fp8 else (128, 256, 64))
    if halves and (not ws or bm != 128):
        raise ValueError(
            f"grouped_gemm_gluon: halves takes the warp-specialized kernel with 128-row tiles, got ws={ws}, block={block}"
        )
    dt = gl.float8e4nv if fp8 else _GL_DTYPES[x.dtype]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt))
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    ph = torch.empty((1,), dtype=torch.float32, device=x.device)
    rs = row_scales if row_scales is not None else ph
    if ws:
        _gg_gluon_ws_kernel[(num_sms(x.device),)](
            x_desc, w_desc, y, rs, x_scale if fp8 else ph, w_scale if fp8 else ph,
            scatter_indices if scatter_indices is not None else m_sizes, m_sizes, M, N, K, G, y.stride(0),
            HAS_RS=row_scales is not None, G_BLOCK=max(32, next_pow2(G)), NUM_BUF=num_buf, HALVES=bool(halves),
            SCATTER=scatter_indices is not None, num_warps=4 if halves else 8,
        )  # fmt: skip
        return y
    _gg_gluon_kernel[(num_sms(x.device),)](
        x_desc, w_desc, y, rs, m_sizes, M, N, K, G, y.stride(0),
        HAS_RS=row_scales is not None, G_BLOCK=max(32, next_pow2(G)), NUM_BUF=num_buf, COALESCE=bool(coalesce),
        DEPTH=int(depth), num_warps=num_warps,
    )  # fmt: skip
    return y


__all__ = ["grouped_gemm_gluon"]
