"""combine_rows: each token's expert-output rows summed into the output by the token-major
selection map (no atomics). Kernel in the interpreter and on the GPU, public op on the CPU,
against ``moekit.reference`` and bitwise against the deterministic scatter-add."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.ops import combine_rows, scatter_add_dense_tokens

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _case(T, K, D, dtype, seed=0, device="cpu", holes=True):
    """A real routing's layout (route_and_shuffle of random logits over 2K experts, an expert
    range that drops some choices when ``holes``), rows [N, D] of random values, out [T, D]."""
    g = torch.Generator().manual_seed(seed)
    E = max(2 * K, 4)
    logits = torch.randn(T, E, generator=g)
    end = E - 1 if holes else E
    counts, eidx, tidx, rw, srow = ref.route_and_shuffle(logits, K, "softmax", True, expert_index_end=end)
    rows = torch.randn(T * K, D, generator=g).to(dtype)
    out = torch.randn(T, D, generator=g).to(dtype)
    return out.to(device), rows.to(device), srow.to(device), tidx.to(device)


def _launch_interp(out, rows, srow, accumulate=True):
    from moekit.ops._triton import combine_rows as C

    C.combine_rows(out, rows, srow, accumulate)
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("T,K,D", [(1, 8, 64), (5, 3, 40), (9, 1, 16), (13, 16, 24), (3, 2, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_matches_reference(T, K, D, dtype):
    out, rows, srow, _ = _case(T, K, D, dtype, seed=T * K)
    want = ref.combine_rows(out.clone(), rows, srow)
    got = _launch_interp(out.clone(), rows, srow)
    if dtype == torch.float32:
        assert torch.equal(got, want)  # same additions in the same order
    else:  # the interpreter's float32 -> bf16 conversion is not round-to-nearest: one step
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.interpreter
@pytest.mark.parametrize("T,K,D", [(6, 4, 32), (17, 8, 48)])
def test_interp_bits_of_the_deterministic_scatter_add(T, K, D):
    """The same rows scatter-added deterministically (the inverse map: token indices) give the
    same bits: both add a token's rows in ascending row order, then add once."""
    from moekit.ops._triton import gather_scatter as GS

    out, rows, srow, tidx = _case(T, K, D, torch.bfloat16, seed=3)
    want = out.clone()
    GS.scatter_add_dense_tokens_deterministic(want, rows, tidx, None)
    assert torch.equal(_launch_interp(out.clone(), rows, srow), want)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_stores_without_reading_out(dtype):
    """``accumulate=False``: the sums stored, out's (NaN) values neither read nor kept; tokens
    with no row get 0."""
    out, rows, srow, _ = _case(11, 4, 40, dtype, seed=6)
    srow = srow.clone()
    srow[8:12] = -1  # token 2: no row at all
    want = ref.combine_rows(torch.zeros_like(out), rows, srow)
    got = _launch_interp(torch.full_like(out, float("nan")), rows, srow, accumulate=False)
    assert not got.isnan().any() and (got[2] == 0).all()
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.interpreter
def test_interp_skips_bad_selection_rows():
    out, rows, srow, _ = _case(4, 3, 16, torch.float32, seed=1, holes=False)
    srow = srow.clone()
    srow[0], srow[4], srow[7] = -5, rows.shape[0], 2**31 - 1  # no row, past M, the padding value
    want = ref.combine_rows(out.clone(), rows, srow)
    assert torch.equal(_launch_interp(out.clone(), rows, srow), want)


