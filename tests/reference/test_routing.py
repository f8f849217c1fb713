"""Routing oracles (topk, routing_weights, dense_scores, index_shuffling) against naive loops."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close, tie_free_scores
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference


def lattice_logits(T: int, E: int, seed: int, column_major: bool = False) -> torch.Tensor:
    """[T, E] float32 logits in [-2, 2], a random permutation of an evenly spaced lattice per
    row: distinct with margins far above float32 rounding, so any score function keeps them
    apart and float64 naive math picks the same experts."""
    g = torch.Generator().manual_seed(seed)
    p = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    x = (p - E / 2) * (4.0 / E)
    return x.T.contiguous().T if column_major else x


def as_ids(ids: list[list[int]], K: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).reshape(-1, K)


def as_f64(w: list[list[float]], K: int) -> torch.Tensor:
    return torch.tensor(w, dtype=torch.float64).reshape(-1, K)


# ----------------------------------------------------------------------------- topk

TOPK_SHAPES = [(0, 6, 1), (1, 6, 1), (1, 6, 6), (7, 6, 3), (9, 24, 5), (5, 257, 1), (3, 257, 17), (2, 257, 257)]


@pytest.mark.parametrize("T,E,K", TOPK_SHAPES)
@pytest.mark.parametrize("column_major", [False, True])
def test_topk_matches_naive(T, E, K, column_major):
    scores = tie_free_scores(T, E, dtype=torch.float32, seed=T * 1000 + E + K, column_major=column_major)
    vals, ids = ref.topk(scores, K)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    want_ids = [naive.topk_row(row, K) for row in scores.tolist()]
    assert_close(ids, as_ids(want_ids, K))
    want_vals = [[scores[t, e].item() for e in want_ids[t]] for t in range(T)]
    assert torch.equal(vals, torch.tensor(want_vals, dtype=torch.float32).reshape(T, K))


@pytest.mark.parametrize("E,K", [(6, 2), (24, 24), (257, 3)])
def test_topk_ties_go_to_lower_index(E, K):
    g = torch.Generator().manual_seed(E)
    scores = torch.randint(0, 3, (11, E), generator=g).float()  # many exact ties
    scores[0] = 1.0  # a row of identical values: experts 0..K-1
    _, ids = ref.topk(scores, K)
    assert_close(ids, as_ids([naive.topk_row(r, K) for r in scores.tolist()], K))
    assert ids[0].tolist() == list(range(K))


# ----------------------------------------------------------------------------- routing_weights

ROUTING_SHAPES = [(0, 6, 2), (1, 6, 6), (7, 6, 2), (5, 24, 8), (3, 257, 4), (4, 257, 1)]


@pytest.mark.parametrize("T,E,K", ROUTING_SHAPES)
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax", "topk_softmax"])
@pytest.mark.parametrize("renormalize,scale", [(False, 1.0), (True, 2.5)])
def test_routing_weights_matches_naive(T, E, K, score_func, renormalize, scale):
    logits = lattice_logits(T, E, seed=E * 31 + K, column_major=(T % 2 == 1))
    w, ids = ref.routing_weights(logits, K, score_func, renormalize, routed_scaling_factor=scale)
    want_w, want_ids = naive.routing(logits, K, score_func, renormalize, routed_scaling_factor=scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert_close(ids, as_ids(want_ids, K))
    assert_close(w, as_f64(want_w, K).float(), dtype=torch.float32)


def test_topk_softmax_equals_softmax_topk_renormalize():
    logits = lattice_logits(9, 24, seed=5)
    w1, i1 = ref.routing_weights(logits, 4, "topk_softmax")
    w2, i2 = ref.routing_weights(logits, 4, "softmax", renormalize=True)
    assert_close(i1, i2)
    assert_close(w1, w2, dtype=torch.float32)


GROUPED_CASES = [
    # T, E, n_group, topk_group, K, score_func, bias, renormalize, scale
    (5, 24, 4, 2, 4, "sigmoid", True, True, 2.5),
    (3, 256, 8, 4, 8, "sigmoid", True, True, 2.5),  # DeepSeek-V3
    (4, 6, 6, 3, 2, "sigmoid", True, False, 1.0),  # one expert per group: group score = top-1
    (4, 6, 2, 1, 3, "sigmoid", False, True, 1.0),  # K = topk_group * experts per group
    (6, 24, 3, 1, 2, "softmax", False, False, 1.0),
    (7, 24, 4, 4, 24, "sigmoid", True, False, 1.0),  # every group kept, K = E
    (0, 24, 4, 2, 4, "sigmoid", True, True, 2.5),
]


@pytest.mark.parametrize("T,E,n_group,topk_group,K,score_func,use_bias,renormalize,scale", GROUPED_CASES)
def test_grouped_routing_matches_naive(T, E, n_group, topk_group, K, score_func, use_bias, renormalize, scale):
    logits = lattice_logits(T, E, seed=E + n_group)
    bias = None
    if use_bias:
        g = torch.Generator().manual_seed(E)
        bias = (torch.rand(E, generator=g) - 0.5) * 0.4  # big enough to change selections
    kw = dict(n_group=n_group, topk_group=topk_group, e_score_correction_bias=bias, routed_scaling_factor=scale)
    w, ids = ref.routing_weights(logits, K, score_func, renormalize, **kw)
    want_w, want_ids = naive.routing(
        logits,
        K,
        score_func,
        renormalize,
        n_group=n_group,
        topk_group=topk_group,
        bias=bias,
        routed_scaling_factor=scale,
    )
    assert_close(ids, as_ids(want_ids, K))
    assert_close(w, as_f64(want_w, K).float(), dtype=torch.float32)
    # Only experts of the kept groups are chosen.
    per = E // n_group
    for t in range(T):
        assert len({e // per for e in ids[t].tolist()}) <= topk_group


def test_bias_is_for_selection_only():
    T, E = 4, 24
    logits = lattice_logits(T, E, seed=3)
    bias = torch.zeros(E)
    bias[5] = 100.0  # a huge bias on expert 5: selected first by every token
    w, ids = ref.routing_weights(logits, 2, "sigmoid", e_score_correction_bias=bias)
    assert (ids[:, 0] == 5).all(), "the biased expert must be selected first"
    s = torch.sigmoid(logits)
    assert_close(w, s.gather(1, ids), dtype=torch.float32)  # unbiased weights
    assert (w[:, 0] < 1.0).all()
    _, ids_nb = ref.routing_weights(logits, 2, "sigmoid")
    assert not torch.equal(ids, ids_nb)


def test_grouped_selection_excludes_weaker_groups():
    # Group 1 (experts 3..5) holds the single best expert, but group 0 has the best top-2 sum.
    logits = torch.tensor([[1.0, 0.9, -5.0, 2.0, -5.0, -5.0]])
    _, ids = ref.routing_weights(logits, 1, "sigmoid", n_group=2, topk_group=1)
    assert ids.tolist() == [[0]]
    _, ids_all = ref.routing_weights(logits, 1, "sigmoid")
    assert ids_all.tolist() == [[3]]


@pytest.mark.parametrize(
    "score_func,kw",
    [
        ("sigmoid", {}),
        ("softmax", {}),
        ("topk_softmax", {}),
        ("sigmoid", dict(n_group=4, topk_group=2)),
        ("softmax", dict(n_group=3, topk_group=1)),
    ],
)
def test_routing_ties_go_to_lower_index(score_func, kw):
    E, K = 24, 4
    logits = torch.zeros(3, E)
    logits[1] = 0.75
    logits[2, ::2] = 1.0  # ties among the even experts
    w, ids = ref.routing_weights(logits, K, score_func, **kw)
    want_w, want_ids = naive.routing(logits, K, score_func, n_group=kw.get("n_group"), topk_group=kw.get("topk_group"))
    assert_close(ids, as_ids(want_ids, K))
    assert_close(w, as_f64(want_w, K).float(), dtype=torch.float32)
    assert ids[0].tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- dense_scores


@pytest.mark.parametrize("T,E,K", [(0, 6, 2), (1, 6, 6), (9, 24, 3), (4, 257, 5)])
def test_dense_scores_matches_naive(T, E, K):
    logits = lattice_logits(T, E, seed=K)
    w, ids = ref.routing_weights(logits, K, "softmax", renormalize=True)
    dense = ref.dense_scores(w, ids.int(), E)
    want = [[0.0] * E for _ in range(T)]
    for t in range(T):
        for k in range(K):
            want[t][ids[t, k].item()] = w[t, k].item()
    assert dense.dtype == torch.float32 and dense.shape == (T, E)
    assert torch.equal(dense, torch.tensor(want, dtype=torch.float32).reshape(T, E))
    # index_shuffling on the dense matrix selects the same experts.
    counts, _, _ = ref.index_shuffling(dense, top_k=K)
    want_counts = [0] * E
    for t in range(T):
        for e in ids[t].tolist():
            want_counts[e] += 1
    assert counts[:E].tolist() == want_counts


# ----------------------------------------------------------------------------- index_shuffling

SHUFFLE_SHAPES = [(0, 6, 1), (1, 6, 1), (1, 6, 6), (7, 6, 2), (33, 24, 3), (3, 24, 24), (5, 257, 1), (4, 257, 16)]
RANGES = ["all", "middle", "upper_half", "empty"]
VALID = ["none", "zero", "half", "over"]


def _range(E: int, kind: str):
    return {"all": (None, None), "middle": (1, E - 2), "upper_half": (E // 2, E), "empty": (3, 3)}[kind]


def _vtc(T: int, kind: str):
    return {"none": None, "zero": 0, "half": T // 2, "over": T + 3}[kind]


def check_index_shuffling(scores, K, start=None, end=None, vtc=None):
    E = scores.shape[1]
    vtc_t = None if vtc is None else torch.tensor([vtc], dtype=torch.int32)
    counts, experts, tokens = ref.index_shuffling(scores, start, end, vtc_t, top_k=K)
    for t_ in (counts, experts, tokens):
        assert t_.dtype == torch.int32
    want_c, want_e, want_t = naive.index_shuffling(scores, K, start or 0, E if end is None else end, vtc)
    assert_close(counts, torch.tensor(want_c), msg="token_counts")
    assert_close(experts, torch.tensor(want_e, dtype=torch.int64).reshape(-1), msg="expert_indices")
    assert_close(tokens, torch.tensor(want_t, dtype=torch.int64).reshape(-1), msg="token_indices")
    return counts, experts, tokens


@pytest.mark.parametrize("T,E,K", SHUFFLE_SHAPES)
@pytest.mark.parametrize("rng", RANGES)
@pytest.mark.parametrize("valid", VALID)
def test_index_shuffling_matches_naive(T, E, K, rng, valid):
    start, end = _range(E, rng)
    scores = tie_free_scores(T, E, dtype=torch.bfloat16, seed=T + E + K)
    check_index_shuffling(scores, K, start, end, _vtc(T, valid))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("column_major", [False, True])
def test_index_shuffling_layouts_and_dtypes(dtype, column_major):
    scores = tie_free_scores(13, 24, dtype=dtype, seed=9, column_major=column_major)
    assert scores.is_contiguous() != column_major
    check_index_shuffling(scores, 3, 4, 20, 11)
    # Same values, contiguous copy: identical outputs.
    a = ref.index_shuffling(scores, top_k=3)
    b = ref.index_shuffling(scores.contiguous(), top_k=3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("K", [1, 2])
def test_index_shuffling_every_token_to_one_expert(K):
    T, E = 9, 6
    scores = tie_free_scores(T, E, dtype=torch.float32, seed=1) * 0.01
    scores[:, 4] = 10.0
    scores[:, 1] = 5.0
    counts, experts, tokens = check_index_shuffling(scores, K)
    assert counts[4].item() == T
    if K == 1:
        assert counts[:E].tolist() == [0, 0, 0, 0, T, 0]  # empty experts count 0
        assert experts.tolist() == [4] * T and tokens.tolist() == list(range(T))
    else:
        assert counts[:E].tolist() == [0, T, 0, 0, T, 0]
        assert experts.tolist() == [1] * T + [4] * T


def test_index_shuffling_ties_go_to_lower_index():
    scores = torch.ones(5, 24, dtype=torch.bfloat16)
    scores[2, 7:] = 2.0  # ties among 7..23 for token 2
    counts, experts, tokens = check_index_shuffling(scores, 2)
    assert counts[:3].tolist() == [4, 4, 0] and counts[7:9].tolist() == [1, 1]


def test_index_shuffling_tail_is_minus_one():
    T, E, K = 10, 24, 2
    scores = tie_free_scores(T, E, dtype=torch.float32, seed=4)
    counts, experts, tokens = check_index_shuffling(scores, K, 0, 12, 6)
    V = counts[E + 1].item()
    assert counts[E].item() == T
    assert V == int(counts[:E].sum())
    assert (experts[V:] == -1).all() and (tokens[V:] == -1).all()
    assert (experts[:V] >= 0).all() and (tokens[:V] < 6).all()
    # Rows grouped by expert ascending, then by token.
    keys = list(zip(experts[:V].tolist(), tokens[:V].tolist()))
    assert keys == sorted(keys)


def test_index_shuffling_valid_token_count_int64():
    scores = tie_free_scores(8, 6, dtype=torch.float32, seed=2)
    a = ref.index_shuffling(scores, valid_token_count=torch.tensor([5], dtype=torch.int64), top_k=2)
    b = ref.index_shuffling(scores, valid_token_count=torch.tensor(5, dtype=torch.int32), top_k=2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- argument errors

S = torch.rand(4, 6)
VTC = torch.tensor([2], dtype=torch.int32)

BAD_CALLS = [
    (lambda: ref.topk(S, 0), ValueError, "top_k"),
    (lambda: ref.topk(S, 7), ValueError, "top_k"),
    (lambda: ref.topk(S, 1.0), TypeError, "top_k"),
    (lambda: ref.topk(S[0], 1), ValueError, "scores_TE"),
    (lambda: ref.topk(S.tolist(), 1), TypeError, "scores_TE"),
    (lambda: ref.routing_weights(S, 2, "relu"), ValueError, "score_func"),
    (lambda: ref.routing_weights(S, 0), ValueError, "top_k"),
    (lambda: ref.routing_weights(S, 2, n_group=2), ValueError, "topk_group"),
    (lambda: ref.routing_weights(S, 2, topk_group=1), ValueError, "n_group"),
    (lambda: ref.routing_weights(S, 2, n_group=4, topk_group=1), ValueError, "n_group"),
    (lambda: ref.routing_weights(S, 2, n_group=2, topk_group=3), ValueError, "topk_group"),
    (lambda: ref.routing_weights(S, 4, n_group=2, topk_group=1), ValueError, "top_k"),
    (lambda: ref.routing_weights(S, 2, e_score_correction_bias=torch.zeros(5)), ValueError, "e_score_correction_bias"),
    (lambda: ref.routing_weights(S, 2, "topk_softmax", n_group=2, topk_group=1), ValueError, "n_group"),
    (lambda: ref.routing_weights(S, 2, "topk_softmax", topk_group=1), ValueError, "topk_group"),
    (lambda: ref.topk(torch.rand(3, 0), 1), ValueError, "scores_TE"),
    (lambda: ref.routing_weights(torch.rand(3, 0), 1), ValueError, "logits_TE"),
    (lambda: ref.dense_scores(S[:, :2], torch.zeros(4, 2, dtype=torch.int64), 1), ValueError, "num_experts"),
    (lambda: ref.dense_scores(S[:, :2], torch.zeros(4, 2, dtype=torch.int64), 6.0), TypeError, "num_experts"),
    (lambda: ref.dense_scores(S[:, :2], torch.zeros(4, 2), 6), TypeError, "ids_TK"),
    (lambda: ref.dense_scores(S[:, :2], torch.zeros(4, 3, dtype=torch.int64), 6), ValueError, "ids_TK"),
    (lambda: ref.index_shuffling(S.int()), TypeError, "routing_scores"),
    (lambda: ref.index_shuffling(S[0]), ValueError, "routing_scores"),
    (lambda: ref.index_shuffling(torch.rand(4, 0)), ValueError, "routing_scores"),
    (lambda: ref.index_shuffling(S, top_k=0), ValueError, "top_k"),
    (lambda: ref.index_shuffling(S, top_k=7), ValueError, "top_k"),
    (lambda: ref.index_shuffling(S, 4, 2), ValueError, "expert_index_start"),
    (lambda: ref.index_shuffling(S, 0, 7), ValueError, "expert_index_end"),
    (lambda: ref.index_shuffling(S, 1.5), TypeError, "expert_index_start"),
    (lambda: ref.index_shuffling(S, valid_token_count=VTC.float()), TypeError, "valid_token_count"),
    (lambda: ref.index_shuffling(S, valid_token_count=torch.tensor([1, 2])), ValueError, "valid_token_count"),
    (lambda: ref.index_shuffling(S, valid_token_count=3), TypeError, "valid_token_count"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)
