"""GPU bad-input tier: the Triton path of every public op fed the inputs a model can get wrong.

Out-of-range token / expert / row indices (negative, past the end, near int32 / int64 limits),
valid counts past the rows or negative, counts inconsistent with T, empty tensors (T = 0, D = 0,
no rows), wrong dtypes / shapes / devices. Each op must either refuse the call with a
``TypeError`` / ``ValueError`` naming the argument or skip what is out of range, touching no
memory it does not own:

- outputs the test can place (the launchers' ``out=`` / in-place outputs) live inside a larger
  buffer whose guard rows are NaN-poisoned (``moekit.testing.poison``) and must stay so; rows
  the contract leaves unwritten stay poisoned, rows it adds nothing to stay bitwise as they were;
- inputs live inside a larger buffer whose rows around them are NaN: a read past an input shows
  up as NaN in rows that must match ``moekit.reference``;
- every launch runs with ``torch.cuda.set_sync_debug_mode("error")`` (the ops must not
  synchronize with the host) and the test then waits for the GPU with a deadline, so a hang
  fails the test instead of stalling the run.

Skipped without CUDA (the ``gpu`` marker, tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from types import SimpleNamespace

import pytest
import torch

import moekit.ops as ops
from moekit import reference as ref
from moekit.testing import assert_fp8_close, poison, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

FP8 = torch.float8_e4m3fn
GUARD = 3  # poisoned rows on each side of a placed output / NaN rows around a placed input
HANG_S = 60.0
I32_MAX = 2**31 - 1


def _tri(name: str):
    return importlib.import_module(f"moekit.ops._triton.{name}")


# ----------------------------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------------------------


def wait_gpu(timeout_s: float = HANG_S) -> None:
    """Wait for the GPU work queued so far, failing (not hanging) past ``timeout_s``."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"GPU work did not finish within {timeout_s:.0f} s (a hang)")
        time.sleep(0.002)
    torch.cuda.synchronize()  # surfaces an asynchronous error (e.g. an illegal address) here


