"""Routing ops: ``index_shuffling`` (MSLK ``torch.ops.mslk.index_shuffling`` API).

The public function validates its arguments, then calls the registered op
``torch.ops.moekit.index_shuffling``, which runs the Triton kernels on CUDA tensors and the
float32 reference (``moekit.reference.routing.index_shuffling``) on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from moekit._checks import check_int, check_optional_count, check_tensor, expert_range
from moekit.ops._common import use_triton
from moekit.reference import routing as _ref

__all__ = ["index_shuffling", "SCORE_DTYPES"]

SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton_op("moekit::index_shuffling", mutates_args=())
def _index_shuffling_op(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(routing_scores):
        from moekit.ops._triton import routing as _tri

        if routing_scores.shape[1] <= _tri.MAX_KERNEL_E:
            return _tri.index_shuffling(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)
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
    expert_range(
        E, expert_index_start, expert_index_end, start_name="expert_index_start", end_name="expert_index_end"
    )
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
    Accepts any ``E`` (kernels up to 4096, PyTorch beyond) and any ``1 <= top_k <= E``. No host
    synchronization; CUDA-graph capturable.
    """
    _check(routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k)
    return torch.ops.moekit.index_shuffling(
        routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
    )
