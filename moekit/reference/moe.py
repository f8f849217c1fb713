"""The whole MoE layer's math (BaselineMoE semantics generalized to top-k and any routing)."""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import check_tensor
from moekit.reference.routing import routing_weights

__all__ = ["swiglu_expert", "moe_forward", "moe_decode"]


def _check_swiglu_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, name13: str, name2: str) -> None:
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim (the model dim last), got a scalar")
    D = x.shape[-1]
    check_tensor(name13, w13, shape=(None, D), device=x.device)
    if w13.shape[0] % 2:
        raise ValueError(f"{name13}.shape[0] must be 2F (even: gate rows over up rows), got {w13.shape[0]}")
    check_tensor(name2, w2, shape=(D, w13.shape[0] // 2), device=x.device)


def swiglu_expert(x: torch.Tensor, w13_2FD: torch.Tensor, w2_DF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert in float32: ``h = x @ w13.T``; ``z = silu(h[:, :F]) * h[:, F:]``; ``z @ w2.T``.

    ``w13`` ``[2F, D]`` stacks the gate rows (``w_in``) over the up rows (``w_swiglu``);
    ``w2`` ``[D, F]``.
    """
    _check_swiglu_weights(x, w13_2FD, w2_DF, "w13_2FD", "w2_DF")
    h = x.float() @ w13_2FD.float().T
    F = h.shape[-1] // 2
    z = torch.nn.functional.silu(h[..., :F]) * h[..., F:]
    return z @ w2_DF.float().T


def moe_forward(
    x_TD: torch.Tensor,
    router_DE: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    *,
    top_k: int = 1,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = True,
    shared_w13_2FD: Optional[torch.Tensor] = None,
    shared_w2_DF: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense MoE layer in float32, returned in ``x_TD.dtype`` with ``x_TD``'s shape.

    ``logits = x @ router_DE``; ``(w, ids) = routing_weights(logits, top_k, ...)``; each token
    ``t`` goes through experts ``ids[t, k]``: with ``apply_router_weight_on_input`` (Llama 4) the
    expert sees ``x[t] * w[t, k]``, else its output is multiplied by ``w[t, k]`` (DeepSeek, Qwen,
    Mixtral). The routed outputs are summed over k and added to the shared expert's output
    ``swiglu_expert(x, shared_w13_2FD, shared_w2_DF)`` when given. Leading dims of ``x`` are kept.
    """
    check_tensor("x_TD", x_TD)
    D = x_TD.shape[-1]
    x = x_TD.reshape(-1, D)
    check_tensor("router_DE", router_DE, ndim=2, device=x.device)
    if router_DE.shape[0] != D:
        raise ValueError(f"router_DE must have shape ({D}, E), got {tuple(router_DE.shape)}")
    E = router_DE.shape[1]
    check_tensor("w13_e2FD", w13_e2FD, shape=(E, None, D), device=x.device)
    twoF = w13_e2FD.shape[1]
    if twoF % 2:
        raise ValueError(f"w13_e2FD.shape[1] must be 2F (even), got {twoF}")
    check_tensor("w2_eDF", w2_eDF, shape=(E, D, twoF // 2), device=x.device)
    if (shared_w13_2FD is None) != (shared_w2_DF is None):
        raise ValueError(
            "shared_w13_2FD and shared_w2_DF go together, got "
            f"shared_w13_2FD={'a tensor' if shared_w13_2FD is not None else None}, "
            f"shared_w2_DF={'a tensor' if shared_w2_DF is not None else None}"
        )
    if shared_w13_2FD is not None:
        _check_swiglu_weights(x, shared_w13_2FD, shared_w2_DF, "shared_w13_2FD", "shared_w2_DF")
    logits = x.float() @ router_DE.float()
    weights, ids = routing_weights(
        logits,
        top_k,
        score_func,
        renormalize,
        n_group=n_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
    out = torch.zeros(x.shape[0], D, dtype=torch.float32, device=x.device)
    for e in range(E):
        sel = ids == e  # [T, K]
        w_te = (weights * sel).sum(dim=1)  # a token picks an expert at most once
        hit = sel.any(dim=1)
        if apply_router_weight_on_input:
            y = swiglu_expert(x.float() * w_te.unsqueeze(1), w13_e2FD[e], w2_eDF[e])
        else:
            y = swiglu_expert(x, w13_e2FD[e], w2_eDF[e]) * w_te.unsqueeze(1)
        out = out + torch.where(hit.unsqueeze(1), y, 0.0)
    if shared_w13_2FD is not None:
        out = out + swiglu_expert(x, shared_w13_2FD, shared_w2_DF)
    return out.to(x_TD.dtype).reshape(x_TD.shape)


def moe_decode(
    x_TD: torch.Tensor,
    logits_TE: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    out_TD: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    w13_scale_e2F: Optional[torch.Tensor] = None,
    w2_scale_eD: Optional[torch.Tensor] = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """``moekit.ops.moe_decode``'s math in float32, with the kernels' roundings: token t's choice
    ``(w, ids) = routing_weights(logits)``; row ``(t, j)``: ``h = x[t] @ w13[ids].T`` (times the
    row scales of FP8 weights and, ``apply_router_weight_on_input``, ``w[t, j]``), ``z =
    silu(h_gate) * h_up`` rounded to x's dtype; ``out[t] (+)= sum_j w[t, j] * (z @ w2[ids].T)``
    (the weight on the output unless on the input), summed in float32 in slot order, rounded once
    to out's dtype. Returns ``out_TD``."""
    T, D = x_TD.shape
    weights, ids = routing_weights(
        logits_TE.float(), top_k, score_func, renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    F = w2_eDF.shape[2]
    e = ids.long()
    w13 = w13_e2FD.float()[e]  # [T, K, 2F, D]
    if w13_scale_e2F is not None:
        w13 = w13 * w13_scale_e2F.float().reshape(-1, 2 * F)[e].unsqueeze(-1)
    h = torch.einsum("tkfd,td->tkf", w13, x_TD.float())
    if apply_router_weight_on_input:
        h = h * weights.float().unsqueeze(-1)
    z = (torch.nn.functional.silu(h[..., :F]) * h[..., F:]).to(x_TD.dtype).float()
    w2 = w2_eDF.float()[e]  # [T, K, D, F]
    if w2_scale_eD is not None:
        w2 = w2 * w2_scale_eD.float().reshape(-1, D)[e].unsqueeze(-1)
    y = torch.einsum("tkdf,tkf->tkd", w2, z)
    if not apply_router_weight_on_input:
        y = y * weights.float().unsqueeze(-1)
    acc = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    for j in range(top_k):
        acc = acc + y[:, j]
    if accumulate:
        acc = out_TD.float() + acc
    out_TD.copy_(acc.to(out_TD.dtype))
    return out_TD
