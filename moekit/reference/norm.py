"""RMSNorm and the MoE-tail collective's math (all-reduce + RMSNorm, top-k finalize,
reduce-scatter along the hidden dim), with the ranks' tensors given as Python lists.

The rank sum is taken in float32 in rank order 0, 1, ..., R-1 (the order every rank of the fused
kernel uses, so its output is bitwise identical across ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from moekit._validate import INDEX_DTYPES, check_tensor

__all__ = ["rms_norm", "topk_finalize", "rank_sum", "all_reduce_rms_norm", "reduce_scatter_hidden", "moe_tail"]


def rms_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float = 1e-6,
    fp32_internal: bool = True,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = x * rsqrt(mean(x^2) + eps) * gamma`` over the last dim, returned in float32.

    ``fp32_internal=True``: ``x`` (plus ``residual``) in float32 throughout. ``False`` (the seed's
    upstream-compatible mode): ``x`` (plus ``residual``, added in float32) is first rounded to
    bf16, each square is computed in bf16 (``bf16 * bf16`` rounded to bf16) and then summed in
    float32; the normalized value uses the bf16-rounded ``x``.
    """
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim, got a scalar")
    check_tensor("gamma", gamma, shape=(x.shape[-1],), device=x.device)
    v = x.float()
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), device=x.device)
        v = v + residual.float()
    if fp32_internal:
        sq = v * v
    else:
        vb = v.to(torch.bfloat16)
        sq = (vb * vb).float()
        v = vb.float()
    inv = torch.rsqrt(sq.sum(dim=-1, keepdim=True) / max(x.shape[-1], 1) + eps)
    return v * inv * gamma.float()


def topk_finalize(gemm2_permuted: torch.Tensor, expert_weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k expert_weights[t, k] * gemm2_permuted[idx[t, k]]`` in float32, slots in
    ascending order, skipping ``idx < 0`` (an expert not local to this rank)."""
    check_tensor("gemm2_permuted", gemm2_permuted, ndim=2)
    check_tensor("expert_weights", expert_weights, ndim=2, device=gemm2_permuted.device)
    check_tensor("expanded_idx_to_permuted_idx", idx, shape=tuple(expert_weights.shape), dtype=INDEX_DTYPES)
    M, K = idx.shape
    rows = gemm2_permuted.shape[0]
    out = torch.zeros(M, gemm2_permuted.shape[1], dtype=torch.float32, device=gemm2_permuted.device)
    for k in range(K):
        i = idx[:, k].long()
        use = (i >= 0) & (i < rows)
        val = gemm2_permuted.float()[torch.where(use, i, 0)] if rows else out
        out = out + torch.where(use.unsqueeze(1), val * expert_weights[:, k].float().unsqueeze(1), 0.0)
    return out


def rank_sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Float32 sum of the ranks' tensors in rank order."""
    if len(xs) == 0:
        raise ValueError("xs must hold at least one rank's tensor, got an empty sequence")
    for r, x in enumerate(xs):
        check_tensor(f"xs[{r}]", x)
        if x.shape != xs[0].shape:
            raise ValueError(f"xs[{r}] must have shape {tuple(xs[0].shape)} like xs[0], got {tuple(x.shape)}")
    acc = xs[0].float().clone()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc


def all_reduce_rms_norm(
    xs: Sequence[torch.Tensor],
    gamma: torch.Tensor,
    eps: float = 1e-6,
    fp32_internal: bool = True,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``rms_norm(sum over ranks of xs[r], gamma)`` (float32 result). Each rank's contribution is
    taken as given (the fused kernel publishes bf16 values)."""
    return rms_norm(rank_sum(xs), gamma, eps, fp32_internal, residual)


def reduce_scatter_hidden(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``out[r] = (sum over ranks of xs)[:, r*H/R:(r+1)*H/R]`` in float32, one shard per rank."""
    total = rank_sum(xs)
    R = len(xs)
    H = total.shape[-1]
    if H % R != 0:
        raise ValueError(f"xs' hidden dim (last, {H}) must be divisible by the number of ranks (len(xs), {R})")
    return list(total.split(H // R, dim=-1))


def moe_tail(
    latent_sources: Sequence[torch.Tensor],
    shared_sources: Sequence[torch.Tensor],
    gamma: torch.Tensor,
    eps: float = 1e-6,
    fp32_internal: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The fused MoE-tail collective on R ranks: ``(rms_norm(sum latent, gamma), shards of sum shared)``.

    ``latent_sources`` and ``shared_sources`` hold one tensor per rank (the same R). Each rank's
    latent and shared contribution is rounded to bf16 before the sum (it travels as bf16); for a
    top-k finalize pass ``topk_finalize(...)`` per rank first. Returns the float32 normalized
    latent ``[M, L]`` and R float32 shards ``[M, H / R]`` (shard r for rank r).
    """
    if len(latent_sources) != len(shared_sources):
        raise ValueError(
            f"latent_sources and shared_sources must hold one tensor per rank each, got "
            f"{len(latent_sources)} and {len(shared_sources)}"
        )
    if len(latent_sources) == 0:
        raise ValueError("latent_sources must hold at least one rank's tensor, got an empty sequence")
    lat = [x.to(torch.bfloat16) for x in latent_sources]
    sh = [x.to(torch.bfloat16) for x in shared_sources]
    return all_reduce_rms_norm(lat, gamma, eps, fp32_internal), reduce_scatter_hidden(sh)
