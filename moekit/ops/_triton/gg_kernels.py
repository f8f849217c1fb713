"""Triton kernels of the grouped GEMM (see ``moekit.ops._triton.grouped_gemm`` for the paths, the
epilogue and the numerics; ``gg_config`` picks their launch configurations)."""

from __future__ import annotations

import triton
import triton.language as tl

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
def _tile_table(gi, starts, rows, n_tiles_n, BLOCK_M: tl.constexpr):
    """The persistent kernels' tile table, per group: ``(group, first tile)`` and ``(first row,
    rows)`` packed into one int64 each (so ``_tile_at`` finds a tile's group with two reductions),
    the first tile, the tile end, and the total number of tiles."""
    tiles = ((rows + BLOCK_M - 1) // BLOCK_M) * n_tiles_n
    tiles_end = tl.cumsum(tiles, axis=0)
    tiles_begin = tiles_end - tiles
    pack_gt = (gi.to(tl.int64) << 32) | tiles_begin.to(tl.int64)
    pack_sr = (starts.to(tl.int64) << 32) | rows.to(tl.int64)
    return pack_gt, pack_sr, tiles_begin, tiles_end, tl.sum(tiles, axis=0)


@triton.jit
def _tile_at(t, pack_gt, pack_sr, tiles_begin, tiles_end, n_tiles_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):  # fmt: skip
    """Persistent tile ``t`` of the tile table (``_tile_table``): (group, first row ``m0``, the
    group's row end, first column ``n0``). Grouped order inside the expert: bands of ``GROUP_M``
    row tiles sweep the N tiles, so the tiles that run together share their x rows and w columns
    in L2. The one group whose tiles hold ``t`` (empty groups hold none) is picked with two
    reductions of packed values (a tile costs a cross-warp reduction each)."""
    sel = (tiles_begin <= t) & (t < tiles_end)
    gt = _pick(pack_gt, sel)
    sr = _pick(pack_sr, sel)
    g = (gt >> 32).to(tl.int32)
    local = t - (gt & 0xFFFFFFFF).to(tl.int32)
    m_begin = (sr >> 32).to(tl.int32)
    rows_g = (sr & 0xFFFFFFFF).to(tl.int32)
    m_end = m_begin + rows_g
    mt_g = (rows_g + BLOCK_M - 1) // BLOCK_M
    band_tiles = GROUP_M * n_tiles_n
    first_m = (local // band_tiles) * GROUP_M
    band_m = tl.minimum(mt_g - first_m, GROUP_M)
    in_band = local % band_tiles
    m0 = m_begin + (first_m + in_band % band_m) * BLOCK_M
    n0 = (in_band // band_m) * BLOCK_N
    return g, m0, m_end, n0


@triton.jit
def _epilogue_vectors(
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    g,
    N,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    tw_ptr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    W_ONLY: tl.constexpr = False,
):
    """The epilogue's per-row and per-column operands of a tile: x scales, w scales, bias and token
    weights (placeholders where a feature is off). FP8 tiles (the streaming kernel, the persistent
    swap-AB loop, short-K tiled tiles up to 64 x 256) load them before the tile's K loop, so that their
    latency hides under its loads and MMAs instead of stalling the epilogue (the kernels'
    ``EARLY_EPI``; ``grouped_gemm.early_epilogue`` has the rule and its measurements). H200,
    session 23, the layer's own FP8 down GEMM alone (``isolate_stages.py``): loaded after the loop,
    DeepSeek-V3 TP8 (K=256, persistent loop) at T=256 ran 124 us with its rows stored and 157 us
    with token weights and scatter-add, loaded before it 132 us (layer 387 -> 362 us); Qwen3-30B
    (K=768, streaming kernel) 65 -> 60 us. 16-bit tiles load them after the loop (early, the
    persistent loop's bf16 tiles lost 2.5% at DeepSeek T=1024, the weight-only FP8 down GEMM of
    the decode pipeline 7-11% at T=16, bf16 tiled tiles 2-11%), and prefill tiles would hold them
    across it (FP8 128 x 256 spills)."""
    col = g.to(tl.int64) * N + offs_n
    xs = offs_m.to(tl.float32)
    ws = offs_n.to(tl.float32)
    b = ws
    tw = xs
    if FP8:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    if FP8 or W_ONLY:
        ws = tl.load(ws_ptr + col, mask=n_mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + col, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_TW:
        tw = tl.load(tw_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
    return xs, ws, b, tw


@triton.jit
def _epilogue(
    acc,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    xs,
    ws,
    b,
    tw,
    y_ptr,
    stride_ym,
    idx_ptr,
    T_OUT,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TW: tl.constexpr,
    SCATTER: tl.constexpr,
    W_ONLY: tl.constexpr = False,
    dst=None,
):
    """``acc`` [BM, BN] float32 for rows ``offs_m`` and expert columns ``offs_n``, with the
    operands ``_epilogue_vectors`` loaded: scale (FP8: x and w scales; ``W_ONLY``, weight-only
    FP8: the w scales), add bias, weight by token, then store or scatter-add into ``y[idx[row]]``.
    The destination rows load here, beside the stores they address, unless the kernel loaded them
    itself (``dst``, int64; before its K loop): inductor's mutation analysis (torch.compile)
    follows pointers into called @triton.jit functions coarsely, and a store address computed from
    values another helper loaded (and returned) made it count every input pointer of the kernel as
    written; a load in the kernel's own body passes (tests/ops/test_grouped_gemm.py checks both)."""
    if FP8:
        acc = acc * xs[:, None] * ws[None, :]
    if W_ONLY:
        acc = acc * ws[None, :]
    if HAS_BIAS:
        acc = acc + b[None, :]
    if HAS_TW:
        acc = acc * tw[:, None]
    val = acc.to(y_ptr.dtype.element_ty)
    if SCATTER:
        if dst is None:
            dst = tl.load(idx_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        ok = m_mask & (dst >= 0) & (dst < T_OUT)
        ptrs = y_ptr + dst[:, None] * stride_ym + offs_n[None, :]
        tl.atomic_add(ptrs, val, mask=ok[:, None] & n_mask[None, :], sem="relaxed")
    else:
        ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, val, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _make_descriptors(x_ptr, w_ptr, x_rows, K, w_rows, stride_xm, stride_wn, USE_TMA: tl.constexpr,
                      X_TMA: tl.constexpr, DEV_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """``(x, w)`` as the kernels read them: with ``DEV_TMA`` the TMA descriptors the host would
    have made (``grouped_gemm._descriptor``: ``x [x_rows, K]`` in ``[BLOCK_M, BLOCK_K]`` tiles
    where ``X_TMA``, ``w [w_rows, K]`` in ``[BLOCK_N, BLOCK_K]`` tiles where ``USE_TMA``), made
    here from the pointers (``tl.make_tensor_descriptor``: torch.compile's traced graphs pass
    tensors, not host descriptors); else the arguments unchanged."""
    if DEV_TMA:
        if USE_TMA:
            w_ptr = tl.make_tensor_descriptor(w_ptr, [w_rows, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        if X_TMA:
            x_ptr = tl.make_tensor_descriptor(x_ptr, [x_rows, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    return x_ptr, w_ptr


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
    W_ONLY: tl.constexpr,
    USE_TMA: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    X_TMA: tl.constexpr,
    EARLY_EPI: tl.constexpr,
    DEV_TMA: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """``X_TMA``: ``x_ptr`` is a TMA descriptor too: the row tile is read whole from ``m0`` (rows of
    the next group or past M come along, zero past M, and are never stored), which frees the
    ``[BLOCK_M, BLOCK_K]`` pointer tile's registers for more resident programs. ``EARLY_EPI`` as
    the tiled kernel's. ``DEV_TMA``: ``x_ptr`` / ``w_ptr`` are the tensors, and the descriptors
    ``USE_TMA`` / ``X_TMA`` ask for are made here (``_make_descriptors``)."""
    pdl_prologue(USE_PDL)
    x_ptr, w_ptr = _make_descriptors(x_ptr, w_ptr, M, K, G * N, stride_xm, stride_wn, USE_TMA, X_TMA, DEV_TMA,
                                     BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
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
            if EARLY_EPI > 0:  # the epilogue's operands load under the K loop
                e_xs, e_ws, e_b, e_tw = _epilogue_vectors(
                    offs_m, m_mask, offs_n, n_mask, g, N, xs_ptr, ws_ptr, bias_ptr, tw_ptr, FP8, HAS_BIAS, HAS_TW,
                    W_ONLY,
                )  # fmt: skip
            e_dst = None
            if SCATTER and EARLY_EPI == 2:  # here, not in a helper: see _epilogue
                e_dst = tl.load(idx_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
            if not X_TMA:
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
                if X_TMA:
                    x_t = x_ptr.load([m0, k0])
                else:
                    # x through pointers: masked rows (other groups, past M) cost no traffic.
                    x_t = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                if W_ONLY:  # weight-only FP8: the weight tile in x's dtype, in registers
                    w_t = w_t.to(x_t.dtype)
                acc = tl.dot(w_t, tl.trans(x_t), acc)
            if EARLY_EPI == 0:  # after the loop (see _epilogue_vectors)
                e_xs, e_ws, e_b, e_tw = _epilogue_vectors(
                    offs_m, m_mask, offs_n, n_mask, g, N, xs_ptr, ws_ptr, bias_ptr, tw_ptr, FP8, HAS_BIAS, HAS_TW,
                    W_ONLY,
                )  # fmt: skip
            _epilogue(
                tl.trans(acc), offs_m, m_mask, offs_n, n_mask, e_xs, e_ws, e_b, e_tw, y_ptr, stride_ym, idx_ptr,
                T_OUT, FP8, HAS_BIAS, HAS_TW, SCATTER, W_ONLY, e_dst,
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
    W_ONLY: tl.constexpr,
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
        if W_ONLY:
            post = post * tl.load(ws_ptr + col, mask=n_mask, other=0.0)
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
        if FP8 or W_ONLY:
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
    W_ONLY: tl.constexpr,
    USE_TMA: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    FLATTEN: tl.constexpr,
    G_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    SWAP_AB: tl.constexpr,
    X_TMA: tl.constexpr,
    EARLY_EPI: tl.constexpr,
    N_SLAB: tl.constexpr = 0,
    DEV_TMA: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
):
    """``SWAP_AB``: the MMA takes the weight tile as its left operand (``[BLOCK_N, BLOCK_M] = w @
    x.T``, BLOCK_N on the warpgroup's M side, a few token rows on its N side: the streaming
    kernel's tiles on this persistent tile loop). ``X_TMA``: x through its TMA descriptor, else
    masked pointers (``USE_TMA``: the weights through theirs). ``EARLY_EPI``: 1 the epilogue's
    operands load before each tile's K loop, 2 its destination rows too, 0 both after it
    (``grouped_gemm.early_epilogue`` says for which tiles). ``N_SLAB`` (> 0): the tiles walk the
    output in column slabs of ``N_SLAB`` N tiles, every group's tiles of one slab before the next
    slab's (``grouped_gemm.n_slab_tiles``: a scatter-add whose ``[T, slab]`` destination stays in
    L2 while every expert adds into it); 0: each group's tiles over all of N in turn. ``DEV_TMA``
    as the streaming kernel's."""
    pdl_prologue(USE_PDL)
    x_ptr, w_ptr = _make_descriptors(x_ptr, w_ptr, M, K, G * N, stride_xm, stride_wn, USE_TMA, X_TMA, DEV_TMA,
                                     BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    gi, starts, rows = _group_table(m_sizes_ptr, G, M, HAS_MSIZES, G_BLOCK)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    if N_SLAB > 0:  # a slab's tile table; the slabs one after the other
        pack_gt, pack_sr, tiles_begin, tiles_end, per_slab = _tile_table(gi, starts, rows, N_SLAB, BLOCK_M)
        total = per_slab * tl.cdiv(n_tiles_n, N_SLAB)
    else:
        pack_gt, pack_sr, tiles_begin, tiles_end, total = _tile_table(gi, starts, rows, n_tiles_n, BLOCK_M)
        per_slab = total
    for t in tl.range(pid, total, n_progs, flatten=FLATTEN):
        if N_SLAB > 0:
            g, m0, m_end, n0 = _tile_at(t % per_slab, pack_gt, pack_sr, tiles_begin, tiles_end, N_SLAB, GROUP_M,
                                        BLOCK_M, BLOCK_N)  # fmt: skip
            n0 += (t // per_slab) * (N_SLAB * BLOCK_N)  # past N in a partial last slab: masked out
        else:
            g, m0, m_end, n0 = _tile_at(t, pack_gt, pack_sr, tiles_begin, tiles_end, n_tiles_n, GROUP_M, BLOCK_M,
                                        BLOCK_N)  # fmt: skip
        w_row0 = g * N + n0
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m_mask = offs_m < m_end
        n_mask = offs_n < N
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EARLY_EPI > 0:  # the epilogue's operands load under the K loop
            e_xs, e_ws, e_b, e_tw = _epilogue_vectors(
                offs_m, m_mask, offs_n, n_mask, g, N, xs_ptr, ws_ptr, bias_ptr, tw_ptr, FP8, HAS_BIAS, HAS_TW,
                W_ONLY,
            )  # fmt: skip
        e_dst = None
        if SCATTER and EARLY_EPI == 2:  # here, not in a helper: see _epilogue
            e_dst = tl.load(idx_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            if X_TMA:
                a = x_ptr.load([m0, k0])
            else:
                a = tl.load(
                    x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            if USE_TMA:
                b = w_ptr.load([w_row0, k0])
            else:
                b = tl.load(
                    w_ptr + (w_row0.to(tl.int64) + tl.arange(0, BLOCK_N))[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            if W_ONLY:
                b = b.to(a.dtype)
            if SWAP_AB:
                if FAST_ACCUM:
                    acc = tl.dot(b, tl.trans(a), acc)
                else:
                    acc = tl.dot(b, tl.trans(a), acc, max_num_imprecise_acc=BLOCK_K)
            elif FAST_ACCUM:
                acc = tl.dot(a, tl.trans(b), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        if SWAP_AB:
            acc_mn = tl.trans(acc)
        else:
            acc_mn = acc
        if EARLY_EPI == 0:  # after the loop (see _epilogue_vectors)
            e_xs, e_ws, e_b, e_tw = _epilogue_vectors(
                offs_m, m_mask, offs_n, n_mask, g, N, xs_ptr, ws_ptr, bias_ptr, tw_ptr, FP8, HAS_BIAS, HAS_TW,
                W_ONLY,
            )  # fmt: skip
        _epilogue(
            acc_mn, offs_m, m_mask, offs_n, n_mask, e_xs, e_ws, e_b, e_tw, y_ptr, stride_ym, idx_ptr, T_OUT, FP8,
            HAS_BIAS, HAS_TW, SCATTER, W_ONLY, e_dst,
        )  # fmt: skip
