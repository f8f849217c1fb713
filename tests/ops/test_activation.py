"""silu_mul / silu_mul_quant: interpreter tier (launchers on CPU tensors), reference tier (public
ops on CPU: values, opcheck, torch.compile, argument errors), gpu tier (public ops on CUDA)."""

from __future__ import annotations

import pytest
import torch

from moekit.ops.activation import silu_mul, silu_mul_quant
from moekit.reference import activation as ref
from moekit.reference.quantize import FUSED_EPS
from moekit.testing import assert_close, assert_poisoned, poison

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(T, F, dtype, device="cpu", seed=0, pad=0, scale=3.0):
    """``x0``/``x1`` as column slices of one ``[T, 2F + pad]`` tensor (row stride ``2F + pad``)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, 2 * F + pad, generator=g) * scale).to(dtype).to(device)
    return h[:, :F], h[:, F + pad : 2 * F + pad]


def _count(n, device="cpu", dtype=torch.int32):
    return torch.tensor([n], dtype=dtype, device=device)


from moekit.testing import assert_fp8_close  # noqa: E402  (one copy, with a cap on values one step off)


def assert_scales_close(s: torch.Tensor, ref_s: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(s.cpu(), ref_s.cpu(), rtol=1e-6, atol=0.0, msg=msg or None)


# ----------------------------------------------------------------------------- interpreter tier

SHAPES_INTERP = [(1, 8, 0), (7, 24, 8), (33, 24, 1), (5, 40, 0), (3, 768, 8)]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,F,pad", SHAPES_INTERP)
def test_silu_mul_kernel_interpreter(T, F, pad, dtype):
    from moekit.ops._triton import activation as tri

    x0, x1 = _inputs(T, F, dtype, pad=pad, seed=T * 1000 + F)
    assert_close(tri.silu_mul(x0, x1), ref.silu_mul(x0, x1), dtype=dtype)
    n = T // 2
    y = poison(torch.empty(T, F, dtype=dtype))
    tri.silu_mul(x0, x1, _count(n), out=y)
    assert_poisoned(y, slice(0, n))
    assert_close(y[:n], ref.silu_mul(x0, x1)[:n], dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,F,pad", SHAPES_INTERP)
def test_silu_mul_quant_kernel_interpreter(T, F, pad, dtype):
    from moekit.ops._triton import activation as tri

    x0, x1 = _inputs(T, F, dtype, pad=pad, seed=T * 1000 + F)
    x0[0].zero_()  # an all-zero row: the eps path
    q, s = tri.silu_mul_quant(x0, x1)
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert_fp8_close(q, rq)
    assert_scales_close(s, rs)
    assert s[0].item() == pytest.approx(FUSED_EPS / 448.0, rel=1e-6)
    # scale_ub clamps the row max; valid_token_count leaves the tail untouched.
    ub = torch.tensor([0.25])
    n = (T + 1) // 2
    out = (poison(torch.empty(T, F, dtype=torch.float8_e4m3fn)), poison(torch.empty(T)))
    tri.silu_mul_quant(x0, x1, ub, _count(n, dtype=torch.int64), out=out)
    rq, rs = ref.silu_mul_quant(x0, x1, ub)
    assert_poisoned(out[0], slice(0, n))
    assert_poisoned(out[1], slice(0, n))
    assert_fp8_close(out[0][:n], rq[:n])
    assert_scales_close(out[1][:n], rs[:n])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,F", [(torch.float32, 8200), (torch.float16, 16400)])
def test_silu_mul_quant_two_pass_interpreter(dtype, F):
    from moekit.ops._triton import activation as tri

    x0, x1 = _inputs(2, F, dtype, pad=8, seed=F)
    assert not tri.np_row_config(2, F, x0.element_size(), 2, 512, x0.device).one_pass
    q, s = tri.silu_mul_quant(x0, x1)
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert_fp8_close(q, rq)
    assert_scales_close(s, rs)


def _check_nan_row(fn, T, F, dtype, device="cpu"):
    """A row whose x0 holds a NaN (in its last column) quantizes to a NaN scale and NaN values,
    as the reference (``torch.amax`` keeps it; a float max instruction would drop it); the other
    rows are unaffected."""
    x0, x1 = _inputs(T, F, dtype, device, seed=F, pad=8)
    x0[1, -1] = float("nan")
    q, s = fn(x0, x1)
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert torch.isnan(rs[1]) and torch.isnan(s[1].cpu()), f"scale of the NaN row: {float(s[1])}"
    assert torch.isnan(q[1].float()).all() and torch.isnan(rq[1].float()).all()
    keep = torch.arange(T, device=q.device) != 1
    assert_fp8_close(q[keep], rq[keep.cpu()])
    assert_scales_close(s[keep], rs[keep.cpu()])


@pytest.mark.interpreter
@pytest.mark.parametrize("F,dtype", [(24, torch.bfloat16), (8200, torch.float32)], ids=["one_pass", "two_pass"])
def test_silu_mul_quant_nan_row_interpreter(F, dtype):
    from moekit.ops._triton import activation as tri

    elem = torch.empty(0, dtype=dtype).element_size()
    assert tri.silu_mul_quant_config(3, F, elem, torch.device("cpu")).one_pass == (F == 24)
    _check_nan_row(tri.silu_mul_quant, 3, F, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("stages", [1, 3])
def test_grid_stride_loop_interpreter(monkeypatch, stages):
    """More tiles / row blocks than programs (a capped grid, or the pipelined persistent variant
    the configs can ask for): each program walks several, and rows past the valid count stay
    untouched."""
    from moekit.ops._triton import activation as tri
    from moekit.ops._triton.quantize import PipeConfig

    x0, x1 = _inputs(300, 768, torch.bfloat16, pad=8, seed=11)
    base = tri.tile_config(300, 768, 2, x0.device)
    n_tiles = -(-300 // base.block_t) * -(-768 // base.block_f)
    assert base.stages == 1 and base.grid == n_tiles
    monkeypatch.setattr(tri, "tile_config", lambda *a: base._replace(stages=stages, grid=7))
    assert_close(tri.silu_mul(x0, x1), ref.silu_mul(x0, x1))
    y = poison(torch.empty(300, 768, dtype=torch.bfloat16))
    tri.silu_mul(x0, x1, _count(203), out=y)
    assert_poisoned(y, slice(0, 203))
    assert_close(y[:203], ref.silu_mul(x0, x1)[:203])

    x0, x1 = _inputs(40, 2048, torch.bfloat16, pad=8, seed=12)
    x0[37].zero_()
    cfg = tri.np_row_config(40, 2048, 2, 2, 512, x0.device)
    assert cfg.one_pass and cfg.stages == 1 and cfg.grid == 40
    monkeypatch.setattr(tri, "silu_mul_quant_config", lambda *a: PipeConfig(2, 2048, True, stages, 4, 3))
    ub = torch.tensor([0.75])
    out = (poison(torch.empty(40, 2048, dtype=torch.float8_e4m3fn)), poison(torch.empty(40)))
    tri.silu_mul_quant(x0, x1, ub, _count(38), out=out)
    rq, rs = ref.silu_mul_quant(x0, x1, ub)
    assert_poisoned(out[0], slice(0, 38))
    assert_poisoned(out[1], slice(0, 38))
    assert_fp8_close(out[0][:38], rq[:38])
    assert_scales_close(out[1][:38], rs[:38])


@pytest.mark.interpreter
def test_empty_interpreter():
    from moekit.ops._triton import activation as tri

    x0, x1 = _inputs(0, 24, torch.float16)
    assert tri.silu_mul(x0, x1).shape == (0, 24)
    q, s = tri.silu_mul_quant(x0, x1)
    assert q.shape == (0, 24) and s.shape == (0,)


# ----------------------------------------------------------------------------- reference tier


@pytest.mark.reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_ops_cpu(dtype):
    x0, x1 = _inputs(6, 24, dtype, pad=8)
    y = silu_mul(x0, x1)
    a = x0.float()
    assert_close(y, (a * torch.sigmoid(a) * x1.float()).to(dtype), dtype=dtype)
    assert y.dtype == dtype and y.is_contiguous()
    q, s = silu_mul_quant(x0, x1, torch.tensor([1.0]), _count(4))
    rq, rs = ref.silu_mul_quant(x0, x1, torch.tensor([1.0]), _count(4))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert_fp8_close(q[:4], rq[:4])
    assert_scales_close(s[:4], rs[:4])


@pytest.mark.reference
def test_opcheck_cpu():
    x0, x1 = _inputs(5, 24, torch.bfloat16, pad=8)
    for vc in (None, _count(3)):
        torch.library.opcheck(torch.ops.moekit.silu_mul.default, (x0, x1, vc))
        torch.library.opcheck(torch.ops.moekit.silu_mul_quant.default, (x0, x1, torch.tensor([2.0]), vc))
        torch.library.opcheck(torch.ops.moekit.silu_mul_quant.default, (x0, x1, None, vc))


@pytest.mark.reference
def test_compile_fullgraph_cpu():
    torch._dynamo.reset()

    def f(h, ub, vc):
        F = h.shape[1] // 2
        return silu_mul(h[:, :F], h[:, F:], vc), silu_mul_quant(h[:, :F], h[:, F:], ub, vc)

    h = torch.randn(6, 48, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    ub, vc = torch.tensor([3.0]), _count(6)
    y, (q, s) = torch.compile(f, fullgraph=True)(h, ub, vc)
    ry, (rq, rs) = f(h, ub, vc)
    # Inductor compiles the CPU reference body with its own codegen (vectorized division, FMA
    # contraction): the contract's tolerances (one e4m3 step, scales to 1e-6), not bitwise.
    assert_close(y, ry)
    assert_fp8_close(q, rq)
    assert_scales_close(s, rs)


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The CUDA path (inline-PTX sigmoid, every silu_mul_quant variant), compiled on the CPU for
    sm_90."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import activation as A
        bf, m = torch.bfloat16, "meta"
        vc, ub = torch.empty(1, dtype=torch.int32, device=m), torch.empty(1, device=m)
        for F in (2048, 8192, 16384, 20000):
            h = torch.empty(2048, 2 * F + 8, dtype=bf, device=m)
            if F == 2048:
                A.silu_mul(h[:, :F], h[:, F + 8 :], vc)
            A.silu_mul_quant(h[:, :F], h[:, F + 8 :], ub, vc if F == 2048 else None)
        h = torch.empty(16384, 2 * 8192, dtype=bf, device=m)  # long rows, large: persistent
        A.silu_mul_quant(h[:, :8192], h[:, 8192:], ub, vc)
        """,
        ["moekit.ops._triton.activation"],
    )
    assert_all_compiled(records, 6)
    stages = [(r["kernel"], r["constants"]["STAGES"], r["constants"].get("ONE_PASS")) for r in records]
    assert stages == [
        ("_silu_mul_kernel", "1", None),
        ("_silu_mul_quant_kernel", "1", "True"),
        ("_silu_mul_quant_kernel", "1", "True"),
        ("_silu_mul_quant_kernel", "1", "True"),
        ("_silu_mul_quant_kernel", "1", "False"),
        ("_silu_mul_quant_kernel", "3", "True"),
    ]
    warps = [r["num_warps"] for r in records]
    assert warps[1:3] == [4, 8], warps  # F = 2048, 8192: the measured best


