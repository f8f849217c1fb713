"""Routing ops: ``index_shuffling`` (MSLK ``torch.ops.mslk.index_shuffling`` API),
``route_and_shuffle`` (router logits -> score function -> top-k -> weights and the sorted row
layout, fused) and ``shuffle_top_k`` (the sorted row layout of a top-k choice made elsewhere).

Each public function validates its arguments, then calls its registered op
(``torch.ops.moekit.index_shuffling``, ``torch.ops.moekit.route_and_shuffle``), which runs the
Triton kernels on CUDA tensors and the float32 reference (``moekit.reference.routing``) on CPU
tensors. ``dense_route`` is the same routing as plain torch ops on dense ``[T, E]`` tensors (the
path of batches too large for the one-launch kernel).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.library import triton_op

from moekit import settings
from moekit._validate import INDEX_DTYPES, check_int, check_optional_count, check_tensor, expert_range
from moekit.ops._common import call_op, use_triton
from moekit.reference import routing as _ref
from moekit.reference.routing import SCORE_FUNCS

__all__ = [
    "index_shuffling",
    "route_and_shuffle",
    "shuffle_top_k",
    "dense_route",
    "check_routing_options",
    "SCORE_DTYPES",
]

SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Routing options (shared by RoutingConfig, MoEArgs and the ops)
# ----------------------------------------------------------------------------------------------


def check_routing_options(
    top_k: object,
    score_func: object,
    renormalize: object,
    n_group: object,
    topk_group: object,
    routed_scaling_factor: object,
    num_experts: Optional[int] = None,
) -> None:
    """Validate routing options (and, given ``num_experts``, their fit with it); raises
    ``TypeError`` / ``ValueError`` naming the option."""
    check_int("top_k", top_k, lo=1)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float, got {type(routed_scaling_factor).__name__}")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor}")
    if (n_group is None) != (topk_group is None):
        raise ValueError(f"n_group and topk_group go together, got n_group={n_group}, topk_group={topk_group}")
    if n_group is not None:
        check_int("n_group", n_group, lo=1)
        check_int("topk_group", topk_group, lo=1, hi=n_group)
        if score_func == "topk_softmax":
            raise ValueError("score_func='topk_softmax' does not take n_group / topk_group (grouped routing)")
    if num_experts is None:
        return
    check_int("top_k", top_k, lo=1, hi=num_experts)
    if n_group is not None:
        if num_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide the number of experts ({num_experts})")
        allowed = topk_group * (num_experts // n_group)
        if top_k > allowed:
            raise ValueError(
                f"top_k ({top_k}) must be <= topk_group * experts per group ({topk_group} * "
                f"{num_experts // n_group} = {allowed})"
            )


def check_correction_bias(bias: object, score_func: str, E: int, device: torch.device) -> None:
    """``e_score_correction_bias``: None, or ``[E]`` scores (not with ``topk_softmax``)."""
    if bias is None:
        return
    if score_func == "topk_softmax":
        raise ValueError("score_func='topk_softmax' does not take e_score_correction_bias")
    check_tensor("e_score_correction_bias", bias, dtype=SCORE_DTYPES, shape=(E,), device=device)


def dense_route(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selection scores [T, E], weights [T, E])`` in float32, with static-shape torch ops.

    The top-k of the selection scores (ties to the lower index) are the chosen experts; the weight
    of a chosen (token, expert) pair is read from the second tensor (``routing_weights``'s
    contract, options already validated)."""
    logits = logits_TE.float()
    T, E = logits.shape
    k = top_k
    if score_func == "topk_softmax":
        # softmax over the selected k: exp(l - max) / sum over the top-k of exp(l - max).
        top = torch.topk(logits, k, dim=-1).values
        ex = torch.exp(logits - top[:, :1])
        weights = ex / torch.exp(top - top[:, :1]).sum(dim=-1, keepdim=True)
        return logits, weights * routed_scaling_factor
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
    if n_group is not None:
        G = n_group
        per = E // G
        top2 = torch.topk(choice.view(T, G, per), min(2, per), dim=-1).values.sum(dim=-1)
        gids = torch.topk(top2, topk_group, dim=-1).indices
        gmask = torch.zeros(T, G, dtype=torch.bool, device=logits.device).scatter_(1, gids, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(per, dim=1), float("-inf"))
    weights = scores
    if renormalize:
        ids = torch.topk(choice, k, dim=-1).indices
        weights = scores / scores.gather(1, ids).sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return choice, weights


