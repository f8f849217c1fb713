"""Grouped GEMMs for MoE experts (MSLK ``mslk.gemm.triton.grouped_gemm`` API) and the dense FP8
row-wise GEMM (MSLK ``f8f8bf16_rowwise``).

- ``grouped_gemm(x, w, m_sizes, bias, token_weights, use_fast_accum, *, ...)``: BF16/FP16/FP32.
- ``grouped_gemm_fp8_rowwise(x, w, m_sizes, x_scale, w_scale, use_fast_accum, *, ...)``: FP8 e4m3fn
  with row-wise dequant scales, bf16 output.
- ``f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias, use_fast_accum)``.

``x [M, K]`` holds rows grouped by expert, ``w [G * N, K]`` (expert g = rows ``g*N:(g+1)*N``,
``y = x @ w_g.T``), ``m_sizes [G]`` int32 (or int64) on x's device, read by the kernel (no host
synchronization: CUDA-graph safe, replays follow new sizes). Rows past ``sum(m_sizes)`` are not
computed (left unwritten in the returned tensor); rows past ``M`` are never touched. N and K must
be multiples of 8.

Fused scatter-add: with ``_output_tensor [T, N]`` and ``_scatter_add_indices [M]`` row i is added
into ``_output_tensor[_scatter_add_indices[i]]`` (negative or ``>= T``: skipped) and
``_output_tensor`` is returned. By default with atomics in the output dtype (bf16 for FP8, like
MSLK: fast, summation order not reproducible); ``deterministic=True`` stores the rows and adds
them token by token (each token's rows summed in ascending row order in float32, then added once:
bitwise reproducible, and the bits of ``scatter_add_dense_tokens(..., deterministic=True)`` on the
rows; costs an ``[M, N]`` scratch buffer and the deterministic scatter-add's three launches).

Registered ops: ``torch.ops.moekit.grouped_gemm``, ``grouped_gemm_fp8_rowwise`` (functional),
``grouped_gemm_scatter_add``, ``grouped_gemm_fp8_rowwise_scatter_add`` (mutate ``output``, return
None) and ``f8f8bf16_rowwise``. On CPU tensors they run the float32 reference.

``use_fast_accum`` matters only for FP8 on the tiled path (see ``moekit.ops._triton.grouped_gemm``);
``_use_warp_specialization`` is accepted for MSLK compatibility and ignored (Triton 3.6 does not
warp-specialize these kernels on Hopper).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch.library import triton_op

from moekit import settings
from moekit._validate import FP8_DTYPE, INDEX_DTYPES, check_bool, check_multiple, check_no_broadcast, check_tensor
from moekit.ops._common import call_op, use_triton

# ``moekit.reference`` re-exports a function named ``grouped_gemm``, which shadows the submodule
# attribute: load the module itself.
_ref = importlib.import_module("moekit.reference.grouped_gemm")

__all__ = [
    "grouped_gemm",
    "combine_rows",
    "grouped_gemm_combine",
    "grouped_gemm_fp8_rowwise",
    "grouped_gemm_swiglu",
    "f8f8bf16_rowwise",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

# ----------------------------------------------------------------------------------------------
# Validation (metadata only: no device synchronization)
# ----------------------------------------------------------------------------------------------


def _check_dims(name: str, v: int, what: str) -> None:
    if v <= 0:
        raise ValueError(f"{name} must be a positive multiple of 8, got {what}={v}")
    check_multiple(f"{name} ({what})", v, 8)


def _validate(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    x_dtypes: tuple,
    bias: Optional[torch.Tensor],
    token_weights: Optional[torch.Tensor],
    output: Optional[torch.Tensor],
    indices: Optional[torch.Tensor],
    out_dtype: Optional[torch.dtype],
    w_dtype: Optional[torch.dtype] = None,
) -> tuple[int, int, int, int]:
    check_tensor("x", x, ndim=2, dtype=x_dtypes)
    M, K = x.shape
    dev = x.device
    check_tensor("w", w, ndim=2, dtype=w_dtype or x.dtype, device=dev)
    check_tensor("m_sizes", m_sizes, ndim=1, dtype=INDEX_DTYPES, device=dev)
    G = m_sizes.shape[0]
    if G < 1:
        raise ValueError("m_sizes must have at least one group, got shape (0,)")
    if w.shape[1] != K:
        raise ValueError(f"w must have K={K} columns like x, got shape {tuple(w.shape)}")
    if w.shape[0] % G != 0 or w.shape[0] == 0:
        raise ValueError(f"w.shape[0] must be G * N with G={G} groups (len(m_sizes)) and N > 0, got {w.shape[0]} rows")
    N = w.shape[0] // G
    _check_dims("x.shape[1]", K, "K")
    _check_dims("w.shape[0] // G", N, "N")
    if bias is not None:
        check_tensor("bias", bias, dtype=_FLOATS, device=dev)
        if bias.numel() != G * N or bias.dim() not in (1, 2):
            raise ValueError(f"bias must have shape [G, N] = [{G}, {N}] (or [G * N]), got shape {tuple(bias.shape)}")
    if token_weights is not None:
        check_tensor("token_weights", token_weights, dtype=_FLOATS, shape=(M,), device=dev)
    if (output is None) != (indices is None):
        raise ValueError(
            "_output_tensor and _scatter_add_indices must be given together, got "
            f"_output_tensor={'None' if output is None else 'a tensor'}, "
            f"_scatter_add_indices={'None' if indices is None else 'a tensor'}"
        )
    if output is not None:
        check_tensor("_output_tensor", output, ndim=2, dtype=out_dtype, device=dev, last_dim_contiguous=True)
        check_no_broadcast("_output_tensor", output)
        if output.shape[1] != N:
            raise ValueError(f"_output_tensor must have N={N} columns, got shape {tuple(output.shape)}")
        check_tensor("_scatter_add_indices", indices, shape=(M,), dtype=INDEX_DTYPES, device=dev)
    return M, K, G, N


def _validate_scales(x_scale: torch.Tensor, w_scale: torch.Tensor, M: int, N_total: int, dev, w_name="w") -> None:
    check_tensor("x_scale", x_scale, dtype=torch.float32, device=dev)
    check_tensor("w_scale", w_scale, dtype=torch.float32, device=dev)
    if x_scale.numel() != M:
        raise ValueError(f"x_scale must have M={M} elements (one per row of x), got shape {tuple(x_scale.shape)}")
    if w_scale.numel() != N_total:
        raise ValueError(
            f"w_scale must have {N_total} elements (one per row of {w_name}), got shape {tuple(w_scale.shape)}"
        )


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1)


# ----------------------------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------------------------


@triton_op("moekit::grouped_gemm", mutates_args=())
def _grouped_gemm_op(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    w_scale: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(x):
        from moekit.ops._triton import grouped_gemm as _tri

        return _tri.grouped_gemm(x, w, m_sizes, bias=_flat(bias), token_weights=token_weights, w_scale=_flat(w_scale))
    return _ref.grouped_gemm(x, w, m_sizes, bias, token_weights, w_scale=w_scale)


@triton_op("moekit::grouped_gemm_scatter_add", mutates_args=("output",))
def _grouped_gemm_scatter_add_op(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    output: torch.Tensor,
    scatter_add_indices: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    deterministic: bool = False,
    w_scale: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> None:
    if use_triton(x):
        from moekit.ops._triton import grouped_gemm as _tri

        _tri.grouped_gemm(
            x, w, m_sizes, bias=_flat(bias), token_weights=token_weights, out=output,
            scatter_indices=scatter_add_indices, deterministic=deterministic, w_scale=_flat(w_scale),
        )  # fmt: skip
        return
    _ref.grouped_gemm(
        x,
        w,
        m_sizes,
        bias,
        token_weights,
        _output_tensor=output,
        _scatter_add_indices=scatter_add_indices,
        w_scale=w_scale,
    )


@triton_op("moekit::grouped_gemm_fp8_rowwise", mutates_args=())
def _grouped_gemm_fp8_rowwise_op(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    token_weights: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(x):
        from moekit.ops._triton import grouped_gemm as _tri

        return _tri.grouped_gemm(
            x, w, m_sizes, x_scale=_flat(x_scale), w_scale=_flat(w_scale), token_weights=token_weights,
            fast_accum=use_fast_accum,
        )  # fmt: skip
    return _ref.grouped_gemm_fp8_rowwise(x, w, m_sizes, x_scale, w_scale, token_weights=token_weights)


@triton_op("moekit::grouped_gemm_fp8_rowwise_scatter_add", mutates_args=("output",))
def _grouped_gemm_fp8_rowwise_scatter_add_op(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    output: torch.Tensor,
    scatter_add_indices: torch.Tensor,
    token_weights: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    deterministic: bool = False,
    cache_tag: str = "",
) -> None:
    if use_triton(x):
        from moekit.ops._triton import grouped_gemm as _tri

        _tri.grouped_gemm(
            x, w, m_sizes, x_scale=_flat(x_scale), w_scale=_flat(w_scale), token_weights=token_weights,
            out=output, scatter_indices=scatter_add_indices, deterministic=deterministic, fast_accum=use_fast_accum,
        )  # fmt: skip
        return
    _ref.grouped_gemm_fp8_rowwise(
        x, w, m_sizes, x_scale, w_scale, token_weights=token_weights, _output_tensor=output,
        _scatter_add_indices=scatter_add_indices,
    )  # fmt: skip


@triton_op("moekit::grouped_gemm_swiglu", mutates_args=())
def _grouped_gemm_swiglu_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_indices: Optional[torch.Tensor] = None,
    row_scales: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(x):
        from moekit.ops._triton import gg_swiglu as _sw

        return _sw.grouped_gemm_swiglu(x, w13, m_sizes, gather_indices, row_scales, _flat(x_scale), _flat(w_scale),
                                       fast_accum=use_fast_accum)  # fmt: skip
    return _ref.grouped_gemm_swiglu(
        x, w13, m_sizes, gather_indices=gather_indices, row_scales=row_scales, x_scale=x_scale, w_scale=w_scale
    )


@triton_op("moekit::grouped_gemm_combine", mutates_args=("out",))
def _grouped_gemm_combine_op(
    z: torch.Tensor,
    w: torch.Tensor,
    expert_indices: torch.Tensor,
    selection_rows: torch.Tensor,
    out: torch.Tensor,
    row_weights: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    cache_tag: str = "",
) -> None:
    if use_triton(z):
        from moekit.ops._triton import gg_combine as _cb

        _cb.grouped_gemm_combine(z, w, expert_indices, selection_rows, out, row_weights, _flat(w_scale))
        return
    _ref.grouped_gemm_combine(z, w, expert_indices, selection_rows, out, row_weights=row_weights, w_scale=w_scale)


@triton_op("moekit::combine_rows", mutates_args=("out",))
def _combine_rows_op(
    out: torch.Tensor, rows: torch.Tensor, selection_rows: torch.Tensor, accumulate: bool = True, cache_tag: str = ""
) -> None:
    if use_triton(rows):
        from moekit.ops._triton import combine_rows as _cr

        _cr.combine_rows(out, rows, selection_rows, accumulate)
        return
    _ref.combine_rows(out, rows, selection_rows, accumulate)


# Dense FP8 on CUDA: the Triton kernel (1 group) below this many rows, torch._scaled_mm (cuBLASLt /
# CUTLASS row-wise) from there on when the layout allows. ``settings.f8_dense`` ($MOEKIT_F8_DENSE)
# pins "triton" or "scaled_mm"; the benchmark measures both (bench_grouped_gemm.py --dense).
SCALED_MM_MIN_ROWS = 1024


def _dense_backend(XQ: torch.Tensor, WQ: torch.Tensor, bias: Optional[torch.Tensor]) -> str:
    choice = settings.get().f8_dense
    if choice == "triton":
        return "triton"
    M, K = XQ.shape
    N = WQ.shape[0]
    fits = (
        hasattr(torch, "_scaled_mm")
        and K % 16 == 0
        and N % 16 == 0
        and XQ.is_contiguous()
        and WQ.is_contiguous()
        and (bias is None or bias.dtype == torch.bfloat16)
    )
    if not fits:
        return "triton"
    if choice == "scaled_mm":
        return "scaled_mm"
    return "scaled_mm" if M >= SCALED_MM_MIN_ROWS else "triton"


@triton_op("moekit::f8f8bf16_rowwise", mutates_args=())
def _f8f8bf16_rowwise_op(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    cache_tag: str = "",
) -> torch.Tensor:
    if use_triton(XQ):
        if _dense_backend(XQ, WQ, bias) == "scaled_mm":
            M, N = XQ.shape[0], WQ.shape[0]
            return torch._scaled_mm(
                XQ, WQ.t(), x_scale.reshape(M, 1), w_scale.reshape(1, N), bias=bias, out_dtype=torch.bfloat16,
                use_fast_accum=use_fast_accum,
            )  # fmt: skip
        from moekit.ops._triton import grouped_gemm as _tri

        return _tri.f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias, use_fast_accum)
    return _ref.f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias)


# ----------------------------------------------------------------------------------------------
# Public API (MSLK signatures)
# ----------------------------------------------------------------------------------------------


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
    deterministic: bool = False,
    w_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y[i] = (x[i] @ w_g.T + bias[g]) * token_weights[i]`` for row ``i`` of group ``g``.

    ``x [M, K]`` bf16/fp16/fp32, ``w [G * N, K]`` same dtype, ``m_sizes [G]`` int32/int64 on the
    device, ``bias [G, N]`` and ``token_weights [M]`` optional. Returns ``[M, N]`` in ``x.dtype``
    (rows past ``sum(m_sizes)`` unwritten), or, with ``_output_tensor [T, N]`` and
    ``_scatter_add_indices [M]``, adds row i into ``_output_tensor[idx[i]]`` and returns
    ``_output_tensor`` (atomics; ``deterministic=True`` for a reproducible order).
    ``w_scale [G * N]`` float32 (moekit): ``w`` is FP8 e4m3fn with row-wise dequant scales and x
    stays 16-bit (weight-only FP8: no activation quantization; decode, where the weights are the
    traffic).
    """
    # x first: the checks below read x.dtype / x.device (a non-tensor x is a TypeError naming x).
    check_tensor("x", x, ndim=2, dtype=_FLOATS)
    check_bool("use_fast_accum", use_fast_accum)
    check_bool("deterministic", deterministic)
    if w_scale is not None:  # before w, whose expected dtype (FP8) depends on w_scale
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=x.device)
    _validate(x, w, m_sizes, _FLOATS, bias, token_weights, _output_tensor, _scatter_add_indices, x.dtype,
              w_dtype=None if w_scale is None else FP8_DTYPE)  # fmt: skip
    if w_scale is not None:
        if w_scale.numel() != w.shape[0]:
            raise ValueError(
                f"w_scale must have {w.shape[0]} elements (one per row of w), got shape {tuple(w_scale.shape)}"
            )
    if _output_tensor is None:
        return call_op(_grouped_gemm_op, x, w, m_sizes, bias, token_weights, use_fast_accum, w_scale)
    call_op(
        _grouped_gemm_scatter_add_op, x, w, m_sizes, _output_tensor, _scatter_add_indices, bias, token_weights,
        use_fast_accum, deterministic, w_scale,
    )  # fmt: skip
    return _output_tensor


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
    deterministic: bool = False,
) -> torch.Tensor:
    """FP8 e4m3fn: ``y[i] = (x[i] @ w_g.T) * x_scale[i] * w_scale[g*N + n] (* token_weights[i])``,
    bf16 ``[M, N]``; ``x_scale [M]`` and ``w_scale [G * N]`` float32 dequant scales. Scatter-add
    and ``deterministic`` as in ``grouped_gemm``."""
    check_bool("use_fast_accum", use_fast_accum)
    check_bool("deterministic", deterministic)
    M, K, G, N = _validate(
        x, w, m_sizes, (FP8_DTYPE,), None, token_weights, _output_tensor, _scatter_add_indices, torch.bfloat16
    )
    _validate_scales(x_scale, w_scale, M, G * N, x.device)
    if _output_tensor is None:
        return call_op(_grouped_gemm_fp8_rowwise_op, x, w, m_sizes, x_scale, w_scale, token_weights, use_fast_accum)
    call_op(
        _grouped_gemm_fp8_rowwise_scatter_add_op, x, w, m_sizes, x_scale, w_scale, _output_tensor,
        _scatter_add_indices, token_weights, use_fast_accum, deterministic,
    )  # fmt: skip
    return _output_tensor


