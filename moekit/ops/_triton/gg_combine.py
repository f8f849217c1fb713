"""Triton kernel of ``grouped_gemm_combine``: the down projection of a decode batch, combined per
token without atomics.

One program = one token ``t`` and a ``BLOCK_N``-column slice of the output: it reads the sorted
rows of the token's ``K`` choices (``selection_rows[t * K + j]``, the token-major inverse map of
``route_and_shuffle``), their experts and router weights, streams the ``K`` experts' weight
slices ``[K, BLOCK_N, F]`` against the rows of ``z`` on CUDA cores (float32 elementwise
accumulators, as the grouped GEMM's GEMV kernel), reduces over F, weights each choice, sums the K
choices in slot order and adds the result to ``out[t]`` with one plain store. No atomics, no
zero-filled output needed beyond what ``out`` holds, and bitwise reproducible. ``moe_decode``
(``moekit.ops._triton.decode``) launches it ``TOKEN_MAJOR`` (token t's rows are ``t * K + j``)
and, into an empty ``out``, without ``ACCUM`` (stores, no read of ``out``).

For decode (a few tokens, every choice a different expert) this replaces the scatter-add GEMM,
whose per-row programs add into the same output row K times with bf16 atomics (H200, Qwen3-30B
T=1: 18.9 µs for 25 MB of weights, 3x the floor; RESULTS.md session 7).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gg_config import widest_slice


@triton.jit
def _combine_kernel(
    z_ptr,
    w_ptr,
    out_ptr,
    srow_ptr,
    eidx_ptr,
    rw_ptr,
    ws_ptr,
    T,
    N,
    F,
    M,
    G,
    stride_zm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_RW: tl.constexpr,
    HAS_WS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    EVEN_F: tl.constexpr,
    STAGES: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr = False,
    ACCUM: tl.constexpr = True,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    t = pid % T
    nb = pid // T
    slots = tl.arange(0, K_PAD)
    if TOKEN_MAJOR:  # token t's rows are t * K + j (moe_decode: no sorted layout)
        rows = tl.where(slots < K, t.to(tl.int32) * K + slots, -1)
    else:
        rows = tl.load(srow_ptr + t.to(tl.int64) * K + slots, mask=slots < K, other=-1)
    r_ok = (rows >= 0) & (rows < M)
    rows = tl.where(r_ok, rows, 0)
    e = tl.load(eidx_ptr + rows, mask=r_ok, other=0)
    r_ok = r_ok & (e >= 0) & (e < G)
    e = tl.where(r_ok, e, 0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    col = e.to(tl.int64)[:, None] * N + offs_n[None, :]  # [K_PAD, BLOCK_N] weight rows
    cmask = r_ok[:, None] & n_mask[None, :]
    # Epilogue operands first: their latency hides under the weight stream.
    post = tl.where(cmask, 1.0, 0.0)
    if HAS_WS:
        post = post * tl.load(ws_ptr + col, mask=cmask, other=0.0)
    if HAS_RW:
        post = post * tl.load(rw_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    o_ptrs = out_ptr + t.to(tl.int64) * stride_om + offs_n
    prev = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ACCUM:
        prev = tl.load(o_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    w_rows = w_ptr + (col * stride_wn)[:, :, None]
    z_rows = z_ptr + (rows.to(tl.int64) * stride_zm)[:, None]
    acc = tl.zeros((K_PAD, BLOCK_N, BLOCK_F), dtype=tl.float32)
    for f0 in tl.range(0, F, BLOCK_F, num_stages=STAGES):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        if EVEN_F:
            wt = tl.load(w_rows + offs_f[None, None, :], mask=cmask[:, :, None], other=0.0)
            zt = tl.load(z_rows + offs_f[None, :], mask=r_ok[:, None], other=0.0)
        else:
            f_ok = offs_f < F
            wt = tl.load(w_rows + offs_f[None, None, :], mask=cmask[:, :, None] & f_ok[None, None, :], other=0.0)
            zt = tl.load(z_rows + offs_f[None, :], mask=r_ok[:, None] & f_ok[None, :], other=0.0)
        acc += wt.to(tl.float32) * zt.to(tl.float32)[:, None, :]
    y = tl.sum(tl.sum(acc, axis=2) * post, axis=0)
    tl.store(o_ptrs, (prev + y).to(out_ptr.dtype.element_ty), mask=n_mask)


# Knob COMBINE_FEW_4KB: ``combine_config``'s tiles for one or two choices per token (top-1, top-2):
# 4 KB of weights per choice, 512-wide F tiles, 3 stages (True), or session 17's widest slices of
# 8 KB tiles (False). Measured in ``combine_config``'s docstring.
COMBINE_FEW_4KB = True


def combine_config(T: int, N: int, F: int, k_pad: int, w_elem: int, sms: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_F, STAGES)``.

    Four or more choices (H200, session 17, ``sweep_decode.py --alts``, each alternative timed
    twice, the passes within ~0.5 µs; T=1 and T=4 of Qwen3-30B, DeepSeek-V3 TP8, gpt-oss-120b):
    - when 16-column programs make at most one wave (``T * N / 16 <= SMs``: each SM streams one
      program's long run of rows, no tail), 16-bit weights take 16 columns, 128-byte F tiles, 3
      stages (Qwen3-30B bf16 T=1: 26.2 µs against 31.1 for the rule below); FP8 weights, twice the
      values (conversions, FMAs) per byte, want more warps per SM than one 4-warp program: 4
      columns and ``[K, 4, 8192 / (4K)]`` tiles (8 KB), 3 stages, four times the programs
      (Qwen3-30B FP8 T=1 moe_decode, two passes each: 16.8 / 16.9 µs against 17.8 / 17.9 in
      session 19, 17.3 / 17.3 against 18.2 in session 20; 8 warps on 8x128x4 tiles: 17.5 / 17.4);
    - else ``[K, BLOCK_N, BLOCK_F]`` weight tiles of about 8 KB (bf16 top-8: 4 columns, FP8 or
      top-4: 8), 4 stages, at least a wave of programs (FP8 T=1 DeepSeek 24.6 -> 23.4, gpt-oss 46.2
      -> 42.5, T=4 DeepSeek 61.4 -> 56.6 against 4 columns; session 16's rule below lost 5-9 µs).
      ``BLOCK_F`` 128, wider where 8 columns of 128 still make a smaller tile: FP8 top-4 takes
      256 (session 19, two passes each: gpt-oss-120b FP8 T=1 moe_decode 36.2 / 36.1 µs against
      41.5 / 41.2, T=4 108.1 / 107.0 against 112.0 / 112.4; with 8 KB tiles already, 256-wide
      ones lost: Qwen3-30B FP8 T=4 47.2 / 47.7 against 45.9 / 44.8, DeepSeek-V3 TP8 FP8 T=1
      21.4 / 21.5 against 19.0 / 18.9).
    Fewer choices (top-1, top-2; ``COMBINE_FEW_4KB``): 4 KB of weights per choice and tile,
    ``BLOCK_F`` 512 (a power of two dividing F when one of at least 64 does: no masks; else F's
    next power of two, at most 512), ``BLOCK_N`` the columns that fill 4 KB (bf16 4, FP8 8), 3
    stages: many short programs (Scout T=1: 1280 of them, ~10 per SM) in place of two or three
    long ones per SM. H100, session 42 (``sweep_decode.py --tiles``, moe_decode, two passes each,
    µs, the rule before -> this one): Llama 4 Scout bf16 T = 1 / 2 / 4 92.8 / 156.7 / 303.9 ->
    88.1 / 153.7 / 299.9, FP8 54.1 / 85.0 / 156.1 -> 48.2 / 82.5 / 156.7; Mixtral-8x7B bf16 248.5
    / 432.7 / 657.6 -> 234.3 / 415.5 / 614.3, FP8 140.4 / 223.1 / 326.7 -> 122.8 / 212.7 /
    315.6-325.6. 8 columns at bf16 lost (Scout T=1 91.6, Mixtral 241.0), 4 at FP8 lost past T=1
    (Scout T=2 84.3, Mixtral T=1 126.3-127.6). Knob off (session 17's rule, H200: Scout 71 vs 88
    µs for the narrow 128-wide F tiles then): the widest slice (up to 16 columns) that still gives
    about two programs per SM, ``[K, BLOCK_N, BLOCK_F]`` tiles of about 8 KB, about 32 KB of
    weights in flight per program."""
    if k_pad >= 4:
        if T * cdiv(N, 16) <= sms and w_elem > 1:
            return 16, max(16, min(next_pow2(F), 128 // w_elem)), 3
        if T * cdiv(N, 16) <= sms:  # FP8: 4-column programs, 8 KB tiles, 3 stages
            return 4, min(max(16, next_pow2(F)), 8192 // (k_pad * 4)), 3
        # More than a wave of 16-column programs here, so narrower slices make more than one too.
        block_n = min(8, max(1, 8192 // (k_pad * 128 * w_elem)))
        block_f = 128 * max(1, 8192 // (k_pad * block_n * 128 * w_elem))
        return block_n, min(block_f, max(16, next_pow2(F))), 4
    div = F & -F
    if settings.get().knob("COMBINE_FEW_4KB", COMBINE_FEW_4KB):
        block_f = min(512, div) if div >= 64 else min(512, max(16, next_pow2(F)))
        return max(1, min(16, 4096 // (block_f * w_elem))), block_f, 3
    block_n = widest_slice(T, N, sms)
    target = max(16, 4096 // (k_pad * block_n))
    block_f = min(target, div) if div >= 64 else min(target, max(16, next_pow2(F)))
    tile = k_pad * block_n * block_f * w_elem
    stages = 1 + max(2, min(6, (32 * 1024) // tile))
    return block_n, block_f, stages


def grouped_gemm_combine(
    z: torch.Tensor,
    w: torch.Tensor,
    expert_indices: torch.Tensor,
    selection_rows: Optional[torch.Tensor],
    out: torch.Tensor,
    row_weights: Optional[torch.Tensor],
    w_scale: Optional[torch.Tensor],
    config: Optional[tuple[int, ...]] = None,
    top_k: int = 0,
    accumulate: bool = True,
) -> None:
    """Launcher (validated arguments): ``out[t] += sum_j rw[r] * (z[r] @ w_e.T)`` for the rows
    ``r = selection_rows[t * K + j]`` (skipped when negative), ``e = expert_indices[r]``.
    ``selection_rows`` None: token-major rows ``r = t * top_k + j``. ``accumulate`` False:
    ``out[t] =`` (out is not read). ``config``: ``(BLOCK_N, BLOCK_F, STAGES[, warps])`` (default
    ``combine_config``'s, 4 warps)."""
    T, N = (int(d) for d in out.shape)
    M, F = (int(d) for d in z.shape)
    if T == 0 or N == 0:
        return
    K = int(selection_rows.shape[0]) // T if selection_rows is not None else int(top_k)
    k_pad = max(1, next_pow2(K))
    G = int(w.shape[0]) // N
    if G * N >= 2**31:
        raise ValueError(f"grouped_gemm_combine supports G * N below 2**31, got {G * N}")
    cfg = config or combine_config(T, N, F, k_pad, w.element_size(), num_sms(z.device))
    bn, bf, stages = cfg[:3]
    warps = int(cfg[3]) if len(cfg) > 3 else 4
    ph = torch.empty((1,), dtype=torch.float32, device=z.device)
    srow = selection_rows if selection_rows is not None else ph
    launch(_combine_kernel)[(T * cdiv(N, bn),)](
        z, w, out, srow, expert_indices, row_weights if row_weights is not None else ph,
        w_scale if w_scale is not None else ph, T, N, F, M, G, z.stride(0), w.stride(0), out.stride(0),
        K=K, K_PAD=k_pad, HAS_RW=row_weights is not None, HAS_WS=w_scale is not None,
        BLOCK_N=bn, BLOCK_F=bf, EVEN_F=F % bf == 0, STAGES=stages, TOKEN_MAJOR=selection_rows is None,
        ACCUM=bool(accumulate), num_warps=warps, num_stages=stages,
    )  # fmt: skip


__all__ = ["grouped_gemm_combine", "combine_config"]
