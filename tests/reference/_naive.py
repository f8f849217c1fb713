"""Naive formulations used to check the float32 oracles in ``moekit.reference``.

Everything here is written with explicit Python loops over tokens, experts, slots, rows and
ranks, on Python floats (float64), and shares no code with ``moekit.reference``. Where an
oracle specifies a float32 intermediate (FP8 quantization), ``f32`` rounds a float64 result to
float32: for one +, -, * or / of float32 operands, computing in float64 and rounding once gives
exactly the float32 result (53 >= 2 * 24 + 2), so these match the oracle bit for bit.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

NEG_INF = float("-inf")
E4M3_MAX = 448.0


# ----------------------------------------------------------------------------- scalars


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (ties to even)."""
    return float(np.float32(v))


def bf16(v: float) -> float:
    """Round a float32-representable value to the nearest bfloat16 (ties to even), by bits."""
    bits = int(np.float32(v).view(np.uint32))
    if (bits & 0x7F800000) == 0x7F800000:  # inf / nan: truncate
        return float(np.uint32(bits & 0xFFFF0000).view(np.float32))
    lsb = (bits >> 16) & 1
    bits = (bits + 0x7FFF + lsb) & 0xFFFF0000
    return float(np.uint32(bits).view(np.float32))


def sigmoid(v: float) -> float:
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    z = math.exp(v)
    return z / (1.0 + z)


def silu(v: float) -> float:
    return v * sigmoid(v)


def softmax(vals: Sequence[float]) -> list[float]:
    if not vals:
        return []
    m = max(vals)
    ex = [math.exp(v - m) for v in vals]
    tot = sum(ex)
    return [v / tot for v in ex]


def e4m3_round(v: float) -> float:
    """Nearest e4m3fn value of ``v`` (|v| <= 448), ties to even, written from the format's
    definition: 3 mantissa bits, exponent bias 7, subnormal step 2**-9."""
    if v == 0.0:
        return 0.0
    a = abs(v)
    e = max(math.floor(math.log2(a)), -6)
    step = 2.0 ** (e - 3)
    q = round(a / step) * step  # Python's round() is round-half-to-even
    return math.copysign(q, v)


def e4m3_step(v: float) -> float:
    """Spacing of e4m3fn values around magnitude ``|v|``."""
    a = abs(v)
    if a == 0.0:
        return 2.0**-9
    return 2.0 ** (max(math.floor(math.log2(a)), -6) - 3)


# ----------------------------------------------------------------------------- routing


def topk_row(vals: Sequence[float], k: int) -> list[int]:
    """Indices of the k largest values by repeated linear scans; a strictly larger value is
    needed to displace the current best, so ties go to the lower index."""
    chosen: list[int] = []
    for _ in range(k):
        best = -1
        for e, v in enumerate(vals):
            if e in chosen:
                continue
            if best < 0 or v > vals[best]:
                best = e
        chosen.append(best)
    return chosen


