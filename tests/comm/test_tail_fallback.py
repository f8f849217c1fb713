"""The torch.distributed fallback of the MoE-tail collectives on gloo (CPU), 2 and 4 spawned
ranks, against ``moekit.reference``; and every call-time validation error (shared by both
backends). One spawn per world size runs every scenario; each test reports one scenario."""

from __future__ import annotations

import re
import zlib

import pytest
import torch

from tests.comm._dist import merge, run_distributed, run_scenarios

L, H, MAX_M, EPS = 40, 64, 8, 1e-6


def _gen(*seed):
    """A generator seeded identically in every process (``hash`` of str is salted per process)."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(seed).encode()))
    return g


def _rank_inputs(R, m, seed, top_k=0, rows=9):
    """Every rank's inputs (each rank builds all of them, for the reference)."""
    lat, sh, unf = [], [], []
    for r in range(R):
        g = _gen(seed, m, r)
        lat.append(torch.randn(m, L, generator=g).to(torch.bfloat16))
        sh.append(torch.randn(m, H, generator=g).to(torch.bfloat16))
        if top_k:
            gemm2 = torch.randn(rows, L, generator=g).to(torch.bfloat16)
            w = torch.rand(m, top_k, generator=g).to(torch.bfloat16)
            idx = torch.randint(0, rows, (m, top_k), generator=g, dtype=torch.int32)
            idx[torch.rand(m, top_k, generator=g) < 0.3] = -1
            unf.append((gemm2, w, idx))
    gamma = (torch.rand(L, generator=_gen(seed, "gamma")) + 0.5).to(torch.bfloat16)
    return lat, sh, gamma, unf


def _same_on_all_ranks(t: torch.Tensor) -> None:
    import torch.distributed as dist

    R = dist.get_world_size()
    out = [torch.empty_like(t) for _ in range(R)]
    dist.all_gather(out, t.contiguous())
    for r in range(1, R):
        assert torch.equal(out[r].view(torch.int16), out[0].view(torch.int16)), f"rank {r} differs from rank 0"


def _ck(rank, R, **kw):
    from moekit.comm import CollectiveKernel

    base = dict(
        group=None,
        rank=rank,
        tp_size=R,
        latent_dim=L,
        hidden_dim=H,
        max_m=MAX_M,
        max_token_ctas=MAX_M,
        rms_eps=EPS,
        fp32_internal=False,
    )
    base.update(kw)
    return CollectiveKernel(**base)


# ---- scenarios (run inside every rank) ---------------------------------------------------------