@contextlib.contextmanager
def no_host_sync():
    """The block must not synchronize with the host (raises RuntimeError if it does)."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def launch(fn, *args, **kwargs):
    with no_host_sync():
        out = fn(*args, **kwargs)
    wait_gpu()
    return out


def randn(shape, dtype=torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).cuda()


def placed_input(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values inside a buffer with ``GUARD`` NaN rows before and after (2-D+ float) or
    ``-7`` entries around (1-D integer: a read past the end would fetch them)."""
    if t.is_floating_point() and t.dtype != FP8:
        buf = torch.full((t.shape[0] + 2 * GUARD,) + tuple(t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        buf[GUARD : GUARD + t.shape[0]] = t
        return buf[GUARD : GUARD + t.shape[0]]
    if t.dtype == FP8:
        buf = torch.empty((t.shape[0] + 2 * GUARD,) + tuple(t.shape[1:]), dtype=FP8, device=t.device)
        poison(buf)
        buf[GUARD : GUARD + t.shape[0]] = t
        return buf[GUARD : GUARD + t.shape[0]]
    buf = torch.full((t.shape[0] + 2 * GUARD,) + tuple(t.shape[1:]), -7, dtype=t.dtype, device=t.device)
    buf[GUARD : GUARD + t.shape[0]] = t
    return buf[GUARD : GUARD + t.shape[0]]


class Placed:
    """An output ``[rows, ...]`` inside a buffer whose ``GUARD`` rows on each side are poisoned;
    ``init``: the output's initial values (default: poisoned too)."""

    def __init__(self, shape, dtype, init: torch.Tensor | None = None):
        shape = tuple(shape)
        self.buf = poison(torch.empty((shape[0] + 2 * GUARD,) + shape[1:], dtype=dtype, device="cuda"))
        self.t = self.buf[GUARD : GUARD + shape[0]]
        if init is not None:
            self.t.copy_(init)
        self.before = self.t.clone()

    def assert_guards(self, what: str) -> None:
        for part, rows in (("before", self.buf[:GUARD]), ("after", self.buf[GUARD + self.t.shape[0] :])):
            if not bool(_poisoned(rows).all()):
                raise AssertionError(f"{what}: a guard row {part} the output was written (out-of-bounds write)")


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == FP8:
        return t.view(torch.uint8) == 0x7F
    if t.is_floating_point():
        return torch.isnan(t)
    return t == -1


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: bitwise equal."""
    if a.dim() == 1:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    av = a.contiguous().view(torch.uint8).reshape(a.shape[0], -1) if a.numel() else a.reshape(a.shape[0], 0)
    bv = b.contiguous().view(torch.uint8).reshape(b.shape[0], -1) if b.numel() else b.reshape(b.shape[0], 0)
    return (av == bv).all(dim=1)


def assert_rows(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor, what: str, tol: float = 0.0) -> None:
    """``got[rows]`` matches ``want[rows]``: bitwise, or within ``tol`` relative (norm-wise) error."""
    g, w = got[rows.to(got.device)].float().cpu(), want[rows.to(want.device)].float().cpu()
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
    if tol == 0.0:
        ok = torch.equal(torch.nan_to_num(g, nan=12345.0), torch.nan_to_num(w, nan=12345.0))
        assert ok, f"{what}: rows differ from the reference"
        return
    assert not bool(torch.isnan(g).any()), f"{what}: NaN in computed rows (a read out of bounds?)"
    if g.numel():
        err = rel_error(g, w)
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def assert_untouched(placed: Placed, rows: torch.Tensor, what: str) -> None:
    """Rows ``rows`` (bool mask) of the placed output are bitwise as they were before the op."""
    same = rows_equal(placed.t, placed.before).cpu()
    bad = rows.cpu() & ~same
    assert not bool(bad.any()), (
        f"{what}: rows that must stay untouched were written: {bad.nonzero().flatten()[:5].tolist()}"
    )


def vcount(v: int, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([v], dtype=dtype, device="cuda")


def bad_indices(n: int, hi: int, dtype, seed: int) -> torch.Tensor:
    """``[n]`` indices: mostly in ``[0, hi)``, with -1, -2**31 (int32) / -2**40 (int64), hi,
    hi + 5 and 2**31 - 1 (or 2**40) sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, max(hi, 1), (n,), generator=g, dtype=torch.int64)
    big = 2**40 if dtype == torch.int64 else I32_MAX
    specials = [-1, -(2**31) if dtype == torch.int32 else -(2**40), hi, hi + 5, big, -3]
    for i, v in enumerate(specials):
        if 3 * i + 1 < n:
            t[3 * i + 1] = v
    return t.to(dtype).cuda()


VALID_COUNTS = [None, 7, 10**6, -3, 0]


def maybe_count(v):
    return None if v is None else vcount(v)


# ----------------------------------------------------------------------------------------------
# Gather
# ----------------------------------------------------------------------------------------------


def _gather_written(tok, exp, T, E, v, a):
    n = a if v is None else max(min(v, a), 0)
    tok, exp = tok.long().cpu(), exp.long().cpu()
    m = (tok >= 0) & (tok < T) & (exp >= 0) & (exp < E)
    m &= torch.arange(a) < n
    return m


@pytest.mark.parametrize("D", [64, 5120])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("v", VALID_COUNTS)
def test_gather_skips_out_of_range_rows(D, idx_dtype, v):
    T, E, a = 16, 4, 40
    tri = _tri("gather_scatter")
    x = placed_input(randn((T, D), seed=1))
    scores = placed_input(randn((T, E), seed=2))
    tok, exp = bad_indices(a, T, idx_dtype, 3), bad_indices(a, E, idx_dtype, 4)
    vt = maybe_count(v)
    want = ref.gather_scale_dense_tokens(x, tok, exp, scores, vt)
    w = _gather_written(tok, exp, T, E, v, a)
    out = Placed((a, D), torch.bfloat16)
    launch(tri.gather_scale_dense_tokens, x, tok, exp, scores, vt, out=out.t)
    out.assert_guards("gather")
    assert_rows(out.t, want, w, "gather written rows")
    assert_untouched(out, ~w, "gather skipped rows")
    got = launch(ops.gather_scale_dense_tokens, x, tok, exp, scores, vt)
    assert_rows(got, want, w, "public gather written rows")
    q = Placed((a, D), FP8)
    s = Placed((a,), torch.float32)
    launch(tri.gather_scale_quant_dense_tokens, x, tok, exp, scores, None, vt, out=q.t, out_scale=s.t)
    q.assert_guards("gather quant values")
    s.assert_guards("gather quant scales")
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tok, exp, scores, None, vt)
    assert_rows(s.t, rs, w, "gather quant scales", tol=1e-6)
    assert_untouched(q, ~w, "gather quant skipped rows")
    assert_untouched(s, ~w, "gather quant skipped scales")
    wc = w.cuda()
    if bool(w.any()):
        assert_fp8_close(q.t[wc], rq[wc], "gather quant values")


