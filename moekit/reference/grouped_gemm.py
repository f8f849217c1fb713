"""Grouped GEMM oracles (BF16 and FP8 row-wise) and the dense FP8 row-wise GEMM.

``x [M, K]`` holds rows grouped by expert: group ``g`` owns the next ``m_sizes[g]`` rows.
``w [G * N, K]``: expert ``g``'s weight is rows ``g*N:(g+1)*N``. Rows past ``sum(m_sizes)`` (or
past ``M``) are not computed: zeros here, untouched by kernels. All math in float32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from moekit._validate import FP8_DTYPE, INDEX_DTYPES, check_tensor

__all__ = [
    "grouped_gemm",
    "grouped_gemm_fp8_rowwise",
    "grouped_gemm_swiglu",
    "grouped_gemm_combine",
    "f8f8bf16_rowwise",
    "group_of_rows",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def group_of_rows(m_sizes: torch.Tensor, M: int) -> torch.Tensor:
    """``[M]`` int64: the group of each row of x, ``G`` for rows past ``sum(m_sizes)``."""
    ends = torch.cumsum(m_sizes.long(), 0)
    return torch.searchsorted(ends, torch.arange(M, device=m_sizes.device), right=True)


def _check_common(x, w, m_sizes, x_dtypes, name_w="w", w_dtype=None):
    check_tensor("x", x, ndim=2, dtype=x_dtypes)
    M, K = x.shape
    check_tensor(name_w, w, ndim=2, dtype=w_dtype or x.dtype, device=x.device)
    check_tensor("m_sizes", m_sizes, ndim=1, dtype=INDEX_DTYPES, device=x.device)
    G = m_sizes.shape[0]
    if G < 1:
        raise ValueError("m_sizes must have at least one group, got shape (0,)")
    if w.shape[1] != K:
        raise ValueError(f"{name_w} must have K={K} columns like x, got shape {tuple(w.shape)}")
    if w.shape[0] % G != 0:
        raise ValueError(f"{name_w}.shape[0] must be G * N with G={G} groups (len(m_sizes)), got {w.shape[0]} rows")
    return M, K, G, w.shape[0] // G


def _finish(y32, group, G, M, N, out_dtype, token_weights, output_tensor, scatter_add_indices):
    valid = group < G
    if token_weights is not None:
        check_tensor("token_weights", token_weights, shape=(M,), device=y32.device)
        y32 = y32 * token_weights.float().unsqueeze(1)
    y32 = torch.where(valid.unsqueeze(1), y32, 0.0)
    if output_tensor is None:
        if scatter_add_indices is not None:
            raise ValueError("_scatter_add_indices needs _output_tensor")
        return y32.to(out_dtype)
    check_tensor("_output_tensor", output_tensor, ndim=2, dtype=out_dtype, device=y32.device)
    if output_tensor.shape[1] != N:
        raise ValueError(f"_output_tensor must have N={N} columns, got shape {tuple(output_tensor.shape)}")
    check_tensor("_scatter_add_indices", scatter_add_indices, shape=(M,), dtype=INDEX_DTYPES, device=y32.device)
    idx = scatter_add_indices.long()
    use = valid & (idx >= 0) & (idx < output_tensor.shape[0])
    acc = output_tensor.float()
    acc.index_add_(0, torch.where(use, idx, 0), torch.where(use.unsqueeze(1), y32, 0.0))
    output_tensor.copy_(acc.to(output_tensor.dtype))
    return output_tensor


def _grouped_product(x32: torch.Tensor, w: torch.Tensor, group: torch.Tensor, G: int, N: int) -> torch.Tensor:
    """``y[i] = x32[i] @ w_g.T`` (float32) for row ``i`` of group ``g = group[i] < G``, 0 for rows of
    group ``G``; ``w [G * N, K]`` in its own dtype, converted to float32 group by group.

    Eager on the CPU (moekit's CPU path runs these functions) each group's product is taken on its
    own rows and only the groups that have rows convert their weights: a Qwen3-30B layer at 16
    tokens took 1.8 s when every one of its 128 experts multiplied all rows. Elsewhere (traced by
    torch.compile, fake tensors, or CUDA tensors without Triton) every group multiplies every row
    and the rows are selected after: no data-dependent shapes, no host reads of device data."""
    M, K = x32.shape
    y = torch.zeros(M, N, dtype=torch.float32, device=x32.device)
    w_g = w.view(G, N, K)
    if not M:
        return y
    if x32.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(x32) and not is_fake(group):
        counts = torch.bincount(group, minlength=G + 1)[:G].tolist()
        order = torch.argsort(group, stable=True)
        start = 0
        for g, c in enumerate(counts):
            if c:
                rows = order[start : start + c]
                y.index_copy_(0, rows, x32.index_select(0, rows) @ w_g[g].float().T)
            start += c
        return y
    w32 = w_g.float()
    for g in range(G):  # the oracle favours clarity over speed
        rows = group == g
        y = torch.where(rows.unsqueeze(1), x32 @ w32[g].T, y)
    return y


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    *,
    _use_warp_specialization: bool = True,
    _output_tensor: Optional[torch.Tensor] = None,
    _scatter_add_indices: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y[i] = (x[i] @ w_g.T + bias[g]) * token_weights[i]`` for row ``i`` of group ``g``.

    ``bias`` ``[G, N]`` (or ``[G * N]``), ``token_weights`` ``[M]``; output ``[M, N]`` in
    ``x.dtype``. With ``_output_tensor`` ``[T, N]`` and ``_scatter_add_indices`` ``[M]``:
    ``_output_tensor[idx[i]] += y[i]`` for computed rows (negative ``idx`` skipped), returning
    ``_output_tensor``. ``use_fast_accum`` and ``_use_warp_specialization`` are tuning hints.
    With ``w_scale`` ``[G * N]`` float32, ``w`` is FP8 e4m3fn with row-wise dequant scales and ``x``
    stays 16/32-bit (weight-only FP8): ``w_g[n] = w_scale[g*N + n] * wq_g[n]``.
    """
    M, K, G, N = _check_common(x, w, m_sizes, _FLOATS, w_dtype=None if w_scale is None else FP8_DTYPE)
    group = group_of_rows(m_sizes, M)
    y = _grouped_product(x.float(), w, group, G, N)
    if w_scale is not None:
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=x.device)
        if w_scale.numel() != G * N:
            raise ValueError(f"w_scale must have G * N = {G * N} elements, got shape {tuple(w_scale.shape)}")
        y = y * w_scale.reshape(G, N)[group.clamp(max=G - 1)]
    if bias is not None:
        check_tensor("bias", bias, device=x.device)
        if bias.numel() != G * N:
            raise ValueError(f"bias must have G * N = {G * N} elements ([G, N]), got shape {tuple(bias.shape)}")
        b = bias.float().reshape(G, N)
        y = y + b[group.clamp(max=G - 1)]
    return _finish(y, group, G, M, N, x.dtype, token_weights, _output_tensor, _scatter_add_indices)


