"""The transformers integration's routing input: the model's top-k choice ``[T, K]`` as moekit's
sorted rows, and token rows in the layout the gather wants."""

from __future__ import annotations

import torch


def _routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, E: int, deterministic: bool = True):
    """``(counts, expert_ids [T*k], token_ids [T*k], row_weights [T*k] float32)`` of the given top-k
    choice (``k = min(K, E)``), via ``index_shuffling`` on a ``[T, E]`` tensor whose top-k is
    exactly that choice (no host sync).

    One cell per (token, expert): a token whose top-k names an expert more than once gets one row
    for it weighted by the sum of those slots' weights (eager and grouped_mm add one output per
    slot; the expert's output is the same for each, so the sum is the same result), and its freed
    slots select zero-score filler experts whose rows weigh 0 (no contribution). ``deterministic``:
    the sum is taken per slot over the token's K slots (no atomics), so every slot naming the same
    expert writes the same value into the dense ``[T, E]`` weights; otherwise one ``scatter_add_``
    (fewer launches; its atomics make the sum of three or more repeats order-dependent, two repeats
    add exactly)."""
    from moekit.ops import index_shuffling

    T, K = top_k_index.shape
    dev = top_k_index.device
    idx = top_k_index.long()
    sel = torch.zeros((T, E), dtype=torch.float32, device=dev).scatter_(1, idx, _ranks(K, dev).expand(T, K))
    counts, expert_ids, token_ids = index_shuffling(sel, top_k=min(K, E))
    w = top_k_weights.float()
    dense_w = torch.zeros((T, E), dtype=torch.float32, device=dev)
    if deterministic:
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(torch.float32)  # [T, K, K]
        w_sum = (same * w.unsqueeze(1)).sum(dim=-1)  # [T, K]: the weight of every slot naming that expert
        dense_w.scatter_(1, idx, w_sum)
    else:
        dense_w.scatter_add_(1, idx, w)
    # (rows past the routed ones hold -1 in both indices: their clamped cell is never read)
    row_weights = dense_w.view(-1)[(token_ids * E + expert_ids).clamp_(min=0)]
    return counts, expert_ids, token_ids, row_weights


_RANKS: dict = {}


def _ranks(K: int, device: torch.device) -> torch.Tensor:
    """``[K, K-1, ..., 1]`` float32 on ``device`` (cached: one tensor per K and device)."""
    key = (K, device)
    r = _RANKS.get(key)
    if r is not None and not torch.compiler.is_compiling():
        return r
    r = torch.arange(K, 0, -1, dtype=torch.float32, device=device)
    # Not kept when made under tracing or inside a CUDA-graph capture (its memory would belong to
    # that graph's pool).
    if not torch.compiler.is_compiling() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _RANKS[key] = r
    return r


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Token rows as the gather op wants them (unit last stride, row stride a multiple of 8)."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8):
        return x.contiguous()
    return x
