"""The MetaShuffling MoE forward on one GPU, as a function of tensors (no module state).

``moe_forward``: router logits -> ``route_and_shuffle`` (score function, top-k, weights and the
expert-sorted row layout, one launch for decode-sized batches; it also zeroes the output) ->
``moekit.layers.experts.run_experts`` (the decode pipeline: gate|up GEMM reading the token rows
by index with SwiGLU fused, down GEMM with the router weight and the scatter-add; or the sorted
pipeline: gather (+ FP8 quant) -> grouped GEMM -> SwiGLU -> grouped GEMM + scatter-add). Where
``moekit.layers.experts.decode_fused`` says so (up to 4 tokens of a model with at most
256 experts, 16-bit or FP8 weights), ``moekit.ops.moe_decode`` runs the experts in two launches
instead: each GEMV program routes its token itself (no routing launch). No host sync anywhere:
CUDA-graph capturable.

``route`` is the same routing as dense ``[T, E]`` torch ops (selection scores and weights), kept
for callers that want the scores themselves. ``RoutingConfig`` is defined in
``moekit.layers.config`` (re-exported here).
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit import settings
from moekit._validate import FP8_DTYPE, check_expert_weights, check_tensor
from moekit.layers.config import RoutingConfig
from moekit.ops.routing import SCORE_DTYPES, dense_route

__all__ = ["RoutingConfig", "route", "quantize_expert_weights", "moe_forward"]


def route(
    logits_TE: torch.Tensor, cfg: RoutingConfig, e_score_correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selection scores [T, E], weights [T, E])`` in float32.

    The top-k of the selection scores (ties to the lower index) are the chosen experts; the weight
    of a chosen (token, expert) pair is read from the second tensor. Matches
    ``moekit.reference.routing_weights`` up to ties.
    """
    check_tensor("logits_TE", logits_TE, ndim=2, dtype=SCORE_DTYPES)
    cfg.check_experts(logits_TE.shape[1])
    return dense_route(
        logits_TE, cfg.top_k, cfg.score_func, cfg.renormalize, cfg.n_group, cfg.topk_group, e_score_correction_bias,
        cfg.routed_scaling_factor,
    )  # fmt: skip


# Float32 bytes of weights ``quantize_expert_weights`` converts per step.
_QUANT_STEP_BYTES = 2**30