@pytest.mark.parametrize("T,a,D", [(0, 5, 64), (6, 0, 64), (6, 5, 0), (0, 0, 0)])
def test_gather_empty(T, a, D):
    x = randn((T, D))
    tok = torch.zeros(a, dtype=torch.int32, device="cuda")
    exp = torch.zeros(a, dtype=torch.int32, device="cuda")
    scores = randn((T, 3))
    got = launch(ops.gather_scale_dense_tokens, x, tok, exp, scores)
    assert got.shape == (a, D)
    q, s = launch(ops.gather_scale_quant_dense_tokens, x, tok, exp, scores)
    assert q.shape == (a, D) and s.shape == (a,)


# ----------------------------------------------------------------------------------------------
# Scatter-add (every path: atomics, per-token locks, bucket sum, deterministic scan / buckets)
# ----------------------------------------------------------------------------------------------

SCATTER_PATHS = {
    # name: (T, rows, deterministic)
    "atomic": (16, 40, False),
    "locked_top1": (2048, 1500, False),
    "bucket_sum": (64, 2048, False),
    "det_scan": (16, 40, True),
    "det_buckets": (64, 2048, True),
}


@pytest.mark.parametrize("path", sorted(SCATTER_PATHS))
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("v", [None, 30, 10**6, -1])
def test_scatter_add_skips_out_of_range_rows(path, idx_dtype, v):
    T, a, det = SCATTER_PATHS[path]
    D = 64
    rows = placed_input(randn((a, D), dtype=torch.float32, seed=5))
    tok = bad_indices(a, T, idx_dtype, 6)
    vt = maybe_count(v)
    init = randn((T, D), dtype=torch.float32, seed=7)
    out = Placed((T, D), torch.float32, init=init)
    want = init.clone()
    ref.scatter_add_dense_tokens(want, rows, tok, vt)
    launch(ops.scatter_add_dense_tokens, out.t, rows, tok, vt, deterministic=det)
    out.assert_guards(f"scatter-add {path}")
    n = a if v is None else max(min(v, a), 0)
    t = tok.long().cpu()[:n]
    hit = torch.zeros(T, dtype=torch.bool)
    hit[t[(t >= 0) & (t < T)]] = True
    assert_rows(out.t, want, hit, f"scatter-add {path} hit rows", tol=1e-5)
    assert_untouched(out, ~hit, f"scatter-add {path} rows nothing lands on")
    if det:
        out2 = Placed((T, D), torch.float32, init=init)
        launch(ops.scatter_add_dense_tokens_deterministic, out2.t, rows, tok, vt)
        assert torch.equal(out2.t, out.t), "the deterministic scatter-add is not reproducible"


@pytest.mark.parametrize("T,a,D", [(0, 5, 64), (6, 0, 64), (6, 5, 0)])
def test_scatter_add_empty(T, a, D):
    out = torch.zeros(T, D, device="cuda")
    for det in (False, True):
        launch(ops.scatter_add_dense_tokens, out, randn((a, D), torch.float32), torch.zeros(a, dtype=torch.int32,
               device="cuda"), deterministic=det)  # fmt: skip
    assert not bool(out.any())


@pytest.mark.parametrize("counts", [[2, 3, 1, 2], [5, 5, 5, 5], [0, 0, 0, 0], [12, 0, 0, 3]])
def test_scatter_add_padded_counts_past_the_rows(counts):
    """Counts summing past the T_K send rows: the rows that do not exist are not read."""
    EP, T_K, T, D = 2, 12, 9, 64
    buf = torch.full((EP, T_K + 2 * GUARD, D), float("nan"), device="cuda")  # NaN rows around each block
    x = buf[:, GUARD : GUARD + T_K]
    x.copy_(randn((EP, T_K, D), torch.float32, seed=1))
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    tok = bad_indices(T_K, T, torch.int32, 8)
    init = randn((T, D), torch.float32, seed=9)
    out = Placed((T, D), torch.float32, init=init)
    want = init.clone()
    ref.scatter_add_padded_tokens(x, c, tok, want)
    launch(ops.scatter_add_padded_tokens, x, c, tok, out.t)
    out.assert_guards("scatter_add_padded_tokens")
    assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), "scatter_add_padded_tokens", tol=1e-5)


# ----------------------------------------------------------------------------------------------
# Shuffling: counts inconsistent with T
# ----------------------------------------------------------------------------------------------