def _warn_reference_e(op: str, E: int, max_kernel_e: int) -> None:
    """The CUDA op ``op`` hands index_shuffling of ``E`` experts to the PyTorch reference: said
    once per op and process (a warning; not while torch.compile traces)."""
    from moekit.ops._common import warn_once

    warn_once(f"{op}-reference-E", f"moekit.{op}: E={E} experts is past the index_shuffling kernels' limit of "
              f"{max_kernel_e}; the PyTorch reference serves it on CUDA (slower; no host sync either)")  # fmt: skip


@triton_op("moekit::index_shuffling", mutates_args=())
def _index_shuffling_op(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    top_k: int = 1,
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(routing_scores):
        from moekit.ops._triton import routing as _tri

        max_e = settings.get().knob("MAX_KERNEL_E", _tri.MAX_KERNEL_E)
        if routing_scores.shape[1] <= max_e:
            return _tri.index_shuffling(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)
        _warn_reference_e("index_shuffling", routing_scores.shape[1], max_e)
    return _ref.index_shuffling(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)


def _check(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int],
    expert_index_end: Optional[int],
    valid_token_count: Optional[torch.Tensor],
    top_k: int,
) -> None:
    check_tensor("routing_scores", routing_scores, dtype=SCORE_DTYPES, ndim=2)
    T, E = routing_scores.shape
    if E < 1:
        raise ValueError(f"routing_scores must have at least one expert column, got shape {(T, E)}")
    check_int("top_k", top_k, lo=1, hi=E)
    expert_range(E, expert_index_start, expert_index_end, start_name="expert_index_start", end_name="expert_index_end")
    check_optional_count("valid_token_count", valid_token_count, routing_scores.device)
    if T * top_k >= 2**31:
        raise ValueError(
            f"routing_scores rows * top_k must be < 2**31 (int32 row indices), got {T} * {top_k} = {T * top_k}"
        )


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused top-k + per-expert count + stable sort of the routed rows, deterministic.

    ``routing_scores`` ``[T, E]`` bf16 / fp16 / fp32, any strides (row- or column-major). No
    score function is applied: the top-``top_k`` of the given values per token are selected,
    ties going to the lower expert index (NaN ranks above +inf, -0.0 ties with +0.0, as in
    ``torch.sort``). Tokens ``t >= valid_token_count[0]`` (a 1-element int32/int64 device
    tensor) are ignored. Only experts in ``[expert_index_start, expert_index_end)`` (default: all)
    produce rows.

    Returns three int32 tensors on the scores' device:

    1. ``token_counts`` ``[E + 2]``: rows per expert (0 outside the range), then ``T``, then the
       number of valid rows ``V``.
    2. ``expert_indices`` ``[T * top_k]``: each row's expert minus ``expert_index_start``.
    3. ``token_indices`` ``[T * top_k]``: each row's token.

    Rows ``r < V`` are sorted by ``(expert, token)`` (bitwise reproducible, unlike MSLK which
    orders an expert's rows by atomic arrival); rows ``r >= V`` hold ``-1`` in both index outputs.
    Accepts any ``E`` and any ``1 <= top_k <= E``. The kernels take ``E <= 4096``
    (``moekit.ops._triton.routing.MAX_KERNEL_E``); beyond, CUDA tensors are served by the PyTorch
    reference (slower, also sync-free), with a ``UserWarning`` the first time in the process. No
    host synchronization; CUDA-graph capturable.
    """
    _check(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)
    return call_op(_index_shuffling_op, routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)


# ----------------------------------------------------------------------------------------------
# route_and_shuffle
# ----------------------------------------------------------------------------------------------


def _quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """``quantize_fp8_row(x)`` (default eps) written into ``q`` / ``s``: the paths that do not
    quantize inside the routing launch."""
    from moekit.ops.quantize import quantize_fp8_row

    xq, xs = quantize_fp8_row(x)
    q.copy_(xq)
    s.copy_(xs)


@triton_op("moekit::route_and_shuffle", mutates_args=("zero_buffer", "quant_out", "quant_scale_out"))
def _route_and_shuffle_op(
    logits_TE: torch.Tensor,
    e_score_correction_bias: Optional[torch.Tensor],
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    routed_scaling_factor: float,
    expert_index_start: int,
    expert_index_end: int,
    zero_buffer: Optional[torch.Tensor],
    # No defaults: torch 2.11's ADInplaceOrView kernel indexes a mutated argument in the call's
    # arguments, where a trailing defaulted one may be missing (IndexError under torch.compile).
    quant_rows: Optional[torch.Tensor],
    quant_out: Optional[torch.Tensor],
    quant_scale_out: Optional[torch.Tensor],
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    quant = (quant_rows, quant_out, quant_scale_out) if quant_rows is not None else None
    if use_triton(logits_TE):
        from moekit.ops._triton import route as _route
        from moekit.ops._triton import routing as _tri

        T, E = logits_TE.shape
        if _route.kernel_supports(T, E, top_k, n_group):
            ride = quant is not None and _route.quant_rides(T, E, top_k, *quant_rows.shape)
            if quant is not None and not ride:
                _quantize_into(*quant)
            return _route.route_and_shuffle(
                logits_TE, e_score_correction_bias, top_k, score_func, renormalize, n_group, topk_group,
                routed_scaling_factor, expert_index_start, expert_index_end, zero_buffer, quant if ride else None,
            )  # fmt: skip
        # Batches past the kernels: dense scores (torch ops), index_shuffling's kernels,
        # one gather of the sorted rows' weights.
        sel, weights = dense_route(
            logits_TE, top_k, score_func, renormalize, n_group, topk_group, e_score_correction_bias,
            routed_scaling_factor,
        )  # fmt: skip
        max_e = settings.get().knob("MAX_KERNEL_E", _tri.MAX_KERNEL_E)
        if E <= max_e:
            counts, eidx, tidx = _tri.index_shuffling(sel, expert_index_start, expert_index_end, None, top_k)
        else:
            _warn_reference_e("route_and_shuffle", E, max_e)
            counts, eidx, tidx = _ref.index_shuffling(sel, expert_index_start, expert_index_end, None, top_k)
        ok = tidx >= 0
        rw = weights[tidx.clamp(min=0).long(), (eidx.clamp(min=0) + expert_index_start).long()]
        # The token-major inverse map through a dense table of rows (-1: no row; the tail's rows
        # land in a spare last token row).
        table = torch.full((T + 1, E), -1, dtype=torch.int32, device=tidx.device)
        rows = torch.arange(tidx.shape[0], dtype=torch.int32, device=tidx.device)
        table[torch.where(ok, tidx, T).long(), (eidx.clamp(min=0) + expert_index_start).long()] = rows
        table[T] = -1
        sel_ids = torch.topk(sel, top_k, dim=-1).indices  # (token, slot) -> expert, slots by score
        srow = table[:T].gather(1, sel_ids).reshape(-1)
        if zero_buffer is not None:
            zero_buffer.zero_()
        if quant is not None:
            _quantize_into(*quant)
        return counts, eidx, tidx, torch.where(ok, rw, 0.0), srow
    if quant is not None:
        _quantize_into(*quant)
    out = _ref.route_and_shuffle(
        logits_TE, top_k, score_func, renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
        expert_index_start=expert_index_start, expert_index_end=expert_index_end,
    )  # fmt: skip
    if zero_buffer is not None:
        zero_buffer.zero_()
    return out


def route_and_shuffle(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    *,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    zero_buffer: Optional[torch.Tensor] = None,
    quantize: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits to the sorted row layout, fused: score function, top-k, weights, counts
    and ``index_shuffling``'s (expert, token)-sorted rows, for ``E <= 512``, ``top_k <= 16``: one
    launch up to ``settings.route_fused_max_t`` tokens (8), two or three beyond (blocks of
    tokens side by side, a column scan of their counts when there are many, then the placement;
    any batch size); past the kernels' sizes (E > 512, top_k > 16, non-power-of-two expert
    groups) a few launches (dense scores, then ``index_shuffling``). An output ``zero_buffer``
    is zeroed by extra programs of the routing launch, or by a memset when large.

    Routing options are ``moekit.reference.routing_weights``'s (``score_func`` sigmoid / softmax /
    topk_softmax, ``renormalize``, DeepSeek grouped top-k ``n_group`` / ``topk_group``,
    ``e_score_correction_bias [E]`` for selection, ``routed_scaling_factor``); ``logits_TE``
    ``[T, E]`` bf16 / fp16 / fp32, any strides. Returns ``(token_counts [E + 2], expert_indices
    [T * top_k], token_indices [T * top_k])`` exactly as ``index_shuffling`` of the chosen experts
    (int32, deterministic), ``row_weights [T * top_k]`` float32: row r's routing weight (0 in
    the -1 tail), and ``selection_rows [T * top_k]`` int32: the sorted row of token t's j-th choice
    at ``t * top_k + j`` (-1 when it produced no row), the token-major inverse map. ``zero_buffer`` (optional, contiguous) is set to zeros by the same launch: the
    output the down GEMM adds into needs no memset of its own.

    ``quantize=(x, x_fp8, x_scale)`` writes ``quantize_fp8_row(x)`` (``x [R, D]`` bf16 / fp16 /
    fp32 with a unit last stride, default eps) into ``x_fp8 [R, D]`` float8_e4m3fn and ``x_scale
    [R]`` float32 (contiguous), the same bits: by extra programs of the routing launch where that
    pays (``quantize_rides``), else by a launch of its own. Past ``E = 4096`` the
    ``index_shuffling`` step on CUDA is the PyTorch reference's (a ``UserWarning``, once per
    process). No host synchronization; CUDA-graph capturable.
    """
    check_tensor("logits_TE", logits_TE, dtype=SCORE_DTYPES, ndim=2)
    T, E = logits_TE.shape
    if E < 1:
        raise ValueError(f"logits_TE must have at least one expert column, got shape {(T, E)}")
    check_routing_options(top_k, score_func, renormalize, n_group, topk_group, routed_scaling_factor, E)
    start, end = expert_range(
        E, expert_index_start, expert_index_end, start_name="expert_index_start", end_name="expert_index_end"
    )
    check_correction_bias(e_score_correction_bias, score_func, E, logits_TE.device)
    if zero_buffer is not None:
        check_tensor("zero_buffer", zero_buffer, device=logits_TE.device, contiguous=True)
    if T * top_k >= 2**31:
        raise ValueError(f"logits_TE rows * top_k must be < 2**31, got {T} * {top_k} = {T * top_k}")
    qx, qq, qs = _check_quantize(quantize, logits_TE.device)
    return call_op(
        _route_and_shuffle_op, logits_TE, e_score_correction_bias, top_k, score_func, renormalize, n_group, topk_group,
        float(routed_scaling_factor), start, end, zero_buffer, qx, qq, qs,
    )  # fmt: skip


def quantize_rides(logits_TE: torch.Tensor, top_k: int, n_group: Optional[int], rows: int, cols: int) -> bool:
    """Whether ``route_and_shuffle(logits_TE, top_k, ..., quantize=...)`` quantizes ``[rows, cols]``
    token rows inside its routing launch (the kernels' sizes, where riding pays); elsewhere the
    ``quantize`` outputs are filled by a launch of their own, which a caller that would quantize
    anyway can as well run itself."""
    if not use_triton(logits_TE):
        return False
    from moekit.ops._triton import route as _route

    T, E = logits_TE.shape
    return _route.kernel_supports(T, E, top_k, n_group) and _route.quant_rides(T, E, top_k, rows, cols)


def _check_quantize(quantize, device: torch.device) -> tuple:
    """``route_and_shuffle``'s ``quantize`` triple, checked: ``(x, x_fp8, x_scale)`` or Nones."""
    if quantize is None:
        return None, None, None
    if not isinstance(quantize, (tuple, list)) or len(quantize) != 3:
        raise TypeError(f"quantize must be a tuple (x, x_fp8, x_scale), got {type(quantize).__name__}")
    x, q, s = quantize
    check_tensor("quantize x", x, ndim=2, dtype=(torch.bfloat16, torch.float16, torch.float32), device=device,
                 last_dim_contiguous=True)  # fmt: skip
    R, D = x.shape
    check_tensor("quantize x_fp8", q, shape=(R, D), dtype=torch.float8_e4m3fn, device=device, contiguous=True)
    check_tensor("quantize x_scale", s, shape=(R,), dtype=torch.float32, device=device, contiguous=True)
    if R >= 2**31 - 2**16:
        raise ValueError(f"quantize x must have fewer than 2**31 - 2**16 rows, got {R}")
    return x, q, s


# ----------------------------------------------------------------------------------------------
# shuffle_top_k
# ----------------------------------------------------------------------------------------------


@triton_op("moekit::shuffle_top_k", mutates_args=("zero_buffer",))
def _shuffle_top_k_op(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    expert_index_start: int,
    expert_index_end: int,
    zero_buffer: Optional[torch.Tensor],
    cache_tag: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = top_k_index.shape
    if use_triton(top_k_index):
        from moekit.ops._triton import route as _route

        if _route.topk_rows_supported(T, num_experts, K):
            return _route.shuffle_top_k(top_k_index, top_k_weights, num_experts, expert_index_start,
                                        expert_index_end, zero_buffer)  # fmt: skip
        if T * K:
            from moekit.ops._common import warn_once

            warn_once("shuffle_top_k-reference", f"moekit.shuffle_top_k: {T} x {K} choices of {num_experts} experts "
                      f"are past its kernels (E <= {_route.ROUTE_MAX_E}, top-k <= {_route.ROUTE_MAX_K}, about 4M "
                      "rows); its PyTorch reference serves them on CUDA (slower; no host sync either)")  # fmt: skip
    out = _ref.shuffle_top_k(top_k_index, top_k_weights, num_experts, expert_index_start, expert_index_end)
    if zero_buffer is not None:
        zero_buffer.zero_()
    return out


def shuffle_top_k(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    *,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    zero_buffer: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted row layout of a routing choice made elsewhere (a model's own router, e.g.
    transformers' ``top_k_index`` / ``top_k_weights``), in one launch up to 64 tokens (E <= 128)
    and two beyond (blocks of tokens side by side, then the placement).

    ``top_k_index [T, K]`` int32 / int64 expert ids, ``top_k_weights [T, K]`` bf16 / fp16 / fp32
    (any strides). Every slot ``(t, j)`` whose id lies in ``[expert_index_start,
    expert_index_end)`` (default ``[0, num_experts)``) becomes one row; a token naming an expert
    twice gets two rows (each with its own weight: summed, that is what an eager loop over the
    slots computes); any other id (outside the range, negative, ``>= num_experts``) produces no
    row. Rows are sorted by (expert, token, slot), deterministic (no atomics).

    Returns ``route_and_shuffle``'s five outputs: ``token_counts [E + 2]`` int32 (rows per expert,
    0 outside the range, then ``T``, then the row count ``V``), ``expert_indices`` /
    ``token_indices [T * K]`` int32 (expert minus ``expert_index_start``, token; -1 from row
    ``V`` on), ``row_weights [T * K]`` float32 (0 in the tail) and ``selection_rows [T * K]``
    int32 (slot ``t * K + j``'s row, -1 when it made none). ``zero_buffer`` (optional, contiguous)
    is zeroed by the same launch. The kernels take ``E <= 512`` and ``K <= 16``; past them CUDA
    tensors are served by the PyTorch reference (``moekit.reference.shuffle_top_k``, sync-free),
    with a ``UserWarning`` once per process. No host synchronization; CUDA-graph capturable.
    """
    check_tensor("top_k_index", top_k_index, dtype=INDEX_DTYPES, ndim=2)
    T, K = top_k_index.shape
    check_tensor("top_k_weights", top_k_weights, dtype=SCORE_DTYPES, shape=(T, K), device=top_k_index.device)
    check_int("num_experts", num_experts, lo=1)
    start, end = expert_range(
        num_experts, expert_index_start, expert_index_end, start_name="expert_index_start",
        end_name="expert_index_end",
    )  # fmt: skip
    if zero_buffer is not None:
        check_tensor("zero_buffer", zero_buffer, device=top_k_index.device, contiguous=True)
    if T * K >= 2**31:
        raise ValueError(f"top_k_index rows * top_k must be < 2**31, got {T} * {K} = {T * K}")
    return call_op(_shuffle_top_k_op, top_k_index, top_k_weights, int(num_experts), start, end, zero_buffer)
