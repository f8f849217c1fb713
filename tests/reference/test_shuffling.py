"""Expert-parallel shuffling oracles (combine / split, dense and padded) against naive loops,
and the static and dynamic EP data paths simulated end to end over 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close, tie_free_scores
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def block_starts(counts: list[list[int]], T: int, padded: bool) -> list[int]:
    EP = len(counts)
    if padded:
        return [r * (T // EP) for r in range(EP)]
    starts, acc = [], 0
    for r in range(EP):
        starts.append(acc)
        acc += sum(counts[r])
    return starts


def naive_combine(tokens: torch.Tensor, counts: list[list[int]], start: int, end: int, padded: bool):
    T, D = tokens.shape
    rows = tokens.tolist()
    blocks = block_starts(counts, T, padded)
    out, per_expert = [], []
    for e in range(start, end):
        n = 0
        for r in range(len(counts)):
            off = blocks[r] + sum(counts[r][:e])
            for j in range(counts[r][e]):
                out.append(rows[off + j])
            n += counts[r][e]
        per_expert.append(n)
    out += [[0.0] * D for _ in range(T - len(out))]
    return torch.tensor(out, dtype=torch.float64).reshape(T, D), per_expert + [sum(per_expert)]


def naive_split(tokens: torch.Tensor, counts: list[list[int]], start: int, end: int, padded: bool):
    T, D = tokens.shape
    rows = tokens.tolist()
    blocks = block_starts(counts, T, padded)
    out = [[0.0] * D for _ in range(T)]
    j = 0
    for e in range(start, end):
        for r in range(len(counts)):
            off = blocks[r] + sum(counts[r][:e])
            for i in range(counts[r][e]):
                out[off + i] = rows[j]
                j += 1
    return torch.tensor(out, dtype=torch.float64).reshape(T, D)


def make_counts(EP: int, E: int, seed: int, kind: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # includes zeros: empty (rank, expert) pairs and empty experts
        c = torch.randint(0, 4, (EP, E), generator=g)
        c[:, E // 2] = 0
    elif kind == "one_expert":
        c = torch.zeros(EP, E, dtype=torch.int64)
        c[:, 1] = torch.randint(1, 6, (EP,), generator=g)
    elif kind == "zeros":
        c = torch.zeros(EP, E, dtype=torch.int64)
    else:
        raise AssertionError(kind)
    return c.tolist()


def layout_rows(counts, padded: bool, extra: int) -> int:
    EP = len(counts)
    if padded:
        return EP * (max(sum(r) for r in counts) + extra)
    return sum(sum(r) for r in counts) + extra


CASES = [
    # EP, E, start, end
    (1, 6, None, None),
    (2, 6, None, None),
    (2, 6, 3, 6),
    (2, 6, 0, 3),
    (4, 24, 6, 12),
    (4, 24, None, None),
    (4, 24, 5, 5),  # no local expert
]


@pytest.mark.parametrize("EP,E,start,end", CASES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", ["random", "one_expert", "zeros"])
@pytest.mark.parametrize("extra", [0, 3])
def test_combine_and_split_match_naive(EP, E, start, end, padded, kind, extra):
    counts = make_counts(EP, E, seed=EP * 10 + E + extra, kind=kind)
    T = layout_rows(counts, padded, extra)
    D = 5
    s, e = (0 if start is None else start), (E if end is None else end)
    c_t = torch.tensor(counts, dtype=torch.int32).reshape(EP, E)
    x = rand(T, D, seed=T)

    out, counts_out = ref.combine_shuffling(x, c_t, start, end, is_padded=padded)
    want, want_counts = naive_combine(x, counts, s, e, padded)
    assert out.shape == (T, D) and out.dtype == x.dtype
    assert counts_out.dtype == torch.int32
    assert_close(counts_out, torch.tensor(want_counts), msg="counts_out")
    assert torch.equal(out.double(), want)

    back = ref.split_shuffling(x, c_t, start, end, is_padded=padded)
    assert back.shape == (T, D)
    assert torch.equal(back.double(), naive_split(x, counts, s, e, padded))

    # Round trips: split(combine(x)) restores the local experts' rows (zeros elsewhere);
    # combine(split(y)) restores the packed rows.
    rt = ref.split_shuffling(out, c_t, start, end, is_padded=padded)
    local = naive_split(naive_combine(x, counts, s, e, padded)[0].float(), counts, s, e, padded)
    assert torch.equal(rt.double(), local)
    total = want_counts[-1]
    y = rand(T, D, seed=T + 1)
    rt2, _ = ref.combine_shuffling(
        ref.split_shuffling(y, c_t, start, end, is_padded=padded), c_t, start, end, is_padded=padded
    )
    assert torch.equal(rt2[:total], y[:total])
    assert (rt2[total:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_int64_counts_and_bf16(dtype):
    counts = [[2, 0, 1], [1, 3, 0]]
    x = rand(9, 4, seed=1, dtype=dtype)
    c64 = torch.tensor(counts, dtype=torch.int64)
    out, co = ref.combine_shuffling(x, c64)
    want, wc = naive_combine(x.float(), counts, 0, 3, False)
    assert out.dtype == dtype and co.tolist() == wc
    assert torch.equal(out.double(), want)
    split = ref.split_shuffling(out, c64, init_with_zeros=True)
    assert torch.equal(split[:7], x[:7]) and (split[7:] == 0).all()


# ----------------------------------------------------------------------------- simulated expert parallelism


def expert_fn(e: int, rows: torch.Tensor) -> torch.Tensor:
    return rows * (0.5 + 0.25 * e) + 0.01 * e


def naive_moe_rank(x: torch.Tensor, scores: torch.Tensor, K: int, vtc=None) -> torch.Tensor:
    """Per-token loop: sum over the token's top-k experts of expert_fn(e, x[t] * score)."""
    T, D = x.shape
    xs, sc = x.double().tolist(), scores.double().tolist()
    out = [[0.0] * D for _ in range(T)]
    for t in range(T):
        if vtc is not None and t >= vtc:
            continue
        for e in naive.topk_row(sc[t], K):
            for d in range(D):
                out[t][d] += xs[t][d] * sc[t][e] * (0.5 + 0.25 * e) + 0.01 * e
    return torch.tensor(out, dtype=torch.float64).reshape(T, D)