SHUFFLE_COUNTS = {
    "fits": ([[2, 1, 3], [0, 4, 1]], False, 11),
    "sum_past_T": ([[5, 5, 5], [5, 5, 5]], False, 11),
    "negative": ([[-4, 3, 2], [1, -1, 6]], False, 11),
    "huge": ([[I32_MAX, 1, 1], [1, 1, 1]], False, 11),
    "padded_rank_past_block": ([[4, 3, 0], [1, 1, 1]], True, 10),
    "T0": ([[0, 0, 0], [0, 0, 0]], False, 0),
    "T0_counts_past": ([[1, 2, 3], [0, 0, 1]], False, 0),
}


@pytest.mark.parametrize("case", sorted(SHUFFLE_COUNTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_shuffling_counts_inconsistent_with_T(case, dtype):
    """Counts that fit move rows exactly as the reference; counts that do not (sums past T,
    negative, int32-sized, a padded rank's rows past its block) are refused on the CPU and on
    CUDA skipped: no write outside the output, no read outside the rows, no hang."""
    counts, padded, T = SHUFFLE_COUNTS[case]
    D = 64
    tri = _tri("shuffling")
    tokens = placed_input(randn((T, D), seed=11).to(dtype) if dtype != FP8 else randn((T, D), seed=11).float().to(FP8))
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = Placed((T, D), dtype)
    got, cnt = launch(tri.combine_shuffling, tokens, c, 0, 3, padded, out=out.t)
    out.assert_guards(f"combine_shuffling {case}")
    back = Placed((T, D), dtype)
    launch(tri.split_shuffling, tokens, c, 0, 3, padded, False, out=back.t)
    back.assert_guards(f"split_shuffling {case}")
    fits = case in ("fits", "T0")
    if fits:
        tb = tokens.view(torch.uint8) if dtype == FP8 else tokens
        want, wcnt = ref.combine_shuffling(tb.cpu(), c.cpu(), None, None, padded)
        n = int(wcnt[-1])
        assert torch.equal(cnt.cpu(), wcnt)
        gb = got.view(torch.uint8) if dtype == FP8 else got
        assert torch.equal(gb[:n].cpu(), want[:n]), "combine_shuffling rows"
        g2, _ = launch(ops.combine_shuffling, tokens, c, None, None, padded)
        g2b = g2.view(torch.uint8) if dtype == FP8 else g2
        assert torch.equal(g2b[:n].cpu(), want[:n]), "public combine_shuffling rows"
    else:
        with pytest.raises(ValueError, match="token_counts"):
            ops.combine_shuffling(tokens.cpu(), c.cpu(), None, None, padded)


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,E,k,v,start,end",
    [(16, 8, 2, 100, None, None), (16, 8, 2, -5, None, None), (0, 8, 2, None, None, None), (5, 1, 1, None, None, None),
     (7, 6, 6, 3, None, None), (9, 8, 2, None, 3, 3), (9, 8, 3, None, 2, 7), (300, 64, 8, 250, 0, 32),
     (5000, 16, 4, None, None, None)],
)  # fmt: skip
def test_index_shuffling_edges(T, E, k, v, start, end):
    g = torch.Generator().manual_seed(T + E)
    s = torch.randn(T, E, generator=g)
    if T > 2:
        s[1, 0] = float("nan")  # NaN ranks above +inf
        s[2, :] = 0.0  # all ties
    vt = maybe_count(v)
    got = launch(ops.index_shuffling, s.cuda(), start, end, vt, k)
    want = ref.index_shuffling(s, start, end, None if v is None else torch.tensor([v]), k)
    for gg, ww, name in zip(got, want, ("token_counts", "expert_indices", "token_indices")):
        assert torch.equal(gg.cpu(), ww), f"index_shuffling {name}"


@pytest.mark.parametrize("T,E,k", [(0, 16, 2), (1, 128, 8), (300, 16, 2), (3, 4, 4)])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "topk_softmax"])
def test_route_and_shuffle_edges(T, E, k, score_func):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
    zero = Placed((4, 64), torch.float32)
    got = launch(ops.route_and_shuffle, logits.cuda(), k, score_func, True, zero_buffer=zero.t)
    zero.assert_guards("route_and_shuffle zero_buffer")
    assert not bool(zero.t.any())
    want = ref.route_and_shuffle(logits, k, score_func, True)
    V = int(want[0][E + 1])
    for i, name in ((0, "token_counts"), (1, "expert_indices"), (2, "token_indices"), (4, "selection_rows")):
        assert torch.equal(got[i].cpu(), want[i]), f"route_and_shuffle {name}"
    torch.testing.assert_close(got[3].cpu()[:V], want[3][:V], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# GEMMs: group sizes inconsistent with the rows, out-of-range scatter / gather / selection rows
# ----------------------------------------------------------------------------------------------

M_SIZES = {"exact": [5, 0, 7, 4], "under": [2, 3, 0, 1], "over": [9, 9, 9, 9], "huge": [I32_MAX, 1, 1, 1],
           "negative": [-3, 8, 6, 5], "M0": [0, 0, 0, 0]}  # fmt: skip


@pytest.mark.parametrize("case", sorted(M_SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_group_sizes_and_scatter_indices(case, dtype):
    """Rows past ``sum(m_sizes)`` or past M are neither computed nor read (x's neighbour rows are
    NaN), out-of-range scatter indices are skipped, nothing is written outside the output. Negative
    sizes are outside the contract: only memory safety is checked there."""
    G, N, K = 4, 32, 64
    M = 0 if case == "M0" else 16
    T = 10
    x = placed_input(randn((M, K), dtype, seed=12))
    w = randn((G * N, K), dtype, seed=13, scale=K**-0.5)
    m = torch.tensor(M_SIZES[case], dtype=torch.int32, device="cuda")
    idx = bad_indices(M, T, torch.int32, 14)
    init = randn((T, N), dtype, seed=15)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3  # bf16 / tf32 tensor cores
    for det in (False, True):
        out = Placed((T, N), dtype, init=init)
        launch(ops.grouped_gemm, x, w, m, _output_tensor=out.t, _scatter_add_indices=idx, deterministic=det)
        out.assert_guards(f"grouped_gemm scatter {case}")
        if case != "negative":
            want = init.clone()
            ref.grouped_gemm(x, w, m, _output_tensor=want, _scatter_add_indices=idx)
            assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), f"grouped_gemm scatter {case} det={det}", tol)
        else:
            assert not bool(torch.isnan(out.t).any()), "grouped_gemm read a row outside x"
    y = launch(ops.grouped_gemm, x, w, m)
    assert y.shape == (M, N)
    if case != "negative":
        done = torch.zeros(M, dtype=torch.bool)
        done[: min(M, int(m.long().clamp(min=0).sum().clamp(max=I32_MAX)))] = True
        assert_rows(y, ref.grouped_gemm(x, w, m), done, f"grouped_gemm rows {case}", tol)


@pytest.mark.parametrize("case", ["exact", "over", "under", "M0"])
def test_grouped_gemm_fp8_group_sizes(case):
    G, N, K = 4, 32, 64
    M = 0 if case == "M0" else 16
    xq, xs = ref.quantize_fp8_row(torch.randn(M, K, generator=torch.Generator().manual_seed(1)))
    wq, ws = ref.quantize_fp8_row(torch.randn(G * N, K, generator=torch.Generator().manual_seed(2)) / 8)
    xq, xs, wq, ws = placed_input(xq.cuda()), xs.cuda(), wq.cuda(), ws.cuda()
    m = torch.tensor(M_SIZES[case], dtype=torch.int32, device="cuda")
    T = 10
    idx = bad_indices(M, T, torch.int64, 16)
    out = Placed((T, N), torch.bfloat16, init=torch.zeros(T, N, dtype=torch.bfloat16, device="cuda"))
    launch(ops.grouped_gemm_fp8_rowwise, xq, wq, m, xs, ws, _output_tensor=out.t, _scatter_add_indices=idx)
    out.assert_guards(f"grouped_gemm_fp8_rowwise {case}")
    want = torch.zeros(T, N, dtype=torch.bfloat16)
    ref.grouped_gemm_fp8_rowwise(xq.cpu(), wq.cpu(), m.cpu(), xs.cpu(), ws.cpu(), _output_tensor=want,
                                 _scatter_add_indices=idx.cpu())  # fmt: skip
    assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), f"grouped_gemm_fp8_rowwise {case}", tol=3e-2)


