"""rms_norm: interpreter tier (launcher on CPU tensors), reference tier (public op on CPU: values,
opcheck, torch.compile, argument errors), gpu tier."""

from __future__ import annotations

import pytest
import torch

from moekit.ops.norm import rms_norm
from moekit.reference import norm as ref
from moekit.testing import assert_close

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rand(shape, dtype, device="cpu", seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _expected(x, gamma, eps=1e-6, residual=None):
    return ref.rms_norm(x, gamma, eps, True, residual).to(x.dtype)


# ----------------------------------------------------------------------------- interpreter tier


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8,), (1, 8), (7, 24), (33, 40), (3, 5, 64)], ids=str)
def test_kernel_interpreter(shape, dtype):
    from moekit.ops._triton import norm as tri

    x = _rand(shape, dtype, seed=sum(shape))
    g = _rand(shape[-1:], dtype, seed=1, scale=1.0)
    y = tri.rms_norm(x, g, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, _expected(x, g), dtype=dtype)
    r = _rand(shape, torch.float32, seed=2)
    assert_close(tri.rms_norm(x, g.float(), 1e-5, r), _expected(x, g.float(), 1e-5, r), dtype=dtype)


@pytest.mark.interpreter
def test_strided_and_two_pass_interpreter():
    from moekit.ops._triton import norm as tri

    base = _rand((4, 6, 3, 40), torch.float16, seed=3)
    res = _rand((6, 4, 40), torch.bfloat16, seed=4)
    x = base[:, :, 1, :]  # [4, 6, 40], leading strides (720, 120)
    r = res.transpose(0, 1)  # [4, 6, 40], leading dims that do not collapse
    g = _rand((40,), torch.float32, seed=5)
    assert_close(tri.rms_norm(x, g, 1e-6, r), _expected(x, g, 1e-6, r), dtype=torch.float16)
    xp = base.permute(1, 0, 2, 3)[..., 8:]
    assert_close(tri.rms_norm(xp, g[8:], 1e-6), _expected(xp, g[8:]), dtype=torch.float16)
    x2 = _rand((2, 8200), torch.float32, seed=6)
    g2 = _rand((8200,), torch.float32, seed=7)
    assert not tri.row_config(2, 8200, 4, x2.device).one_pass
    assert_close(tri.rms_norm(x2, g2, 1e-6, x2 * 0.5), _expected(x2, g2, 1e-6, x2 * 0.5), dtype=torch.float32)
    assert tri.rms_norm(torch.empty(0, 16), g2[:16]).shape == (0, 16)


# ----------------------------------------------------------------------------- reference tier


@pytest.mark.reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_cpu(dtype):
    x = _rand((3, 5, 64), dtype)
    g = _rand((64,), torch.bfloat16, seed=1)
    r = _rand((3, 5, 64), dtype, seed=2)
    assert_close(rms_norm(x, g), _expected(x, g), dtype=dtype)
    y = rms_norm(x, g, 1e-3, r)
    assert y.dtype == dtype
    v = x.float() + r.float()
    manual = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-3) * g.float()
    assert_close(y, manual.to(dtype), dtype=dtype)


