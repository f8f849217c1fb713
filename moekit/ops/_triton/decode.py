"""Triton kernels of ``moe_decode``: one decode step of the routed experts from router logits in
two launches, with no routing launch and no sorted layout.

1. ``_decode_swiglu_kernel``: program ``(m, nb)`` owns row ``m = t * K + j`` (token t's j-th
   choice: token-major, nothing sorted) and a ``BLOCK_N`` slice of the SwiGLU output ``z [T*K,
   F]``. It routes token t itself (``route._select_topk``, the routing launch's own code: the
   same experts; the weights within float32 rounding, reduced in another thread layout), then
   streams the chosen expert's gate and up rows against ``x[t]`` (``gg_swiglu._gemv_pair``) and
   stores ``silu(gate) * up``. The ``nb == 0`` programs store the choice (expert ``ids [T*K]``
   int32, weight ``rw [T*K]`` float32) for launch 2.
2. ``gg_combine._combine_kernel`` launched token-major: token t's K rows ``t * K + j`` through
   their experts' down weights, weighted and summed in slot order, stored (or added) into
   ``out[t]`` with one plain store.

Routing in every GEMV program costs each program rounds of row reductions over the E logits
before its weight stream starts (lazy: up to its own slot), against the routing launch and its
gap on the decode critical path (H200, session 18, T=1: Qwen3-30B bf16 24.6 µs against the sorted
decode pipeline's 28.4, FP8 17.8 vs 18.8, gpt-oss-120b FP8 40.9 vs 45.0; session 16's FP8 loss
came from a GEMV grid of 1.45 waves, each wave paying its routing;
``moekit.layers.experts.decode_fused``).
In the interpreter the sorted decode pipeline's kernels give the same bits (the same products,
the same slot order).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moekit import settings
from moekit.ops._common import cdiv, launch, next_pow2, num_sms
from moekit.ops._triton._pdl import pdl_prologue
from moekit.ops._triton.gg_combine import grouped_gemm_combine
from moekit.ops._triton.gg_swiglu import _gate_up_scales, _gemv_pair, _swiglu_store, swiglu_gemv_config
from moekit.ops._triton.route_select import SCORE_CODES, _select_topk


@triton.jit(do_not_specialize=["T"])
def _decode_swiglu_kernel(
    x_ptr,
    logits_ptr,
    bias_ptr,
    w_ptr,
    ws_ptr,
    z_ptr,
    ids_ptr,
    rw_ptr,
    T,
    E,
    F,
    D,
    stride_xm,
    stride_lt,
    stride_le,
    stride_wn,
    stride_zm,
    scale,
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    NG: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    WEIGHT_IN: tl.constexpr,
    HAS_WS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    LAZY: tl.constexpr = False,
    ROWS: tl.constexpr = 1,
    PERM_S: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    M = T * TOPK
    m = pid % M
    nb = pid // M
    t = m // TOPK
    j = m % TOPK
    x_row = x_ptr + t.to(tl.int64) * stride_xm
    # The token's choice, as the routing launch makes it (one row of its [BT, BLOCK_E] tiles), on
    # ROWS copies of the row (``route_rows``: one per warp, the rounds' reductions warp-local).
    cols = tl.arange(0, BLOCK_E)
    if PERM_S > 0:
        # Two halves of a warp's width each (whole 16-byte vectors), joined: half h's c-th value in
        # column 2c + h. Half 0 holds the first PERM_S of every 2 * PERM_S experts, half 1 the next
        # PERM_S, so an expert group (or the whole row) keeps one block of columns.
        c = tl.arange(0, BLOCK_E // 2)
        lo = (c // PERM_S) * (2 * PERM_S) + c % PERM_S  # half 0's experts (half 1: + PERM_S)
        cols = tl.reshape(tl.join(lo, lo + PERM_S), [BLOCK_E])  # each column's expert
    col_ok = cols < E
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOPK
    row_ok = tl.full((ROWS,), 1, tl.int1)
    bias = tl.zeros([BLOCK_E], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    reps = tl.zeros([ROWS, 1], dtype=tl.int32)
    if PERM_S > 0:
        row = logits_ptr + t.to(tl.int64) * stride_lt + (reps + lo[None, :]) * stride_le
        l = tl.join(tl.load(row, mask=(lo < E)[None, :], other=0.0),
                    tl.load(row + PERM_S * stride_le, mask=(lo + PERM_S < E)[None, :], other=0.0))  # fmt: skip
        l = tl.reshape(l, [ROWS, BLOCK_E])
    else:
        l = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + (reps + cols[None, :]) * stride_le,
                    mask=col_ok[None, :], other=0.0)  # fmt: skip
    if LAZY:  # the weights (all K rounds) where stored or used; elsewhere rounds up to the own slot
        need_w = (nb == 0) | WEIGHT_IN
        _, _, ids, w, _ = _select_topk(l.to(tl.float32), cols, col_ok, bias, slots, slot_ok, row_ok, scale, TOPK,
                                       SCORE, HAS_BIAS, RENORM, NG, TOPK_GROUP, ROWS, BLOCK_E,
                                       tl.where(need_w, TOPK - 1, j), need_w, PERM_S)  # fmt: skip
    else:
        _, _, ids, w, _ = _select_topk(l.to(tl.float32), cols, col_ok, bias, slots, slot_ok, row_ok, scale, TOPK,
                                       SCORE, HAS_BIAS, RENORM, NG, TOPK_GROUP, ROWS, BLOCK_E, TOPK - 1,
                                       True, PERM_S)  # fmt: skip
    mine = (slots[None, :] == j) & (tl.arange(0, ROWS)[:, None] == 0)
    g = tl.sum(tl.where(mine, ids, 0))
    wj = tl.sum(tl.where(mine, w, 0.0))
    if nb == 0:
        tl.store(ids_ptr + m, g)
        tl.store(rw_ptr + m, wj)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    gate = g.to(tl.int64) * 2 * F + offs_n
    up = gate + F
    ws_g, ws_u = _gate_up_scales(ws_ptr, gate, up, n_mask, HAS_WS, BLOCK_N)
    rs = tl.full((1,), 1.0, tl.float32)
    if WEIGHT_IN:
        rs = wj + rs * 0.0
    hg, hu = _gemv_pair(w_ptr + gate[:, None] * stride_wn, w_ptr + up[:, None] * stride_wn, x_row, n_mask, D,
                        BLOCK_N, BLOCK_K, EVEN_K, STAGES)  # fmt: skip
    offs_m = m + tl.zeros((1,), tl.int32)
    _swiglu_store(hg, hu, offs_m, offs_m >= 0, offs_n, n_mask, z_ptr, stride_zm, rs, ws_g, ws_u, rs,
                  False, HAS_WS, WEIGHT_IN)  # fmt: skip


# Knob DECODE_ROUTE_ROWS (off until timed): each of the GEMV program's warps routes the token on
# its own copy of the logits row (``route_rows``), so the top-k rounds' row reductions stay in a
# warp (shuffles) instead of crossing the 4 warps through shared memory and a block barrier each.
# A row wider than a warp's 32 16-byte vectors (float32 logits of 256 experts, bf16 of 512) is
# loaded as two halves joined column by column (``PERM_S``): Triton's layout of a plain load caps
# a thread at one 16-byte vector and splits such a row over two warps. sm_90 SASS of the first
# launch at T=1 (FP8 weights; block barriers ahead of the first weight copy, one row -> a row per
# warp): Qwen3-30B 36 -> 4, DeepSeek-V3 TP8 (grouped, with a bias) 54 -> 8 with bf16 logits and
# 56 -> 8 with float32 (halves), gpt-oss-120b 18 -> 4, 256 float32 logits without groups 38 -> 4,
# 512 bf16 50 -> 10; no more registers. Not for float32 logits of 512 experts (four warps' width)
# nor below 32 experts (one warp holds the row already). Predicted: the routing ahead of every
# program's weight stream ~1-2 µs shorter at T=1 (32-48 fewer barrier round trips of ~60-100
# cycles), less at T=4 (more programs than one wave, whose routing overlaps other programs'
# streams). Built in session 50 on the CPU (the interpreter gives the same bits). Measured level
# (H100, session 51, bench_layer.py --lean --quick --models qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-tp8
# --tokens 1,4 --dtype fp8,bf16 --alt-knobs DECODE_ROUTE_ROWS=1, one process, knob on / off:
# 0.987-1.007; Qwen3-30B FP8 T=1 20.3 / 20.1 -> 20.2 / 20.0 µs, T=4 55.1 / 55.0 -> 54.7 / 53.9,
# DeepSeek-V3 TP8 bf16 T=1 35.9 / 36.2 -> 36.3 / 36.3): the barriers cost ~0.1-0.2 µs, not the
# predicted 1-2, so the routing is not what holds the first launch (as session 30 found for the
# top-k rounds). Off: the first launch's sm_90 SASS is the one before the knob, instruction for
# instruction.
DECODE_ROUTE_ROWS = False


def route_rows(E: int, logits: torch.Tensor, warps: int, n_group: Optional[int] = None) -> tuple[int, int]:
    """``(ROWS, PERM_S)`` of the first launch: the copies of the token's logits row it routes on
    (one per warp where Triton's layout of the ``[warps, BLOCK_E]`` load gives each warp a whole
    row: 16-byte vectors across its 32 lanes, rows contiguous and 16-byte aligned, ``32 <= BLOCK_E
    <= 32 * vector``; else one) and, for a row of two warps' width (float32 logits of 256 experts,
    bf16 of 512), the width ``S`` of the blocks of experts it loads as two halves and joins (whole
    16-byte vectors: ``S >= vector``; half a group where experts are grouped), else 0. Knob
    ``DECODE_ROUTE_ROWS`` False: ``(1, 0)``."""
    if not settings.get().knob("DECODE_ROUTE_ROWS", DECODE_ROUTE_ROWS):
        return 1, 0
    vec = 16 // logits.element_size()
    block_e = max(16, next_pow2(E))
    whole = logits.stride(1) == 1 and E % vec == 0 and (logits.stride(0) % vec == 0 or logits.shape[0] == 1)
    if not whole or block_e < 32:
        return 1, 0
    if block_e <= 32 * vec:
        return warps, 0
    half = (block_e // (n_group or 1)) // 2  # S: half a group (the row's half without groups)
    if block_e == 64 * vec and half >= vec:
        return warps, half
    return 1, 0


def decode_swiglu_config(M: int, F: int, D: int, w_elem: int, sms: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, STAGES, warps)`` of the routing GEMV for ``M`` rows: the gate/up
    GEMV's (``gg_swiglu.swiglu_gemv_config``)."""
    cfg = swiglu_gemv_config(M, F, D, w_elem, sms)
    return cfg.block_n, cfg.block_k, cfg.stages, cfg.warps