@pytest.mark.parametrize("case", ["exact", "over", "under", "M0"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_grouped_gemm_swiglu_bad_gather_indices(case, idx_dtype):
    G, F, K, R = 4, 32, 64, 12
    M = 0 if case == "M0" else 16
    x = placed_input(randn((R, K), seed=17))
    w13 = randn((G * 2 * F, K), seed=18, scale=K**-0.5)
    m = torch.tensor(M_SIZES[case], dtype=torch.int32, device="cuda")
    gi = bad_indices(M, R, idx_dtype, 19)
    got = launch(ops.grouped_gemm_swiglu, x, w13, m, gather_indices=gi)
    want = ref.grouped_gemm_swiglu(x, w13, m, gather_indices=gi)
    src = gi.long().cpu()
    done = (src >= 0) & (src < R)
    done &= torch.arange(M) < int(m.long().sum().clamp(max=M))
    assert_rows(got, want, done, f"grouped_gemm_swiglu {case}", tol=3e-2)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("M", [0, 9])
def test_grouped_gemm_combine_bad_rows(idx_dtype, M):
    """Selection rows negative / past M / near the int limits are skipped, and so are negative
    expert ids (expert ids >= G: ``test_grouped_gemm_combine_expert_ids_past_G``)."""
    G, N, F, T, K = 4, 32, 64, 5, 3
    z = placed_input(randn((M, F), seed=20))
    w = randn((G * N, F), seed=21, scale=F**-0.5)
    eidx = bad_indices(M, G, idx_dtype, 22)
    eidx = torch.where(eidx >= G, -1, eidx)
    srow = bad_indices(T * K, M, idx_dtype, 23)
    rw = placed_input(randn((M,), torch.float32, seed=24)) if M else None
    init = randn((T, N), seed=25)
    out = Placed((T, N), torch.bfloat16, init=init)
    launch(ops.grouped_gemm_combine, z, w, eidx, srow, out.t, row_weights=rw)
    out.assert_guards("grouped_gemm_combine")
    if M:
        want = init.clone()
        ref.grouped_gemm_combine(z, w, eidx, srow, want, row_weights=rw)
        assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), "grouped_gemm_combine", tol=3e-2)
    else:
        assert_untouched(out, torch.ones(T, dtype=torch.bool), "grouped_gemm_combine without rows")