def run_local_experts(tokens: torch.Tensor, counts_out: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Apply each local expert to its packed rows (rows past the total stay NaN: unused)."""
    out = torch.full_like(tokens, float("nan"))
    off = 0
    for i, n in enumerate(counts_out[:-1].tolist()):
        out[off : off + n] = expert_fn(first_expert + i, tokens[off : off + n])
        off += n
    return out


@pytest.mark.parametrize(
    "R,T,E,K,vtc", [(2, 5, 6, 1, None), (2, 7, 6, 2, 4), (4, 6, 24, 1, None), (4, 5, 8, 3, None), (4, 3, 8, 8, 2)]
)
def test_static_ep_round_trip(R, T, E, K, vtc):
    """MetaShuffling's static path: all-gather counts and tokens, padded combine, experts,
    padded split, all-to-all back, padded scatter-add."""
    D, EG, TK = 8, E // R, T * K
    ranks = []
    for s in range(R):
        scores = tie_free_scores(T, E, dtype=torch.float32, seed=R * 100 + s)
        x = rand(T, D, seed=R * 100 + s + 50)
        vtc_t = None if vtc is None else torch.tensor([vtc], dtype=torch.int32)
        counts, experts, tokens = ref.index_shuffling(scores, valid_token_count=vtc_t, top_k=K)
        send = ref.gather_scale_dense_tokens(x, tokens, experts, scores, counts[E + 1 :])
        ranks.append(dict(x=x, scores=scores, counts=counts[:E], tokens=tokens, send=send))
    recv_counts = torch.stack([r["counts"] for r in ranks])  # [R, E] (all-gather)
    recv_tokens = torch.cat([r["send"] for r in ranks])  # [R * TK, D] (all-gather)
    returned = []
    for r in range(R):
        packed, counts_out = ref.combine_shuffling(recv_tokens, recv_counts, r * EG, (r + 1) * EG, is_padded=True)
        z = run_local_experts(packed, counts_out, r * EG)
        returned.append(ref.split_shuffling(z, recv_counts, r * EG, (r + 1) * EG, is_padded=True))
    for s in range(R):
        in_tokens = torch.stack([returned[r][s * TK : (s + 1) * TK] for r in range(R)])  # all-to-all
        base = rand(T, D, seed=s + 999)  # the shared expert's output
        out = base.clone()
        ref.scatter_add_padded_tokens(in_tokens, ranks[s]["counts"], ranks[s]["tokens"], out)
        want = base.double() + naive_moe_rank(ranks[s]["x"], ranks[s]["scores"], K, vtc)
        assert_close(out, want.float(), dtype=torch.float32, msg=f"rank {s}")


@pytest.mark.parametrize("R,T,E,K", [(2, 5, 6, 1), (2, 6, 6, 2), (4, 7, 24, 2), (4, 4, 8, 8)])
def test_dynamic_ep_round_trip(R, T, E, K):
    """MetaShuffling's dynamic path: all-to-all of counts and of rows (dense layout),
    combine, experts, split, all-to-all back, dense scatter-add."""
    D, EG = 6, E // R
    ranks = []
    for s in range(R):
        scores = tie_free_scores(T, E, dtype=torch.float32, seed=R * 7 + s)
        x = rand(T, D, seed=R * 7 + s + 30)
        counts, experts, tokens = ref.index_shuffling(scores, top_k=K)
        send = ref.gather_scale_dense_tokens(x, tokens, experts, scores)
        c = counts[:E].tolist()
        seg = [sum(c[: r * EG]) for r in range(R + 1)]  # rows for rank r: seg[r] : seg[r] + sizes
        sizes = [sum(c[r * EG : (r + 1) * EG]) for r in range(R)]
        ranks.append(dict(x=x, scores=scores, tokens=tokens, send=send, c=c, seg=seg, sizes=sizes))
    back = [[None] * R for _ in range(R)]  # back[s][r]: rows rank r returns to rank s
    for r in range(R):
        recv_counts = torch.tensor(
            [[ranks[s]["c"][r * EG + i] for i in range(EG)] for s in range(R)], dtype=torch.int32
        )
        recv = torch.cat(
            [ranks[s]["send"][ranks[s]["seg"][r] : ranks[s]["seg"][r] + ranks[s]["sizes"][r]] for s in range(R)]
        )
        packed, counts_out = ref.combine_shuffling(recv, recv_counts)
        assert counts_out[-1].item() == recv.shape[0]
        z = run_local_experts(packed, counts_out, r * EG)
        rank_major = ref.split_shuffling(z, recv_counts)
        off = 0
        for s in range(R):
            n = ranks[s]["sizes"][r]
            back[s][r] = rank_major[off : off + n]
            off += n
    for s in range(R):
        routed = torch.cat(back[s])
        base = rand(T, D, seed=s + 77)
        out = base.clone()
        ref.scatter_add_dense_tokens(out, routed, ranks[s]["tokens"])
        want = base.double() + naive_moe_rank(ranks[s]["x"], ranks[s]["scores"], K)
        assert_close(out, want.float(), dtype=torch.float32, msg=f"rank {s}")


# ----------------------------------------------------------------------------- argument errors

X = torch.rand(8, 4)
C = torch.tensor([[1, 2, 0], [2, 0, 1]], dtype=torch.int32)

BAD_CALLS = [
    (lambda: ref.combine_shuffling(X[0], C), ValueError, "tokens"),
    (lambda: ref.combine_shuffling(X.tolist(), C), TypeError, "tokens"),
    (lambda: ref.combine_shuffling(X, C.float()), TypeError, "token_counts"),
    (lambda: ref.combine_shuffling(X, C[0]), ValueError, "token_counts"),
    (lambda: ref.combine_shuffling(X, C, 2, 1), ValueError, "expert_start"),
    (lambda: ref.combine_shuffling(X, C, 0, 4), ValueError, "expert_end"),
    (lambda: ref.combine_shuffling(X, C, -1), ValueError, "expert_start"),
    (lambda: ref.combine_shuffling(X[:7], C, is_padded=True), ValueError, "tokens"),
    (lambda: ref.combine_shuffling(X, C[:0]), ValueError, "token_counts"),
    (lambda: ref.combine_shuffling(X.to("meta"), C), ValueError, "token_counts"),
    (lambda: ref.split_shuffling(X[0], C), ValueError, "tokens"),
    (lambda: ref.split_shuffling(X, C.double()), TypeError, "token_counts"),
    (lambda: ref.split_shuffling(X, C, 0, 9), ValueError, "expert_end"),
    (lambda: ref.split_shuffling(X, C, 1.0), TypeError, "expert_start"),
    (lambda: ref.split_shuffling(X[:7], C, is_padded=True), ValueError, "tokens"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)


# Counts inconsistent with the 6 rows of tokens (EP = 2: 3 rows per rank block when padded):
# (counts, is_padded, what the message must say).
BAD_COUNTS = [
    ([[3, 4], [1, 1]], False, "must sum to at most tokens.shape[0] = 6"),  # 9 rows counted
    ([[0, 0], [4, 3]], False, "got a sum of 7"),
    ([[3, 4], [1, 1]], True, "at most tokens.shape[0] / EP = 6 / 2 = 3"),
    ([[0, 0], [2, 2]], True, "got 4 for rank 1"),  # rank 1's block would run past the buffer
    ([[4, 0], [0, 0]], True, "got 4 for rank 0"),  # in bounds, but spills into rank 1's block
    ([[1, -1], [1, 1]], False, "must be >= 0 everywhere"),
    ([[1, -1], [1, 1]], True, "must be >= 0 everywhere"),
]


@pytest.mark.parametrize("fn", ["combine_shuffling", "split_shuffling"])
@pytest.mark.parametrize("counts,padded,text", BAD_COUNTS)
@pytest.mark.parametrize("api", ["ops", "reference"])
def test_counts_inconsistent_with_rows_raise(fn, counts, padded, text, api):
    """Counts the rows cannot hold (more rows than tokens has, a rank over its padded block, a
    negative count): a ValueError naming token_counts, what was expected and what came, never a
    raw IndexError from inside or a silently wrong layout (issue 16). CPU tensors: the public op
    runs the reference, which reads the counts (on CUDA they are not read: no host sync)."""
    import re

    from moekit import ops

    mod = ops if api == "ops" else ref
    x = rand(6, 8)
    for idt in (torch.int32, torch.int64):
        with pytest.raises(ValueError, match="token_counts") as e:
            getattr(mod, fn)(x, torch.tensor(counts, dtype=idt), is_padded=padded)
        assert re.search(re.escape(text), str(e.value)), str(e.value)
    # an expert range does not hide the inconsistency (the offsets use every expert's count)
    with pytest.raises(ValueError, match="token_counts"):
        getattr(mod, fn)(x, torch.tensor(counts, dtype=torch.int32), 1, 2, is_padded=padded)


@pytest.mark.parametrize("fn", ["combine_shuffling", "split_shuffling"])
@pytest.mark.parametrize(
    "counts,padded", [([[3, 1], [1, 1]], False), ([[1, 2], [2, 1]], True), ([[0, 0], [0, 0]], True)]
)
def test_counts_that_fill_the_rows_exactly_are_accepted(fn, counts, padded):
    """The bounds of the check are inclusive: every row used (dense) or every block full (padded)."""
    from moekit import ops

    x = rand(6, 8)
    c = torch.tensor(counts, dtype=torch.int32)
    got = getattr(ops, fn)(x, c, is_padded=padded)
    want = getattr(ref, fn)(x, c, is_padded=padded)
    if fn == "combine_shuffling":
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(got[1][-1]) == sum(map(sum, counts))
    else:
        assert torch.equal(got, want)