@pytest.mark.reference
def test_opcheck_and_compile_cpu():
    x = _rand((4, 7, 64), torch.bfloat16)
    g = _rand((64,), torch.float32, seed=1)
    r = _rand((4, 7, 64), torch.bfloat16, seed=2)
    op = torch.ops.moekit.rms_norm.default
    torch.library.opcheck(op, (x, g, 1e-6, None))
    torch.library.opcheck(op, (x, g, 1e-5, r))
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: rms_norm(a, g, 1e-6, b), fullgraph=True)
    assert torch.equal(f(x, r), rms_norm(x, g, 1e-6, r))


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The CUDA path, compiled on the CPU for sm_90 with ``eps`` typed fp64 as inductor passes it."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import norm as N
        bf, m = torch.bfloat16, "meta"
        g = torch.empty(7168, dtype=bf, device=m)
        N.rms_norm(torch.empty(2048, 7168, dtype=bf, device=m), g, 1e-6, torch.empty(2048, 7168, dtype=bf, device=m))
        r = torch.empty(7, 4, 7168, dtype=torch.float32, device=m).transpose(0, 1)  # two-level rows
        N.rms_norm(torch.empty(4, 7, 7168, dtype=bf, device=m), g, 1e-5, r)
        N.rms_norm(torch.empty(5, 20000, dtype=bf, device=m), torch.empty(20000, dtype=bf, device=m), 1e-6)
        """,
        ["moekit.ops._triton.norm"],
    )
    assert_all_compiled(records, 3)


def _bad_cases():
    x = _rand((4, 16), torch.bfloat16)
    g = _rand((16,), torch.bfloat16)
    return [
        ("x", TypeError, lambda: rms_norm(x.to(torch.int32), g)),
        ("x", TypeError, lambda: rms_norm([1.0], g)),
        ("x", ValueError, lambda: rms_norm(torch.tensor(1.0), g)),
        ("x", ValueError, lambda: rms_norm(x.T, g[:4])),
        ("gamma", ValueError, lambda: rms_norm(x, g[:8])),
        ("gamma", ValueError, lambda: rms_norm(x, g.reshape(4, 4))),
        ("gamma", TypeError, lambda: rms_norm(x, g.to(torch.int64))),
        ("residual", ValueError, lambda: rms_norm(x, g, 1e-6, x[:2])),
        ("residual", TypeError, lambda: rms_norm(x, g, 1e-6, x.to(torch.int32))),
        ("residual", ValueError, lambda: rms_norm(x, g, 1e-6, torch.randn(16, 4, dtype=torch.bfloat16).T)),
        ("eps", ValueError, lambda: rms_norm(x, g, -1.0)),
        ("eps", TypeError, lambda: rms_norm(x, g, None)),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    name, exc, call = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        call()


# ----------------------------------------------------------------------------- gpu tier


def _gpu_cases():
    cases = [(torch.bfloat16, T, H) for T in [0, 1, 7, 128, 2048] for H in [8, 24, 768, 2048, 5120, 7168, 8192]]
    cases += [(d, T, H) for d in (torch.float16, torch.float32) for T, H in [(1, 24), (7, 7168), (2048, 5120)]]
    cases += [(torch.bfloat16, 5, 20000), (torch.float32, 5, 10000), (torch.bfloat16, 16384, 1024)]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: f"{str(c[0])[6:]}-T{c[1]}-H{c[2]}")
def test_rms_norm_gpu(case, cuda):
    dtype, T, H = case
    x = _rand((T, H), dtype, cuda, seed=T + H)
    g = _rand((H,), dtype, cuda, seed=1, scale=1.0)
    y = rms_norm(x, g)
    assert y.dtype == dtype and y.shape == (T, H) and y.device.type == "cuda"
    assert_close(y, _expected(x, g), dtype=dtype)
    assert torch.equal(y, rms_norm(x, g))
    r = _rand((T, H), torch.bfloat16, cuda, seed=3)
    assert_close(rms_norm(x, g.float(), 1e-5, r), _expected(x, g.float(), 1e-5, r), dtype=dtype)


@pytest.mark.gpu
def test_strided_gpu(cuda):
    base = _rand((64, 3, 7168), torch.bfloat16, cuda)
    x = base[:, 1]
    r = _rand((7168, 64), torch.float32, cuda, seed=1).T.contiguous()
    g = _rand((7168,), torch.bfloat16, cuda, seed=2)
    assert_close(rms_norm(x, g, 1e-6, r), _expected(x, g, 1e-6, r))
    x3 = base.permute(1, 0, 2)  # [3, 64, 7168], non-collapsing leading dims
    assert_close(rms_norm(x3, g), _expected(x3, g))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 7168), (300, 2048), (4096, 5120)])
def test_cuda_graph_replay_gpu(T, H, cuda):
    x = torch.randn(T, H, device=cuda, dtype=torch.bfloat16)
    r = torch.randn(T, H, device=cuda, dtype=torch.bfloat16)
    g = torch.randn(H, device=cuda, dtype=torch.bfloat16)
    rms_norm(x, g, 1e-6, r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rms_norm(x, g, 1e-6, r)
    for rep in range(3):
        x.copy_(torch.randn(T, H, device=cuda) * (rep + 1))
        r.copy_(torch.randn(T, H, device=cuda))
        g.copy_(torch.randn(H, device=cuda))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, _expected(x, g, 1e-6, r))


@pytest.mark.gpu
def test_opcheck_and_compile_gpu(cuda):
    x = _rand((64, 5120), torch.bfloat16, cuda)
    g = _rand((5120,), torch.bfloat16, cuda, seed=1)
    torch.library.opcheck(torch.ops.moekit.rms_norm.default, (x, g, 1e-6, x))
    torch._dynamo.reset()
    f = torch.compile(lambda a: rms_norm(a, g, 1e-6, a), fullgraph=True)
    assert_close(f(x), _expected(x, g, 1e-6, x))


@pytest.mark.gpu
def test_int64_offsets_gpu(cuda):
    H = 4096
    T = (1 << 31) // H + 8
    try:
        x = torch.empty(T, H, dtype=torch.bfloat16, device=cuda)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a > 2**31-element test")
    x.uniform_(-4, 4)
    g = torch.randn(H, device=cuda, dtype=torch.bfloat16)
    y = rms_norm(x, g)
    tail = slice(T - 16, T)
    assert_close(y[tail], _expected(x[tail], g))