def test_grouped_gemm_combine_expert_ids_past_G():
    G, N, F, T, K, M = 4, 32, 64, 5, 2, 6
    wbuf = torch.full(((G + 2) * N, F), float("nan"), dtype=torch.bfloat16, device="cuda")  # NaN rows past w
    w = wbuf[: G * N]
    w.copy_(randn((G * N, F), seed=21, scale=F**-0.5))
    z = randn((M, F), seed=20)
    eidx = torch.tensor([0, G, 1, G + 1, 2, 3], dtype=torch.int32, device="cuda")
    srow = torch.arange(T * K, dtype=torch.int32, device="cuda") % M
    init = randn((T, N), seed=25)
    out = Placed((T, N), torch.bfloat16, init=init)
    launch(ops.grouped_gemm_combine, z, w, eidx, srow, out.t)
    out.assert_guards("grouped_gemm_combine")
    want = init.clone()
    ref.grouped_gemm_combine(z, w, eidx, srow, want)
    assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), "grouped_gemm_combine with expert ids >= G", tol=3e-2)


@pytest.mark.skipif(not hasattr(ops, "combine_rows"), reason="no combine_rows op")
@pytest.mark.parametrize("M", [0, 9])
def test_combine_rows_bad_rows(M):
    T, K, D = 5, 3, 64
    rows = placed_input(randn((M, D), torch.float32, seed=26))
    srow = bad_indices(T * K, M, torch.int32, 27)
    init = randn((T, D), torch.float32, seed=28)
    out = Placed((T, D), torch.float32, init=init)
    launch(ops.combine_rows, out.t, rows, srow)
    out.assert_guards("combine_rows")
    want = init.clone()
    ref.combine_rows(want, rows, srow)
    assert_rows(out.t, want, torch.ones(T, dtype=torch.bool), "combine_rows", tol=1e-5)