def grouped_gemm_fp8_rowwise(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    use_fast_accum: bool = True,
    *,
    token_weights: Optional[torch.Tensor] = None,
    _use_warp_specialization: bool = True,
    _output_tensor: Optional[torch.Tensor] = None,
    _scatter_add_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FP8 e4m3fn: ``y[i] = (x[i] @ w_g.T) * x_scale[i] * w_scale[g*N + n]`` (dequant scales),
    output bf16 ``[M, N]``; ``token_weights`` and the fused scatter-add as in ``grouped_gemm``."""
    M, K, G, N = _check_common(x, w, m_sizes, (FP8_DTYPE,))
    check_tensor("x_scale", x_scale, dtype=torch.float32, device=x.device)
    check_tensor("w_scale", w_scale, dtype=torch.float32, device=x.device)
    if x_scale.numel() != M:
        raise ValueError(f"x_scale must have M={M} elements, got shape {tuple(x_scale.shape)}")
    if w_scale.numel() != G * N:
        raise ValueError(f"w_scale must have G * N = {G * N} elements, got shape {tuple(w_scale.shape)}")
    group = group_of_rows(m_sizes, M)
    y = _grouped_product(x.float(), w, group, G, N)
    ws = w_scale.reshape(G, N)[group.clamp(max=G - 1)]
    y = y * x_scale.reshape(M, 1) * ws
    return _finish(y, group, G, M, N, torch.bfloat16, token_weights, _output_tensor, _scatter_add_indices)


def grouped_gemm_swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    gather_indices: Optional[torch.Tensor] = None,
    row_scales: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gate|up grouped GEMM with the SwiGLU fused: ``z[i] = silu(h[i, :F]) * h[i, F:]`` with
    ``h[i] = (x[src_i] @ w13_g.T) * x_scale[src_i] * w_scale[g rows] * row_scales[i]`` for row ``i``
    of group ``g`` (``m_sizes`` as in ``grouped_gemm``).

    ``w13`` ``[G * 2F, K]``: group g's ``2F`` rows are its F gate rows, then its F up rows.
    ``src_i = gather_indices[i]`` when given (``M = len(gather_indices)`` rows read from ``x`` by
    index, no gathered copy; a negative or out-of-range index leaves row i uncomputed), else
    ``src_i = i`` (``M = x.shape[0]``). ``x`` bf16/fp16/fp32, or FP8 e4m3fn with ``x_scale``
    ``[x rows]``; ``w13`` of x's dtype, or FP8 with ``w_scale`` ``[G * 2F]`` (with 16-bit x: weight-only
    FP8). ``row_scales`` ``[M]`` (the router weight applied to the expert's input) scales ``h``
    before the SiLU. Returns ``[M, F]`` in x's dtype (bf16 for FP8 x); rows not computed are 0 here
    (left unwritten by the kernels).
    """
    fp8_x = x.dtype == FP8_DTYPE
    check_tensor("x", x, ndim=2, dtype=_FLOATS + (FP8_DTYPE,))
    R, K = x.shape
    w_dtype = FP8_DTYPE if (w_scale is not None or fp8_x) else x.dtype
    check_tensor("w13", w13, ndim=2, dtype=w_dtype, device=x.device)
    check_tensor("m_sizes", m_sizes, ndim=1, dtype=INDEX_DTYPES, device=x.device)
    G = m_sizes.shape[0]
    if G < 1 or w13.shape[0] % (2 * G) or w13.shape[1] != K:
        raise ValueError(
            f"w13 must have shape [G * 2F, K] = [{G} * 2F, {K}] (G = len(m_sizes)), got {tuple(w13.shape)}"
        )
    twoF = w13.shape[0] // G
    F = twoF // 2
    if gather_indices is not None:
        check_tensor("gather_indices", gather_indices, ndim=1, dtype=INDEX_DTYPES, device=x.device)
        M = gather_indices.shape[0]
        src = gather_indices.long()
    else:
        M = R
        src = torch.arange(M, device=x.device)
    ok = (src >= 0) & (src < R)
    src = torch.where(ok, src, 0)
    xr = x.float()[src] if R else torch.zeros(M, K, device=x.device)
    group = group_of_rows(m_sizes, M)
    h = _grouped_product(xr, w13, group, G, twoF)
    if fp8_x:
        check_tensor("x_scale", x_scale, dtype=torch.float32, device=x.device)
        if x_scale.numel() != R:
            raise ValueError(f"x_scale must have {R} elements (one per row of x), got shape {tuple(x_scale.shape)}")
        h = h * x_scale.reshape(-1)[src].unsqueeze(1) if R else h
    if w_dtype == FP8_DTYPE:
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=x.device)
        if w_scale.numel() != G * twoF:
            raise ValueError(f"w_scale must have G * 2F = {G * twoF} elements, got shape {tuple(w_scale.shape)}")
        h = h * w_scale.reshape(G, twoF)[group.clamp(max=G - 1)]
    if row_scales is not None:
        check_tensor("row_scales", row_scales, shape=(M,), device=x.device)
        h = h * row_scales.float().unsqueeze(1)
    z = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    z = torch.where((ok & (group < G)).unsqueeze(1), z, 0.0)
    return z.to(torch.bfloat16 if fp8_x else x.dtype)


