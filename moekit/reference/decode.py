"""Oracle of the fused decode op ``route_swiglu``: router logits -> top-k -> the gate/up GEMM of
each chosen expert with SwiGLU, rows in token-major order (float32 math)."""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import FP8_DTYPE, check_tensor
from moekit.reference.routing import routing_weights

__all__ = ["route_swiglu"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z [T * K, F], expert_ids [T * K] int32, weights [T * K] float32)``: row ``m = t * K + j``
    is token t's j-th choice (``routing_weights``' order: descending selection score, ties to the
    lower expert), ``e = expert_ids[m]``, ``weights[m]`` its routing weight, and ``z[m] =
    silu(h[:F]) * h[F:]`` with ``h = (x[t] @ w13_e.T) * w_scale[e rows] (* weights[m] when
    weight_on_input)``. ``x [T, D]`` bf16 / fp16 / fp32, ``logits [T, E]``, ``w13 [E * 2F, D]``
    (expert e's F gate rows, then its F up rows) of x's dtype, or FP8 e4m3fn with ``w_scale [E *
    2F]`` (weight-only FP8). ``z`` in x's dtype."""
    check_tensor("x", x, ndim=2, dtype=_FLOATS)
    check_tensor("logits", logits, ndim=2, device=x.device)
    T, D = x.shape
    E = logits.shape[1]
    check_tensor("w13", w13, ndim=2, dtype=FP8_DTYPE if w_scale is not None else x.dtype, device=x.device)
    if w13.shape[1] != D or w13.shape[0] % (2 * E):
        raise ValueError(f"w13 must have shape [E * 2F, D] = [{E} * 2F, {D}], got {tuple(w13.shape)}")
    twoF = w13.shape[0] // E
    weights, ids = routing_weights(
        logits, top_k, score_func, renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    ids = ids.reshape(-1)
    rw = weights.reshape(-1).float()
    w3 = w13.float().view(E, twoF, D)
    if w_scale is not None:
        w3 = w3 * w_scale.float().view(E, twoF, 1)
    xr = x.float().repeat_interleave(top_k, dim=0)
    h = torch.zeros(T * top_k, twoF, dtype=torch.float32, device=x.device)
    for e in range(E):  # the oracle favours clarity over speed (and never syncs with the host)
        h = torch.where((ids == e).unsqueeze(1), xr @ w3[e].T, h) if T else h
    if weight_on_input:
        h = h * rw.unsqueeze(1)
    F = twoF // 2
    z = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    return z.to(x.dtype), ids.to(torch.int32), rw
