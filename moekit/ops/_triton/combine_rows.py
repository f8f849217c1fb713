"""Triton kernel of ``combine_rows``: each token's expert-output rows summed into the output, no
atomics.

``out[t] += sum_j rows[selection_rows[t * K + j]]``: one program = ``BLOCK_T`` tokens x a
``BLOCK_D``-column slice. It loads the tokens' ``K`` row indices (``route_and_shuffle``'s
token-major inverse map; negative or ``>= M``: no row), sorts them ascending in registers, adds
the rows in that order in float32 starting from +0.0 and does one read-modify-write of ``out``:
the additions of ``scatter_add_dense_tokens(..., deterministic=True)`` (a token's rows in
ascending row order), so the bits are the same, with one launch instead of its inverse-map
launches. ``ACCUMULATE`` False stores the sums instead (``out`` neither read nor zeroed first).

The experts pipeline's deterministic down projection uses it (``moekit.layers.experts``,
``settings.down_sum``): the GEMM stores its rows (``[M, N]``, written and read once more) and
this kernel sums them. As a replacement of the scatter-add epilogue's bf16 atomics it measured
even (H200, T = 16..256, Qwen3-30B and DeepSeek-V3 TP8: the down GEMM is bound by its weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.ops._common import cdiv, launch, next_pow2
from moekit.ops._triton._pdl import pdl_prologue

# Rows past every valid row index (sorts after them).
_NO_ROW = tl.constexpr(2**31 - 1)


@triton.jit(do_not_specialize=["T", "M"])
def _combine_rows_kernel(
    out_ptr,
    rows_ptr,
    srow_ptr,
    T,
    M,
    D,
    stride_out,
    stride_rows,
    n_db,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACCUMULATE: tl.constexpr = True,
    USE_PDL: tl.constexpr = 0,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    tb = pid // n_db
    db = pid - tb * n_db
    toks = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tin = toks < T
    slots = tl.arange(0, K_PAD)
    sel = tl.load(srow_ptr + toks[:, None] * K + slots[None, :], mask=tin[:, None] & (slots < K)[None, :], other=-1)
    sel = tl.where((sel >= 0) & (sel < M), sel, _NO_ROW).to(tl.int32)
    if K_PAD > 1:
        sel = tl.sort(sel, 1)
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    o_ptr = out_ptr + (toks * stride_out)[:, None] + cols[None, :]
    if ACCUMULATE:
        o = tl.load(o_ptr, mask=tin[:, None] & cm[None, :], other=0.0).to(tl.float32)
    else:  # the sums stored: out's values are not read
        o = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.sum(tl.where(slots[None, :] == j, sel, 0), axis=1)
        h = r != _NO_ROW
        v = tl.load(rows_ptr + (r.to(tl.int64) * stride_rows)[:, None] + cols[None, :],
                    mask=h[:, None] & cm[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip
        acc += v.to(tl.float32)
    tl.store(o_ptr, (o + acc).to(out_ptr.dtype.element_ty), mask=tin[:, None] & cm[None, :])


def combine_config(T: int, D: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): tiles of at most 2048 elements (4 KB of 16-bit rows per row read),
    slices of up to 1024 columns, whole rows of up to 8 tokens when D is short."""
    block_d = min(1024, max(16, next_pow2(D)))
    block_t = max(1, min(8, 2048 // block_d, next_pow2(max(T, 1))))
    return block_t, block_d


def combine_rows(out: torch.Tensor, rows: torch.Tensor, selection_rows: torch.Tensor, accumulate: bool = True) -> None:
    """Launcher (validated arguments: ``out [T, D]``, ``rows [M, D]`` unit last strides,
    ``selection_rows [T * K]`` contiguous; ``accumulate`` False: the sums stored, out not read)."""
    T, D = out.shape
    M = rows.shape[0]
    if T == 0 or D == 0:
        return
    K = selection_rows.shape[0] // T
    bt, bd = combine_config(T, D)
    n_db = cdiv(D, bd)
    launch(_combine_rows_kernel)[(cdiv(T, bt) * n_db,)](
        out, rows, selection_rows, T, M, D, out.stride(0), rows.stride(0), n_db,
        K=K, K_PAD=next_pow2(K), BLOCK_T=bt, BLOCK_D=bd, ACCUMULATE=bool(accumulate), num_warps=4,
    )  # fmt: skip