def decode_swiglu(
    x: torch.Tensor,
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    w13: torch.Tensor,
    w13_scale: Optional[torch.Tensor],
    F: int,
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    scale: float,
    weight_on_input: bool,
    config: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch 1: ``(z [T*K, F], ids [T*K] int32, rw [T*K] float32)``, token-major rows.
    ``config``: ``(BLOCK_N, BLOCK_K, STAGES, warps[, lazy])``; ``lazy`` (default True): each
    program runs the routing rounds up to its own slot only and normalizes the weights only where
    it stores or uses them (the same bits). H200, session 18, moe_decode at T=1, two passes each:
    lazy 1.2-2.0 µs faster in 10 of 12 (model, tile) pairs (Qwen3-30B bf16 24.8 vs 26.3, DeepSeek-V3
    TP8 bf16 28.6 vs 29.9, gpt-oss-120b bf16 57.4 vs 59.0, Qwen3 FP8 19.6 vs 20.8), level in two."""
    T, D = (int(d) for d in x.shape)
    E = int(logits.shape[1])
    M = T * top_k
    dev = x.device
    z = torch.empty((M, F), dtype=x.dtype, device=dev)
    ids = torch.empty((M,), dtype=torch.int32, device=dev)
    rw = torch.empty((M,), dtype=torch.float32, device=dev)
    if M == 0:
        return z, ids, rw
    cfg = config or decode_swiglu_config(M, F, D, w13.element_size(), num_sms(dev))
    bn, bk, stages, warps = cfg[:4]
    lazy = bool(cfg[4]) if len(cfg) > 4 else True
    rows, perm_s = route_rows(E, logits, warps, n_group)
    ph = torch.empty((1,), dtype=torch.float32, device=dev)
    launch(_decode_swiglu_kernel)[(M * cdiv(F, bn),)](
        x, logits, bias if bias is not None else ph, w13, w13_scale if w13_scale is not None else ph, z, ids, rw,
        T, E, F, D, x.stride(0), logits.stride(0), logits.stride(1), w13.stride(0), z.stride(0), float(scale),
        TOPK=top_k, K_PAD=next_pow2(top_k), SCORE=SCORE_CODES[score_func], HAS_BIAS=bias is not None,
        RENORM=bool(renormalize), NG=1 if n_group is None else int(n_group), TOPK_GROUP=int(topk_group or 1),
        BLOCK_E=max(16, next_pow2(E)), WEIGHT_IN=bool(weight_on_input), HAS_WS=w13_scale is not None,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=D % bk == 0, STAGES=stages, LAZY=lazy, ROWS=rows, PERM_S=perm_s, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return z, ids, rw


def moe_decode(
    x: torch.Tensor,
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    out: torch.Tensor,
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    scale: float,
    weight_on_input: bool,
    accumulate: bool,
    swiglu_cfg: Optional[tuple] = None,
    combine_cfg: Optional[tuple[int, ...]] = None,
) -> None:
    """Launcher (validated arguments; ``route.kernel_supports`` sizes): ``w13 [E * 2F, D]``, ``w2
    [E * D, F]`` (16-bit, or FP8 with flat row scales: weight-only FP8), ``out [T, D]``
    contiguous. ``swiglu_cfg`` / ``combine_cfg``: the two launches' configurations (tuning
    aids; default ``decode_swiglu_config`` / ``gg_combine.combine_config``)."""
    if x.shape[0] * top_k == 0:
        return
    z, ids, rw = decode_swiglu(x, logits, bias, w13, w13_scale, int(w2.shape[1]), top_k, score_func, renormalize,
                               n_group, topk_group, scale, weight_on_input, swiglu_cfg)  # fmt: skip
    grouped_gemm_combine(z, w2, ids, None, out, None if weight_on_input else rw, w2_scale, config=combine_cfg,
                         top_k=top_k, accumulate=accumulate)  # fmt: skip


__all__ = ["moe_decode", "decode_swiglu", "decode_swiglu_config"]
