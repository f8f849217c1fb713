"""combine_shuffling / split_shuffling: the Triton kernel (interpreter and GPU) against
moekit.reference.shuffling, both layouts, expert ranges, round trips, CUDA-graph replay."""

from __future__ import annotations

import re

import pytest
import torch

from moekit import reference as ref
from moekit.ops import shuffling as ops
from moekit.reference.shuffling import shuffle_row_map
from moekit.testing import assert_poisoned, poison, tie_free_scores

FP8 = torch.float8_e4m3fn


def _tri():
    from moekit.ops._triton import shuffling

    return shuffling


def rank_counts(EP: int, E: int, tokens_per_rank, K: int, seed: int = 0) -> torch.Tensor:
    """``[EP, E]`` int32: rank r routes ``tokens_per_rank[r]`` tokens top-``K`` with the
    reference index_shuffling on tie-free scores."""
    rows = []
    for r in range(EP):
        s = tie_free_scores(int(tokens_per_rank[r]), E, seed=seed * 97 + r)
        rows.append(ref.index_shuffling(s, top_k=K)[0][:E])
    return torch.stack(rows).to(torch.int32)


def make_case(EP, E, T_rank, K, D, padded, dtype=torch.bfloat16, seed=0, slack=3, device="cpu"):
    """(tokens [T, D] rank-major, token_counts [EP, E]). Dense: ranks send a varying number of
    tokens and the buffer has ``slack`` spare rows; padded: every rank's block is T_rank * K rows
    and ranks send up to that many."""
    g = torch.Generator().manual_seed(seed)
    if padded:
        per_rank = [int(torch.randint(0, T_rank + 1, (1,), generator=g)) for _ in range(EP)]
        T = EP * T_rank * K
    else:
        per_rank = [int(torch.randint(0, T_rank + 1, (1,), generator=g)) for _ in range(EP)]
        T = sum(per_rank) * K + slack
    counts = rank_counts(EP, E, per_rank, K, seed)
    tokens = torch.randn(T, D, generator=g)
    tokens = tokens.to(dtype)
    return tokens.to(device), counts.to(device)


def written_rank_major(counts, T, start, end, padded):
    src, valid, _ = shuffle_row_map(counts.cpu(), T, start, end, padded)
    w = torch.zeros(T, dtype=torch.bool)
    w[src[valid]] = True
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    """CPU copy, FP8 viewed as bytes (CPU fp8 indexing and comparisons are sparse)."""
    t = t.detach().cpu()
    return t.view(torch.uint8) if t.dtype == FP8 else t


def check_combine_split(tokens, counts, start, end, padded, combine, split):
    """Run the combine/split callables (given full-range bounds as None) and check both, the
    round trip, poisoning of rows that must stay untouched, and zero fill."""
    T = tokens.shape[0]
    E = counts.shape[1]
    full = start == 0 and end == E
    s_arg, e_arg = (None, None) if full else (start, end)
    ro, rco = ref.combine_shuffling(bits(tokens), counts.cpu(), s_arg, e_arg, padded)
    total = int(rco[-1])
    out, counts_out = combine(tokens, counts, s_arg, e_arg, padded)
    assert counts_out.dtype == torch.int32 and counts_out.shape == (end - start + 1,)
    assert torch.equal(counts_out.cpu(), rco), f"counts_out {counts_out.cpu().tolist()} != {rco.tolist()}"
    assert torch.equal(bits(out)[:total], ro[:total]), "combined rows differ"
    w = written_rank_major(counts, T, s_arg, e_arg, padded)
    for zero in (False, True):
        back = split(out, counts, s_arg, e_arg, padded, zero)
        if T and zero:
            assert not bits(back)[~w].any(), "uncovered rows are not zero"
        elif T:
            assert_poisoned(back, w.to(back.device))
        # combine -> split round trip restores every covered row.
        assert torch.equal(bits(back)[w], bits(tokens)[w]), "split(combine(x)) != x on covered rows"
    return out, counts_out


def launcher_combine(tokens, counts, s, e, padded):
    T, D = tokens.shape
    out = poison(torch.empty(T, D, dtype=tokens.dtype, device=tokens.device))
    start, end = (0, counts.shape[1]) if s is None else (s, e)
    o, c = _tri().combine_shuffling(tokens, counts, start, end, padded, out=out)
    total = int(c[-1])
    if T:
        assert_poisoned(o, slice(0, total))
    return o, c


