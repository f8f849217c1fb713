"""The MoE-tail collective on plain ``torch.distributed`` collectives (any backend: gloo on the
CPU, NCCL where symmetric memory or P2P is unavailable).

Same numerics contract as the symmetric-memory kernel: each rank's routed contribution travels
as bf16 (the top-k finalize is done in float32 and rounded first), the rank sum is taken in
float32 in rank order 0..R-1 (so every rank gets bitwise the same routed output), then RMSNorm *
gamma; the shared role sums, in float32 and rank order, every rank's slice of this rank's shard.
Built on ``all_gather_into_tensor`` (routed) and ``all_to_all_single`` (shared), which gloo and
NCCL both support for bf16.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moekit.reference import norm as _ref


def _rank_order_sum(stacked: torch.Tensor) -> torch.Tensor:
    """float32 sum over dim 0 in index order (deterministic, as the kernel does it)."""
    acc = stacked[0].float()
    for r in range(1, stacked.shape[0]):
        acc = acc + stacked[r].float()
    return acc


# torch >= 2.12 renamed all_gather_into_tensor (the old name warns); 2.11 has only the old one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def finalize_bf16(gemm2_permuted: torch.Tensor, expert_weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """This rank's top-k finalize, as published: float32 accumulate, rounded to bf16."""
    return _ref.topk_finalize(gemm2_permuted, expert_weights, idx).to(torch.bfloat16)


def routed_all_reduce_rms_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    out: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup],
    world_size: int,
    eps: float,
    fp32_internal: bool,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[:m] = rms_norm(sum over ranks of x (bf16), gamma)`` (bf16)."""
    m = x.shape[0]
    x = x.to(torch.bfloat16).contiguous()
    gathered = torch.empty((world_size * m,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(gathered, x, group=group)
    total = _rank_order_sum(gathered.view((world_size,) + tuple(x.shape)))
    y = _ref.rms_norm(total, gamma, eps, fp32_internal, residual)
    out[:m].copy_(y.to(out.dtype))
    return out[:m]


def shared_reduce_scatter(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup],
    world_size: int,
) -> torch.Tensor:
    """``out[:m] = (sum over ranks of x)[:, rank*S:(rank+1)*S]`` (bf16, float32 rank-order sum)."""
    m, H = x.shape
    S = H // world_size
    send = x.to(torch.bfloat16).reshape(m, world_size, S).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out[:m].copy_(_rank_order_sum(recv).to(out.dtype))
    return out[:m]