# ----------------------------------------------------------------------------------------------
# Elementwise / row ops: valid counts past T or negative, empty tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", VALID_COUNTS)
@pytest.mark.parametrize("F", [24, 1536])
def test_silu_mul_valid_counts(v, F):
    T = 12
    tri = _tri("activation")
    h = placed_input(randn((T, 2 * F), seed=29))
    vt = maybe_count(v)
    n = T if v is None else max(min(v, T), 0)
    w = torch.arange(T) < n
    out = Placed((T, F), torch.bfloat16)
    launch(tri.silu_mul, h[:, :F], h[:, F:], vt, out=out.t)
    out.assert_guards("silu_mul")
    assert_rows(out.t, ref.silu_mul(h[:, :F], h[:, F:], vt), w, "silu_mul", tol=1e-2)
    assert_untouched(out, ~w, "silu_mul rows past the valid count")
    q, s = Placed((T, F), FP8), Placed((T,), torch.float32)
    launch(tri.silu_mul_quant, h[:, :F], h[:, F:], None, vt, out=(q.t, s.t))
    q.assert_guards("silu_mul_quant values")
    s.assert_guards("silu_mul_quant scales")
    assert_untouched(q, ~w, "silu_mul_quant rows past the valid count")
    assert_untouched(s, ~w, "silu_mul_quant scales past the valid count")
    _, rs = ref.silu_mul_quant(h[:, :F], h[:, F:], None, vt)
    assert_rows(s.t, rs, w, "silu_mul_quant scales", tol=1e-2)


@pytest.mark.parametrize("T,F", [(0, 16), (4, 0), (0, 0)])
def test_activation_empty(T, F):
    y = launch(ops.silu_mul, randn((T, F)), randn((T, F)))
    q, s = launch(ops.silu_mul_quant, randn((T, F)), randn((T, F)))
    assert y.shape == (T, F) and q.shape == (T, F) and s.shape == (T,)


@pytest.mark.parametrize("shape,zs", [((3, 5, 40), [7, -2, 0]), ((2, 0, 16), [1, 1]), ((0, 16), None), ((4, 7), None),
                                      ((6, 4096), None), ((2, 3, 1), [3, 2])])  # fmt: skip
