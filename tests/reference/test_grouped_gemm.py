"""Grouped GEMM oracles (bf16/fp32 and fp8 row-wise, fused scatter-add) and the dense
f8f8bf16_rowwise GEMM against naive per-row loops."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close, random_m_sizes
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def group_of_each_row(m_sizes: list[int], M: int) -> list[int]:
    """Walk the groups: row i belongs to the group whose span covers it, or -1 past the total."""
    out, g, first = [], 0, 0
    for i in range(M):
        while g < len(m_sizes) and i >= first + m_sizes[g]:
            first += m_sizes[g]
            g += 1
        out.append(g if g < len(m_sizes) else -1)
    return out


def naive_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: list[int],
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
) -> tuple[list[list[float]], list[bool]]:
    """float64 rows of y and which rows are computed, row by row and column by column."""
    M = x.shape[0]
    G = len(m_sizes)
    N = w.shape[0] // G
    xs, ws = x.double().tolist(), w.double().tolist()
    b = None if bias is None else bias.double().reshape(-1).tolist()
    tw = None if token_weights is None else token_weights.double().tolist()
    xsc = None if x_scale is None else x_scale.double().reshape(-1).tolist()
    wsc = None if w_scale is None else w_scale.double().reshape(-1).tolist()
    y, computed = [], []
    for i, g in enumerate(group_of_each_row(m_sizes, M)):
        if g < 0:
            y.append([0.0] * N)
            computed.append(False)
            continue
        row = []
        for n in range(N):
            v = naive.dot(xs[i], ws[g * N + n])
            if xsc is not None:
                v = v * xsc[i] * wsc[g * N + n]
            if b is not None:
                v += b[g * N + n]
            if tw is not None:
                v *= tw[i]
            row.append(v)
        y.append(row)
        computed.append(True)
    return y, computed


def to_t(rows: list[list[float]], M: int, N: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).reshape(M, N)


def check_against(out: torch.Tensor, want64: torch.Tensor):
    """fp32 outputs within fp32 tolerance; bf16 outputs equal to the rounded float64 result
    except for rare one-ulp flips."""
    if out.dtype == torch.float32:
        assert_close(out, want64.float(), dtype=torch.float32)
    else:
        assert_close(out, want64.float().to(out.dtype), dtype=torch.float32, tol=1e-3)


M_SIZES = {
    "zeros_inside": ([3, 0, 5, 0, 2], 10),
    "one_group_all_rows": ([0, 0, 12, 0], 12),
    "sum_below_M": ([2, 3, 1], 9),
    "single_row": ([0, 1], 1),
    "empty": ([0], 0),
    "empty_groups_only": ([0, 0, 0], 4),
    "G6_odd_M": (None, 18),  # random_m_sizes over 6 groups
}


def get_sizes(name):
    sizes, M = M_SIZES[name]
    if sizes is None:
        sizes = random_m_sizes(M, 6, top_k=2, seed=3).tolist()
        M += 1  # one row past the total
    return sizes, M


@pytest.mark.parametrize("case", list(M_SIZES))
@pytest.mark.parametrize("extras", ["plain", "bias_GN", "bias_flat+weights", "weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_naive(case, extras, dtype):
    sizes, M = get_sizes(case)
    G, N, K = len(sizes), 8, 16
    x = rand(M, K, seed=M, dtype=dtype)
    w = rand(G * N, K, seed=G, dtype=dtype)
    m = torch.tensor(sizes, dtype=torch.int32)
    bias = None
    if extras.startswith("bias"):
        bias = rand(G, N, seed=11)
        if extras.startswith("bias_flat"):
            bias = bias.reshape(-1)
    tw = rand(M, seed=12).abs() + 0.1 if "weights" in extras else None
    out = ref.grouped_gemm(x, w, m, bias=bias, token_weights=tw)
    assert out.dtype == dtype and out.shape == (M, N)
    rows, computed = naive_grouped(x, w, sizes, bias=bias, token_weights=tw)
    check_against(out, to_t(rows, M, N))
    for i, c in enumerate(computed):
        if not c:
            assert (out[i] == 0).all()  # rows past sum(m_sizes): zeros in the oracle


@pytest.mark.parametrize("case", ["zeros_inside", "sum_below_M", "G6_odd_M", "empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_fused_scatter_add(case, dtype):
    sizes, M = get_sizes(case)
    G, N, K, T = len(sizes), 8, 16, 5
    x = rand(M, K, seed=M + 1, dtype=dtype)
    w = rand(G * N, K, seed=G + 1, dtype=dtype)
    m = torch.tensor(sizes, dtype=torch.int32)
    g = torch.Generator().manual_seed(M)
    idx = torch.randint(-1, T, (M,), generator=g, dtype=torch.int32)  # negatives skipped, duplicates summed
    tw = rand(M, seed=2).abs()
    out = rand(T, N, seed=9, dtype=dtype)
    base = out.double().tolist()
    res = ref.grouped_gemm(x, w, m, token_weights=tw, _output_tensor=out, _scatter_add_indices=idx)
    assert res is out
    rows, computed = naive_grouped(x, w, sizes, token_weights=tw)
    for i in range(M):
        if computed[i] and idx[i].item() >= 0:
            for n in range(N):
                base[idx[i].item()][n] += rows[i][n]
    check_against(out, to_t(base, T, N))


def test_grouped_gemm_scatter_into_empty_output():
    x, w = rand(3, 16), rand(2 * 8, 16)
    out = torch.zeros(0, 8)
    res = ref.grouped_gemm(x, w, torch.tensor([2, 1]), _output_tensor=out, _scatter_add_indices=torch.full((3,), -1))
    assert res is out and out.shape == (0, 8)


def fp8_operands(M, K, G, N, seed):
    xq, xs = ref.quantize_fp8_row(rand(M, K, seed=seed, scale=2.0))
    wq, ws = ref.quantize_fp8_row(rand(G * N, K, seed=seed + 1, scale=0.1))
    return xq, xs, wq, ws


@pytest.mark.parametrize("case", ["zeros_inside", "one_group_all_rows", "sum_below_M", "G6_odd_M", "empty"])
@pytest.mark.parametrize("scatter", [False, True])
def test_grouped_gemm_fp8_rowwise_matches_naive(case, scatter):
    sizes, M = get_sizes(case)
    G, N, K, T = len(sizes), 8, 32, 4
    xq, xs, wq, ws = fp8_operands(M, K, G, N, seed=M)
    m = torch.tensor(sizes, dtype=torch.int64)
    tw = rand(M, seed=5).abs() + 0.5
    rows, computed = naive_grouped(xq.float(), wq.float(), sizes, token_weights=tw, x_scale=xs, w_scale=ws)
    if not scatter:
        out = ref.grouped_gemm_fp8_rowwise(xq, wq, m, xs, ws, token_weights=tw)
        assert out.dtype == torch.bfloat16 and out.shape == (M, N)
        check_against(out, to_t(rows, M, N))
        return
    idx = torch.arange(M) % (T + 1) - 1  # -1, 0, 1, ..., T-1, -1, ...
    out = rand(T, N, seed=1, dtype=torch.bfloat16)
    base = out.double().tolist()
    for i in range(M):
        if computed[i] and idx[i] >= 0:
            for n in range(N):
                base[idx[i]][n] += rows[i][n]
    res = ref.grouped_gemm_fp8_rowwise(
        xq, wq, m, xs, ws, token_weights=tw, _output_tensor=out, _scatter_add_indices=idx
    )
    assert res is out
    check_against(out, to_t(base, T, N))


@pytest.mark.parametrize("M,N,K", [(0, 8, 16), (1, 8, 16), (7, 24, 32), (5, 6, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_f8f8bf16_rowwise_matches_naive(M, N, K, with_bias):
    xq, xs = ref.quantize_fp8_row(rand(M, K, seed=M, scale=3.0))
    wq, ws = ref.quantize_fp8_row(rand(N, K, seed=N, scale=0.2))
    bias = rand(N, seed=1, dtype=torch.bfloat16) if with_bias else None
    out = ref.f8f8bf16_rowwise(xq, wq, xs, ws, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    xf, wf = xq.double().tolist(), wq.double().tolist()
    want = []
    for i in range(M):
        row = []
        for n in range(N):
            v = naive.dot(xf[i], wf[n]) * xs[i].item() * ws[n].item()
            if bias is not None:
                v += bias[n].item()
            row.append(v)
        want.append(row)
    check_against(out, to_t(want, M, N))


def test_fp8_grouped_equals_dense_per_group():
    """One group: grouped fp8 GEMM == dense f8f8bf16_rowwise on the same operands."""
    M, N, K = 6, 8, 32
    xq, xs, wq, ws = fp8_operands(M, K, 1, N, seed=4)
    a = ref.grouped_gemm_fp8_rowwise(xq, wq, torch.tensor([M]), xs, ws)
    b = ref.f8f8bf16_rowwise(xq, wq, xs, ws)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- argument errors

X = torch.rand(6, 16)
W = torch.rand(16, 16)
MS = torch.tensor([4, 2], dtype=torch.int32)
XQ, XS = ref.quantize_fp8_row(X)
WQ, WS = ref.quantize_fp8_row(W)

BAD_CALLS = [
    (lambda: ref.grouped_gemm(X.int(), W, MS), TypeError, "x"),
    (lambda: ref.grouped_gemm(X[0], W, MS), ValueError, "x"),
    (lambda: ref.grouped_gemm(X, W.double(), MS), TypeError, "w"),
    (lambda: ref.grouped_gemm(X, W[:, :8], MS), ValueError, "w"),
    (lambda: ref.grouped_gemm(X, W[:15], MS), ValueError, "w"),
    (lambda: ref.grouped_gemm(X, W, MS.float()), TypeError, "m_sizes"),
    (lambda: ref.grouped_gemm(X, W, MS[:0]), ValueError, "m_sizes"),
    (lambda: ref.grouped_gemm(X, W, MS[None]), ValueError, "m_sizes"),
    (lambda: ref.grouped_gemm(X, W, MS, bias=torch.zeros(2, 7)), ValueError, "bias"),
    (lambda: ref.grouped_gemm(X, W, MS, token_weights=torch.ones(5)), ValueError, "token_weights"),
    (
        lambda: ref.grouped_gemm(X, W, MS, _scatter_add_indices=torch.zeros(6, dtype=torch.int32)),
        ValueError,
        "_scatter_add_indices",
    ),
    (lambda: ref.grouped_gemm(X, W, MS, _output_tensor=torch.zeros(3, 8)), TypeError, "_scatter_add_indices"),
    (
        lambda: ref.grouped_gemm(
            X, W, MS, _output_tensor=torch.zeros(3, 7), _scatter_add_indices=torch.zeros(6, dtype=torch.int32)
        ),
        ValueError,
        "_output_tensor",
    ),
    (
        lambda: ref.grouped_gemm(
            X,
            W,
            MS,
            _output_tensor=torch.zeros(3, 8, dtype=torch.bfloat16),
            _scatter_add_indices=torch.zeros(6, dtype=torch.int32),
        ),
        TypeError,
        "_output_tensor",
    ),
    (
        lambda: ref.grouped_gemm(
            X, W, MS, _output_tensor=torch.zeros(3, 8), _scatter_add_indices=torch.zeros(5, dtype=torch.int32)
        ),
        ValueError,
        "_scatter_add_indices",
    ),
    (lambda: ref.grouped_gemm_fp8_rowwise(X.bfloat16(), W.bfloat16(), MS, XS, WS), TypeError, "x"),
    (lambda: ref.grouped_gemm_fp8_rowwise(XQ, W, MS, XS, WS), TypeError, "w"),
    (lambda: ref.grouped_gemm_fp8_rowwise(XQ, WQ, MS, XS.bfloat16(), WS), TypeError, "x_scale"),
    (lambda: ref.grouped_gemm_fp8_rowwise(XQ, WQ, MS, XS[:5], WS), ValueError, "x_scale"),
    (lambda: ref.grouped_gemm_fp8_rowwise(XQ, WQ, MS, XS, WS[:8]), ValueError, "w_scale"),
    (lambda: ref.grouped_gemm_fp8_rowwise(XQ, WQ, MS, XS, WS.double()), TypeError, "w_scale"),
    (lambda: ref.f8f8bf16_rowwise(X, WQ, XS, WS), TypeError, "XQ"),
    (lambda: ref.f8f8bf16_rowwise(XQ, WQ[:, :8], XS, WS), ValueError, "WQ"),
    (lambda: ref.f8f8bf16_rowwise(XQ, W, XS, WS), TypeError, "WQ"),
    (lambda: ref.f8f8bf16_rowwise(XQ, WQ, XS[:2], WS), ValueError, "x_scale"),
    (lambda: ref.f8f8bf16_rowwise(XQ, WQ, XS, WS[:3]), ValueError, "w_scale"),
    (lambda: ref.f8f8bf16_rowwise(XQ, WQ, XS, WS, bias=torch.zeros(15)), ValueError, "bias"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (aten.mm / addmm / bmm) run under it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_grouped_product_only_groups_with_rows():
    """Eager on the CPU every group's product covers its own rows only (one product per group that
    has rows, its weights converted alone), for rows in any order and rows of no group (``G``):
    the values of every row against every group's weights, selected."""
    from moekit.reference.grouped_gemm import _grouped_product

    g = torch.Generator().manual_seed(3)
    G, N, K, M = 8, 24, 40, 30
    x = torch.randn(M, K, generator=g)
    w = torch.randn(G * N, K, generator=g).bfloat16()
    group = torch.tensor([5, 2, 8, 5, 2, 2, 8, 5] * 3 + [2, 5, 2, 8, 8, 5])  # 8 = G: no group
    with _CountMM() as c:
        y = _grouped_product(x, w, group, G, N)
    assert c.n == 2, c.n
    every = torch.stack([x @ w.float().view(G, N, K)[e].T for e in range(G)])  # [G, M, N]
    want = torch.where((group < G)[:, None], every[group.clamp(max=G - 1), torch.arange(M)], 0.0)
    assert_close(y, want, tol=1e-6)
    assert (y[group == G] == 0).all()


