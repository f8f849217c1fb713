"""The Lamport MoE-tail kernel in the Triton interpreter, one rank at a time with simulated peers
(the other ranks' fragments pre-published into its workspace; scratch buffers stand in for the
peers' workspaces), plus the registered op (opcheck, torch.compile) and argument validation."""

from __future__ import annotations

import pytest
import torch

from moekit.comm import CollectiveKernel, validate_shape
from moekit.comm._triton_tail import NUM_BUFFERS, SENTINEL16, TailLayout, launch_tail
from moekit.reference import norm as ref
from moekit.testing import assert_close, assert_poisoned, poison
from tests.comm._sim import Sim, bits_f32

EPS = 1e-6
MAX_M = 4
# the Triton 3.6 interpreter converts 1-element numpy arrays with int() (numpy < 2.4 warns)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _layout(
    R, rank, L, H, *, top_k=0, routed=True, shared=True, fp32=False, two_shot=False, max_m=MAX_M, gather_f32=None
):
    return TailLayout(
        rank,
        R,
        L if routed else 0,
        H if shared else 0,
        max_m,
        top_k,
        routed,
        shared,
        fp32,
        1 if two_shot else 1 << 30,
        gather_f32,
    )


def _inputs(R, m, L, H, seed, top_k=0, rows=7):
    g = torch.Generator().manual_seed(seed)
    lat = [torch.randn(m, L, generator=g).to(torch.bfloat16) for _ in range(R)]
    lat[0][0, :3] = -0.0  # published as +0.0
    sh = [torch.randn(m, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    sh[-1][-1, :2] = -0.0
    gamma = (torch.rand(L, generator=g) + 0.5).to(torch.bfloat16)
    res = torch.randn(m, L, generator=g).to(torch.bfloat16)
    unf = None
    if top_k:
        unf = []
        for _ in range(R):
            gemm2 = torch.randn(rows, L, generator=g).to(torch.bfloat16)
            w = torch.rand(m, top_k, generator=g).to(torch.bfloat16)
            idx = torch.randint(0, rows, (m, top_k), generator=g, dtype=torch.int32)
            idx[torch.rand(m, top_k, generator=g) < 0.3] = -1  # experts not local to this rank
            unf.append((gemm2, w, idx))
    return lat, sh, gamma, res, unf


def _call(sim: Sim, m, lat, sh, gamma, *, unf=None, res=None, two_shot=False, poison_out=True):
    """Prefill the simulated peers, run the kernel, check outputs and everything published."""
    lay = sim.layout
    L, H, rank = lay.latent_dim, lay.hidden_dim, lay.rank
    if unf is not None:
        rows_bits = [sim.contributions([ref.topk_finalize(*u)])[0] for u in unf]
    else:
        rows_bits = sim.contributions(lat) if lay.routed else None
    sim.reset_peers()
    b = sim.current
    sim.prefill(m, rows_bits, sh, two_shot=two_shot)
    lat_out = torch.empty(MAX_M, max(L, 1), dtype=torch.bfloat16)
    sh_full = torch.empty(MAX_M, max(H, 1), dtype=torch.bfloat16)
    if poison_out:
        poison(lat_out)
        poison(sh_full)
    S = lay.shard_dim
    sh_view = sh_full[:, rank * S : (rank + 1) * S] if lay.shared else None
    if unf is not None:
        src, w, idx = unf[rank]
    else:
        src, w, idx = (lat[rank] if lay.routed else None), None, None
    launch_tail(
        sim.state,
        m,
        src,
        w,
        idx,
        res,
        gamma if lay.routed else None,
        sh[rank] if lay.shared else None,
        lat_out if lay.routed else None,
        sh_view,
        EPS,
        two_shot,
    )
    assert sim.state.errors.sum().item() == 0, sim.state.errors
    if lay.routed:
        want = ref.all_reduce_rms_norm([bits_f32(x) for x in rows_bits], gamma, EPS, lay.fp32_internal, res)
        assert_close(lat_out[:m], want, msg="latent")
        assert_poisoned(lat_out, slice(0, m))
    if lay.shared:
        want_sh = ref.reduce_scatter_hidden([x.float() for x in sh])[rank]
        assert_close(sh_view[:m], want_sh, msg="shared shard")
        # exact: a float32 rank-order sum rounded once to bf16
        assert torch.equal(sh_view[:m], want_sh.to(torch.bfloat16))
        assert_poisoned(sh_full[:, rank * S : (rank + 1) * S], slice(0, m))
        others = torch.cat([sh_full[:, : rank * S], sh_full[:, (rank + 1) * S :]], dim=1)
        assert torch.isnan(others).all(), "columns of other ranks' shards were written"
    sim.check_peer_writes(b, m, sim.expected_peer_writes(m, rows_bits, sh, two_shot))
    return lat_out, b


CASES = [
    # R, rank, L, H, m, kwargs
    pytest.param(2, 0, 64, 64, 3, {}, id="r2-upstream"),
    pytest.param(2, 1, 64, 64, 3, dict(fp32=True), id="r2-fp32"),
    pytest.param(3, 2, 48, 48, 2, {}, id="r3-npow2"),
    pytest.param(2, 1, 40, 80, 3, dict(top_k=5), id="r2-topk5"),
    pytest.param(2, 0, 64, 64, 4, dict(shared=False), id="routed-only"),
    pytest.param(2, 1, 64, 64, 1, dict(routed=False), id="shared-only"),
    pytest.param(4, 2, 64, 64, 3, dict(two_shot=True), id="r4-two-shot"),
    pytest.param(4, 1, 64, 32, 2, dict(two_shot=True, fp32=True, top_k=2), id="r4-two-shot-fp32-topk"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("R, rank, L, H, m, kw", CASES)
def test_kernel_vs_reference(R, rank, L, H, m, kw):
    lay = _layout(R, rank, L, H, **kw)
    sim = Sim(lay)
    lat, sh, gamma, _, unf = _inputs(R, m, L, H, seed=R * 100 + m, top_k=kw.get("top_k", 0))
    _call(sim, m, lat, sh, gamma, unf=unf, two_shot=kw.get("two_shot", False))
    f = sim.state.flags.tolist()
    assert f[:6] == [1, 0, m, lay.used(kw.get("two_shot", False)), 0, 1]


@pytest.mark.interpreter
@pytest.mark.parametrize("fp32, two_shot", [(False, False), (True, False), (False, True)])
def test_kernel_long_rows_residual(fp32, two_shot):
    """Rows longer than one block (two passes) and a residual: the standalone all-reduce + norm
    layout (its two-shot all-gather is float32, so the residual meets the unrounded sum)."""
    R, L, m = 2, 64, 3
    lay = _layout(R, 1, L, 0, shared=False, fp32=fp32, two_shot=two_shot, gather_f32=True)
    sim = Sim(lay, max_block_l=16)
    assert sim.state.blocks.block_l < L
    lat, sh, gamma, res, _ = _inputs(R, m, L, 16, seed=7)
    lat_out, _ = _call(sim, m, lat, sh, gamma, res=res, two_shot=two_shot)
    if not fp32:  # bit-exact vs the reference up to the final rounding and rsqrt
        want = ref.all_reduce_rms_norm([x.float() for x in lat], gamma, EPS, False, res)
        assert (lat_out[:m].float() - want).abs().max() <= want.abs().max() * 2**-7


@pytest.mark.interpreter
def test_rotation_and_lazy_clear():
    """Four calls with varying M: the buffers rotate 0, 1, 2, 0 and each call re-fills exactly
    the extent the previous call used."""
    R, L, H = 2, 64, 64
    lay = _layout(R, 0, L, H)
    sim = Sim(lay, max_programs=3)
    seq = [3, 1, 4, 2]
    for i, m in enumerate(seq):
        lat, sh, gamma, _, _ = _inputs(R, m, L, H, seed=i)
        _, b = _call(sim, m, lat, sh, gamma)
        assert b == i % NUM_BUFFERS
        f = sim.state.flags.tolist()
        assert f[:6] == [(b + 1) % 3, b, m, lay.used(False), 0, i + 1]
        local = sim.buf(0, 0).new_empty(0)
        for other in range(NUM_BUFFERS):
            local = sim.buf(0, other)
            if other == b:
                assert (local[:m] != SENTINEL16).any()
            elif i > 0 and other == (i - 1) % NUM_BUFFERS:
                assert (local == SENTINEL16).all(), "the previous call's buffer was not cleared"


@pytest.mark.interpreter
@pytest.mark.parametrize("two_shot", [False, True])
def test_timeout_names_missing_rank(two_shot):
    """A rank that never publishes: the wait stops at the deadline (an iteration cap in the
    interpreter), the missing rank is recorded on the device and in the host mirror, and the
    flags still advance (no hang)."""
    R, L, H, m, missing = 4, 64, 64, 2, 3
    lay = _layout(R, 0, L, H, two_shot=two_shot)
    sim = Sim(lay, timeout_s=0.003)
    lat, sh, gamma, _, _ = _inputs(R, m, L, H, seed=3)
    sim.prefill(m, sim.contributions(lat), sh, two_shot=two_shot, skip=(missing,))
    lat_out = torch.empty(MAX_M, L, dtype=torch.bfloat16)
    sh_out = torch.empty(MAX_M, H // R, dtype=torch.bfloat16)
    launch_tail(sim.state, m, lat[0], None, None, None, gamma, sh[0], lat_out, sh_out, EPS, two_shot)
    assert sim.state.errors.tolist() == [0, 0, 0, 1]
    assert sim.host_errors.tolist() == [0, 0, 0, 1]
    assert sim.state.flags.tolist()[:2] == [1, 0]


# ---- the registered op ------------------------------------------------------------------------


def _tp1_state():
    from moekit.comm.symm import create_local_state, register_state

    lay = _layout(1, 0, 32, 32, top_k=0)
    ws = torch.full((lay.workspace_elems,), SENTINEL16, dtype=torch.int16)
    st = create_local_state(lay, ws, [ws.data_ptr()], max_programs=1)
    return st, register_state(st)


@pytest.mark.interpreter
def test_registered_op_opcheck():
    st, h = _tp1_state()
    g = torch.Generator().manual_seed(0)
    m = 3
    x = torch.randn(m, 32, generator=g).to(torch.bfloat16)
    sh = torch.randn(m, 32, generator=g).to(torch.bfloat16)
    gamma = torch.rand(32, generator=g).to(torch.bfloat16)
    lat_out = torch.empty(MAX_M, 32, dtype=torch.bfloat16)
    sh_out = torch.empty(MAX_M, 32, dtype=torch.bfloat16)
    args = (h, m, EPS, -1, x, None, None, None, gamma, sh, lat_out, sh_out)
    torch.library.opcheck(torch.ops.moekit.symm_moe_tail_.default, args)
    torch.ops.moekit.symm_moe_tail_(*args)
    assert_close(lat_out[:m], ref.rms_norm(x.float(), gamma, EPS, False))
    assert torch.equal(sh_out[:m], sh)


@pytest.mark.interpreter
def test_registered_op_torch_compile():
    st, h = _tp1_state()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    sh = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    gamma = torch.rand(32, generator=g).to(torch.bfloat16)
    lat_out = torch.zeros(MAX_M, 32, dtype=torch.bfloat16)
    sh_out = torch.zeros(MAX_M, 32, dtype=torch.bfloat16)

    def f(x, sh, gamma):
        torch.ops.moekit.symm_moe_tail_(h, x.shape[0], EPS, -1, x, None, None, None, gamma, sh, lat_out, sh_out)
        return lat_out[: x.shape[0]] * 2, sh_out[: x.shape[0]] + 1

    torch._dynamo.reset()
    a, b = torch.compile(f, fullgraph=True, backend="aot_eager")(x, sh, gamma)
    assert_close(a, 2 * ref.rms_norm(x.float(), gamma, EPS, False), dtype=torch.bfloat16)
    assert_close(b, sh.float() + 1, dtype=torch.bfloat16)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize(
    "args, exc, text",
    [
        ((0, 64, 64), ValueError, "tp_size must be in [1, 16]"),
        ((17, 64, 272), ValueError, "tp_size must be in [1, 16]"),
        ((2, 60, 64), ValueError, "latent_dim must be a positive multiple of 8"),
        ((2, 64, 65), ValueError, "hidden_dim must be a positive multiple of tp_size"),
        ((4, 64, 48), ValueError, "the shard) must be a multiple of 8"),
        ((2.0, 64, 64), TypeError, "tp_size must be an int"),
    ],
)
def test_validate_shape_errors(args, exc, text):
    with pytest.raises(exc, match=pytest.importorskip("re").escape(text)):
        validate_shape(*args)


@pytest.mark.reference
def test_validate_shape_relaxed():
    # the seed's cluster constraints are not needed: latent not a multiple of the shard, tp 3
    assert validate_shape(3, 40, 48) == 16
    assert validate_shape(2, 2880, 2880) == 1440
    assert validate_shape(1, 8, 8) == 8


@pytest.mark.reference
@pytest.mark.parametrize(
    "kw, exc, text",
    [
        (dict(rank=2), ValueError, "rank must be in [0,2), got 2"),
        (dict(include_routed=False, include_reduce_scatter=False), ValueError, "at least one collective role"),
        (dict(max_m=0), ValueError, "max_m must be >= 1"),
        (dict(max_token_ctas=0), ValueError, "max_token_ctas must be >= 1"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0"),
        (dict(rms_eps=-1.0), ValueError, "rms_eps must be a non-negative float"),
        (dict(rms_eps=float("nan")), ValueError, "rms_eps must be a non-negative float and finite, got nan"),
        (dict(rms_eps="1e-6"), TypeError, "rms_eps must be a float, got str"),
        (dict(fp32_internal=1), TypeError, "fp32_internal must be a bool"),
        (dict(latent_dim=30), ValueError, "latent_dim must be a positive multiple of 8"),
        (dict(two_shot_min_m=0), ValueError, "two_shot_min_m must be >= 1"),
    ],
)
def test_collective_kernel_argument_errors(kw, exc, text):
    import re

    base = dict(
        group=None,
        rank=0,
        tp_size=2,
        latent_dim=64,
        hidden_dim=64,
        max_m=4,
        max_token_ctas=4,
        rms_eps=1e-6,
        fp32_internal=False,
    )
    base.update(kw)
    with pytest.raises(exc, match=re.escape(text)):
        CollectiveKernel(**base)


# ---- the public class on the symmetric-memory path (tp_size=1, interpreter) -----------------


def _local_collective(L=32, H=32, max_m=MAX_M, top_k=0, fp32=False):
    """A CollectiveKernel on the symm_mem path over a CPU tp_size=1 state (no process group)."""
    from moekit.comm.symm import create_local_state, register_state

    lay = _layout(1, 0, L, H, top_k=top_k, fp32=fp32, max_m=max_m)
    ws = torch.full((lay.workspace_elems,), SENTINEL16, dtype=torch.int16)
    st = create_local_state(lay, ws, [ws.data_ptr()], max_programs=1, host_errors=torch.zeros(1, dtype=torch.int32))
    ck = object.__new__(CollectiveKernel)
    ck.__dict__.update(
        rank=0,
        tp_size=1,
        latent_dim=L,
        hidden_dim=H,
        shard_dim=H,
        max_m=max_m,
        max_token_ctas=max_m,
        rms_eps=EPS,
        fp32_internal=fp32,
        top_k=top_k,
        include_routed=True,
        include_reduce_scatter=True,
        device=torch.device("cpu"),
        backend="symm_mem",
        timeout_s=1.0,
        group=None,
        _state=st,
        _state_handle=register_state(st),
        _failed=None,
        _latent_output=torch.empty(max_m, L, dtype=torch.bfloat16),
        _shared_output=torch.empty(max_m, H, dtype=torch.bfloat16),
    )
    ck._shared_shard = ck._shared_output[:, :H]
    return ck


@pytest.mark.interpreter
@pytest.mark.parametrize("top_k", [0, 3])
def test_collective_kernel_call_symm_path(top_k):
    from moekit.comm import UnfinalizedMoEOutput

    ck = _local_collective(top_k=top_k)
    g = torch.Generator().manual_seed(top_k)
    gamma = torch.rand(32, generator=g).to(torch.bfloat16)
    for m in (2, 4, 1):
        sh = torch.randn(m, 32, generator=g).to(torch.bfloat16)
        if top_k:
            gemm2 = torch.randn(5, 32, generator=g).to(torch.bfloat16)
            w = torch.rand(m, top_k, generator=g).to(torch.bfloat16)
            idx = torch.randint(-1, 5, (m, top_k), generator=g, dtype=torch.int32)
            src, x = UnfinalizedMoEOutput(gemm2, w, idx), ref.topk_finalize(gemm2, w, idx)
        else:
            src = x = torch.randn(m, 32, generator=g).to(torch.bfloat16)
        lo, so = ck(src, sh, gamma)
        assert lo.shape == (m, 32) and so.shape == (m, 32)
        assert_close(lo, ref.rms_norm(x.to(torch.bfloat16).float(), gamma, EPS, False))
        assert torch.equal(so, sh)
    ck.check()


@pytest.mark.interpreter
def test_collective_kernel_compiles_fullgraph():
    ck = _local_collective()
    g = torch.Generator().manual_seed(3)
    gamma = torch.rand(32, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    sh = torch.randn(3, 32, generator=g).to(torch.bfloat16)

    def f(x, sh, gamma):
        lo, so = ck(x, sh, gamma)
        return lo.float() * 2, so.float() + 1

    torch._dynamo.reset()
    a, b = torch.compile(f, fullgraph=True, backend="aot_eager")(x, sh, gamma)
    assert_close(a, 2 * ref.rms_norm(x.float(), gamma, EPS, False), dtype=torch.bfloat16)
    assert torch.equal(b, sh.float() + 1)


@pytest.mark.interpreter
def test_timeout_raises_on_next_call_and_check():
    """A timed-out call (here: tp_size=2 with the peer never publishing) makes check() and the
    next call raise RuntimeError naming the missing rank."""
    from moekit.comm.symm import register_state

    lay = _layout(2, 0, 32, 32)
    sim = Sim(lay, timeout_s=0.003)
    ck = _local_collective()
    ck.__dict__.update(tp_size=2, shard_dim=16, _state=sim.state, _state_handle=register_state(sim.state))
    ck._shared_shard = ck._shared_output[:, :16]
    x = torch.randn(2, 32).to(torch.bfloat16)
    gamma = torch.rand(32).to(torch.bfloat16)
    ck(x, torch.randn(2, 32).to(torch.bfloat16), gamma)  # returns: the wait is bounded
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\]"):
        ck.check()
    with pytest.raises(RuntimeError, match="no longer usable"):
        ck(x, torch.randn(2, 32).to(torch.bfloat16), gamma)


@pytest.mark.interpreter
def test_kernel_compiles_for_sm90():
    """The real compiler (not the interpreter) accepts the kernel for sm_90 in its main
    specializations: no spills, registers for one program per SM, vectorized volatile polling, the
    %globaltimer deadline and the acq_rel arrival atomic are there."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "tests.comm._compile_sm90"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0 and "ptxas" in p.stderr and "not found" in p.stderr:  # pragma: no cover
        pytest.skip("no ptxas in this triton install")
    assert p.returncode == 0, p.stdout + p.stderr
