"""Token-movement oracles (gather + scale (+ fp8), dense and padded scatter-add) against naive loops."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close, tie_free_scores
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def routing_metadata(T, E, K, seed, start=None, end=None, vtc=None, column_major=False):
    """Scores [T, E] (tie-free, positive) and naive index_shuffling metadata as int32 tensors."""
    scores = tie_free_scores(T, E, dtype=torch.float32, seed=seed, column_major=column_major)
    counts, experts, tokens = naive.index_shuffling(scores, K, start or 0, E if end is None else end, vtc)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32).reshape(-1)  # noqa: E731
    return scores, as_i32(counts), as_i32(experts), as_i32(tokens)


def naive_gather(x, tok, exp, scores, vtc):
    """fp32 rows (list of lists) and the written mask, one output row at a time."""
    xs, sc = x.float().tolist(), scores.float().tolist()
    D = x.shape[1]
    rows, written = [], []
    for r in range(len(tok)):
        # negative or out-of-range indices: skipped (never clamped to the last token / expert)
        ok = (vtc is None or r < vtc) and 0 <= tok[r] < len(xs) and 0 <= exp[r] < scores.shape[1]
        written.append(ok)
        if ok:
            s = sc[tok[r]][exp[r]]
            rows.append([naive.f32(v * s) for v in xs[tok[r]]])
        else:
            rows.append([0.0] * D)
    return rows, written


def i32(v):
    return torch.tensor([v], dtype=torch.int32) if v is not None else None


GATHER_CASES = [
    # T, E, K, D, start, end, vtc (rows)
    (0, 6, 1, 8, None, None, None),
    (1, 6, 1, 8, None, None, None),
    (1, 6, 6, 5, None, None, None),
    (7, 6, 2, 24, None, None, 9),
    (7, 6, 2, 24, None, None, 0),
    (13, 24, 3, 16, 4, 20, None),  # an expert range: -1 tail rows are skipped
    (9, 257, 2, 8, None, None, 5),
]


@pytest.mark.parametrize("T,E,K,D,start,end,vtc", GATHER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scale_matches_naive(T, E, K, D, start, end, vtc, dtype):
    scores, _, experts, tokens = routing_metadata(T, E, K, seed=T + E, start=start, end=end, column_major=(T % 2 == 1))
    x = rand(T, D, seed=T + D, dtype=dtype)
    out = ref.gather_scale_dense_tokens(x, tokens, experts, scores, i32(vtc))
    assert out.dtype == dtype and out.shape == (T * K, D)
    rows, _ = naive_gather(x, tokens.tolist(), experts.tolist(), scores, vtc)
    want = torch.tensor(rows, dtype=torch.float32).reshape(T * K, D).to(dtype)
    assert torch.equal(out, want)


def test_gather_scale_random_indices_with_negatives():
    T, E, D, a = 5, 6, 12, 17
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(-1, T, (a,), generator=g, dtype=torch.int64)  # duplicates and -1
    exp = torch.randint(-1, E, (a,), generator=g, dtype=torch.int32)
    scores = rand(T, E, seed=4).abs().T.contiguous().T  # column-major
    x = rand(T, D, seed=5)
    for vtc in (None, 0, 11, a + 2):
        out = ref.gather_scale_dense_tokens(x, tok, exp, scores, i32(vtc))
        rows, _ = naive_gather(x, tok.tolist(), exp.tolist(), scores, vtc)
        assert torch.equal(out, torch.tensor(rows, dtype=torch.float32).reshape(a, D))


@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
@pytest.mark.parametrize("vtc", [None, 9])
def test_gather_out_of_range_indices_are_skipped_not_clamped(idt, vtc):
    """Token 7 of 4, token T, an index past 2**32 (int32: 2**31 - 1), negative ones and an expert
    past E leave their rows unwritten (zeros here; the kernels skip them, leaving them untouched)
    instead of gathering the clamped last token / expert; the other rows are unaffected and the
    FP8 rows get zero values and a zero scale (issue 16)."""
    T, E, D = 4, 3, 16
    x = rand(T, D, seed=1)
    scores = rand(T, E, seed=2).abs() + 0.25
    big = 2**32 + 1 if idt == torch.int64 else 2**31 - 1
    tok = torch.tensor([0, 7, big, 1, 3, 2, T, -1, 2, 1, -(2**31)], dtype=idt)
    exp = torch.tensor([0, 0, 1, 5, 2, 1, 0, 0, -1, E - 1, 0], dtype=idt)
    in_range = [True, False, False, False, True, True, False, False, False, True, False]
    want_rows, written = naive_gather(x, tok.tolist(), exp.tolist(), scores, vtc)
    assert written == [ok and (vtc is None or r < vtc) for r, ok in enumerate(in_range)]
    out = ref.gather_scale_dense_tokens(x, tok, exp, scores, i32(vtc))
    assert torch.equal(out, torch.tensor(want_rows, dtype=torch.float32).reshape(len(written), D))
    q, scale = ref.gather_scale_quant_dense_tokens(x, tok, exp, scores, None, i32(vtc))
    w = torch.tensor(written)
    assert (q[~w].float() == 0).all() and (scale[~w] == 0).all(), "skipped rows must not be written"
    assert (scale[w] > 0).all()
    assert_close(q[w].float() * scale[w, None], out[w], tol=6e-2)


@pytest.mark.parametrize("T,E,K,D,start,end,vtc", GATHER_CASES)
@pytest.mark.parametrize("scale_ub", [None, 5.0])  # scaled rows have amax ~ 10..40: 5.0 clamps
def test_gather_scale_quant_matches_naive(T, E, K, D, start, end, vtc, scale_ub):
    scores, _, experts, tokens = routing_metadata(T, E, K, seed=T + E + 1, start=start, end=end)
    x = rand(T, D, seed=T * D + 1, dtype=torch.bfloat16, scale=3000.0)
    if T:
        x[0] = 0.0  # an all-zero token: its rows use eps = 1e-12
    ub = None if scale_ub is None else torch.tensor([scale_ub])
    q, s = ref.gather_scale_quant_dense_tokens(x, tokens, experts, scores, ub, i32(vtc))
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == (T * K, D) and s.shape == (T * K,)
    rows, written = naive_gather(x, tokens.tolist(), experts.tolist(), scores, vtc)
    want_q, want_s = [], []
    for row, ok in zip(rows, written):
        if ok:
            qr, sr = naive.quantize_row(row, ref.FUSED_EPS, None if ub is None else ub.item())
        else:
            qr, sr = [0.0] * D, 0.0
        want_q.append(qr)
        want_s.append(sr)
    assert torch.equal(q.float(), torch.tensor(want_q, dtype=torch.float32).reshape(T * K, D))
    assert torch.equal(s, torch.tensor(want_s, dtype=torch.float32))
    for r, (row, ok) in enumerate(zip(rows, written)):
        amax = max(abs(v) for v in row) if ok else -1.0
        if amax == 0.0:  # the all-zero token: scale from eps = 1e-12
            assert s[r].item() == pytest.approx(ref.FUSED_EPS / 448.0, rel=1e-6)
        elif ub is not None and amax > scale_ub:  # clamped: scale from scale_ub, big values saturate
            assert s[r].item() == pytest.approx(scale_ub / 448.0, rel=1e-6)
            assert q[r].float().abs().max().item() == 448.0


# ----------------------------------------------------------------------------- dense scatter-add


def naive_scatter(out, rows, tok, vtc):
    """float64 result of ``out[tok[r]] += rows[r]`` for the used rows."""
    acc = out.double().tolist()
    ins = rows.double().tolist()
    for r in range(len(tok)):
        if (vtc is None or r < vtc) and 0 <= tok[r] < len(acc):
            for d in range(len(ins[r])):
                acc[tok[r]][d] += ins[r][d]
    return torch.tensor(acc, dtype=torch.float64).reshape(out.shape)


SCATTER_CASES = [
    # T, a, D, vtc
    (0, 0, 8, None),
    (1, 1, 8, None),
    (1, 6, 5, None),  # every row to the single token
    (7, 14, 24, 9),
    (7, 14, 24, 0),
    (13, 39, 16, None),
    (5, 3, 8, 10),
]


@pytest.mark.parametrize("T,a,D,vtc", SCATTER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [ref.scatter_add_dense_tokens, ref.scatter_add_dense_tokens_deterministic])
def test_scatter_add_dense_matches_naive(T, a, D, vtc, dtype, fn):
    g = torch.Generator().manual_seed(T * 7 + a)
    tok = torch.randint(-1, max(T, 1), (a,), generator=g, dtype=torch.int32) if T else torch.full((a,), -1)
    rows = rand(a, D, seed=a, dtype=dtype)
    out = rand(T, D, seed=T + 100, dtype=dtype)
    want = naive_scatter(out, rows, tok.tolist(), vtc)
    res = fn(out, rows, tok, i32(vtc))
    assert res is None
    # bf16: the naive float64 sum rounded once to bf16; only rare 1-ulp flips may differ.
    assert_close(out, want.float().to(dtype), dtype=torch.float32, tol=1e-5 if dtype == torch.float32 else 1e-3)


def test_scatter_add_dense_deterministic_is_bitwise_reproducible_and_ascending():
    T, a, D = 4, 40, 33
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, T, (a,), generator=g)
    rows = rand(a, D, seed=1, scale=100.0)
    base = rand(T, D, seed=2)
    outs = []
    for _ in range(2):
        out = base.clone()
        ref.scatter_add_dense_tokens_deterministic(out, rows, tok)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # Contract: rows of one token summed in ascending row order in float32, then added once.
    r = rows.tolist()
    want = base.tolist()
    for t in range(T):
        for d in range(D):
            s = 0.0
            for i in range(a):
                if tok[i].item() == t:
                    s = naive.f32(s + r[i][d])
            want[t][d] = naive.f32(want[t][d] + s)
    assert torch.equal(outs[0], torch.tensor(want, dtype=torch.float32))


# ----------------------------------------------------------------------------- padded scatter-add (static EP)


def expert_fn(e: int, v: float) -> float:
    """What simulated expert e does to one element: distinct per expert, cheap to evaluate."""
    return v * (0.5 + 0.25 * e) + 0.01 * e


def simulate_static_ep(R, T, E, K, D, vtc, seed):
    """Each rank routes its tokens; experts live on rank e // (E // R). Rank s's in_tokens[r]
    holds, at rank s's send-row positions of rank r's experts, what those experts returned;
    every other row is NaN (never read). Returns per rank: (in_tokens, counts[:E], token_indices,
    x, scores, expected routed sum per token in float64)."""
    EG = E // R
    ranks = []
    for s in range(R):
        scores = tie_free_scores(T, E, dtype=torch.float32, seed=seed * 10 + s)
        x = rand(T, D, seed=seed * 10 + s + 1)
        counts, experts, tokens = naive.index_shuffling(scores, K, 0, E, vtc)
        sc, xs = scores.tolist(), x.tolist()
        TK = T * K
        in_tokens = [[[float("nan")] * D for _ in range(TK)] for _ in range(R)]
        for o in range(counts[E + 1]):
            e, t = experts[o], tokens[o]
            owner = e // EG
            in_tokens[owner][o] = [expert_fn(e, v * sc[t][e]) for v in xs[t]]
        expected = [[0.0] * D for _ in range(T)]
        for t in range(T):
            if vtc is not None and t >= vtc:
                continue
            for e in naive.topk_row(sc[t], K):
                for d in range(D):
                    expected[t][d] += expert_fn(e, xs[t][d] * sc[t][e])
        ranks.append(
            dict(
                in_tokens=torch.tensor(in_tokens, dtype=torch.float32).reshape(R, TK, D),
                counts=torch.tensor(counts[:E], dtype=torch.int32),
                tokens=torch.tensor(tokens, dtype=torch.int32).reshape(TK),
                expected=torch.tensor(expected, dtype=torch.float64).reshape(T, D),
            )
        )
    return ranks


@pytest.mark.parametrize(
    "R,T,E,K,D,vtc",
    [
        (2, 5, 6, 1, 8, None),
        (2, 7, 6, 2, 12, 4),
        (4, 9, 24, 1, 8, None),
        (4, 6, 8, 2, 16, None),
        (4, 3, 8, 8, 8, None),  # K = E
        (4, 8, 24, 3, 8, 0),  # no valid token: nothing is added
        (2, 0, 6, 1, 8, None),
    ],
)
def test_scatter_add_padded_static_ep(R, T, E, K, D, vtc):
    for rank in simulate_static_ep(R, T, E, K, D, vtc, seed=R * 100 + T):
        base = rand(T, D, seed=7)
        out = base.clone()
        assert ref.scatter_add_padded_tokens(rank["in_tokens"], rank["counts"], rank["tokens"], out) is None
        assert not torch.isnan(out).any()
        assert_close(out, (base.double() + rank["expected"]).float(), dtype=torch.float32)


def test_scatter_add_padded_bf16_and_row_formula():
    # Direct check of the contract formula on hand-made metadata, with rows past the total.
    EP, E, T_K, D, T = 2, 4, 9, 3, 4
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int64)  # 6 rows, 3 rows of padding
    tok = torch.tensor([3, 1, 0, 2, 3, 1, -1, -1, -1])
    in_tokens = rand(EP, T_K, D, seed=3, dtype=torch.bfloat16)
    out = rand(T, D, seed=4, dtype=torch.bfloat16)
    want = out.double().tolist()
    c = counts.tolist()
    src = in_tokens.double().tolist()
    for e in range(E):
        for j in range(c[e]):
            o = sum(c[:e]) + j
            for d in range(D):
                want[tok[o].item()][d] += src[e // (E // EP)][o][d]
    ref.scatter_add_padded_tokens(in_tokens, counts, tok, out)
    assert_close(out, torch.tensor(want).float().to(torch.bfloat16), dtype=torch.float32, tol=1e-3)


# ----------------------------------------------------------------------------- argument errors

X = torch.rand(4, 8)
TOK = torch.tensor([0, 1, 2], dtype=torch.int32)
SC = torch.rand(4, 6)

BAD_CALLS = [
    (lambda: ref.gather_scale_dense_tokens(X.int(), TOK, TOK, SC), TypeError, "x"),
    (lambda: ref.gather_scale_dense_tokens(X[0], TOK, TOK, SC), ValueError, "x"),
    (lambda: ref.gather_scale_dense_tokens(X, TOK.float(), TOK, SC), TypeError, "token_indices"),
    (lambda: ref.gather_scale_dense_tokens(X, TOK[None], TOK, SC), ValueError, "token_indices"),
    (lambda: ref.gather_scale_dense_tokens(X, TOK, TOK[:2], SC), ValueError, "expert_indices"),
    (lambda: ref.gather_scale_dense_tokens(X, TOK, TOK, SC[:3]), ValueError, "scores"),
    (lambda: ref.gather_scale_dense_tokens(X, TOK, TOK, SC, torch.tensor([1.0])), TypeError, "valid_token_count"),
    (
        lambda: ref.gather_scale_quant_dense_tokens(X, TOK, TOK, SC, torch.tensor([1.0], dtype=torch.float64)),
        TypeError,
        "scale_ub",
    ),
    (lambda: ref.gather_scale_quant_dense_tokens(X, TOK, TOK, SC, torch.ones(2)), ValueError, "scale_ub"),
    (lambda: ref.scatter_add_dense_tokens(X.int(), X[:3], TOK), TypeError, "out_tokens"),
    (lambda: ref.scatter_add_dense_tokens(X, X[:3, :5], TOK), ValueError, "out_tokens"),
    (lambda: ref.scatter_add_dense_tokens(X, X[:3], TOK[:2]), ValueError, "token_indices"),
    (lambda: ref.scatter_add_dense_tokens(X, X[0], TOK), ValueError, "in_tokens"),
    (lambda: ref.scatter_add_dense_tokens(X, X[:3], TOK, torch.tensor([1, 2])), ValueError, "valid_token_count"),
    (lambda: ref.scatter_add_padded_tokens(X, TOK, TOK, X), ValueError, "in_tokens"),
    (lambda: ref.scatter_add_padded_tokens(X.view(2, 2, 8), torch.ones(4), TOK[:2], X), TypeError, "token_counts"),
    (lambda: ref.scatter_add_padded_tokens(X.view(2, 2, 8), TOK, TOK[:2], X), ValueError, "token_counts"),
    (lambda: ref.scatter_add_padded_tokens(X.view(2, 2, 8), TOK[:2], TOK, X), ValueError, "token_indices"),
    (lambda: ref.scatter_add_padded_tokens(X.view(2, 2, 8), TOK[:2], TOK[:2], X.double()), TypeError, "out_tokens"),
    (lambda: ref.scatter_add_padded_tokens(X.view(2, 2, 8), TOK[:2], TOK[:2], X[:, :4]), ValueError, "out_tokens"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)
