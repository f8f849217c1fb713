"""The MetaShuffling MoE forward on one GPU, as a function of tensors (no module state).

``route`` turns router logits into two dense ``[T, E]`` tensors: the scores whose top-k
``index_shuffling`` takes (selection) and the weight of every (token, expert) pair. Both are built
with static-shape torch ops, so the whole forward has no host sync and is CUDA-graph capturable.
``moe_forward`` then runs: index_shuffling -> gather (+ scale, + FP8 quant) -> grouped GEMM (gate|up)
-> SwiGLU (+ FP8 quant) -> grouped GEMM (down) with the fused scatter-add into the shared
expert's output (or zeros).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moekit._checks import check_int, check_tensor
from moekit.reference.routing import SCORE_FUNCS

__all__ = ["RoutingConfig", "route", "quantize_expert_weights", "moe_forward"]


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become expert choices and weights (see ``moekit.reference.routing_weights``)."""

    top_k: int = 1
    score_func: str = "sigmoid"
    renormalize: bool = False
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = True

    def __post_init__(self) -> None:
        check_int("top_k", self.top_k, lo=1)
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(
                f"n_group and topk_group go together, got n_group={self.n_group}, topk_group={self.topk_group}"
            )


def route(
    logits_TE: torch.Tensor, cfg: RoutingConfig, e_score_correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selection scores [T, E], weights [T, E])`` in float32.

    The top-k of the selection scores (ties to the lower index) are the chosen experts; the weight
    of a chosen (token, expert) pair is read from the second tensor. Matches
    ``moekit.reference.routing_weights`` up to ties.
    """
    logits = logits_TE.float()
    T, E = logits.shape
    k = cfg.top_k
    if k > E:
        raise ValueError(f"top_k ({k}) must be <= the number of experts ({E})")
    if cfg.score_func == "topk_softmax":
        # softmax over the selected k: exp(l - max) / sum over the top-k of exp(l - max).
        top = torch.topk(logits, k, dim=-1).values
        ex = torch.exp(logits - top[:, :1])
        weights = ex / torch.exp(top - top[:, :1]).sum(dim=-1, keepdim=True)
        return logits, weights * cfg.routed_scaling_factor
    scores = torch.sigmoid(logits) if cfg.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
    if cfg.n_group is not None:
        G = cfg.n_group
        per = E // G
        top2 = torch.topk(choice.view(T, G, per), min(2, per), dim=-1).values.sum(dim=-1)
        gids = torch.topk(top2, cfg.topk_group, dim=-1).indices
        gmask = torch.zeros(T, G, dtype=torch.bool, device=logits.device).scatter_(1, gids, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(per, dim=1), float("-inf"))
    weights = scores
    if cfg.renormalize:
        ids = torch.topk(choice, k, dim=-1).indices
        weights = scores / scores.gather(1, ids).sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return choice, weights


def quantize_expert_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 of stacked expert weights ``[G, N, K]`` -> ``(w_fp8 [G, N, K], scale [G, N])``."""
    from moekit.reference.quantize import quantize_rows

    q, s = quantize_rows(w.float(), eps=1e-12)
    return q, s


def moe_forward(
    x_TD: torch.Tensor,
    router_DE: Optional[torch.Tensor],
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    cfg: RoutingConfig = RoutingConfig(),
    *,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    logits_TE: Optional[torch.Tensor] = None,
    shared_out_TD: Optional[torch.Tensor] = None,
    w13_scale_e2F: Optional[torch.Tensor] = None,
    w2_scale_eD: Optional[torch.Tensor] = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Routed experts of one MoE layer, added into ``shared_out_TD`` (or zeros); returns ``[T, D]``.

    BF16 weights, or FP8 e4m3fn weights with row-wise dequant scales (``w13_scale_e2F``,
    ``w2_scale_eD``), in which case activations are quantized row-wise on the fly.
    ``deterministic`` uses the atomics-free scatter-add (bitwise reproducible for top-k > 1).
    ``logits_TE`` (e.g. computed in float32 by the caller) replaces ``x_TD @ router_DE``.
    """
    from moekit.ops import (
        gather_scale_dense_tokens,
        gather_scale_quant_dense_tokens,
        grouped_gemm,
        grouped_gemm_fp8_rowwise,
        index_shuffling,
        silu_mul,
        silu_mul_quant,
    )

    check_tensor("x_TD", x_TD, ndim=2)
    T, D = x_TD.shape
    if logits_TE is None:
        if router_DE is None:
            raise ValueError("moe_forward needs router_DE or logits_TE, got neither")
        logits_TE = x_TD @ router_DE
    check_tensor("logits_TE", logits_TE, ndim=2)
    E = logits_TE.shape[1]
    check_tensor("w13_e2FD", w13_e2FD, shape=(E, None, D))
    F = w13_e2FD.shape[1] // 2
    check_tensor("w2_eDF", w2_eDF, shape=(E, D, F))
    fp8 = w13_e2FD.dtype == torch.float8_e4m3fn
    if fp8 and (w13_scale_e2F is None or w2_scale_eD is None):
        raise ValueError("FP8 expert weights need w13_scale_e2F and w2_scale_eD")

    sel, weights = route(logits_TE, cfg, e_score_correction_bias)
    counts, expert_ids, token_ids = index_shuffling(sel, top_k=cfg.top_k)
    m_sizes = counts[:E]

    on_input = cfg.apply_router_weight_on_input
    gather_scores = weights if on_input else torch.ones((1, 1), device=x_TD.device).expand(T, E)
    token_weights = None
    if not on_input:
        safe_t = token_ids.clamp(min=0).long()
        safe_e = expert_ids.clamp(min=0).long()
        token_weights = weights[safe_t, safe_e]

    out = shared_out_TD if shared_out_TD is not None else torch.zeros_like(x_TD)
    if not fp8:
        xg = gather_scale_dense_tokens(x_TD, token_ids, expert_ids, gather_scores)
        h = grouped_gemm(xg, w13_e2FD.view(-1, D), m_sizes)
        z = silu_mul(h[:, :F], h[:, F:])
        return grouped_gemm(
            z,
            w2_eDF.view(-1, F),
            m_sizes,
            token_weights=token_weights,
            _output_tensor=out,
            _scatter_add_indices=token_ids,
            deterministic=deterministic,
        )
    xq, xs = gather_scale_quant_dense_tokens(x_TD, token_ids, expert_ids, gather_scores)
    h = grouped_gemm_fp8_rowwise(xq, w13_e2FD.view(-1, D), m_sizes, xs, w13_scale_e2F.reshape(-1))
    zq, zs = silu_mul_quant(h[:, :F], h[:, F:])
    return grouped_gemm_fp8_rowwise(
        zq,
        w2_eDF.view(-1, F),
        m_sizes,
        zs,
        w2_scale_eD.reshape(-1),
        token_weights=token_weights,
        _output_tensor=out,
        _scatter_add_indices=token_ids,
        deterministic=deterministic,
    )
