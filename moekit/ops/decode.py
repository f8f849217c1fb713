"""``moe_decode``: the routed experts of a decode step from router logits in two launches.

``moe_decode(x, logits, w13, w2, out, top_k, ...)`` routes each token inside the gate/up GEMV
(every program routes its own token: no routing launch, no sorted layout), applies SiLU * mul in
that GEMV's epilogue, and sums each token's K down projections in one program with one plain
store per output element (no atomics): bitwise reproducible. The routing is the routing launch's
own code (``route_and_shuffle``): the same experts in the same slots, weights within float32
rounding (a row's scores are reduced in another thread layout).
For a few tokens whose choices rarely share an expert (decode of top-k models); each program
streams its expert's weights alone. Registered as ``torch.ops.moekit.moe_decode`` (mutates
``out``); CPU tensors run the float32 reference ``moekit.reference.moe_decode``.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch.library import triton_op

from moekit._validate import check_expert_weights, check_tensor
from moekit.ops._common import call_op, use_triton
from moekit.ops.routing import SCORE_DTYPES, check_correction_bias, check_routing_options

_ref = importlib.import_module("moekit.reference.moe")

__all__ = ["moe_decode", "moe_decode_supports"]

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def moe_decode_supports(num_experts: int, top_k: int, n_group: Optional[int] = None) -> bool:
    """Whether ``moe_decode``'s kernels take these routing sizes (those of ``route_and_shuffle``'s
    one-launch kernel: ``E <= 512``, ``top_k <= 16``, power-of-two expert groups filling E)."""
    from moekit.ops._triton.route import kernel_supports

    return kernel_supports(1, num_experts, top_k, n_group)


@triton_op("moekit::moe_decode", mutates_args=("out",))
def _moe_decode_op(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    score_func: str,
    renormalize: bool,
    n_group: Optional[int],
    topk_group: Optional[int],
    bias: Optional[torch.Tensor],
    scale: float,
    weight_on_input: bool,
    w13_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    accumulate: bool,
    cache_tag: str = "",
) -> None:
    if use_triton(x):
        from moekit.ops._triton import decode as _dec

        E, twoF, D = w13.shape
        _dec.moe_decode(
            x, logits, bias, w13.reshape(-1, D), w2.reshape(-1, twoF // 2),
            None if w13_scale is None else w13_scale.reshape(-1), None if w2_scale is None else w2_scale.reshape(-1),
            out, top_k, score_func, renormalize, n_group, topk_group, scale, weight_on_input, accumulate,
        )  # fmt: skip
        return
    _ref.moe_decode(
        x, logits, w13, w2, out, top_k=top_k, score_func=score_func, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=bias, routed_scaling_factor=scale,
        apply_router_weight_on_input=weight_on_input, w13_scale_e2F=w13_scale, w2_scale_eD=w2_scale,
        accumulate=accumulate,
    )  # fmt: skip


def moe_decode(
    x_TD: torch.Tensor,
    logits_TE: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    out_TD: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    *,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    w13_scale_e2F: Optional[torch.Tensor] = None,
    w2_scale_eD: Optional[torch.Tensor] = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """Routed SwiGLU experts of ``T`` tokens from their router logits, into ``out_TD``.

    ``x_TD [T, D]`` bf16 / fp16 / fp32; ``logits_TE [T, E]`` (any float dtype and strides);
    routing options as ``route_and_shuffle`` (``score_func`` sigmoid / softmax / topk_softmax,
    ``renormalize``, DeepSeek grouped top-k ``n_group`` / ``topk_group``,
    ``e_score_correction_bias [E]``, ``routed_scaling_factor``; sizes ``moe_decode_supports``).
    Weights ``w13_e2FD [E, 2F, D]`` (gate rows, then up rows) and ``w2_eDF [E, D, F]`` of x's
    dtype, or FP8 e4m3fn with float32 row scales ``w13_scale_e2F [E, 2F]`` / ``w2_scale_eD [E,
    D]`` (weight-only FP8: x stays 16-bit). The router weight multiplies the expert's output, or
    its input with ``apply_router_weight_on_input``. ``out_TD [T, D]`` of x's dtype, contiguous:
    the sum of each token's K expert outputs is added to it (``accumulate``) or stored (``accumulate``
    False: out need not be initialized). Returns ``out_TD``. No host synchronization;
    CUDA-graph capturable; bitwise reproducible.
    """
    check_tensor("x_TD", x_TD, ndim=2, dtype=_X_DTYPES, last_dim_contiguous=True)
    T, D = x_TD.shape
    dev = x_TD.device
    check_tensor("logits_TE", logits_TE, ndim=2, dtype=SCORE_DTYPES, device=dev)
    if logits_TE.shape[0] != T:
        raise ValueError(f"logits_TE must have shape ({T}, E) for x_TD's T={T} tokens, got {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    check_routing_options(top_k, score_func, renormalize, n_group, topk_group, routed_scaling_factor, E)
    if not moe_decode_supports(E, top_k, n_group):
        raise ValueError(
            f"moe_decode takes E <= 512 experts, top_k <= 16 and power-of-two expert groups filling E, got E={E}, "
            f"top_k={top_k}, n_group={n_group}"
        )
    check_correction_bias(e_score_correction_bias, score_func, E, dev)
    _, fp8 = check_expert_weights(w13_e2FD, w2_eDF, w13_scale_e2F, w2_scale_eD, E, x_TD, contiguous=True)
    if not fp8 and (w13_scale_e2F is not None or w2_scale_eD is not None):
        raise ValueError("w13_scale_e2F / w2_scale_eD go with FP8 (float8_e4m3fn) expert weights only")
    check_tensor("out_TD", out_TD, shape=(T, D), dtype=x_TD.dtype, device=dev, contiguous=True)
    if T * top_k >= 2**31:
        raise ValueError(f"T * top_k must be < 2**31, got {T} * {top_k}")
    if T == 0:
        return out_TD
    call_op(
        _moe_decode_op, x_TD, logits_TE, w13_e2FD, w2_eDF, out_TD, top_k, score_func, renormalize, n_group,
        topk_group, e_score_correction_bias, float(routed_scaling_factor), bool(apply_router_weight_on_input),
        w13_scale_e2F, w2_scale_eD, bool(accumulate),
    )  # fmt: skip
    return out_TD