def _bad_cases():
    x0, x1 = _inputs(4, 16, torch.bfloat16)
    t = torch.randn(16, 4, dtype=torch.bfloat16).T  # last stride 4
    return [
        ("x1", TypeError, lambda f: f(x0, x1.half())),
        ("x1", ValueError, lambda f: f(x0, x1[:, :8])),
        ("x1", ValueError, lambda f: f(x0, x1[:3])),
        ("x0", ValueError, lambda f: f(t, x1)),
        ("x1", ValueError, lambda f: f(x0, t)),
        ("x0", TypeError, lambda f: f(x0.to(torch.int32), x1.to(torch.int32))),
        ("x0", ValueError, lambda f: f(x0[0], x1[0])),
        ("x0", TypeError, lambda f: f("x", x1)),
        ("valid_token_count", TypeError, lambda f: f(x0, x1, valid_token_count=torch.tensor([1.0]))),
        ("valid_token_count", ValueError, lambda f: f(x0, x1, valid_token_count=torch.tensor([1, 2]))),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(_bad_cases())))
@pytest.mark.parametrize("fn", [silu_mul, silu_mul_quant])
def test_bad_inputs(fn, case):
    name, exc, call = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        call(fn)


@pytest.mark.reference
def test_bad_scale_ub():
    x0, x1 = _inputs(4, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="scale_ub"):
        silu_mul_quant(x0, x1, torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="scale_ub"):
        silu_mul_quant(x0, x1, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="scale_ub"):
        silu_mul_quant(x0, x1, 1.0)