def grouped_gemm_combine(
    z: torch.Tensor,
    w: torch.Tensor,
    expert_indices: torch.Tensor,
    selection_rows: torch.Tensor,
    out: torch.Tensor,
    *,
    row_weights: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The down projection combined per token: ``out[t] += sum_j rw[r] * (z[r] @ w_e.T)`` over
    token t's choices ``j < K`` (``K = len(selection_rows) // T``), with ``r =
    selection_rows[t * K + j]`` (skipped when negative or ``>= len(z)``) and ``e =
    expert_indices[r]``; the K terms summed in float32 in slot order, added to ``out`` once.
    ``w [G * N, F]`` (x's dtype, or FP8 with ``w_scale [G * N]``), ``z [M, F]``, ``out [T, N]``.
    Returns ``out``."""
    check_tensor("out", out, ndim=2, dtype=_FLOATS)
    T, N = out.shape
    check_tensor("z", z, ndim=2, dtype=_FLOATS, device=out.device)
    M, F = z.shape
    check_tensor("w", w, ndim=2, device=out.device)
    if w.shape[1] != F or w.shape[0] % max(N, 1):
        raise ValueError(f"w must have shape [G * {N}, {F}], got {tuple(w.shape)}")
    G = w.shape[0] // max(N, 1)
    if T == 0 or M == 0:  # no token to add into / no row to add
        return out
    K = selection_rows.numel() // T
    rows = selection_rows.long().view(T, K)
    ok = (rows >= 0) & (rows < M)
    rs = rows.clamp(0, max(M - 1, 0))
    e = expert_indices.long()[rs] if M else torch.zeros_like(rs)
    ok &= (e >= 0) & (e < G)
    e = e.clamp(0, max(G - 1, 0))
    # Every (token, slot) pair's product with its expert's weights, [T, K, N]; pairs of no row in
    # group G (not computed).
    pairs = _grouped_product(z.float()[rs.reshape(-1)], w, torch.where(ok, e, G).reshape(-1), G, N).view(T, K, N)
    if w_scale is not None:
        pairs = pairs * w_scale.float().view(G, N)[e]
    acc = torch.zeros(T, N, dtype=torch.float32, device=out.device)
    for j in range(K):
        y = pairs[:, j]
        if row_weights is not None:
            y = y * row_weights.float()[rs[:, j]].unsqueeze(-1)
        acc = acc + torch.where(ok[:, j : j + 1], y, 0.0)
    out.copy_((out.float() + acc).to(out.dtype))
    return out


def combine_rows(
    out: torch.Tensor, rows: torch.Tensor, selection_rows: torch.Tensor, accumulate: bool = True
) -> torch.Tensor:
    """Each token's expert-output rows added into ``out``: ``out[t] += sum_j rows[r]`` over
    ``r = selection_rows[t * K + j]`` (``K = len(selection_rows) // T``; skipped when negative or
    ``>= len(rows)``), summed in float32 in ascending row order and added to ``out`` once
    (``accumulate`` False: ``out[t] = sum_j rows[r]``, out's values not read). ``out [T, D]``,
    ``rows [M, D]`` of one floating dtype. Returns ``out``."""
    check_tensor("out", out, ndim=2, dtype=_FLOATS)
    T, D = out.shape
    check_tensor("rows", rows, ndim=2, dtype=out.dtype, device=out.device)
    if rows.shape[1] != D:
        raise ValueError(f"rows must have D={D} columns like out, got shape {tuple(rows.shape)}")
    if T == 0:
        return out
    M = rows.shape[0]
    K = selection_rows.numel() // T
    sel = selection_rows.long().view(T, K)
    ok = (sel >= 0) & (sel < M)
    sel = torch.where(ok, sel, M).sort(dim=1).values  # ascending, the missing ones last
    padded = torch.cat([rows.float(), torch.zeros(1, D, dtype=torch.float32, device=rows.device)])
    acc = torch.zeros(T, D, dtype=torch.float32, device=out.device)
    for j in range(K):
        acc = acc + padded[sel[:, j]]
    out.copy_((out.float() + acc if accumulate else acc).to(out.dtype))
    return out


def f8f8bf16_rowwise(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """Dense FP8 row-wise GEMM: ``[M, N] bf16 = (XQ @ WQ.T) * x_scale[:, None] * w_scale[None, :] (+ bias)``."""
    check_tensor("XQ", XQ, ndim=2, dtype=FP8_DTYPE)
    M, K = XQ.shape
    check_tensor("WQ", WQ, ndim=2, dtype=FP8_DTYPE, device=XQ.device)
    N = WQ.shape[0]
    if WQ.shape[1] != K:
        raise ValueError(f"WQ must have K={K} columns like XQ, got shape {tuple(WQ.shape)}")
    check_tensor("x_scale", x_scale, dtype=torch.float32, device=XQ.device)
    check_tensor("w_scale", w_scale, dtype=torch.float32, device=XQ.device)
    if x_scale.numel() != M:
        raise ValueError(f"x_scale must have M={M} elements, got shape {tuple(x_scale.shape)}")
    if w_scale.numel() != N:
        raise ValueError(f"w_scale must have N={N} elements, got shape {tuple(w_scale.shape)}")
    y = (XQ.float() @ WQ.float().T) * x_scale.reshape(M, 1) * w_scale.reshape(1, N)
    if bias is not None:
        check_tensor("bias", bias, shape=(N,), device=XQ.device)
        y = y + bias.float()
    return y.to(torch.bfloat16)