def test_quantize_row_counts_and_empty(shape, zs):
    a = randn(shape, seed=30)
    zt = None if zs is None else torch.tensor(zs, dtype=torch.int64, device="cuda")
    q, s = launch(ops.quantize_fp8_row, a, zero_start_index_M=zt)
    want_q, want_s = ops.quantize_fp8_row(a.cpu(), zero_start_index_M=None if zt is None else zt.cpu())
    assert q.shape == want_q.shape and s.shape == want_s.shape
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-6, atol=0)
    q2, _ = launch(ops.triton_quantize_fp8_row, a, zero_start_index_M=zt, align_rows_to=16)
    assert q2.shape[-1] == -(-shape[-1] // 16) * 16
    assert not bool(q2[..., shape[-1] :].float().any())


@pytest.mark.parametrize("shape", [(0, 64), (3, 1), (5, 5000), (2, 0, 8)])
def test_rms_norm_edges(shape):
    x, g = randn(shape, seed=31), randn((shape[-1],), seed=32)
    y = launch(ops.rms_norm, x, g, 1e-6, randn(shape, seed=33))
    want = ref.rms_norm(x.cpu(), g.cpu(), 1e-6, True, randn(shape, seed=33).cpu()).to(torch.bfloat16)
    assert y.shape == want.shape
    torch.testing.assert_close(y.float().cpu(), want.float(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------
# Refusals on CUDA: wrong dtypes / shapes / devices name the argument (no kernel launched)
# ----------------------------------------------------------------------------------------------


def _tensors() -> SimpleNamespace:
    c = "cuda"
    return SimpleNamespace(
        c=c, x=torch.randn(6, 64, device=c, dtype=torch.bfloat16), i32=torch.zeros(6, dtype=torch.int32, device=c),
        s=torch.rand(6, 4, device=c), w=torch.randn(64, 64, device=c, dtype=torch.bfloat16),
        m=torch.tensor([3, 3], dtype=torch.int32, device=c), out=torch.zeros(6, 64, device=c, dtype=torch.bfloat16),
        i32_cpu=torch.zeros(6, dtype=torch.int32), m_cpu=torch.tensor([3, 3], dtype=torch.int32),  # made here: .cpu() syncs
    )  # fmt: skip


# (case id, the argument the message must name, the call on _tensors())
REFUSALS = [
    ("index_shuffling-top_k", "top_k", lambda t: ops.index_shuffling(t.s, top_k=5)),
    ("index_shuffling-dtype", "routing_scores", lambda t: ops.index_shuffling(t.s.int(), top_k=1)),
    ("index_shuffling-device", "valid_token_count",
     lambda t: ops.index_shuffling(t.s, valid_token_count=torch.tensor([1]))),
    ("route-bias-device", "e_score_correction_bias",
     lambda t: ops.route_and_shuffle(t.s, 2, "softmax", e_score_correction_bias=torch.zeros(4))),
    ("gather-device", "token_indices", lambda t: ops.gather_scale_dense_tokens(t.x, t.i32_cpu, t.i32, t.s)),
    ("gather-dtype", "token_indices", lambda t: ops.gather_scale_dense_tokens(t.x, t.i32.float(), t.i32, t.s)),
    ("gather-D", "x", lambda t: ops.gather_scale_dense_tokens(t.x[:, :12], t.i32, t.i32, t.s)),
    ("gather-scores-rows", "scores", lambda t: ops.gather_scale_dense_tokens(t.x, t.i32, t.i32, t.s[:5])),
    ("gather_quant-scale_ub-device", "scale_ub",
     lambda t: ops.gather_scale_quant_dense_tokens(t.x, t.i32, t.i32, t.s, torch.tensor([1.0]))),
    ("scatter-out-dtype", "out_tokens", lambda t: ops.scatter_add_dense_tokens(t.out.int(), t.x, t.i32)),
    ("scatter-out-expanded", "out_tokens",
     lambda t: ops.scatter_add_dense_tokens(t.out[:1].expand(6, 64), t.x, t.i32)),
    ("scatter-indices-len", "token_indices", lambda t: ops.scatter_add_dense_tokens(t.out, t.x, t.i32[:5])),
    ("scatter_det-device", "token_indices",
     lambda t: ops.scatter_add_dense_tokens_deterministic(t.out, t.x, t.i32_cpu)),
    ("padded-counts-device", "token_counts",
     lambda t: ops.scatter_add_padded_tokens(t.x.view(2, 3, 64), t.m_cpu, t.i32[:3], t.out)),
    ("combine-counts-device", "token_counts",
     lambda t: ops.combine_shuffling(t.x, torch.zeros(2, 3, dtype=torch.int32))),
    ("split-counts-dtype", "token_counts", lambda t: ops.split_shuffling(t.x, torch.zeros(2, 3, device=t.c))),
    ("grouped_gemm-w-dtype", "w", lambda t: ops.grouped_gemm(t.x, t.w.float(), t.m)),
    ("grouped_gemm-m_sizes-device", "m_sizes", lambda t: ops.grouped_gemm(t.x, t.w, t.m_cpu)),
    ("grouped_gemm-out-expanded", "_output_tensor",
     lambda t: ops.grouped_gemm(t.x, t.w, t.m, _output_tensor=t.out[:1, :32].expand(6, 32), _scatter_add_indices=t.i32)),
    ("grouped_gemm_fp8-w_scale", "w_scale",
     lambda t: ops.grouped_gemm_fp8_rowwise(t.x.to(FP8), t.w.to(FP8), t.m, torch.ones(6, device=t.c),
                                            torch.ones(63, device=t.c))),
    ("f8f8bf16-x_scale-device", "x_scale",
     lambda t: ops.f8f8bf16_rowwise(t.x.to(FP8), t.w.to(FP8), torch.ones(6), torch.ones(64, device=t.c))),
    ("swiglu-gather-device", "gather_indices",
     lambda t: ops.grouped_gemm_swiglu(t.x, t.w, t.m, gather_indices=t.i32_cpu)),
    ("combine_gemm-row_weights-device", "row_weights",
     lambda t: ops.grouped_gemm_combine(t.x, t.w, t.i32, t.i32, t.out, row_weights=torch.ones(6))),
    ("silu_mul-x1-dtype", "x1", lambda t: ops.silu_mul(t.x, t.x.float())),
    ("silu_mul_quant-count-device", "valid_token_count",
     lambda t: ops.silu_mul_quant(t.x, t.x, valid_token_count=torch.tensor([1]))),
    ("quantize-zero_start-device", "zero_start_index_M",
     lambda t: ops.quantize_fp8_row(t.x, zero_start_index_M=torch.tensor([1]))),
    ("quantize-scale_ub-device", "scale_ub", lambda t: ops.triton_quantize_fp8_row(t.x, scale_ub=torch.tensor([1.0]))),
    ("rms_norm-gamma-device", "gamma", lambda t: ops.rms_norm(t.x, torch.ones(64))),
]  # fmt: skip


@pytest.mark.parametrize("name,call", [(n, c) for _, n, c in REFUSALS], ids=[i for i, _, _ in REFUSALS])
def test_refusals_name_the_argument_on_cuda(name, call):
    t = _tensors()
    with pytest.raises((TypeError, ValueError), match=rf"(?<!\w){name}(?!\w)"):
        with no_host_sync():
            call(t)
    wait_gpu()