# ----------------------------------------------------------------------------- gpu tier

T_GPU = [0, 1, 7, 128, 2048]
F_GPU = [8, 24, 768, 2048, 8192]
OTHER_DTYPE_SHAPES = [(1, 24, 0), (7, 8192, 8), (128, 768, 1), (2048, 2048, 0)]


def _gpu_cases():
    cases = [(torch.bfloat16, T, F, 0) for T in T_GPU for F in F_GPU]
    cases += [(torch.bfloat16, 128, 2048, 8), (torch.bfloat16, 7, 24, 1), (torch.bfloat16, 3, 20000, 8)]
    cases += [(d, T, F, p) for d in (torch.float16, torch.float32) for T, F, p in OTHER_DTYPE_SHAPES]
    cases += [(torch.float32, 5, 10000, 0)]
    return cases


def _id(c):
    return f"{str(c[0])[6:]}-T{c[1]}-F{c[2]}-pad{c[3]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=_id)
def test_silu_mul_gpu(case, cuda):
    dtype, T, F, pad = case
    x0, x1 = _inputs(T, F, dtype, cuda, seed=T + F, pad=pad)
    y = silu_mul(x0, x1)
    assert y.shape == (T, F) and y.dtype == dtype and y.device.type == "cuda"
    assert_close(y, ref.silu_mul(x0, x1), dtype=dtype)
    assert torch.equal(y, silu_mul(x0, x1))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=_id)