def quantize_expert_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 of stacked expert weights ``[G, N, K]`` -> ``(w_fp8 [G, N, K], scale [G, N])``.
    Computed in float32 a few experts at a time (at most ``_QUANT_STEP_BYTES`` of float32 per step; the rows are
    independent, so the bits are those of one pass): one pass over Llama 4 Maverick's w13 would
    take a 43 GB float32 copy."""
    from moekit.reference.quantize import quantize_rows

    if w.dim() != 3 or w.shape[0] <= 1:
        return quantize_rows(w.float(), eps=1e-12)
    per = max(1, _QUANT_STEP_BYTES // max(1, 4 * w[0].numel()))
    if per >= w.shape[0]:
        return quantize_rows(w.float(), eps=1e-12)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e0 in range(0, w.shape[0], per):
        q[e0 : e0 + per], s[e0 : e0 + per] = quantize_rows(w[e0 : e0 + per].float(), eps=1e-12)
    return q, s


_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    use_fast_accum: bool = True,
    path: Optional[str] = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer, added into ``shared_out_TD`` (or zeros); returns ``[T, D]``.

    BF16 weights, or FP8 e4m3fn weights with row-wise dequant scales (``w13_scale_e2F``,
    ``w2_scale_eD``): activations are then quantized row-wise on the fly on the sorted pipeline and
    kept 16-bit on the decode pipeline (weight-only FP8). ``deterministic`` uses the atomics-free
    scatter-add (bitwise reproducible for top-k > 1). ``logits_TE`` (e.g. computed in float32 by
    the caller) replaces ``x_TD @ router_DE``. ``use_fast_accum``: FP8 tensor-core accumulation
    (sorted pipeline). ``path``: ``"auto"`` (``settings.moe_path``), ``"decode"`` or ``"sorted"``
    (see ``moekit.layers.experts``).
    """
    from moekit.layers.experts import decode_fused, quantizes_token_rows, run_experts, will_store_rows
    from moekit.ops import moe_decode, route_and_shuffle
    from moekit.ops.routing import quantize_rides

    if not isinstance(cfg, RoutingConfig):
        raise TypeError(f"cfg must be a RoutingConfig, got {type(cfg).__name__}")
    check_tensor("x_TD", x_TD, ndim=2, dtype=_X_DTYPES)
    T, D = x_TD.shape
    dev = x_TD.device
    if logits_TE is None:
        if router_DE is None:
            raise ValueError("moe_forward needs router_DE or logits_TE, got neither")
        check_tensor("router_DE", router_DE, ndim=2, dtype=x_TD.dtype, device=dev)
        if router_DE.shape[0] != D:
            raise ValueError(f"router_DE must have shape ({D}, E) for x_TD's D={D}, got {tuple(router_DE.shape)}")
        logits_TE = x_TD @ router_DE
    check_tensor("logits_TE", logits_TE, ndim=2, dtype=SCORE_DTYPES, device=dev)
    if logits_TE.shape[0] != T:
        raise ValueError(f"logits_TE must have shape ({T}, E) for x_TD's T={T} tokens, got {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    cfg.check_experts(E)
    _, fp8 = check_expert_weights(w13_e2FD, w2_eDF, w13_scale_e2F, w2_scale_eD, E, x_TD)
    out_dtype = torch.bfloat16 if fp8 else x_TD.dtype
    if shared_out_TD is not None:
        check_tensor("shared_out_TD", shared_out_TD, shape=(T, D), dtype=out_dtype, device=dev)
    if out_dtype == x_TD.dtype and decode_fused(T * cfg.top_k, E, cfg.top_k, fp8, path, cfg.n_group):
        # Two launches from the logits: routing inside the gate/up GEMV, the per-token combine.
        out = shared_out_TD if shared_out_TD is not None else torch.empty((T, D), dtype=out_dtype, device=dev)
        return moe_decode(
            x_TD, logits_TE, w13_e2FD, w2_eDF, out, cfg.top_k, cfg.score_func, cfg.renormalize, n_group=cfg.n_group,
            topk_group=cfg.topk_group, e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=cfg.routed_scaling_factor,
            apply_router_weight_on_input=cfg.apply_router_weight_on_input, w13_scale_e2F=w13_scale_e2F,
            w2_scale_eD=w2_scale_eD, accumulate=shared_out_TD is not None,
        )  # fmt: skip
    empty = False
    if shared_out_TD is not None:
        out = shared_out_TD
    else:
        out = torch.empty((T, D), dtype=out_dtype, device=dev)
        # Summed rows are stored into out as it is; any other down projection adds into it, zeroed
        # by the routing launch.
        empty = will_store_rows(out, T * cfg.top_k, E, cfg.top_k, fp8, deterministic, path, down_k=w2_eDF.shape[-1])
    # The token rows' FP8 copy where the experts would quantize them next: by extra programs of
    # the routing launch, one launch fewer (where that pays: quantize_rides).
    quant = None
    rows = T * cfg.top_k
    if (settings.get().knob("ROUTE_QUANT", True) and quantizes_token_rows(x_TD, w13_e2FD, rows, cfg.top_k, path)
            and quantize_rides(logits_TE, cfg.top_k, cfg.n_group, T, D)):  # fmt: skip
        quant = (
            x_TD,
            torch.empty((T, D), dtype=FP8_DTYPE, device=dev),
            torch.empty((T,), dtype=torch.float32, device=dev),
        )
    counts, expert_ids, token_ids, row_weights, selection_rows = route_and_shuffle(
        logits_TE, cfg.top_k, cfg.score_func, cfg.renormalize, n_group=cfg.n_group, topk_group=cfg.topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=cfg.routed_scaling_factor,
        zero_buffer=None if shared_out_TD is not None or empty else out, quantize=quant,
    )  # fmt: skip
    return run_experts(
        x_TD, w13_e2FD, w2_eDF, counts[:E], token_ids=token_ids, expert_ids=expert_ids, row_weights=row_weights,
        selection_rows=selection_rows,
        weight_on_input=cfg.apply_router_weight_on_input, w13_scale=w13_scale_e2F, w2_scale=w2_scale_eD, out=out,
        out_empty=empty, deterministic=deterministic, use_fast_accum=use_fast_accum, path=path,
        x_fp8=quant[1:] if quant is not None else None,
    )  # fmt: skip