def grouped_gemm_swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    gather_indices: Optional[torch.Tensor] = None,
    row_scales: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """The gate|up GEMM of SwiGLU experts with ``silu(gate) * up`` fused into its epilogue:
    ``z [M, F]`` with ``z[i] = silu(h[i, :F]) * h[i, F:]``, ``h[i] = x[src_i] @ w13_g.T`` for row
    ``i`` of group ``g`` (``m_sizes [G]`` on the device, as in ``grouped_gemm``).

    ``w13 [G * 2F, K]``: each expert's F gate rows, then its F up rows (``w13_e2FD.view(-1, D)``).
    ``gather_indices [M]`` (optional): row i reads token row ``x[gather_indices[i]]`` directly (no
    gathered copy; ``index_shuffling``'s token indices); negative / out-of-range entries leave row
    i unwritten. Without it x holds the M rows. ``row_scales [M]``: a per-row factor on ``h``
    before the SiLU (the router weight applied to the expert input). Dtypes: x and w13 bf16 /
    fp16 / fp32; or FP8 e4m3fn both, with ``x_scale`` (one per x row) and ``w_scale`` ``[G * 2F]``
    float32 dequant scales; or 16-bit x with FP8 ``w13`` and ``w_scale`` (weight-only FP8).
    ``use_fast_accum`` (FP8 x): False promotes the tensor-core sums to float32 every K slice, as
    ``grouped_gemm_fp8_rowwise``. Returns ``z`` in x's dtype (bf16 for FP8 x); rows past
    ``sum(m_sizes)`` are left unwritten. No host synchronization; CUDA-graph capturable.

    Kernels by rows per expert: per-row GEMV (decode), swap-AB streaming tiles (up to 32-48 rows),
    persistent tensor-core tiles beyond (prefill: the gather, the ``[M, 2F]`` intermediate and the
    SiLU pass of the unfused pipeline all skipped).
    """
    check_tensor("x", x, ndim=2, dtype=_FLOATS + (FP8_DTYPE,))
    R, K = x.shape
    dev = x.device
    fp8_x = x.dtype == FP8_DTYPE
    # The scales' kinds before w13, whose expected dtype depends on them.
    if x_scale is not None:
        check_tensor("x_scale", x_scale, dtype=torch.float32, device=dev)
    if w_scale is not None:
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=dev)
    w_dtype = FP8_DTYPE if (fp8_x or w_scale is not None) else x.dtype
    check_tensor("w13", w13, ndim=2, dtype=w_dtype, device=dev)
    check_tensor("m_sizes", m_sizes, ndim=1, dtype=INDEX_DTYPES, device=dev)
    G = m_sizes.shape[0]
    if G < 1:
        raise ValueError("m_sizes must have at least one group, got shape (0,)")
    if w13.shape[1] != K or w13.shape[0] == 0 or w13.shape[0] % (2 * G):
        raise ValueError(
            f"w13 must have shape [G * 2F, K] = [{G} * 2F, {K}] (G = len(m_sizes) groups, F > 0), "
            f"got {tuple(w13.shape)}"
        )
    F = w13.shape[0] // (2 * G)
    _check_dims("x.shape[1]", K, "K")
    _check_dims("w13.shape[0] // (2 * G)", F, "F")
    M = R
    if gather_indices is not None:
        check_tensor("gather_indices", gather_indices, ndim=1, dtype=INDEX_DTYPES, device=dev)
        M = gather_indices.shape[0]
    if row_scales is not None:
        check_tensor("row_scales", row_scales, dtype=_FLOATS, shape=(M,), device=dev)
    if fp8_x:
        if x_scale is None or w_scale is None:
            raise ValueError("FP8 x needs x_scale (one per x row) and w_scale (one per w13 row)")
        if x_scale.numel() != R:
            raise ValueError(f"x_scale must have {R} elements (one per row of x), got shape {tuple(x_scale.shape)}")
    elif x_scale is not None:
        raise ValueError(f"x_scale is for FP8 x only, got x of dtype {x.dtype}")
    if w_scale is not None:
        if w_scale.numel() != G * 2 * F:
            raise ValueError(f"w_scale must have G * 2F = {G * 2 * F} elements, got shape {tuple(w_scale.shape)}")
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    return call_op(_grouped_gemm_swiglu_op, x, w13, m_sizes, gather_indices, row_scales, x_scale, w_scale,
                   use_fast_accum)  # fmt: skip


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
    """The down projection of a decode batch, combined per token (no atomics): ``out[t] += sum_j
    row_weights[r] * (z[r] @ w_e.T)`` over token t's K choices, ``r = selection_rows[t * K + j]``
    (``route_and_shuffle``'s token-major inverse map; negative: skipped), ``e =
    expert_indices[r]``. The K terms are summed in float32 in slot order and added to ``out`` with
    one store per element: bitwise reproducible. ``z [M, F]`` bf16 / fp16 / fp32, ``w [G * N, F]``
    of z's dtype or FP8 e4m3fn with ``w_scale [G * N]`` (weight-only FP8), ``out [T, N]`` of z's
    dtype (contiguous rows), ``row_weights [M]``. Reads each choice's weight slice once per token:
    for a few tokens whose choices rarely share an expert. Returns ``out``.
    """
    check_tensor("z", z, ndim=2, dtype=_FLOATS, last_dim_contiguous=True)
    M, F = z.shape
    dev = z.device
    check_tensor("out", out, ndim=2, dtype=z.dtype, device=dev, last_dim_contiguous=True)
    check_no_broadcast("out", out)
    T, N = out.shape
    if w_scale is not None:  # before w, whose expected dtype (FP8) depends on w_scale
        check_tensor("w_scale", w_scale, dtype=torch.float32, device=dev)
    check_tensor("w", w, ndim=2, dtype=FP8_DTYPE if w_scale is not None else z.dtype, device=dev,
                 last_dim_contiguous=True)  # fmt: skip
    if w.shape[1] != F or N == 0 or w.shape[0] % N:
        raise ValueError(f"w must have shape [G * N, F] = [G * {N}, {F}] (N = out.shape[1]), got {tuple(w.shape)}")
    check_tensor("expert_indices", expert_indices, shape=(M,), dtype=INDEX_DTYPES, device=dev)
    check_tensor("selection_rows", selection_rows, ndim=1, dtype=INDEX_DTYPES, device=dev)
    if T and selection_rows.shape[0] % T:
        raise ValueError(
            f"selection_rows must have T * K entries for out's T={T} tokens, got {selection_rows.shape[0]}"
        )
    if row_weights is not None:
        check_tensor("row_weights", row_weights, shape=(M,), dtype=_FLOATS, device=dev)
    if w_scale is not None:
        if w_scale.numel() != w.shape[0]:
            raise ValueError(f"w_scale must have {w.shape[0]} elements (one per row of w), got {tuple(w_scale.shape)}")
    if M == 0 or T == 0:  # no row to add / no token to add into (the CPU reference indexed empty rows)
        return out
    call_op(_grouped_gemm_combine_op, z, w, expert_indices, selection_rows, out, row_weights, w_scale)
    return out