@pytest.mark.reference
def test_reference_is_a_per_token_sum():
    out, rows, srow, _ = _case(7, 4, 8, torch.float32, seed=2)
    want = out.clone().double()
    for t in range(7):
        for j in range(4):
            r = int(srow[t * 4 + j])
            if r >= 0:
                want[t] += rows[r].double()
    torch.testing.assert_close(ref.combine_rows(out.clone(), rows, srow).double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.reference
def test_public_cpu_stores_without_reading_out():
    out, rows, srow, _ = _case(6, 3, 16, torch.float32, seed=7)
    want = ref.combine_rows(torch.zeros_like(out), rows, srow)
    assert torch.equal(combine_rows(torch.full_like(out, float("nan")), rows, srow, accumulate=False), want)
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        combine_rows(out, rows, srow, accumulate=1)


@pytest.mark.reference
def test_public_cpu_and_scatter_add_agree():
    out, rows, srow, tidx = _case(9, 8, 32, torch.float32, seed=4)
    got = combine_rows(out.clone(), rows, srow)
    want = out.clone()
    scatter_add_dense_tokens(want, rows, tidx)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(rows=torch.zeros(8, 5)), ValueError, "rows must have D=4"),
        (dict(rows=torch.zeros(8, 4, dtype=torch.int32)), TypeError, "rows"),
        (dict(out=torch.zeros(4, 4, dtype=torch.bfloat16)), TypeError, "out"),
        (dict(srow=torch.zeros(7, dtype=torch.int32)), ValueError, "T \\* K"),
        (dict(srow=torch.zeros(8)), TypeError, "selection_rows"),
        (dict(srow=torch.zeros(16, dtype=torch.int32)[::2]), ValueError, "selection_rows"),
        (dict(out=torch.zeros(0, 4)), ValueError, "empty"),
        (dict(rows="rows"), TypeError, "rows"),
    ],
)
def test_bad_arguments(change, exc, match):
    args = dict(out=torch.zeros(4, 4), rows=torch.zeros(8, 4), srow=torch.zeros(8, dtype=torch.int32))
    args.update(change)
    with pytest.raises(exc, match=match):
        combine_rows(args["out"], args["rows"], args["srow"])


@pytest.mark.reference
def test_opcheck_and_compile_cpu():
    out, rows, srow, _ = _case(5, 2, 16, torch.float32, seed=5)
    torch.library.opcheck(torch.ops.moekit.combine_rows.default, (out.clone(), rows, srow))
    torch.library.opcheck(torch.ops.moekit.combine_rows.default, (out.clone(), rows, srow, False))
    torch._dynamo.reset()
    fn = torch.compile(lambda o, r, s: combine_rows(o, r, s), fullgraph=True)
    torch.testing.assert_close(fn(out.clone(), rows, srow), ref.combine_rows(out.clone(), rows, srow))


@pytest.mark.reference
def test_kernel_compiles_for_sm90():
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import combine_rows as C
        m = "meta"
        for T, K, D, acc in ((256, 8, 7168, True), (1, 8, 2048, True), (64, 4, 2880, True), (3, 1, 16, True),
                             (8192, 8, 7168, False)):
            C.combine_rows(torch.empty(T, D, dtype=torch.bfloat16, device=m),
                           torch.empty(T * K, D, dtype=torch.bfloat16, device=m),
                           torch.empty(T * K, dtype=torch.int32, device=m), acc)
        """,
        ["moekit.ops._triton.combine_rows"],
        pdl=True,
    )
    assert_all_compiled(records, 5)


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,D", [(1, 8, 2048), (256, 8, 7168), (64, 4, 2880), (300, 1, 5120), (7, 16, 24)])
def test_gpu_matches_reference_and_scatter_add_bits(T, K, D, cuda):
    out, rows, srow, tidx = _case(T, K, D, torch.bfloat16, seed=T)
    want = ref.combine_rows(out.clone(), rows, srow)
    got = combine_rows(out.to(cuda).clone(), rows.to(cuda), srow.to(cuda))
    assert torch.equal(got.cpu(), want)
    det = out.to(cuda).clone()
    scatter_add_dense_tokens(det, rows.to(cuda), tidx.to(cuda), deterministic=True)
    assert torch.equal(got, det)
    stored = combine_rows(torch.full_like(got, float("nan")), rows.to(cuda), srow.to(cuda), accumulate=False)
    assert torch.equal(stored.cpu(), ref.combine_rows(torch.zeros_like(out), rows, srow))
