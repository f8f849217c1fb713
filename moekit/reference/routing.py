"""Routing oracles: score functions, top-k selection and index shuffling.

Pure PyTorch, float32 math, deterministic, device-agnostic. These define the semantics that the
Triton kernels in ``moekit.ops`` must reproduce exactly (integer outputs) or within tolerance.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit._validate import INDEX_DTYPES, check_int, check_optional_count, check_tensor, expert_range

SCORE_FUNCS = ("sigmoid", "softmax", "topk_softmax")


def _topk_lowest_index_on_ties(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; ties go to the lower index (a stable descending sort)."""
    sorted_vals, sorted_ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_vals[..., :k], sorted_ids[..., :k]


def topk(scores_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per row of ``scores_TE`` in float32, ties to the lower expert index.

    Returns ``(values_TK float32, ids_TK int64)``, values in descending order.
    """
    check_tensor("scores_TE", scores_TE, ndim=2)
    if scores_TE.shape[1] < 1:
        raise ValueError(f"scores_TE must have at least one expert column, got shape {tuple(scores_TE.shape)}")
    check_int("top_k", top_k, lo=1, hi=scores_TE.shape[1])
    return _topk_lowest_index_on_ties(scores_TE.float(), top_k)


def routing_weights(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    *,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits -> (weights_TK float32, expert ids_TK int64).

    Contract (all math in float32, ties go to the lower expert index):

    - ``score_func="sigmoid"``: ``s = sigmoid(logits)`` (Llama 4, DeepSeek-V3).
    - ``score_func="softmax"``: ``s = softmax(logits)`` over the experts (Qwen3, Mixtral).
    - ``score_func="topk_softmax"``: top-k of the logits, then softmax over those k values
      (equal to softmax + top-k + renormalize, computed the cheap way).
    - ``e_score_correction_bias`` ``[E]`` (DeepSeek-V3): added to ``s`` for *selection only*;
      the weights are the unbiased ``s`` of the selected experts.
    - ``n_group`` / ``topk_group`` (DeepSeek-V3 grouped top-k): the E experts form ``n_group``
      contiguous groups; a group's score is the sum of its top-2 (biased) scores (its top-1 when a
      group has one expert); only experts of the ``topk_group`` best groups may be selected.
    - ``renormalize``: divide the k weights by their sum.
    - ``routed_scaling_factor``: multiply the final weights.

    Ids are ordered by descending selection score.
    """
    check_tensor("logits_TE", logits_TE, ndim=2)
    T, E = logits_TE.shape
    if E < 1:
        raise ValueError(f"logits_TE must have at least one expert column, got shape {(T, E)}")
    check_int("top_k", top_k, lo=1, hi=E)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    logits = logits_TE.float()

    if score_func == "topk_softmax":
        if n_group is not None or topk_group is not None or e_score_correction_bias is not None:
            raise ValueError(
                "score_func='topk_softmax' does not take n_group, topk_group or e_score_correction_bias, got "
                f"n_group={n_group}, topk_group={topk_group}, "
                f"e_score_correction_bias={'a tensor' if e_score_correction_bias is not None else None}"
            )
        vals, ids = _topk_lowest_index_on_ties(logits, top_k)
        weights = torch.softmax(vals, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor, ids

    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores
    if e_score_correction_bias is not None:
        check_tensor("e_score_correction_bias", e_score_correction_bias, shape=(E,))
        choice = scores + e_score_correction_bias.float().to(scores.device)
    if n_group is not None or topk_group is not None:
        if n_group is None or topk_group is None:
            raise ValueError(f"n_group and topk_group go together, got n_group={n_group}, topk_group={topk_group}")
        check_int("n_group", n_group, lo=1)
        check_int("topk_group", topk_group, lo=1, hi=n_group)
        if E % n_group != 0:
            raise ValueError(f"the number of experts ({E}) must be divisible by n_group, got n_group={n_group}")
        per_group = E // n_group
        grouped = choice.view(T, n_group, per_group)
        top2 = _topk_lowest_index_on_ties(grouped, min(2, per_group))[0]
        group_scores = top2.sum(dim=-1)  # [T, n_group]
        group_ids = _topk_lowest_index_on_ties(group_scores, topk_group)[1]
        group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device)
        group_mask.scatter_(1, group_ids, True)
        expert_mask = group_mask.unsqueeze(-1).expand(T, n_group, per_group).reshape(T, E)
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k ({top_k}) must be <= topk_group * experts per group ({topk_group * per_group})")
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = _topk_lowest_index_on_ties(choice, top_k)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids


def dense_scores(weights_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Scatter top-k weights into a dense ``[T, E]`` float32 score matrix (zeros elsewhere).

    Feeding this to ``index_shuffling`` with the same ``top_k`` selects the same experts when the
    weights are positive and distinct within each row.
    """
    check_tensor("weights_TK", weights_TK, ndim=2)
    check_tensor("ids_TK", ids_TK, dtype=INDEX_DTYPES, shape=tuple(weights_TK.shape), device=weights_TK.device)
    check_int("num_experts", num_experts, lo=weights_TK.shape[1])
    out = torch.zeros(weights_TK.shape[0], num_experts, dtype=torch.float32, device=weights_TK.device)
    return out.scatter_(1, ids_TK.long(), weights_TK.float())


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
    valid_token_count: Optional[torch.Tensor] = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused top-k + per-expert count + sort (MSLK ``index_shuffling`` layout, deterministic).

    ``routing_scores`` ``[T, E]`` (any float dtype, any strides). No score function is applied:
    the top-k of the given values is taken, ties going to the lower expert index. Tokens
    ``t >= valid_token_count[0]`` are ignored. A selection ``(t, slot) -> e`` is *valid* when the
    token is valid and ``start <= e < end``.

    Returns three int32 tensors on the scores' device:

    1. ``token_counts`` ``[E + 2]``: ``[e]`` the number of valid selections of expert ``e``
       (0 outside ``[start, end)``); ``[E]`` = T (padding included); ``[E + 1]`` = number of
       valid selections ``V``.
    2. ``expert_indices`` ``[T * top_k]``: row r's expert minus ``start``.
    3. ``token_indices`` ``[T * top_k]``: row r's token.

    Rows ``r < V`` are the valid selections sorted by ``(expert, token, slot)`` ascending. moekit
    specifies the tail that MSLK leaves undefined: rows ``r >= V`` hold ``-1`` in both index
    outputs, so consumers can skip them without reading ``token_counts``.
    """
    check_tensor("routing_scores", routing_scores, ndim=2)
    if not routing_scores.is_floating_point():
        raise TypeError(f"routing_scores must be a floating tensor, got {routing_scores.dtype}")
    T, E = routing_scores.shape
    if E < 1:
        raise ValueError(f"routing_scores must have at least one expert column, got shape {(T, E)}")
    check_int("top_k", top_k, lo=1, hi=E)
    start, end = expert_range(
        E, expert_index_start, expert_index_end, start_name="expert_index_start", end_name="expert_index_end"
    )
    device = routing_scores.device
    check_optional_count("valid_token_count", valid_token_count, device)

    _, ids = _topk_lowest_index_on_ties(routing_scores.float(), top_k)  # [T, K]
    counts, expert_indices, token_indices, _ = _shuffle_ids(ids, E, start, end, valid_token_count)
    return counts, expert_indices, token_indices


def _shuffle_ids(
    ids: torch.Tensor, E: int, start: int, end: int, valid_token_count: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``index_shuffling`` layout of top-k ids ``[T, K]``, and each sorted row's selection
    (``t * K + slot``; -1 past the valid rows)."""
    T, top_k = ids.shape
    device = ids.device
    N = T * top_k
    tok = torch.arange(T, device=device).unsqueeze(1).expand(T, top_k)
    valid = (ids >= start) & (ids < end)
    if valid_token_count is not None:
        valid &= tok < valid_token_count.reshape(()).to(device=device, dtype=torch.int64)
    # Row key = (expert, token, slot) in one int64; invalid selections sort last.
    key = ids * N + torch.arange(N, device=device).view(T, top_k)
    key = torch.where(valid, key, torch.full_like(key, E * N + N))
    order = torch.sort(key.reshape(-1), stable=True).indices
    nvalid = valid.sum()
    row_valid = torch.arange(N, device=device) < nvalid

    counts = torch.zeros(E + 2, dtype=torch.int64, device=device)
    counts[:E].scatter_add_(0, ids.reshape(-1).clamp(0, E - 1), valid.reshape(-1).long())
    counts[E] = T
    counts[E + 1] = nvalid
    expert_indices = torch.where(row_valid, ids.reshape(-1)[order] - start, -1)
    token_indices = torch.where(row_valid, order // max(top_k, 1), -1)
    selection = torch.where(row_valid, order, -1)
    return counts.int(), expert_indices.int(), token_indices.int(), selection


def route_and_shuffle(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "sigmoid",
    renormalize: bool = False,
    *,
    n_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits to the sorted row layout in one step: ``routing_weights`` (same arguments,
    same contract) followed by ``index_shuffling`` of the chosen experts.

    Returns ``(token_counts [E + 2] int32, expert_indices [T*K] int32, token_indices [T*K] int32,
    row_weights [T*K] float32, selection_rows [T*K] int32)``: the first three exactly as
    ``index_shuffling`` lays them out (rows sorted by (expert, token); experts outside
    ``[expert_index_start, expert_index_end)`` produce no row; the tail holds -1),
    ``row_weights[r]`` the routing weight of row ``r``'s (token, expert) pair (0 in the tail), and
    ``selection_rows[t * K + j]`` the sorted row of token t's j-th choice (-1 when it produced no
    row): the inverse map, token-major.
    """
    weights, ids = routing_weights(
        logits_TE, top_k, score_func, renormalize, n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    E = logits_TE.shape[1]
    start, end = expert_range(
        E, expert_index_start, expert_index_end, start_name="expert_index_start", end_name="expert_index_end"
    )
    return _rows_of_choice(ids, weights, E, start, end)


def _rows_of_choice(ids: torch.Tensor, weights: torch.Tensor, E: int, start: int, end: int):
    """``route_and_shuffle``'s five outputs for a given choice ``ids`` / ``weights [T, K]``."""
    counts, expert_indices, token_indices, sel = _shuffle_ids(ids, E, start, end, None)
    row_weights = torch.where(sel >= 0, weights.reshape(-1).float()[sel.clamp(min=0)], 0.0)
    N = sel.shape[0]
    rows = torch.arange(N, device=sel.device)
    # scatter each valid row to its selection (the tail's rows to a spare last slot): no
    # data-dependent shapes
    selection_rows = torch.full((N + 1,), -1, dtype=torch.int64, device=sel.device)
    selection_rows.scatter_(0, torch.where(sel >= 0, sel, N), torch.where(sel >= 0, rows, -1))
    return counts, expert_indices, token_indices, row_weights.float(), selection_rows[:N].int()


def shuffle_top_k(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    expert_index_start: Optional[int] = None,
    expert_index_end: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted row layout of a routing choice made elsewhere (e.g. a model's own router):
    ``top_k_index [T, K]`` (any integer dtype) and ``top_k_weights [T, K]``.

    Every slot ``(t, j)`` whose expert lies in ``[expert_index_start, expert_index_end)`` (default
    ``[0, num_experts)``) is one row, so a token naming an expert twice gets two rows (each with
    its own weight: the sum over slots that an eager loop computes); any other id (outside the
    range, negative, ``>= num_experts``) produces no row. Rows are sorted by (expert, token,
    slot). Returns ``route_and_shuffle``'s five outputs: ``token_counts [E + 2]`` (rows per
    expert, then ``T``, then the row count), ``expert_indices`` / ``token_indices [T * K]`` int32
    (-1 in the tail), ``row_weights [T * K]`` float32 (0 in the tail) and ``selection_rows [T * K]``
    int32 (slot ``t * K + j``'s row, -1 when it made none)."""
    check_tensor("top_k_index", top_k_index, dtype=INDEX_DTYPES, ndim=2)
    check_tensor("top_k_weights", top_k_weights, shape=tuple(top_k_index.shape), device=top_k_index.device)
    check_int("num_experts", num_experts, lo=1)
    start, end = expert_range(
        num_experts, expert_index_start, expert_index_end, start_name="expert_index_start",
        end_name="expert_index_end",
    )  # fmt: skip
    ids = top_k_index.long()
    return _rows_of_choice(ids, top_k_weights, num_experts, start, end)