def test_silu_mul_quant_gpu(case, cuda):
    dtype, T, F, pad = case
    x0, x1 = _inputs(T, F, dtype, cuda, seed=T + F, pad=pad)
    if T:
        x0[T // 2].zero_()  # all-zero row: eps path
    q, s = silu_mul_quant(x0, x1)
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert q.shape == (T, F) and q.dtype == torch.float8_e4m3fn and s.shape == (T,)
    assert_fp8_close(q, rq)
    assert_scales_close(s, rs)
    q2, s2 = silu_mul_quant(x0, x1)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    # scale_ub below most row maxima: clamped values saturate at +-448.
    ub = torch.tensor([0.5], device=cuda)
    q, s = silu_mul_quant(x0, x1, ub)
    rq, rs = ref.silu_mul_quant(x0, x1, ub)
    assert_fp8_close(q, rq)
    assert_scales_close(s, rs)


@pytest.mark.gpu
@pytest.mark.parametrize("T,F", [(4, 2048), (3, 20000), (16384, 8192)])  # one pass, two passes, persistent
def test_silu_mul_quant_nan_row_gpu(T, F, cuda):
    _check_nan_row(silu_mul_quant, T, F, torch.bfloat16, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("T,F,n", [(3000, 8192, 2999), (600, 4096, 600)])
def test_silu_mul_quant_persistent_gpu(T, F, n, cuda, pin_knobs):
    """The persistent cp.async-pipelined silu_mul_quant (long rows of problems over 256 MB take
    it; forced here on smaller ones): values, scales, the valid count, poisoned tails."""
    from moekit.ops._triton import activation as tri

    pin_knobs(PIPE_MIN_BYTES_SILU=0)
    cfg = tri.silu_mul_quant_config(T, F, 2, torch.device(cuda))
    assert cfg.stages > 1 and cfg.grid < -(-T // cfg.block_t)
    x0, x1 = _inputs(T, F, torch.bfloat16, cuda, seed=F, pad=8)
    x0[T // 3].zero_()
    out = (poison(torch.empty(T, F, dtype=torch.float8_e4m3fn, device=cuda)), poison(torch.empty(T, device=cuda)))
    tri.silu_mul_quant(x0, x1, None, _count(n, cuda), out=out)
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert_poisoned(out[0], slice(0, n))
    assert_poisoned(out[1], slice(0, n))
    assert_fp8_close(out[0][:n], rq[:n])
    assert_scales_close(out[1][:n], rs[:n])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,F,n", [(7, 24, 3), (128, 768, 0), (2048, 2048, 1000), (2048, 8192, 2047), (9, 20000, 5)])
def test_valid_token_count_poison_gpu(T, F, n, dtype, cuda):
    from moekit.ops._triton import activation as tri

    x0, x1 = _inputs(T, F, dtype, cuda, seed=n, pad=8)
    vc = _count(n, cuda)
    y = poison(torch.empty(T, F, dtype=dtype, device=cuda))
    tri.silu_mul(x0, x1, vc, out=y)
    assert_poisoned(y, slice(0, n))
    assert_close(y[:n], ref.silu_mul(x0, x1)[:n], dtype=dtype)
    out = (poison(torch.empty(T, F, dtype=torch.float8_e4m3fn, device=cuda)), poison(torch.empty(T, device=cuda)))
    tri.silu_mul_quant(x0, x1, None, vc, out=out)
    assert_poisoned(out[0], slice(0, n))
    assert_poisoned(out[1], slice(0, n))
    rq, rs = ref.silu_mul_quant(x0, x1)
    assert_fp8_close(out[0][:n], rq[:n])
    assert_scales_close(out[1][:n], rs[:n])
    # The public ops agree on the valid rows.
    assert_close(silu_mul(x0, x1, vc)[:n], ref.silu_mul(x0, x1)[:n], dtype=dtype)
    q, s = silu_mul_quant(x0, x1, None, vc)
    assert_fp8_close(q[:n], rq[:n])


@pytest.mark.gpu
@pytest.mark.parametrize("T,F", [(1, 2048), (300, 768), (2048, 8192)])
def test_cuda_graph_replay_gpu(T, F, cuda):
    h = torch.randn(T, 2 * F, device=cuda, dtype=torch.bfloat16)
    ub = torch.tensor([4.0], device=cuda)
    vc = _count(T, cuda)

    def run():
        return silu_mul(h[:, :F], h[:, F:], vc), silu_mul_quant(h[:, :F], h[:, F:], ub, vc)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, (q, s) = run()
    for rep in range(3):
        h.copy_(torch.randn(T, 2 * F, device=cuda, dtype=torch.bfloat16) * (rep + 1))
        n = max(1, T - 7 * rep)
        vc.fill_(n)
        ub.fill_(1.0 + rep)
        g.replay()
        torch.cuda.synchronize()
        assert_close(y[:n], ref.silu_mul(h[:, :F], h[:, F:])[:n])
        rq, rs = ref.silu_mul_quant(h[:, :F], h[:, F:], ub)
        assert_fp8_close(q[:n], rq[:n])
        assert_scales_close(s[:n], rs[:n])


@pytest.mark.gpu
def test_fast_sigmoid_extremes_gpu(cuda):
    """The MUFU ex2/rcp sigmoid (flush-to-zero) against float32 torch at the ends of its range.
    The relative error grows with |x| through the rounding of x * log2(e) (as in tl.exp), about
    |x| * 4e-8; silu values below ~1e-36 in magnitude (x < -87) may flush to 0."""
    v = torch.tensor([-1e4, -100.0, -88.0, -87.0, -30.0, -5.0, -1.0, -1e-3, 0.0])
    v = torch.cat([v, -v.flip(0)[1:], torch.tensor([1e-30])])
    x0 = v.repeat(8, 16).to(cuda)
    x1 = torch.randn(x0.shape, device=cuda)
    y = silu_mul(x0, x1)
    want = ref.silu_mul(x0, x1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-30)
    for special, expect in ((float("inf"), float("inf")), (float("nan"), float("nan"))):
        z = silu_mul(torch.full((1, 8), special, device=cuda), torch.ones(1, 8, device=cuda))
        torch.testing.assert_close(z, torch.full((1, 8), expect, device=cuda), equal_nan=True)
    assert torch.isnan(silu_mul(torch.full((1, 8), -float("inf"), device=cuda), torch.ones(1, 8, device=cuda))).all()


@pytest.mark.gpu
def test_opcheck_and_compile_gpu(cuda):
    x0, x1 = _inputs(64, 768, torch.bfloat16, cuda, pad=8)
    vc = _count(50, cuda)
    ub = torch.tensor([2.0], device=cuda)
    torch.library.opcheck(torch.ops.moekit.silu_mul.default, (x0, x1, None))
    torch.library.opcheck(torch.ops.moekit.silu_mul_quant.default, (x0, x1, ub, None))
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: (silu_mul(a, b, vc), silu_mul_quant(a, b, ub, vc)), fullgraph=True)
    y, (q, s) = f(x0, x1)
    assert_close(y[:50], ref.silu_mul(x0, x1)[:50])
    rq, rs = ref.silu_mul_quant(x0, x1, ub)
    assert_fp8_close(q[:50], rq[:50])
    assert_scales_close(s[:50], rs[:50])


@pytest.mark.gpu
def test_int64_offsets_gpu(cuda):
    """More than 2**31 elements per output: rows near the end must land in the right place."""
    F = 4096
    T = (1 << 31) // F + 8
    try:
        h = torch.empty(T, 2 * F, dtype=torch.bfloat16, device=cuda)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a > 2**31-element test")
    h.uniform_(-4, 4)
    x0, x1 = h[:, :F], h[:, F:]
    tail = slice(T - 16, T)
    y = silu_mul(x0, x1)
    assert_close(y[tail], ref.silu_mul(x0[tail], x1[tail]))
    del y
    q, s = silu_mul_quant(x0, x1)
    rq, rs = ref.silu_mul_quant(x0[tail], x1[tail])
    assert_fp8_close(q[tail], rq)
    assert_scales_close(s[tail], rs)