def sc_both_roles(rank, R):
    from moekit.reference import norm as ref
    from moekit.testing import assert_close, assert_poisoned, poison

    for fp32 in (False, True):
        ck = _ck(rank, R, fp32_internal=fp32)
        assert ck.backend == "torch"
        for m in (1, 5, MAX_M):
            lat, sh, gamma, _ = _rank_inputs(R, m, ("both", fp32))
            poison(ck.latent_output)
            poison(ck.shared_output)
            lo, so = ck(lat[rank], sh[rank], gamma)
            want_lat, want_sh = ref.moe_tail(lat, sh, gamma, EPS, fp32)
            assert lo.shape == (m, L) and so.shape == (m, H // R)
            assert_close(lo, want_lat, msg=f"latent fp32={fp32} m={m}")
            assert torch.equal(so, want_sh[rank].to(torch.bfloat16)), "shard is not the rank-order float32 sum"
            assert_poisoned(ck.latent_output, slice(0, m))
            assert_poisoned(ck.shared_shard, slice(0, m))
            S = H // R
            others = torch.cat([ck.shared_output[:, : rank * S], ck.shared_output[:, (rank + 1) * S :]], 1)
            assert torch.isnan(others).all()
            _same_on_all_ranks(lo)


def sc_fp32_modes_differ(rank, R):
    """The upstream mode squares in bf16: on data where that matters the two modes differ, each
    matching its own reference mode exactly in the fallback."""
    from moekit.reference import norm as ref

    m = 4
    lat, sh, gamma, _ = _rank_inputs(R, m, "modes")
    outs = {}
    for fp32 in (False, True):
        ck = _ck(rank, R, fp32_internal=fp32)
        lo, _ = ck(lat[rank], sh[rank], gamma)
        want, _ = ref.moe_tail(lat, sh, gamma, EPS, fp32)
        assert torch.equal(lo, want.to(torch.bfloat16))
        outs[fp32] = lo.clone()
    assert not torch.equal(outs[False], outs[True])


def sc_one_role(rank, R):
    from moekit.reference import norm as ref
    from moekit.testing import assert_close

    m = 3
    lat, sh, gamma, _ = _rank_inputs(R, m, "one-role")
    ck = _ck(rank, R, include_reduce_scatter=False)
    lo, so = ck(lat[rank], None, gamma)
    assert so is None
    assert_close(lo, ref.all_reduce_rms_norm([x.float() for x in lat], gamma, EPS, False))
    ck = _ck(rank, R, include_routed=False)
    lo, so = ck(None, sh[rank], None)
    assert lo is None
    assert torch.equal(so, ref.reduce_scatter_hidden([x.float() for x in sh])[rank].to(torch.bfloat16))


def sc_topk(rank, R):
    from moekit.comm import UnfinalizedMoEOutput
    from moekit.reference import norm as ref
    from moekit.testing import assert_close

    K = 3
    for fp32 in (False, True):
        ck = _ck(rank, R, top_k=K, fp32_internal=fp32)
        for m in (1, 6):
            lat, sh, gamma, unf = _rank_inputs(R, m, ("topk", fp32), top_k=K)
            gemm2, w, idx = unf[rank]
            lo, so = ck(UnfinalizedMoEOutput(gemm2, w, idx), sh[rank], gamma)
            fin = [ref.topk_finalize(*u) for u in unf]
            want_lat, want_sh = ref.moe_tail(fin, sh, gamma, EPS, fp32)
            assert_close(lo, want_lat, msg="top-k latent")
            assert torch.equal(so, want_sh[rank].to(torch.bfloat16))
            _same_on_all_ranks(lo)
    # float32 weights and int64 indices are accepted too
    ck = _ck(rank, R, top_k=K)
    lat, sh, gamma, unf = _rank_inputs(R, 2, "topk64", top_k=K)
    gemm2, w, idx = unf[rank]
    lo, _ = ck(UnfinalizedMoEOutput(gemm2, w.float(), idx.long()), sh[rank], gamma)
    want, _ = ref.moe_tail([ref.topk_finalize(*u) for u in unf], sh, gamma, EPS, False)
    assert_close(lo, want)


def sc_standalone(rank, R):
    from moekit.comm import AllReduceRMSNorm, ReduceScatterHidden
    from moekit.reference import norm as ref
    from moekit.testing import assert_close

    hidden, m = 24, 5  # any multiple of 8
    g = _gen("standalone", rank)
    xs = [torch.randn(m, hidden, generator=_gen("sa", r)).to(torch.bfloat16) for r in range(R)]
    gamma = torch.rand(hidden, generator=_gen("sa-g")).to(torch.bfloat16)
    res = torch.randn(m, hidden, generator=_gen("sa-res")).to(torch.bfloat16)
    for fp32 in (True, False):
        ar = AllReduceRMSNorm(None, 8, hidden, eps=EPS, fp32_internal=fp32)
        out = ar.all_reduce_rms_norm(xs[rank], gamma, EPS, residual=res)
        assert_close(out, ref.all_reduce_rms_norm([x.float() for x in xs], gamma, EPS, fp32, res))
        out = ar(xs[rank], gamma)
        assert_close(out, ref.all_reduce_rms_norm([x.float() for x in xs], gamma, EPS, fp32))
        _same_on_all_ranks(out)
    rs = ReduceScatterHidden(None, 8, 8 * R * 2)
    ys = [torch.randn(m, 16 * R, generator=_gen("rs", r)).to(torch.bfloat16) for r in range(R)]
    got = rs.reduce_scatter_hidden(ys[rank])
    assert torch.equal(got, ref.reduce_scatter_hidden([y.float() for y in ys])[rank].to(torch.bfloat16))
    del g


def _raises(exc, text, fn, *a, **k):
    try:
        fn(*a, **k)
    except exc as e:
        assert re.search(re.escape(text), str(e)), f"message {str(e)!r} lacks {text!r}"
        return
    raise AssertionError(f"expected {exc.__name__}({text!r})")


def sc_call_validation(rank, R):
    """Every call-time error, raised before any collective (so ranks stay matched)."""
    from moekit.comm import UnfinalizedMoEOutput

    ck = _ck(rank, R)
    ck_k = _ck(rank, R, top_k=2)
    m = 3
    lat, sh, gamma, unf = _rank_inputs(R, m, "val", top_k=2)
    x, s = lat[rank], sh[rank]
    gemm2, w, idx = unf[rank]
    bf = torch.bfloat16
    _raises(ValueError, "latent_source must be contiguous CPU bfloat16 [3, 40], got float32", ck, x.float(), s, gamma)
    _raises(
        ValueError,
        f"latent_source must be contiguous CPU bfloat16 [3, {L}], got bfloat16 [3, 48]",
        ck,
        torch.zeros(3, 48, dtype=bf),
        s,
        gamma,
    )
    nc = torch.zeros(L, 3, dtype=bf).t()
    _raises(ValueError, "non-contiguous", ck, nc, s, gamma)
    _raises(ValueError, "on meta", ck, torch.empty(3, L, dtype=bf, device="meta"), s, gamma)
    _raises(ValueError, "latent_source must be rank-2", ck, x[0], s, gamma)
    _raises(TypeError, "latent_source must be a torch.Tensor", ck, [1, 2], s, gamma)
    _raises(ValueError, "shared_source must be rank-2", ck, x, s[None], gamma)
    _raises(ValueError, f"shared_source must be contiguous CPU bfloat16 [3, {H}]", ck, x, s[:2], gamma)
    _raises(ValueError, f"shared_source must be contiguous CPU bfloat16 [3, {H}], got float16", ck, x, s.half(), gamma)
    _raises(ValueError, f"gamma must be contiguous CPU bfloat16 [{L}]", ck, x, s, gamma[:-8])
    _raises(ValueError, "gamma must be contiguous CPU bfloat16", ck, x, s, gamma.float())
    _raises(ValueError, f"runtime M=0 must be in [1, {MAX_M}]", ck, x[:0], s[:0], gamma)
    big = torch.zeros(MAX_M + 1, L, dtype=bf)
    _raises(
        ValueError,
        f"runtime M={MAX_M + 1} must be in [1, {MAX_M}]",
        ck,
        big,
        torch.zeros(MAX_M + 1, H, dtype=bf),
        gamma,
    )
    _raises(
        ValueError,
        "collective was not configured for top-k finalize",
        ck,
        UnfinalizedMoEOutput(gemm2, w, idx),
        s,
        gamma,
    )
    _raises(ValueError, "top-k collective requires an unfinalized output", ck_k, x, s, gamma)
    _raises(
        ValueError,
        "expert_weights must be contiguous CPU bfloat16 or float32 [3, 2]",
        ck_k,
        UnfinalizedMoEOutput(gemm2, w[:, :1], idx),
        s,
        gamma,
    )
    _raises(
        ValueError,
        "expanded_idx_to_permuted_idx must be contiguous CPU int32 or int64 [3, 2], got float32",
        ck_k,
        UnfinalizedMoEOutput(gemm2, w, idx.float()),
        s,
        gamma,
    )
    _raises(
        ValueError,
        f"gemm2_permuted must be contiguous CPU bfloat16 [9, {L}]",
        ck_k,
        UnfinalizedMoEOutput(gemm2.float(), w, idx),
        s,
        gamma,
    )
    _raises(ValueError, "expert_weights must be rank-2", ck_k, UnfinalizedMoEOutput(gemm2, w[0], idx), s, gamma)
    # constructor checks against the group (local, no collective)
    _raises(ValueError, f"tp_size must equal the group size ({R})", _ck, rank, R * 2, hidden_dim=H * 2)
    _raises(ValueError, "rank must be this process's rank in the group", _ck, (rank + 1) % R, R)
    _raises(ValueError, "backend must be one of", _ck, rank, R, backend="nccl")
    _raises(ValueError, "timeout_s must be a positive number", _ck, rank, R, timeout_s=0)
    # standalone ops
    from moekit.comm import AllReduceRMSNorm, ReduceScatterHidden

    _raises(ValueError, "hidden must be a multiple of 8", AllReduceRMSNorm, None, 4, 20)
    _raises(
        ValueError, f"hidden must be a multiple of 8 * group size ({8 * R})", ReduceScatterHidden, None, 4, 8 * R + 8
    )
    ar = AllReduceRMSNorm(None, 4, 16)
    _raises(ValueError, "x must be contiguous CPU bfloat16 [2, 16]", ar, torch.zeros(2, 24, dtype=bf), gamma[:16])
    _raises(
        ValueError,
        "residual must be contiguous CPU bfloat16 [2, 16]",
        ar,
        torch.zeros(2, 16, dtype=bf),
        gamma[:16],
        None,
        torch.zeros(2, 16),
    )
    _raises(ValueError, "runtime M=5 must be in [1, 4]", ar, torch.zeros(5, 16, dtype=bf), gamma[:16])
    x16 = torch.zeros(2, 16, dtype=bf)
    _raises(ValueError, "eps must be a non-negative float and finite, got -1.0", ar, x16, gamma[:16], -1.0)
    _raises(ValueError, "eps must be a non-negative float and finite, got nan", ar, x16, gamma[:16], float("nan"))
    _raises(TypeError, "eps must be a float, got str", ar, x16, gamma[:16], "0.1")
    _raises(
        ValueError, "eps must be a non-negative float and finite, got -0.5", AllReduceRMSNorm, None, 4, 16, eps=-0.5
    )
    rs = ReduceScatterHidden(None, 4, 16 * R)
    _raises(ValueError, f"x must be contiguous CPU bfloat16 [2, {16 * R}]", rs, torch.zeros(2, 16 * R))


def sc_symm_refused_on_gloo(rank, R):
    """backend='symm_mem' on a CPU (gloo) group is refused on every rank, naming the reason."""
    _raises(RuntimeError, "backend='symm_mem' is unavailable", _ck, rank, R, backend="symm_mem")


SCENARIOS = {
    "both_roles": sc_both_roles,
    "fp32_modes": sc_fp32_modes_differ,
    "one_role": sc_one_role,
    "topk": sc_topk,
    "standalone": sc_standalone,
    "call_validation": sc_call_validation,
    "symm_refused": sc_symm_refused_on_gloo,
}


def _worker(rank, world_size):
    import moekit.comm  # noqa: F401 - sets the no-multicast environment

    return run_scenarios(rank, SCENARIOS, world_size)


@pytest.fixture(scope="module", params=[2, 4], ids=["gloo2", "gloo4"])
def gloo_results(request):
    return merge(run_distributed(_worker, request.param, "gloo", timeout_s=150))


@pytest.mark.reference
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fallback(gloo_results, scenario):
    res = gloo_results[scenario]
    assert res == "ok", res


@pytest.mark.reference
@pytest.mark.parametrize(
    "eps, exc, text",
    [
        (-1.0, ValueError, "eps must be a non-negative float and finite, got -1.0"),
        (float("nan"), ValueError, "eps must be a non-negative float and finite, got nan"),
        (float("inf"), ValueError, "eps must be a non-negative float and finite, got inf"),
        ("1e-6", TypeError, "eps must be a float, got str"),
        (True, TypeError, "eps must be a float, got bool"),
    ],
)
def test_all_reduce_rms_norm_rejects_bad_eps(eps, exc, text):
    """A negative or NaN eps made every output NaN (issue 16): refused as rms_norm and
    CollectiveKernel's rms_eps are, before any group work (the call-time eps: sc_call_validation)."""
    from moekit.comm import AllReduceRMSNorm

    with pytest.raises(exc, match=re.escape(text)):
        AllReduceRMSNorm(None, 4, 16, eps=eps)