def routing(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[list[list[float]], list[list[int]]]:
    """(weights [T][K], ids [T][K]) token by token, in float64."""
    rows = logits_TE.float().tolist()
    b = None if bias is None else bias.float().tolist()
    all_w, all_ids = [], []
    for row in rows:
        E = len(row)
        if score_func == "topk_softmax":
            ids = topk_row(row, top_k)
            w = softmax([row[e] for e in ids])
        else:
            if score_func == "sigmoid":
                s = [sigmoid(v) for v in row]
            else:
                s = softmax(row)
            choice = [s[e] + (b[e] if b is not None else 0.0) for e in range(E)]
            if n_group is not None:
                per = E // n_group
                gscore = []
                for g in range(n_group):
                    members = sorted(choice[g * per : (g + 1) * per], reverse=True)
                    gscore.append(sum(members[: min(2, per)]))
                keep = topk_row(gscore, topk_group)
                choice = [choice[e] if (e // per) in keep else NEG_INF for e in range(E)]
            ids = topk_row(choice, top_k)
            w = [s[e] for e in ids]
        if renormalize:
            tot = sum(w)
            w = [v / tot for v in w]
        all_w.append([v * routed_scaling_factor for v in w])
        all_ids.append(ids)
    return all_w, all_ids


def index_shuffling(
    scores: torch.Tensor,
    top_k: int,
    start: int = 0,
    end: Optional[int] = None,
    valid_token_count: Optional[int] = None,
) -> tuple[list[int], list[int], list[int]]:
    """(token_counts [E + 2], expert_indices [T*K], token_indices [T*K]) with the -1 tail."""
    T, E = scores.shape
    end = E if end is None else end
    rows = scores.float().tolist()
    selections = []
    for t in range(T):
        for slot, e in enumerate(topk_row(rows[t], top_k)):
            token_ok = valid_token_count is None or t < valid_token_count
            if token_ok and start <= e < end:
                selections.append((e, t, slot))
    selections.sort()
    counts = [0] * (E + 2)
    for e, _, _ in selections:
        counts[e] += 1
    counts[E] = T
    counts[E + 1] = len(selections)
    N = T * top_k
    pad = [-1] * (N - len(selections))
    experts = [e - start for e, _, _ in selections] + pad
    tokens = [t for _, t, _ in selections] + pad
    return counts, experts, tokens


# ----------------------------------------------------------------------------- fp8


def quantize_row(row: Sequence[float], eps: float, scale_ub: Optional[float] = None) -> tuple[list[float], float]:
    """Row-wise e4m3 quantization with float32 intermediates: (q values as floats, dequant scale)."""
    amax = 0.0
    for v in row:
        amax = max(amax, abs(v))
    amax = max(amax, f32(eps))
    if scale_ub is not None:
        amax = min(amax, scale_ub)
    inv = f32(E4M3_MAX / amax)
    q = []
    for v in row:
        y = f32(v * inv)
        y = min(max(y, -E4M3_MAX), E4M3_MAX)
        q.append(e4m3_round(y))
    return q, f32(1.0 / inv)


def assert_fp8_within_one_step(out: torch.Tensor, ref: torch.Tensor, max_mismatch_frac: float = 0.01, msg: str = ""):
    """Every element of two e4m3 tensors within one e4m3 step; at most a small fraction differ."""
    a = out.float().reshape(-1).tolist()
    b = ref.float().reshape(-1).tolist()
    assert len(a) == len(b), msg
    bad = 0
    for x, y in zip(a, b):
        if x != y:
            bad += 1
            step = e4m3_step(max(abs(x), abs(y)))
            assert abs(x - y) <= step, f"{msg} fp8 values {x} and {y} are more than one step ({step}) apart"
    assert bad <= max_mismatch_frac * max(len(a), 1), f"{msg} {bad} of {len(a)} fp8 values differ"


# ----------------------------------------------------------------------------- linear algebra


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    acc = 0.0
    for x, y in zip(a, b):
        acc += x * y
    return acc


def matvec(w_rows: Sequence[Sequence[float]], v: Sequence[float]) -> list[float]:
    """``[dot(w_row, v) for each row]``: ``w @ v`` for a row-major matrix."""
    return [dot(r, v) for r in w_rows]


def swiglu(x: Sequence[float], w13: Sequence[Sequence[float]], w2: Sequence[Sequence[float]]) -> list[float]:
    """One SwiGLU expert on one token: gate rows over up rows in ``w13`` ``[2F][D]``, ``w2`` ``[D][F]``."""
    h = matvec(w13, x)
    F = len(h) // 2
    z = [silu(h[j]) * h[F + j] for j in range(F)]
    return matvec(w2, z)


# ----------------------------------------------------------------------------- errors


def assert_raises_naming(call, exc: type, name: str) -> None:
    """``call()`` raises ``exc`` whose message names ``name`` as a whole word."""
    import re

    try:
        call()
    except exc as err:
        msg = str(err)
        assert re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", msg), f"message does not name {name!r}: {msg}"
        assert len(msg) > len(name) + 10, f"message too terse: {msg}"
        return
    raise AssertionError(f"expected {exc.__name__} naming {name!r}, nothing raised")
