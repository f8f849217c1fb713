"""Fused decode ops: the routing computed inside the expert GEMM that needs it.

``route_swiglu``: router logits -> score function -> top-k -> each choice's gate/up GEMM with
SwiGLU, in one launch. Every program of the GEMV kernel routes its own token (the same helper as
``route_and_shuffle``'s kernels: the same experts and weights), so a decode step needs no routing
launch and no sorted layout: its rows are token-major (row ``t * K + j`` is token t's j-th
choice), and ``grouped_gemm_combine(..., selection_rows=None)`` adds them up per token. From
router logits to the layer's output that is two launches (``moekit.layers.functional.moe_forward``
takes it for a few routed rows: ``settings.fused_decode_max_rows``).

Registered as ``torch.ops.moekit.route_swiglu``: the Triton kernel on CUDA tensors (routings
with ``E <= 512``, ``top_k <= 16``; others run the float32 reference, with a warning), the
reference (``moekit.reference.route_swiglu``) on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import FP8_DTYPE, check_bool, check_tensor
from moekit.ops._common import call_op, use_triton, warn_once
from moekit.ops.routing import SCORE_DTYPES, check_routing_options
from moekit.reference import decode as _ref

__all__ = ["route_swiglu"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton_op("moekit::route_swiglu", mutates_args=())
def _route_swiglu_op(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    e_score_correction_bias: Optional[torch.Tensor],
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    routed_scaling_factor: float,
    weight_on_input: bool,
    w_scale: Optional[torch.Tensor],
    prefetch: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from moekit.ops._triton import gg_swiglu as _sw
        from moekit.ops._triton import route as _route

        E = logits.shape[1]
        if _route.routing_supported(E, top_k, n_group):
            return _sw.route_swiglu(
                x, logits, w13, e_score_correction_bias, top_k, score_func, renormalize, n_group, topk_group,
                routed_scaling_factor, weight_on_input, None if w_scale is None else w_scale.reshape(-1), prefetch,
            )  # fmt: skip
        warn_once("route_swiglu-reference", f"moekit.route_swiglu: E={E} experts / top_k={top_k} / n_group="
                  f"{n_group} are past its kernel (E <= {_route.ROUTE_MAX_E}, top_k <= {_route.ROUTE_MAX_K}, "
                  "power-of-two groups); its PyTorch reference serves them on CUDA (slower)")  # fmt: skip
    return _ref.route_swiglu(
        x, logits, w13, top_k, score_func, renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
        weight_on_input=weight_on_input, w_scale=w_scale,
    )  # fmt: skip


def route_swiglu(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    *,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    weight_on_input: bool = False,
    w_scale: Optional[torch.Tensor] = None,
    prefetch: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing and the gate/up GEMM with SwiGLU of every choice, fused (decode batches).

    ``x [T, D]`` bf16 / fp16 / fp32, ``logits [T, E]`` bf16 / fp16 / fp32 (any strides),
    ``w13 [E * 2F, D]`` (``w13_e2FD.view(-1, D)``: expert e's F gate rows, then its F up rows) of
    x's dtype, or FP8 e4m3fn with ``w_scale [E * 2F]`` float32 (weight-only FP8: activations
    stay 16-bit). Routing options as ``route_and_shuffle`` (``score_func``, ``renormalize``,
    ``n_group`` / ``topk_group``, ``e_score_correction_bias [E]``, ``routed_scaling_factor``).
    ``weight_on_input``: each row's routing weight scales the expert's input (Llama 4), else it
    is only returned (apply it on the output, e.g. ``grouped_gemm_combine(row_weights=...)``).
    ``prefetch`` (optional): the down projection's weights ``[E * D, F]`` (contiguous, e.g.
    ``w2_eDF.view(-1, F)``), whose slices of the chosen experts the kernel asks L2 to hold for
    the down GEMM that follows (a hint: the results do not depend on it).

    Returns ``(z [T * K, F]`` in x's dtype, ``expert_ids [T * K]`` int32, ``weights [T * K]``
    float32), rows token-major: row ``t * K + j`` is token t's j-th choice in
    ``moekit.reference.routing_weights``' order, ``z`` of it ``silu(h[:F]) * h[F:]``, ``h =
    x[t] @ w13_e.T`` (dequantized; times the weight with ``weight_on_input``). No host
    synchronization; CUDA-graph capturable.
    """
    check_tensor("x", x, ndim=2, dtype=_X_DTYPES)
    T, D = x.shape
    dev = x.device
    check_tensor("logits", logits, ndim=2, dtype=SCORE_DTYPES, device=dev)
    if logits.shape[0] != T:
        raise ValueError(f"logits must have shape ({T}, E) for x's T={T} tokens, got {tuple(logits.shape)}")
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must have at least one expert column, got shape {tuple(logits.shape)}")
    check_routing_options(top_k, score_func, renormalize, n_group, topk_group, routed_scaling_factor, E)
    check_bool("weight_on_input", weight_on_input)
    if e_score_correction_bias is not None:
        if score_func == "topk_softmax":
            raise ValueError("score_func='topk_softmax' does not take e_score_correction_bias")
        check_tensor("e_score_correction_bias", e_score_correction_bias, dtype=SCORE_DTYPES, shape=(E,), device=dev)
    if w_scale is not None:
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=dev)
    check_tensor("w13", w13, ndim=2, dtype=FP8_DTYPE if w_scale is not None else x.dtype, device=dev)
    if w13.shape[1] != D or w13.shape[0] == 0 or w13.shape[0] % (2 * E):
        raise ValueError(
            f"w13 must have shape [E * 2F, D] = [{E} * 2F, {D}] (E = logits.shape[1], F > 0), got {tuple(w13.shape)}"
        )
    F = w13.shape[0] // (2 * E)
    if w_scale is not None and w_scale.numel() != E * 2 * F:
        raise ValueError(f"w_scale must have E * 2F = {E * 2 * F} elements, got shape {tuple(w_scale.shape)}")
    if prefetch is not None:
        check_tensor("prefetch", prefetch, ndim=2, device=dev)
        if prefetch.shape[0] % E:
            raise ValueError(f"prefetch must have shape [E * D, F] with E={E}, got {tuple(prefetch.shape)}")
    if T * top_k >= 2**31:
        raise ValueError(f"x rows * top_k must be < 2**31, got {T} * {top_k} = {T * top_k}")
    return call_op(
        _route_swiglu_op, x, logits, w13, e_score_correction_bias, top_k, score_func, renormalize, n_group,
        topk_group, float(routed_scaling_factor), weight_on_input, w_scale, prefetch,
    )  # fmt: skip
