"""The routing's selection step, shared by ``route_and_shuffle``'s kernels (``route``) and
``moe_decode``'s routing GEMV (``decode``): a tile of router logits to each token's top-k experts
and their weights (score function, correction bias, DeepSeek's group mask, unique integer keys
and K rounds of "largest key below the previous one", the weights' normalization)."""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops._triton.routing import _row_below, _score_keys

SCORE_CODES = {"sigmoid": 0, "softmax": 1, "topk_softmax": 2}


@triton.jit
def _scores(l, col_ok, bias, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(selection values, weight source) of a logits tile; padding columns select as -inf."""
    if SCORE == 0:
        s = tl.sigmoid(l)
    elif SCORE == 1:
        lm = tl.where(col_ok[None, :], l, float("-inf"))
        e = tl.exp(lm - tl.max(lm, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    else:
        s = l
    c = s
    if HAS_BIAS:
        c = s + bias[None, :]
    c = tl.where(col_ok[None, :], c, float("-inf"))
    return c, s


@triton.jit
def _group_mask(c, BT: tl.constexpr, NG: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """DeepSeek's grouped top-k: keep the ``TOPK_GROUP`` groups (of ``GP`` contiguous experts)
    with the largest sums of their top two values (ties to the lower group), -inf elsewhere."""
    c3 = tl.reshape(c, [BT, NG, GP])
    m1 = tl.max(c3, axis=2)
    if GP == 1:
        gs = m1
    else:
        iota = tl.arange(0, GP)[None, None, :]
        first = tl.min(tl.where(c3 == m1[:, :, None], iota, GP), axis=2)
        m2 = tl.max(tl.where(iota == first[:, :, None], float("-inf"), c3), axis=2)
        gs = m1 + m2
    giota = tl.arange(0, NG)[None, :]
    keep = giota < 0
    for _ in tl.static_range(TOPK_GROUP):
        cand = tl.where(keep, float("-inf"), gs)
        mx = tl.max(cand, axis=1)
        pick = tl.min(tl.where(cand == mx[:, None], giota, NG), axis=1)
        keep = keep | (giota == pick[:, None])
    keep3 = tl.broadcast_to(keep[:, :, None], [BT, NG, GP])
    return tl.where(tl.reshape(keep3, [BT, NG * GP]), c, float("-inf"))


@triton.jit
def _select_topk(l, cols, col_ok, bias, slots, slot_ok, row_ok, scale, K: tl.constexpr, SCORE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 BT: tl.constexpr, BLOCK_E: tl.constexpr, last, weights, PERM_S: tl.constexpr = 0):  # fmt: skip
    """A ``[BT, BLOCK_E]`` float32 logits tile to each token's choice: ``(key, thr, ids, w, ok)``,
    the unique selection keys, the K-th largest key per row (``key >= thr``: the chosen experts),
    the experts ``[BT, K_PAD]`` in slot order (value descending, expert ascending; 0 where not
    ``ok``), their float32 weights (normalized, scaled) and the valid (row, slot) mask. Shared by
    the routing launch and the fused decode GEMV (``moekit.ops._triton.decode``). ``last``: the
    last slot to find (``K - 1``: all; the decode GEMV may stop at its own, the later slots then
    0 and ``thr`` that slot's key); ``weights`` False: the raw gathered scores, not normalized.
    ``PERM_S`` = S > 0: the tile's columns are the decode GEMV's two joined halves, not the experts
    in order: column ``2c + h`` holds expert ``(c // S) * 2S + c % S + h * S`` (``cols`` gives each
    column's expert, which the keys and so ``ids`` carry; the weights are gathered by column)."""
    c, s = _scores(l, col_ok, bias, SCORE, HAS_BIAS)
    if NG > 1:
        c = _group_mask(c, BT, NG, BLOCK_E // NG, TOPK_GROUP)
    key = _score_keys(c, cols, True)
    # K rounds of "largest key below the previous one"; slot j gets round j's expert.
    thr = tl.max(key, axis=1)
    ids = tl.where(slots[None, :] == 0, (65535 - (thr & 65535)).to(tl.int32)[:, None], 0)
    for j in tl.static_range(1, K):
        if j <= last:
            thr = _row_below(key, key, key, thr, 1, True)
            ids = tl.where(slots[None, :] == j, (65535 - (thr & 65535)).to(tl.int32)[:, None], ids)
    ok = row_ok[:, None] & slot_ok[None, :]
    ids = tl.where(ok, ids, 0)
    pos = ids
    if PERM_S > 0:  # each chosen expert's column
        r = ids % (2 * PERM_S)
        pos = ids - r + 2 * (r % PERM_S) + r // PERM_S
    w = tl.gather(s, pos, 1)
    if weights:
        if SCORE == 2:  # softmax over the k logits (the first slot holds their max)
            w0 = tl.sum(tl.where(slots[None, :] == 0, w, 0.0), axis=1)
            w = tl.where(slot_ok[None, :], tl.exp(w - w0[:, None]), 0.0)
            w = w / tl.sum(w, axis=1)[:, None]
        if RENORM:
            w = tl.where(slot_ok[None, :], w, 0.0)
            w = w / tl.sum(w, axis=1)[:, None]
        w = (w * scale).to(tl.float32)
    return key, thr, ids, w.to(tl.float32), ok
