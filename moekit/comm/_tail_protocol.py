"""Device helpers of the fused MoE-tail kernel (``moekit.comm._triton_tail``): the clock and
bounded waits of the Lamport protocol (sentinel-checked spins with a deadline, missing sources
recorded), peer-pointer loads, bf16 bit conversions and the per-row sums."""

from __future__ import annotations

import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _now_ns(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        t = _globaltimer()
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def _peer16(peers_ptr, p):
    """int16 view of peer ``p``'s workspace (16-byte aligned base)."""
    return tl.multiple_of(tl.load(peers_ptr + p).to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def _peer32(peers_ptr, p):
    return tl.multiple_of(tl.load(peers_ptr + p).to(tl.pointer_type(tl.int32)), 16)


@triton.jit
def _to_bf16(x, EMULATE: tl.constexpr):
    """float32 -> bf16, round to nearest even. The Triton 3.6 interpreter truncates instead, so
    there (``EMULATE``) the value is first rounded on the bf16 grid in integer arithmetic and the
    conversion of the now exact value cannot differ."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _bf16_bits(x, EMULATE: tl.constexpr):
    """float32 -> bf16 bit pattern (round to nearest even) with -0.0 turned into +0.0."""
    b = _to_bf16(x, EMULATE).to(tl.int16, bitcast=True)
    return tl.where(b == -32768, tl.zeros_like(b), b)


@triton.jit
def _bits_f32(b):
    return b.to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _record_missing(err_ptr, herr_ptr, src, pending, HOST_ERR: tl.constexpr):
    """Mark the source rank(s) of the still-pending elements as missing."""
    one = tl.full(pending.shape, 1, tl.int32)
    tl.store(err_ptr + src, one, mask=pending)
    if HOST_ERR:
        tl.store(herr_ptr + src, one, mask=pending)


@triton.jit
def _pending(count, deadline, spins, max_spins, USE_TIMER: tl.constexpr):
    """(number of missing elements, whether the wait has expired), both uniform across the
    program: the clock of the thread that owns element 0 decides (each thread reads its own
    %globaltimer; a per-thread decision could split the loop around the reduction's barrier)."""
    if USE_TIMER:
        expired = (_globaltimer() >= deadline).to(tl.int32)
    else:
        expired = (spins >= max_spins).to(tl.int32)
    first = tl.arange(0, count.shape[0]) == 0
    stat = tl.sum(count.to(tl.int32) * 2 + tl.where(first, expired, 0), axis=0)
    return stat // 2, (stat % 2) == 1


@triton.jit
def _wait16(ptrs, mask, src, deadline, max_spins, err_ptr, herr_ptr, USE_TIMER: tl.constexpr, HOST_ERR: tl.constexpr):
    """Spin on volatile loads of ``ptrs`` until no element is the sentinel (or the deadline).
    ``src`` is the source rank of each element (for the timeout report)."""
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    pend = tl.sum((v == -32768).to(tl.int32), axis=0)
    spins = pend * 0
    go = pend > 0
    while go:
        miss = v == -32768
        w = tl.load(ptrs, mask=mask, other=0, volatile=True)
        v = tl.where(miss, w, v)
        spins += 1
        pend, expired = _pending((v == -32768).to(tl.int32), deadline, spins, max_spins, USE_TIMER)
        go = (pend > 0) & (not expired)
    if pend > 0:
        miss = v == -32768
        _record_missing(err_ptr, herr_ptr, src, miss, HOST_ERR)
        v = tl.where(miss, tl.zeros_like(v), v)
    return v


@triton.jit
def _wait32(ptrs, mask, src, deadline, max_spins, err_ptr, herr_ptr, USE_TIMER: tl.constexpr, HOST_ERR: tl.constexpr):
    """``_wait16`` for float32 words (sentinel 0x80008000)."""
    v = tl.load(ptrs, mask=mask, other=0, volatile=True)
    pend = tl.sum((v == -2147450880).to(tl.int32), axis=0)
    spins = pend * 0
    go = pend > 0
    while go:
        miss = v == -2147450880
        w = tl.load(ptrs, mask=mask, other=0, volatile=True)
        v = tl.where(miss, w, v)
        spins += 1
        pend, expired = _pending((v == -2147450880).to(tl.int32), deadline, spins, max_spins, USE_TIMER)
        go = (pend > 0) & (not expired)
    if pend > 0:
        miss = v == -2147450880
        _record_missing(err_ptr, herr_ptr, src, miss, HOST_ERR)
        v = tl.where(miss, tl.zeros_like(v), v)
    return v


@triton.jit
def _load_sum(base, STRIDE: tl.constexpr, cols, mask, R: tl.constexpr, BLOCK: tl.constexpr):
    """Volatile loads of the R source slots ``base + s*STRIDE + cols`` issued back to back: their
    float32 sum in rank order and, per element, how many are still the sentinel."""
    acc = tl.zeros([BLOCK], tl.float32)
    npend = tl.zeros([BLOCK], tl.int32)
    for s in tl.static_range(R):
        v = tl.load(base + s * STRIDE + cols, mask=mask, other=0, volatile=True)
        npend += (v == -32768).to(tl.int32)
        acc += _bits_f32(v)
    return acc, npend


@triton.jit
def _sum_sources(
    base,
    STRIDE: tl.constexpr,
    cols,
    mask,
    deadline,
    max_spins,
    err_ptr,
    herr_ptr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_TIMER: tl.constexpr,
    HOST_ERR: tl.constexpr,
):
    """Wait until every source slot is complete and return the float32 rank-order sum. Each spin
    reloads all R slots and takes one reduction, so a wait costs one round trip, not R. On
    timeout, the still-missing sources are recorded and their elements count as 0."""
    acc, npend = _load_sum(base, STRIDE, cols, mask, R, BLOCK)
    pend = tl.sum(npend, axis=0)
    spins = pend * 0
    go = pend > 0
    while go:
        acc, npend = _load_sum(base, STRIDE, cols, mask, R, BLOCK)
        spins += 1
        pend, expired = _pending(npend, deadline, spins, max_spins, USE_TIMER)
        go = (pend > 0) & (not expired)
    if pend > 0:
        acc = tl.zeros([BLOCK], tl.float32)
        src = tl.zeros([BLOCK], tl.int32)
        for s in tl.static_range(R):
            v = tl.load(base + s * STRIDE + cols, mask=mask, other=0, volatile=True)
            miss = v == -32768
            _record_missing(err_ptr, herr_ptr, src + s, miss, HOST_ERR)
            acc += tl.where(miss, 0.0, _bits_f32(v))
    return acc


@triton.jit
def _local_values(
    lat_ptr,
    wts_ptr,
    idx_ptr,
    t64,
    cols,
    mask,
    gemm_rows,
    L: tl.constexpr,
    TOP_K: tl.constexpr,
    KG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This rank's routed contribution to row ``t`` at ``cols`` in float32: the latent source
    row, or the top-k finalize ``sum_k w[t,k] * gemm2[idx[t,k]]`` (slots ascending, idx < 0 or
    past the last row skipped)."""
    if TOP_K > 0:
        acc = tl.zeros([BLOCK], tl.float32)
        for k0 in tl.range(0, TOP_K, KG):
            for kk in tl.static_range(KG):
                k = k0 + kk
                i = tl.load(idx_ptr + t64 * TOP_K + k).to(tl.int64)
                w = tl.load(wts_ptr + t64 * TOP_K + k).to(tl.float32)
                ok = (i >= 0) & (i < gemm_rows)
                row = tl.where(ok, i, 0)
                v = tl.load(lat_ptr + row * L + cols, mask=mask & ok, other=0.0).to(tl.float32)
                acc += tl.where(ok, v * w, 0.0)
        out = acc
    else:
        out = tl.load(lat_ptr + t64 * L + cols, mask=mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def _routed_row(
    ws16_ptr,
    ws32_ptr,
    cur,
    t64,
    cols,
    mask,
    deadline,
    max_spins,
    err_ptr,
    herr_ptr,
    R: tl.constexpr,
    L: tl.constexpr,
    FOOT: tl.constexpr,
    BUF: tl.constexpr,
    RT0: tl.constexpr,
    CH: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    GATHER_F32: tl.constexpr,
    USE_TIMER: tl.constexpr,
    HOST_ERR: tl.constexpr,
):
    """The float32 rank sum of row ``t`` at ``cols`` (waiting for every contribution)."""
    if TWO_SHOT:
        owner = cols // CH
        if GATHER_F32:
            base32 = cur.to(tl.int64) * (BUF // 2) + t64 * (FOOT // 2) + (RT0 + L) // 2
            w = _wait32(
                ws32_ptr + base32 + cols, mask, owner, deadline, max_spins, err_ptr, herr_ptr, USE_TIMER, HOST_ERR
            )
            acc = w.to(tl.float32, bitcast=True)
        else:
            base16 = cur.to(tl.int64) * BUF + t64 * FOOT + RT0 + L
            v = _wait16(
                ws16_ptr + base16 + cols, mask, owner, deadline, max_spins, err_ptr, herr_ptr, USE_TIMER, HOST_ERR
            )
            acc = _bits_f32(v)
    else:
        base16 = cur.to(tl.int64) * BUF + t64 * FOOT + RT0
        acc = _sum_sources(
            ws16_ptr + base16, L, cols, mask, deadline, max_spins, err_ptr, herr_ptr, R, BLOCK, USE_TIMER, HOST_ERR
        )
    return acc


@triton.jit
def _norm_input(
    x,
    res_ptr,
    t64,
    cols,
    mask,
    L: tl.constexpr,
    HAS_RES: tl.constexpr,
    FP32_INTERNAL: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """(value entering the norm, its square as summed) for the rank sum ``x``."""
    if HAS_RES:
        x += tl.load(res_ptr + t64 * L + cols, mask=mask, other=0.0).to(tl.float32)
    if FP32_INTERNAL:
        sq = x * x
    else:
        # upstream-compatible: the sum rounded to bf16, each square rounded to bf16
        x = _to_bf16(x, EMULATE).to(tl.float32)
        sq = _to_bf16(x * x, EMULATE).to(tl.float32)
    sq = tl.where(mask, sq, 0.0)
    return x, sq