def launcher_split(tokens, counts, s, e, padded, zero):
    T, D = tokens.shape
    out = poison(torch.empty(T, D, dtype=tokens.dtype, device=tokens.device))
    start, end = (0, counts.shape[1]) if s is None else (s, e)
    return _tri().split_shuffling(tokens, counts, start, end, padded, zero, out=out)


def public_split(tokens, counts, s, e, padded, zero):
    out = ops.split_shuffling(tokens, counts, s, e, padded, zero)
    if not zero:  # rows no expert maps to are unspecified: poison them for the shared check
        w = written_rank_major(counts, tokens.shape[0], s, e, padded).to(out.device)
        if out.dtype == FP8:
            out.view(torch.uint8)[~w] = 0x7F
        else:
            out[~w] = float("nan")
    return out


# ----------------------------------------------------------------------------------------------
# interpreter tier
# ----------------------------------------------------------------------------------------------

INTERP_CASES = [
    # EP, E, (start, end), tokens per rank, K, D, padded, dtype
    (1, 6, (0, 6), 7, 2, 8, False, torch.bfloat16),
    (1, 6, (2, 5), 7, 1, 24, True, torch.float32),
    (2, 16, (0, 8), 5, 4, 8, True, torch.bfloat16),
    (2, 16, (8, 16), 5, 4, 24, False, FP8),
    (4, 16, (4, 8), 3, 2, 8, True, torch.float16),
    (4, 6, (0, 6), 4, 1, 8, False, torch.bfloat16),
    (8, 16, (2, 4), 2, 8, 8, True, torch.bfloat16),
    (8, 128, (16, 32), 3, 2, 8, False, torch.bfloat16),
    (2, 257, (0, 257), 3, 4, 8, False, torch.bfloat16),
    (2, 6, (3, 3), 3, 1, 8, False, torch.bfloat16),  # no local expert
    (4, 6, (0, 6), 0, 1, 8, True, torch.bfloat16),  # T = 0
    (4, 6, (0, 6), 4, 1, 8, True, torch.bfloat16),  # padded, every expert local
    (3, 5, (0, 5), 6, 2, 24, True, torch.float32),
    (2, 16, (0, 16), 1, 1, 2880, False, torch.bfloat16),
    # More row units than programs (the interpreter has 4 "SMs"): programs loop over units.
    (4, 8, (0, 8), 40, 2, 8, False, torch.bfloat16),
    # Padded buffer larger than the moved rows: programs without a unit, plus the loop.
    (4, 16, (4, 12), 40, 2, 16, True, torch.float32),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("EP,E,rng,Tr,K,D,padded,dtype", INTERP_CASES)
def test_shuffling_interpreter(EP, E, rng, Tr, K, D, padded, dtype):
    tokens, counts = make_case(EP, E, Tr, K, D, padded, dtype=dtype, seed=EP * 31 + E)
    check_combine_split(tokens, counts, rng[0], rng[1], padded, launcher_combine, launcher_split)


@pytest.mark.interpreter
@pytest.mark.parametrize("pipeline", [False, True], ids=["load-after-store", "pipelined"])
@pytest.mark.parametrize(
    "EP,E,rng,Tr,K,D,padded",
    [
        (4, 8, (0, 8), 40, 2, 8, False),  # dense, every expert local: the walk is the source rows
        (4, 16, (4, 12), 40, 2, 16, True),  # padded: combine finds each source row's rank block
        (4, 8, (0, 8), 40, 2, 16, True),  # padded, every expert local: the same lookup
        (4, 16, (2, 9), 40, 2, 16, False),  # dense, some experts local: the same lookup
        (2, 16, (0, 16), 3, 2, 5120, False),  # D = 5120 bf16: 2 x 2048 + a 1024 tail per row
        (4, 16, (0, 16), 0, 1, 8, False),  # nothing moves
    ],
)
def test_shuffling_interpreter_walks(pin_knobs, pipeline, EP, E, rng, Tr, K, D, padded):
    """Rows held whole, the next unit's loaded after this unit's stores or before them
    (pipelined), with programs looping over several units, give the reference's rows."""
    pin_knobs(PIPELINE=pipeline)
    tokens, counts = make_case(EP, E, Tr, K, D, padded, seed=EP * 7 + D)
    check_combine_split(tokens, counts, rng[0], rng[1], padded, launcher_combine, launcher_split)


@pytest.mark.interpreter
@pytest.mark.parametrize("unroll", [0, 4], ids=["loop", "unrolled"])
def test_shuffling_interpreter_long_rows(pin_knobs, unroll):
    """Rows of several main chunks (D = 5120 bf16: 2 x 2048 + 1024): loaded whole before they are
    stored (unrolled), or chunk by chunk (the loop taken past ``_UNROLL_MAX`` chunks)."""
    pin_knobs(UNROLL_MAX=unroll)
    tokens, counts = make_case(2, 16, 3, 2, 5120, True, seed=7)
    check_combine_split(tokens, counts, 4, 12, True, launcher_combine, launcher_split)


@pytest.mark.interpreter
def test_shuffling_interpreter_int64_strided_counts():
    """int64 counts stored column-major, and a row-strided tokens buffer."""
    EP, E, D = 4, 8, 16
    tokens, counts = make_case(EP, E, 4, 2, D, False, seed=3)
    wide = torch.randn(tokens.shape[0], 2 * D).to(tokens.dtype)
    wide[:, :D] = tokens
    counts64 = counts.long().T.contiguous().T
    check_combine_split(wide[:, :D], counts64, 2, 6, False, launcher_combine, launcher_split)


@pytest.mark.interpreter
def test_shuffling_interpreter_split_writes_only_moved_rows():
    """Split walks the expert-major rows that move: rows past the total in its input are never
    read (NaN there must not leak), rank-major rows of other experts stay poisoned."""
    EP, E, D = 4, 16, 8
    tokens, counts = make_case(EP, E, 6, 2, D, True, seed=11)
    start, end = 4, 8
    _, rco = ref.combine_shuffling(tokens, counts, start, end, True)
    total = int(rco[-1])
    assert 0 < total < tokens.shape[0]
    x = tokens.clone()
    x[total:] = float("nan")
    out = poison(torch.empty_like(x))
    _tri().split_shuffling(x, counts, start, end, True, False, out=out)
    w = written_rank_major(counts, x.shape[0], start, end, True)
    assert_poisoned(out, w)
    assert torch.equal(out[w], ref.split_shuffling(x, counts, start, end, True)[w])
    assert not torch.isnan(out[w]).any()


@pytest.mark.reference
def test_config_shape_buckets():
    """Whole rows per unit: D = 5120 is two 2048-wide chunks plus a 1024-wide tail (no masked
    lanes); the grid is one program per unit, capped per SM; 2 warps for one row of 10 KB (the
    measured best on the H200)."""
    tri = _tri()
    cpu = torch.device("cpu")
    n = tri.num_sms(cpu)
    assert tri._config(4096, 5120, 2, 128, cpu)[:3] == (1, 2048, 1024)
    assert tri._config(4096, 5120, 2, 128, cpu)[3] == min(4096, tri._MAX_PROGRAMS_PER_SM * n)
    assert tri._config(4096, 5120, 2, 128, cpu)[4] == 2
    assert tri._config(4096, 4096, 2, 128, cpu)[1:3] == (2048, 0)
    assert tri._config(64, 5120, 4, 16, cpu)[1:3] == (1024, 0)  # fp32: 4 KB chunks, five of them
    assert tri._config(64, 24, 1, 16, cpu)[1:3] == (16, 8)
    assert tri._config(64, 8, 2, 4096, cpu)[0] == 1  # many segments: one row per unit


# ----------------------------------------------------------------------------------------------
# reference tier
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("padded", [False, True])
def test_public_ops_cpu(padded):
    tokens, counts = make_case(4, 16, 5, 2, 16, padded, seed=1)
    check_combine_split(tokens, counts, 4, 12, padded, ops.combine_shuffling, public_split)
    tokens8 = tokens.to(FP8)
    out, c = ops.combine_shuffling(tokens8, counts, 4, 12, padded)
    assert out.dtype == FP8 and c.dtype == torch.int32


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The CUDA launcher at the benchmark's shapes (dense and padded, combine, split, split with
    zero fill, bf16 / fp8 / fp32 rows), compiled on the CPU for sm_90."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import shuffling as S
        m, i32 = "meta", torch.int32
        x = torch.empty(32768, 5120, dtype=torch.bfloat16, device=m)
        c16, c128 = torch.empty(8, 16, dtype=i32, device=m), torch.empty(8, 128, dtype=i32, device=m)
        S.combine_shuffling(x[:4096], c16, 0, 16, False)
        S.split_shuffling(x[:4096], c16, 0, 16, False, False)
        S.split_shuffling(x, c128, 16, 32, True, True)
        S.combine_shuffling(torch.empty(4096, 5120, dtype=torch.float8_e4m3fn, device=m), c16, 0, 16, False)
        S.split_shuffling(torch.empty(1024, 2880, dtype=torch.float32, device=m), c128, 0, 128, False, True)
        """,
        ["moekit.ops._triton.shuffling"],
    )
    assert_all_compiled(records, 5)


def _op_cases():
    tokens, counts = make_case(2, 6, 4, 2, 16, True, seed=2)
    return [
        ("combine_shuffling", (tokens, counts, 2, 5, True)),
        ("combine_shuffling", (tokens, counts, None, None, False)),
        ("split_shuffling", (tokens, counts, 1, 4, True, True)),
        ("split_shuffling", (tokens, counts, None, None, False, False)),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("name,args", _op_cases(), ids=[f"{c[0]}-{i}" for i, c in enumerate(_op_cases())])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.moekit, name).default, args)


@pytest.mark.reference
def test_torch_compile_fullgraph():
    tokens, counts = make_case(4, 16, 4, 2, 16, True, seed=4)

    def f(tokens, counts):
        x, c = ops.combine_shuffling(tokens, counts, 4, 8, is_padded=True)
        y = ops.split_shuffling(x * 2, counts, 4, 8, is_padded=True, init_with_zeros=True)
        return x, c, y

    got = torch.compile(f, fullgraph=True)(tokens, counts)
    want = f(tokens, counts)
    total = int(want[1][-1])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0][:total], want[0][:total])
    assert torch.equal(got[2], want[2])


def _bad_calls():
    tokens, counts = make_case(2, 6, 4, 1, 16, True, seed=0)
    c, s = ops.combine_shuffling, ops.split_shuffling
    return [
        ("tokens dtype", lambda: c(tokens.int(), counts), TypeError, "tokens must have dtype"),
        ("tokens 1-D", lambda: c(tokens[0], counts), ValueError, "tokens must be 2-D"),
        ("tokens D % 8", lambda: c(tokens[:, :12], counts), ValueError, "multiple of 8"),
        (
            "tokens non-contiguous",
            lambda: c(torch.randn(16, tokens.shape[0]).T, counts),
            ValueError,
            "tokens must have a unit stride",
        ),
        ("tokens row stride", lambda: c(torch.randn(tokens.shape[0], 20)[:, :16], counts), ValueError, "row stride"),
        ("token_counts dtype", lambda: c(tokens, counts.float()), TypeError, "token_counts must have dtype"),
        ("token_counts 1-D", lambda: c(tokens, counts[0]), ValueError, "token_counts must be 2-D"),
        ("expert_end > E", lambda: c(tokens, counts, 0, 7), ValueError, "expert range [expert_start, expert_end)"),
        ("expert_start > end", lambda: s(tokens, counts, 4, 2), ValueError, "expert range [expert_start, expert_end)"),
        ("expert_start negative", lambda: c(tokens, counts, -1, 2), ValueError, "expert range"),
        ("expert_start type", lambda: c(tokens, counts, 1.0, 2), TypeError, "expert_start must be an int"),
        ("padded T % EP", lambda: c(tokens[:-1], counts, is_padded=True), ValueError, "divisible by EP"),
        ("is_padded type", lambda: c(tokens, counts, is_padded=1), TypeError, "is_padded must be a bool"),
        (
            "init_with_zeros type",
            lambda: s(tokens, counts, init_with_zeros=None),
            TypeError,
            "init_with_zeros must be a bool",
        ),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("case", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=re.escape(match)):
        call()


# ----------------------------------------------------------------------------------------------
# GPU tier
# ----------------------------------------------------------------------------------------------

GPU_CASES = [
    # EP, E, local experts (start, end), tokens per rank, K, D, padded
    (1, 16, (0, 16), 4096, 1, 5120, False),
    (2, 16, (8, 16), 4096, 1, 5120, True),
    (2, 16, (0, 8), 2048, 2, 7168, False),
    (4, 128, (32, 64), 1024, 4, 5120, True),
    (8, 16, (2, 4), 512, 1, 7168, True),
    (8, 128, (0, 16), 128, 8, 2880, False),
    (8, 128, (0, 128), 7, 2, 24, False),
    (8, 257, (0, 257), 1, 4, 8, False),
    (4, 16, (0, 16), 0, 1, 5120, True),
    (4, 16, (0, 16), 512, 2, 5120, True),  # padded, every expert local (the per-rank lookup)
    # The benchmark's padded layout: a buffer 8x larger than the rows that move.
    (8, 128, (16, 32), 512, 1, 5120, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("EP,E,rng,Tr,K,D,padded", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_shuffling_gpu(EP, E, rng, Tr, K, D, padded, dtype, cuda):
    tokens, counts = make_case(EP, E, Tr, K, D, padded, dtype=torch.float32, seed=EP + E + Tr)
    tokens = tokens.to(dtype).to(cuda)
    counts = counts.to(cuda)
    check_combine_split(tokens, counts, rng[0], rng[1], padded, launcher_combine, launcher_split)
    check_combine_split(tokens, counts, rng[0], rng[1], padded, ops.combine_shuffling, public_split)


@pytest.mark.gpu
def test_shuffling_cuda_graph_replay(cuda):
    """Capture combine + split once; new counts (a different split across ranks and experts)
    and new tokens written in place; the replay follows them."""
    EP, E, Tr, K, D = 4, 16, 512, 2, 5120
    start, end = 4, 12
    tokens, counts = make_case(EP, E, Tr, K, D, True, seed=1, device=cuda)
    out_split = {}

    def step():
        x, c = ops.combine_shuffling(tokens, counts, start, end, True)
        out_split["y"] = ops.split_shuffling(x, counts, start, end, True, True)
        return x, c

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x, c = step()
    y = out_split["y"]
    for seed in (7, 8):
        t2, c2 = make_case(EP, E, Tr, K, D, True, seed=seed, device=cuda)
        tokens.copy_(t2)
        counts.copy_(c2)
        g.replay()
        torch.cuda.synchronize()
        ro, rco = ref.combine_shuffling(tokens, counts, start, end, True)
        total = int(rco[-1])
        assert torch.equal(c, rco.to(cuda))
        assert torch.equal(x[:total], ro[:total])
        assert torch.equal(y, ref.split_shuffling(ro, counts, start, end, True))


@pytest.mark.gpu
def test_torch_compile_fullgraph_gpu(cuda):
    tokens, counts = make_case(4, 16, 256, 2, 512, True, seed=4, device=cuda)

    def f(tokens, counts):
        x, c = ops.combine_shuffling(tokens, counts, 4, 8, is_padded=True)
        y = ops.split_shuffling(x, counts, 4, 8, is_padded=True, init_with_zeros=True)
        return x, c, y

    got = torch.compile(f, fullgraph=True)(tokens, counts)
    want = f(tokens, counts)
    total = int(want[1][-1])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0][:total], want[0][:total])
    assert torch.equal(got[2], want[2])


@pytest.mark.gpu
def test_offsets_past_2_pow_31_gpu(cuda):
    """Rank 1's local rows sit past element 2**31 of a padded buffer of about 4.3 GB."""
    D = 4096
    T = 2 * (2**31 // D // 2 + 64)
    half = T // 2
    tokens = torch.empty(T, D, dtype=torch.bfloat16, device=cuda).normal_()
    counts = torch.tensor([[5, 3, 0], [half - 40, 40, 0]], dtype=torch.int32, device=cuda)
    x, c = ops.combine_shuffling(tokens, counts, 1, 2, is_padded=True)
    assert c.tolist() == [43, 43]
    assert torch.equal(x[:3], tokens[5:8])
    assert torch.equal(x[3:43], tokens[T - 40 :])
    y = ops.split_shuffling(x, counts, 1, 2, is_padded=True, init_with_zeros=True)
    assert torch.equal(y[T - 40 :], tokens[T - 40 :])
    assert torch.equal(y[5:8], tokens[5:8])
    assert not y[T - 41].any() and not y[:5].any()