def combine_rows(
    out: torch.Tensor, rows: torch.Tensor, selection_rows: torch.Tensor, *, accumulate: bool = True
) -> torch.Tensor:
    """Each token's expert-output rows added into ``out`` without atomics: ``out[t] += sum_j
    rows[selection_rows[t * K + j]]`` (``K = len(selection_rows) // T``; negative or ``>= len(rows)``
    entries: no row), the rows summed in float32 in ascending row order and added to ``out`` once:
    bitwise reproducible, and the bits of ``scatter_add_dense_tokens(out, rows, token_indices,
    deterministic=True)`` for the same rows. ``accumulate=False`` stores ``out[t] = sum_j ...``
    instead: out's values are not read, so it need not be zeroed first. ``selection_rows``:
    ``route_and_shuffle``'s token-major inverse map; ``rows [M, D]`` e.g. a grouped GEMM's output
    rows; ``out [T, D]`` of rows' dtype (bf16 / fp16 / fp32). One launch; no host
    synchronization. Returns ``out``."""
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    check_tensor("rows", rows, ndim=2, dtype=_FLOATS, last_dim_contiguous=True)
    check_tensor("out", out, ndim=2, dtype=rows.dtype, device=rows.device, last_dim_contiguous=True)
    check_no_broadcast("out", out)
    T, D = out.shape
    if rows.shape[1] != D:
        raise ValueError(f"rows must have D={D} columns like out, got shape {tuple(rows.shape)}")
    check_tensor("selection_rows", selection_rows, ndim=1, dtype=INDEX_DTYPES, device=rows.device,
                 contiguous=True)  # fmt: skip
    if T and selection_rows.shape[0] % T:
        raise ValueError(
            f"selection_rows must have T * K entries for out's T={T} tokens, got {selection_rows.shape[0]}"
        )
    if not T and selection_rows.shape[0]:
        raise ValueError(f"selection_rows must be empty for an empty out, got {selection_rows.shape[0]} entries")
    call_op(_combine_rows_op, out, rows, selection_rows, accumulate)
    return out


def f8f8bf16_rowwise(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """Dense FP8 row-wise GEMM: ``[M, N] bf16 = (XQ @ WQ.T) * x_scale[:, None] * w_scale[None, :]
    (+ bias [N])``. ``XQ [M, K]``, ``WQ [N, K]`` e4m3fn; K and N multiples of 8."""
    check_tensor("XQ", XQ, ndim=2, dtype=FP8_DTYPE)
    M, K = XQ.shape
    check_tensor("WQ", WQ, ndim=2, dtype=FP8_DTYPE, device=XQ.device)
    N = WQ.shape[0]
    if WQ.shape[1] != K:
        raise ValueError(f"WQ must have K={K} columns like XQ, got shape {tuple(WQ.shape)}")
    _check_dims("XQ.shape[1]", K, "K")
    _check_dims("WQ.shape[0]", N, "N")
    _validate_scales(x_scale, w_scale, M, N, XQ.device, w_name="WQ")
    if bias is not None:
        check_tensor("bias", bias, dtype=_FLOATS, shape=(N,), device=XQ.device)
    return call_op(_f8f8bf16_rowwise_op, XQ, WQ, x_scale, w_scale, bias, check_bool("use_fast_accum", use_fast_accum))
