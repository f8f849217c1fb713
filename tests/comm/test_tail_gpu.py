"""GPU tier of the MoE-tail collectives: NCCL + symmetric memory (peer pointers, no multicast)
on every visible GPU (world size = ``torch.cuda.device_count()``, at least 2). One spawn runs
every scenario (compilations and rendezvous are paid once); each test reports one scenario.

Run on a multi-GPU machine: ``bash scripts/run_comm_gpu.sh`` (or ``pytest tests/comm -m gpu``).
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from tests.comm._dist import merge, run_distributed, run_scenarios

EPS = 1e-6
WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
# The scenarios run on CUDA with the symm_mem backend. ``dry_run`` (a development aid) runs the
# device-independent ones on gloo/CPU with the torch backend, to check the test code itself.
DEV = torch.device("cuda")
BACKEND = "symm_mem"


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _gen(*seed):
    g = torch.Generator(device=DEV)
    g.manual_seed(zlib.crc32(repr(seed).encode()))
    return g


def _inputs(R, m, L, H, seed, top_k=0, rows=None):
    """Every rank's inputs, identical in every process (each rank computes the reference)."""
    dev = DEV
    lat, sh, unf = [], [], []
    for r in range(R):
        g = _gen(seed, m, r)
        x = torch.randn(m, L, generator=g, device=dev).to(torch.bfloat16)
        x[0, :4] = -0.0  # published as +0.0
        lat.append(x)
        sh.append(torch.randn(m, H, generator=g, device=dev).to(torch.bfloat16))
        if top_k:
            n = rows if rows is not None else max(1, m * top_k // R)
            gemm2 = torch.randn(n, L, generator=g, device=dev).to(torch.bfloat16)
            w = torch.rand(m, top_k, generator=g, device=dev).to(torch.bfloat16)
            idx = torch.randint(0, n, (m, top_k), generator=g, device=dev, dtype=torch.int32)
            idx[torch.rand(m, top_k, generator=g, device=dev) < 0.4] = -1
            unf.append((gemm2, w, idx))
    gamma = (torch.rand(L, generator=_gen(seed, "gamma"), device=dev) + 0.5).to(torch.bfloat16)
    return lat, sh, gamma, unf


def _ck(rank, R, L, H, max_m, **kw):
    from moekit.comm import CollectiveKernel

    base = dict(
        group=None,
        rank=rank,
        tp_size=R,
        latent_dim=L,
        hidden_dim=H,
        max_m=max_m,
        max_token_ctas=max_m,
        rms_eps=EPS,
        fp32_internal=False,
        backend=BACKEND,
    )
    base.update(kw)
    return CollectiveKernel(**base)


def _same_on_all_ranks(t: torch.Tensor, what: str) -> None:
    import torch.distributed as dist

    R = dist.get_world_size()
    out = [torch.empty_like(t) for _ in range(R)]
    dist.all_gather(out, t.contiguous())
    for r in range(1, R):
        assert torch.equal(out[r].view(torch.int16), out[0].view(torch.int16)), f"{what}: rank {r} differs from rank 0"


def _check_call(ck, rank, R, m, lat, sh, gamma, fp32, unf=None, what=""):
    """One call vs the reference; outputs poisoned first; routed output bitwise equal on all
    ranks and deterministic (a second identical call gives the same bits). The collectives run
    whatever the local outcome, so a failure on one rank does not desynchronize the others."""
    from moekit.comm import UnfinalizedMoEOutput
    from moekit.reference import norm as ref
    from moekit.testing import assert_close, assert_poisoned, poison

    problems = []

    def expect(fn, *a, **k):
        try:
            fn(*a, **k)
        except AssertionError as e:
            problems.append(f"{what} m={m}: {e}")

    if unf:
        src = UnfinalizedMoEOutput(*unf[rank])
        contrib = [ref.topk_finalize(*u) for u in unf]
    else:
        src, contrib = lat[rank], lat
    if ck.include_routed:
        poison(ck.latent_output)
    if ck.include_reduce_scatter:
        poison(ck.shared_output)
    routed_in = src if ck.include_routed else None
    shared_in = sh[rank] if ck.include_reduce_scatter else None
    lo, so = ck(routed_in, shared_in, gamma if ck.include_routed else None)
    want_lat, want_sh = ref.moe_tail(contrib, sh, gamma, EPS, fp32)
    S = ck.shard_dim
    if ck.include_routed:
        expect(assert_close, lo, want_lat, msg="latent")
        expect(assert_poisoned, ck.latent_output, slice(0, m), msg="latent rows")
        expect(_same_on_all_ranks, lo, "latent")
        first = lo.clone()
    if ck.include_reduce_scatter:
        if not torch.equal(so, want_sh[rank].to(torch.bfloat16)):
            problems.append(f"{what} m={m}: the shard is not the rank-order float32 sum")
        expect(assert_poisoned, ck.shared_shard, slice(0, m), msg="shard rows")
        full = ck.shared_output
        others = torch.cat([full[:, : rank * S], full[:, (rank + 1) * S :]], 1)
        if not torch.isnan(others).all():
            problems.append(f"{what} m={m}: other ranks' shard columns were written")
    if ck.include_routed:
        lo2, _ = ck(routed_in, shared_in, gamma)
        if not torch.equal(lo2.view(torch.int16), first.view(torch.int16)):
            problems.append(f"{what} m={m}: not deterministic")
    try:
        ck.check()
    except RuntimeError as e:
        problems.append(f"{what} m={m}: {e}")
    assert not problems, "\n".join(problems)


# ---- scenarios ------------------------------------------------------------------------------


SHAPES = [(3584, 7168), (7168, 7168), (5120, 5120), (2880, 2880)]


def sc_shapes(rank, R):
    for L, H in SHAPES:
        for fp32 in (False, True):
            ck = _ck(rank, R, L, H, 64, fp32_internal=fp32)
            assert ck.backend == BACKEND
            for m in (1, 7, 64):
                lat, sh, gamma, _ = _inputs(R, m, L, H, ("shapes", L, H, fp32))
                _check_call(ck, rank, R, m, lat, sh, gamma, fp32, what=f"L={L} H={H} fp32={fp32}")
            ck.close()


def sc_topk(rank, R):
    L, H, K = 3584, 7168, 8
    for fp32 in (False, True):
        ck = _ck(rank, R, L, H, 40, fp32_internal=fp32, top_k=K)
        for m in (1, 33):
            lat, sh, gamma, unf = _inputs(R, m, L, H, ("topk", fp32), top_k=K)
            _check_call(ck, rank, R, m, lat, sh, gamma, fp32, unf=unf, what=f"top-k fp32={fp32}")
        # rank 0 holds no local expert rows at all (every rank edits the same entry)
        lat, sh, gamma, unf = _inputs(R, 2, L, H, "topk-empty", top_k=K, rows=3)
        unf[0] = (unf[0][0][:0], unf[0][1], torch.full_like(unf[0][2], -1))
        _check_call(ck, rank, R, 2, lat, sh, gamma, fp32, unf=unf, what="top-k empty")
        ck.close()


def sc_one_role(rank, R):
    L = H = 7168
    for kw in (dict(include_reduce_scatter=False), dict(include_routed=False)):
        ck = _ck(rank, R, L, H, 32, **kw)
        for m in (1, 32):
            lat, sh, gamma, _ = _inputs(R, m, L, H, ("one-role", str(kw)))
            _check_call(ck, rank, R, m, lat, sh, gamma, False, what=str(kw))
        ck.close()


def sc_two_shot(rank, R):
    """The two-shot routed path forced from M=1 (auto picks it only from 4 ranks up)."""
    L, H = 3584, 7168
    if L % (8 * R):
        return  # the two-shot path needs L divisible by 8 * R
    for fp32 in (False, True):
        ck = _ck(rank, R, L, H, 64, fp32_internal=fp32, two_shot_min_m=1)
        assert ck._state.layout.use_two_shot(1)
        for m in (1, 5, 64):
            lat, sh, gamma, _ = _inputs(R, m, L, H, ("two-shot", fp32))
            _check_call(ck, rank, R, m, lat, sh, gamma, fp32, what=f"two-shot fp32={fp32}")
        ck.close()


def sc_back_to_back(rank, R, n_calls=2000):
    """2000 back-to-back calls, M varying in [1, max_m] (one sequence shared by all ranks), every
    call compared on the device (no sync per call), checksums compared across ranks. From M=64
    the routed role switches to the two-shot path, so the buffers also see both layouts."""
    from moekit.reference import norm as ref

    L, H, max_m = 3584, 7168, 128
    ck = _ck(rank, R, L, H, max_m, two_shot_min_m=64)
    dev = DEV
    ms = torch.randint(1, max_m + 1, (n_calls,), generator=torch.Generator().manual_seed(5)).tolist()
    g = _gen("b2b")
    base_lat = torch.randn(R, max_m, L, generator=g, device=dev).to(torch.bfloat16)
    base_sh = torch.randn(R, max_m, H, generator=g, device=dev).to(torch.bfloat16)
    gamma = (torch.rand(L, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    errs = torch.zeros(n_calls, device=dev)
    bad_shard = torch.zeros(n_calls, dtype=torch.int64, device=dev)
    sums = torch.zeros(n_calls, dtype=torch.int64, device=dev)
    S = H // R
    for i, m in enumerate(ms):
        # fresh data each call: rotate rows and scale by the call index (cheap, no host sync)
        shift = (i * 7) % max_m
        lat = [torch.roll(base_lat[r], shift, 0)[:m] * (1 + (i % 5) * 0.25) for r in range(R)]
        sh = [torch.roll(base_sh[r], shift, 0)[:m] * (1 - (i % 3) * 0.25) for r in range(R)]
        lo, so = ck(lat[rank], sh[rank], gamma)
        want = ref.rank_sum(lat)
        vb = want.to(torch.bfloat16).float()
        sq = (vb * vb).to(torch.bfloat16).float()
        want = vb * torch.rsqrt(sq.sum(-1, keepdim=True) / L + EPS) * gamma.float()
        errs[i] = torch.linalg.vector_norm(lo.float() - want) / torch.linalg.vector_norm(want)
        want_sh = ref.rank_sum([x[:, rank * S : (rank + 1) * S] for x in sh]).to(torch.bfloat16)
        bad_shard[i] = (so.view(torch.int16) != want_sh.view(torch.int16)).sum()
        sums[i] = lo.view(torch.int16).to(torch.int64).sum()
    worst = errs.max().item()
    assert worst < 1e-2, f"worst relative error over {n_calls} calls: {worst:.3e} (call {errs.argmax().item()})"
    assert bad_shard.sum().item() == 0, f"{(bad_shard > 0).sum().item()} calls had a wrong shard"
    _same_on_all_ranks(sums, "per-call checksums")
    ck.check()
    ck.close()


def sc_cuda_graph(rank, R):
    """Capture 3 calls in one CUDA graph, then replay with new data written in place into the
    captured inputs; eager calls with another M in between keep the rotation consistent."""
    from moekit.reference import norm as ref
    from moekit.testing import assert_close

    L, H, m = 3584, 7168, 16
    ck = _ck(rank, R, L, H, 64)
    dev = DEV
    ins = [
        (torch.empty(m, L, dtype=torch.bfloat16, device=dev), torch.empty(m, H, dtype=torch.bfloat16, device=dev))
        for _ in range(3)
    ]
    gamma = (torch.rand(L, device=dev, generator=_gen("g-gamma")) + 0.5).to(torch.bfloat16)
    outs = [
        (torch.empty(m, L, dtype=torch.bfloat16, device=dev), torch.empty(m, H // R, dtype=torch.bfloat16, device=dev))
        for _ in range(3)
    ]

    def fill(step):
        all_in = []
        for k in range(3):
            lat, sh, _, _ = _inputs(R, m, L, H, ("graph", step, k))
            ins[k][0].copy_(lat[rank])
            ins[k][1].copy_(sh[rank])
            all_in.append((lat, sh))
        return all_in

    def body():
        for k in range(3):
            lo, so = ck(ins[k][0], ins[k][1], gamma)
            outs[k][0].copy_(lo)
            outs[k][1].copy_(so)

    fill(-1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up: compiles, and exercises the rotation
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    for step in range(12):
        all_in = fill(step)
        graph.replay()
        if step % 4 == 3:  # an eager call in between (a different M)
            lat, sh, gamma2, _ = _inputs(R, 5, L, H, ("graph-eager", step))
            ck(lat[rank], sh[rank], gamma2)
        torch.cuda.synchronize()
        for k in range(3):
            lat, sh = all_in[k]
            want_lat, want_sh = ref.moe_tail(lat, sh, gamma, EPS, False)
            assert_close(outs[k][0], want_lat, msg=f"graph replay {step} call {k}")
            assert torch.equal(outs[k][1], want_sh[rank].to(torch.bfloat16)), f"graph replay {step} call {k} shard"
    ck.check()
    ck.close()


def sc_standalone(rank, R):
    from moekit.comm import AllReduceRMSNorm, ReduceScatterHidden
    from moekit.reference import norm as ref
    from moekit.testing import assert_close

    dev = DEV
    for hidden in (7168, 1000):
        for fp32 in (True, False):
            ar = AllReduceRMSNorm(None, 128, hidden, eps=EPS, fp32_internal=fp32, backend=BACKEND)
            for m in (1, 100):
                xs = [
                    torch.randn(m, hidden, generator=_gen("ar", hidden, m, r), device=dev).to(torch.bfloat16)
                    for r in range(R)
                ]
                gamma = torch.rand(hidden, generator=_gen("ar-g", hidden), device=dev).to(torch.bfloat16)
                res = torch.randn(m, hidden, generator=_gen("ar-r", hidden, m), device=dev).to(torch.bfloat16)
                out = ar(xs[rank], gamma, EPS, residual=res)
                assert_close(out, ref.all_reduce_rms_norm(xs, gamma, EPS, fp32, res), msg=f"AR+norm h={hidden}")
                _same_on_all_ranks(out, "all_reduce_rms_norm")
                out = ar.all_reduce_rms_norm(xs[rank], gamma)
                assert_close(out, ref.all_reduce_rms_norm(xs, gamma, EPS, fp32), msg="AR+norm no residual")
            ar.check()
            ar.close()
    rs = ReduceScatterHidden(None, 128, 7168, backend=BACKEND)
    for m in (1, 128):
        ys = [torch.randn(m, 7168, generator=_gen("rs", m, r), device=dev).to(torch.bfloat16) for r in range(R)]
        got = rs(ys[rank])
        assert torch.equal(got, ref.reduce_scatter_hidden(ys)[rank].to(torch.bfloat16))
    rs.check()
    rs.close()


def sc_torch_backend_nccl(rank, R):
    """The fallback on NCCL gives the same numbers."""
    L, H = 3584, 7168
    ck = _ck(rank, R, L, H, 16, backend="torch")
    assert ck.backend == "torch"
    for fp32 in (False, True):
        ck.fp32_internal = fp32
        lat, sh, gamma, _ = _inputs(R, 9, L, H, ("torch", fp32))
        _check_call(ck, rank, R, 9, lat, sh, gamma, fp32, what=f"torch backend fp32={fp32}")


def sc_skipped_call_times_out(rank, R):
    """The last rank skips one call: the others' kernels stop at the deadline and raise naming
    it, in well under the default timeout; nobody hangs. Runs last (it desynchronizes)."""
    import torch.distributed as dist

    L = H = 1024
    timeout = 0.5
    ck = _ck(rank, R, L, H, 8, timeout_s=timeout)
    lat, sh, gamma, _ = _inputs(R, 4, L, H, "timeout")
    ck(lat[rank], sh[rank], gamma)
    ck.check()
    torch.cuda.synchronize()
    dist.barrier()
    culprit = R - 1
    if rank != culprit:
        t0 = time.monotonic()
        ck(lat[rank], sh[rank], gamma)
        try:
            ck.check()
        except RuntimeError as e:
            elapsed = time.monotonic() - t0
            assert f"rank(s) [{culprit}]" in str(e), str(e)
            assert elapsed < timeout + 4.0, f"took {elapsed:.1f} s"
        else:
            raise AssertionError("a call with a missing rank did not raise")
        try:  # sticky: the next call raises at once, without touching the device
            ck(lat[rank], sh[rank], gamma)
        except RuntimeError as e:
            assert "no longer usable" in str(e)
        else:
            raise AssertionError("the call after a timeout did not raise")
    torch.cuda.synchronize()
    dist.barrier()


SCENARIOS = {
    "shapes": sc_shapes,
    "topk": sc_topk,
    "one_role": sc_one_role,
    "two_shot": sc_two_shot,
    "back_to_back": sc_back_to_back,
    "cuda_graph": sc_cuda_graph,
    "standalone": sc_standalone,
    "torch_backend_nccl": sc_torch_backend_nccl,
    "skipped_call_times_out": sc_skipped_call_times_out,  # last: leaves the group desynchronized
}


def _worker(rank, world_size):
    import moekit.comm  # noqa: F401 - no-multicast environment

    return run_scenarios(rank, SCENARIOS, world_size)


DRY_RUN = ("shapes", "topk", "one_role", "standalone", "torch_backend_nccl")


def _dry_worker(rank, world_size, n_calls):
    global DEV, BACKEND
    DEV, BACKEND = torch.device("cpu"), "torch"
    scen = {k: SCENARIOS[k] for k in DRY_RUN}
    scen["back_to_back"] = lambda r, R: sc_back_to_back(r, R, n_calls=n_calls)
    return run_scenarios(rank, scen, world_size)


def dry_run(world_size: int = 2, n_calls: int = 20) -> dict:
    """Run the device-independent scenarios on gloo/CPU with the torch backend."""
    return merge(run_distributed(_dry_worker, world_size, "gloo", args=(n_calls,), timeout_s=600))


@pytest.fixture(scope="module")
def gpu_results():
    return merge(run_distributed(_worker, WORLD, "nccl", timeout_s=310, pg_timeout_s=90))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_symm_tail_gpu(gpu_results, scenario):
    res = gpu_results[scenario]
    assert res == "ok", res


@pytest.mark.reference
def test_gpu_scenarios_dry_run_on_gloo():
    """The device-independent GPU scenarios, run on gloo/CPU with the torch backend: keeps the
    GPU-tier test code itself honest on machines without GPUs."""
    res = dry_run(2, n_calls=10)
    bad = {k: v for k, v in res.items() if v != "ok"}
    assert not bad, bad
