"""RMSNorm and MoE-tail oracles (rms_norm, topk_finalize, rank_sum, all_reduce_rms_norm,
reduce_scatter_hidden, moe_tail) against naive loops over tokens, slots and simulated ranks."""

from __future__ import annotations

import math

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close, rel_error
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def naive_rms_norm(x, gamma, eps, fp32_internal, residual=None):
    """float64 rows, token by token. In the bf16 mode the input (after the float32 residual
    add) is rounded to bf16 and every square is rounded to bf16 before the float64 sum."""
    D = x.shape[-1]
    rows = x.float().reshape(-1, D).tolist()
    res = None if residual is None else residual.float().reshape(-1, D).tolist()
    g = gamma.double().tolist()
    out = []
    for i, row in enumerate(rows):
        v = [naive.f32(row[d] + res[i][d]) for d in range(D)] if res is not None else list(row)
        if fp32_internal:
            sq = [u * u for u in v]
        else:
            v = [naive.bf16(u) for u in v]
            sq = [naive.bf16(u * u) for u in v]
        inv = 1.0 / math.sqrt(sum(sq) / D + eps)
        out.append([v[d] * inv * g[d] for d in range(D)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


RMS_SHAPES = [(0, 16), (1, 16), (7, 24), (3, 5), (2, 3, 32)]


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp32_internal", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm_matches_naive(shape, dtype, fp32_internal, with_residual, eps):
    x = rand(*shape, seed=len(shape) + shape[0], dtype=dtype, scale=3.0)
    gamma = rand(shape[-1], seed=1, dtype=torch.bfloat16)
    residual = rand(*shape, seed=2, dtype=dtype) if with_residual else None
    y = ref.rms_norm(x, gamma, eps, fp32_internal, residual)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert_close(y, naive_rms_norm(x, gamma, eps, fp32_internal, residual).float(), dtype=torch.float32)


def test_rms_norm_bf16_mode_differs_from_fp32_mode():
    x = rand(6, 64, seed=5, scale=2.0)  # float32 values that bf16 cannot hold
    gamma = torch.ones(64)
    fp32 = ref.rms_norm(x, gamma, fp32_internal=True)
    bf16 = ref.rms_norm(x, gamma, fp32_internal=False)
    assert rel_error(bf16, fp32) > 1e-4  # the bf16 mode really rounds
    assert_close(bf16, naive_rms_norm(x, gamma, 1e-6, False).float(), dtype=torch.float32)
    assert_close(fp32, naive_rms_norm(x, gamma, 1e-6, True).float(), dtype=torch.float32)
    # Squares are rounded to bf16 too, not only the input: a value whose square is not a bf16.
    v = torch.tensor([[1.0 + 2**-7, 1.0]])  # both exact in bf16; (1 + 2^-7)^2 is not
    y = ref.rms_norm(v, torch.ones(2), eps=0.0, fp32_internal=False)
    sq = naive.bf16((1 + 2**-7) ** 2) + 1.0
    assert y[0, 1].item() == pytest.approx(1.0 / math.sqrt(sq / 2), rel=1e-7)


# ----------------------------------------------------------------------------- topk_finalize


def naive_finalize(gemm2, weights, idx):
    rows = gemm2.double().tolist()
    w = weights.double().tolist()
    ix = idx.tolist()
    L = gemm2.shape[1]
    out = []
    for t in range(len(ix)):
        acc = [0.0] * L
        for k in range(len(ix[t])):
            i = ix[t][k]
            if 0 <= i < len(rows):
                for d in range(L):
                    acc[d] += w[t][k] * rows[i][d]
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64).reshape(len(ix), L)


@pytest.mark.parametrize("M,K,rows,L", [(0, 2, 4, 8), (1, 1, 1, 8), (7, 4, 20, 16), (5, 8, 12, 24), (3, 2, 0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_finalize_matches_naive(M, K, rows, L, dtype):
    g = torch.Generator().manual_seed(M * 10 + K)
    gemm2 = rand(rows, L, seed=rows, dtype=dtype)
    weights = rand(M, K, seed=M, dtype=dtype).abs()
    idx = torch.randint(-1, max(rows, 1), (M, K), generator=g, dtype=torch.int32)  # -1: not local
    if rows == 0:
        idx.fill_(-1)
    if M > 2:
        idx[2] = -1  # a token with no local expert: zeros
    out = ref.topk_finalize(gemm2, weights, idx)
    assert out.dtype == torch.float32 and out.shape == (M, L)
    assert_close(out, naive_finalize(gemm2, weights, idx).float(), dtype=torch.float32)
    if M > 2:
        assert (out[2] == 0).all()


# ----------------------------------------------------------------------------- collectives over simulated ranks


@pytest.mark.parametrize("R", [1, 2, 4])
def test_rank_sum_is_float32_in_rank_order(R):
    xs = [rand(5, 7, seed=r, dtype=torch.bfloat16, scale=10.0**r) for r in range(R)]
    s = ref.rank_sum(xs)
    want = [[0.0] * 7 for _ in range(5)]
    for r in range(R):  # sequential float32 accumulation, rank 0 first
        vals = xs[r].float().tolist()
        for t in range(5):
            for d in range(7):
                want[t][d] = naive.f32(want[t][d] + vals[t][d])
    assert s.dtype == torch.float32
    assert torch.equal(s, torch.tensor(want, dtype=torch.float32))


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("fp32_internal", [True, False])
def test_all_reduce_rms_norm_and_reduce_scatter(R, fp32_internal):
    M, L, H = 5, 32, 48
    xs = [rand(M, L, seed=r, dtype=torch.bfloat16) for r in range(R)]
    gamma = rand(L, seed=9, dtype=torch.bfloat16)
    residual = rand(M, L, seed=10)
    y = ref.all_reduce_rms_norm(xs, gamma, 1e-5, fp32_internal, residual)
    total = [[sum(xs[r][t, d].item() for r in range(R)) for d in range(L)] for t in range(M)]
    want = naive_rms_norm(torch.tensor(total, dtype=torch.float32), gamma, 1e-5, fp32_internal, residual)
    assert_close(y, want.float(), dtype=torch.float32)

    sh = [rand(M, H, seed=20 + r, dtype=torch.bfloat16) for r in range(R)]
    shards = ref.reduce_scatter_hidden(sh)
    assert len(shards) == R
    w = H // R
    for r in range(R):
        assert shards[r].shape == (M, w) and shards[r].dtype == torch.float32
        want_r = [[sum(sh[q][t, r * w + j].item() for q in range(R)) for j in range(w)] for t in range(M)]
        assert_close(shards[r], torch.tensor(want_r, dtype=torch.float32), dtype=torch.float32)


def simulated_tail(R: int, M: int, E: int, K: int, L: int, seed: int):
    """A latent MoE layer over R tensor-parallel ranks, each holding E // R experts. Rank r's
    expert outputs sit in its own permuted buffer; idx[t, k] = -1 when expert ids[t, k] is not
    local. Routing weights are powers of two and expert outputs bf16, so each rank's finalize is
    exact in float32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(M, E, generator=g), dim=1)[:, :K]
    weights = 2.0 ** -torch.randint(0, 4, (M, K), generator=g).float()
    expert_out = rand(M, K, L, seed=seed + 1, dtype=torch.bfloat16)  # output of (token, slot)
    EG = E // R
    per_rank = []
    for r in range(R):
        sel = [(t, k) for t in range(M) for k in range(K) if ids[t, k].item() // EG == r]
        perm = torch.randperm(len(sel), generator=g).tolist()  # arbitrary permuted row order
        buf = torch.zeros(len(sel), L, dtype=torch.bfloat16)
        idx = torch.full((M, K), -1, dtype=torch.int32)
        for j, (t, k) in enumerate(sel):
            buf[perm[j]] = expert_out[t, k]
            idx[t, k] = perm[j]
        per_rank.append((buf, idx))
    return weights, expert_out, per_rank


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("fp32_internal", [None, True, False])
@pytest.mark.parametrize("M", [0, 1, 6])
def test_moe_tail_matches_per_token_loop(R, fp32_internal, M):
    E, K, L, H = 8, 3, 32, 64
    weights, expert_out, per_rank = simulated_tail(R, M, E, K, L, seed=R * 10 + M)
    latents = [ref.topk_finalize(buf, weights, idx) for buf, idx in per_rank]
    shared = [rand(M, H, seed=40 + r) for r in range(R)]  # float32: the tail rounds to bf16
    gamma = rand(L, seed=3, dtype=torch.bfloat16)
    kw = {} if fp32_internal is None else {"fp32_internal": fp32_internal}
    normed, shards = ref.moe_tail(latents, shared, gamma, 1e-6, **kw)
    mode = False if fp32_internal is None else fp32_internal  # the seed's default is the bf16 mode

    # Naive: per token, per rank (in rank order) the local slots' weighted sum, rounded to bf16.
    w = weights.tolist()
    total = []
    for t in range(M):
        acc = [0.0] * L
        for buf, idx in per_rank:
            local = [0.0] * L
            for k in range(K):
                i = idx[t, k].item()
                if i >= 0:
                    row = buf[i].float().tolist()
                    for d in range(L):
                        local[d] += w[t][k] * row[d]
            for d in range(L):
                acc[d] += naive.bf16(local[d])
        total.append(acc)
    want = naive_rms_norm(torch.tensor(total, dtype=torch.float32).reshape(M, L), gamma, 1e-6, mode)
    assert normed.shape == (M, L) and normed.dtype == torch.float32
    assert_close(normed, want.float(), dtype=torch.float32)

    # Without the tensor-parallel split the latent is the plain top-k combination.
    full = [[sum(w[t][k] * expert_out[t, k, d].item() for k in range(K)) for d in range(L)] for t in range(M)]
    assert_close(
        torch.tensor(total, dtype=torch.float32).reshape(M, L),
        torch.tensor(full, dtype=torch.float32).reshape(M, L),
        dtype=torch.bfloat16,
    )

    assert len(shards) == R
    width = H // R
    for r in range(R):
        want_r = [
            [sum(naive.bf16(shared[q][t, r * width + j].item()) for q in range(R)) for j in range(width)]
            for t in range(M)
        ]
        assert_close(shards[r], torch.tensor(want_r, dtype=torch.float32).reshape(M, width), dtype=torch.float32)


# ----------------------------------------------------------------------------- argument errors

X = torch.rand(4, 8)
G = torch.ones(8)
IDX = torch.zeros(4, 2, dtype=torch.int32)

BAD_CALLS = [
    (lambda: ref.rms_norm(X.tolist(), G), TypeError, "x"),
    (lambda: ref.rms_norm(torch.tensor(1.0), G[:1]), ValueError, "x"),
    (lambda: ref.rms_norm(X, G[:7]), ValueError, "gamma"),
    (lambda: ref.rms_norm(X, G, residual=X[:3]), ValueError, "residual"),
    (lambda: ref.topk_finalize(X[0], X[:, :2], IDX), ValueError, "gemm2_permuted"),
    (lambda: ref.topk_finalize(X, X[:, 0], IDX), ValueError, "expert_weights"),
    (lambda: ref.topk_finalize(X, X[:, :2], IDX.float()), TypeError, "expanded_idx_to_permuted_idx"),
    (lambda: ref.topk_finalize(X, X[:, :2], IDX[:, :1]), ValueError, "expanded_idx_to_permuted_idx"),
    (lambda: ref.rank_sum([]), ValueError, "xs"),
    (lambda: ref.rank_sum([X, X[:3]]), ValueError, "xs[1]"),
    (lambda: ref.rank_sum([X, "y"]), TypeError, "xs[1]"),
    (lambda: ref.reduce_scatter_hidden([X, X, X]), ValueError, "xs"),
    (lambda: ref.all_reduce_rms_norm([X, X], G[:4]), ValueError, "gamma"),
    (lambda: ref.moe_tail([X, X], [X], G), ValueError, "shared_sources"),
    (lambda: ref.moe_tail([], [], G), ValueError, "latent_sources"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)