def test_grouped_gemm_combine_cpu_products_per_expert():
    """``grouped_gemm_combine`` on the CPU: one product per expert that some (token, slot) pair
    uses, the same sums as the naive per-pair loop."""
    g = torch.Generator().manual_seed(4)
    T, K, G, N, F = 6, 3, 7, 16, 12
    z = torch.randn(T * K, F, generator=g)
    w = torch.randn(G * N, F, generator=g)
    experts = torch.tensor([1, 4, 4, 0, 1, 1, 4, 0, 0, 1, 4, 1, 0, 0, 4, 1, 1, 4], dtype=torch.int32)
    sel = torch.randperm(T * K, generator=g).to(torch.int32)
    sel[5] = -1  # a slot with no row
    rw = torch.rand(T * K, generator=g)
    out = torch.randn(T, N, generator=g)
    want = out.clone()
    for t in range(T):
        acc = torch.zeros(N)
        for j in range(K):
            r = int(sel[t * K + j])
            if r >= 0:
                acc += rw[r] * (z[r] @ w.view(G, N, F)[int(experts[r])].T)
        want[t] += acc
    with _CountMM() as c:
        got = ref.grouped_gemm_combine(z, w, experts, sel, out.clone(), row_weights=rw)
    assert c.n == 3, c.n  # experts 0, 1 and 4
    assert_close(got, want, tol=1e-5)
