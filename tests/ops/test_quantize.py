"""quantize_fp8_row / triton_quantize_fp8_row: interpreter tier (launcher on CPU tensors),
reference tier (public op on CPU: values, opcheck, torch.compile, argument errors), gpu tier."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.ops.quantize import DEFAULT_EPS, FUSED_EPS, quantize_fp8_row, triton_quantize_fp8_row
from moekit.reference import quantize as ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8 = torch.float8_e4m3fn


def _rand(shape, dtype, device="cpu", seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _expected(a, scale_ub=None, zsi=None, eps=DEFAULT_EPS, align=1):
    """The float32 oracle, with rows past ``zsi`` zeroed and the K padding appended."""
    rows = a.float()
    if zsi is not None:
        n = a.shape[-2] if a.dim() >= 2 else 1
        keep = (torch.arange(n, device=a.device) < zsi.reshape(tuple(a.shape[:-2]) + (1,))).reshape(a.shape[:-1])
        rows = torch.where(keep.unsqueeze(-1), rows, 0.0)
    K = a.shape[-1]
    k_out = -(-K // align) * align
    rows = torch.nn.functional.pad(rows, (0, k_out - K))
    return ref.quantize_fp8_row(rows, scale_ub, eps)


from moekit.testing import assert_fp8_close  # noqa: E402  (one copy, with a cap on values one step off)


def assert_scales_close(s: torch.Tensor, ref_s: torch.Tensor) -> None:
    torch.testing.assert_close(s.cpu(), ref_s.cpu(), rtol=1e-6, atol=0.0)


def _check(got, want):
    assert got[0].dtype == FP8 and got[1].dtype == torch.float32
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert_fp8_close(got[0], want[0])
    assert_scales_close(got[1], want[1])


# ----------------------------------------------------------------------------- interpreter tier

SHAPES_INTERP = [(8,), (1, 8), (7, 24), (33, 40), (3, 5, 40), (2, 3, 2, 16)]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES_INTERP, ids=str)
def test_kernel_interpreter(shape, dtype):
    from moekit.ops._triton import quantize as tri

    a = _rand(shape, dtype, seed=sum(shape))
    a.reshape(-1, shape[-1])[0].zero_()  # an all-zero row: the eps path
    q, s = tri.quantize_fp8_row(a)
    _check((q, s), _expected(a))
    assert s.reshape(-1)[0].item() == pytest.approx(DEFAULT_EPS / 448.0, rel=1e-6)
    ub = torch.tensor([0.5])
    _check(tri.quantize_fp8_row(a, ub), _expected(a, ub))
    _check(tri.quantize_fp8_row(a, None, None, FUSED_EPS), _expected(a, eps=FUSED_EPS))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_jagged_and_padding_interpreter(dtype):
    from moekit.ops._triton import quantize as tri

    a = _rand((4, 5, 24), dtype, seed=1)
    zsi = torch.tensor([0, 2, 5, 9], dtype=torch.int32)
    _check(tri.quantize_fp8_row(a, None, zsi), _expected(a, zsi=zsi))
    _check(
        tri.quantize_fp8_row(a, torch.tensor([1.0]), zsi.long(), k_out=32),
        _expected(a, torch.tensor([1.0]), zsi, align=16),
    )
    a2 = _rand((6, 24), dtype, seed=2)
    z1 = torch.tensor([4])
    _check(tri.quantize_fp8_row(a2, None, z1), _expected(a2, zsi=z1))


@pytest.mark.interpreter
def test_strided_rows_interpreter():
    from moekit.ops._triton import quantize as tri

    base = _rand((4, 6, 3, 40), torch.float16, seed=3)
    for a in (base[:, ::2, 1, :32], base.permute(1, 0, 2, 3)[..., 8:], base[0, :, 0, :24], base[:, :, :, :16]):
        _check(tri.quantize_fp8_row(a), _expected(a))


@pytest.mark.interpreter
def test_persistent_loop_interpreter(pin_knobs):
    """More row blocks than programs (4 interpreter SMs x programs per SM): each program walks
    several, jagged groups and strided rows included (the persistent path, which inputs over
    ``PIPE_MIN_BYTES`` take, forced here on small ones)."""
    from moekit.ops._triton import quantize as tri

    pin_knobs(PIPE_MIN_BYTES=0)
    cfg = tri.pipe_row_config(40, 4096, 2, 1, torch.device("cpu"))
    assert cfg.one_pass and cfg.stages > 1 and cfg.grid < 40
    assert tri.quantize_config(40, 4096, 2, torch.device("cpu")).stages > 1  # the launcher's plan: persistent
    a = _rand((40, 4096), torch.bfloat16, seed=5)
    a[17].zero_()
    _check(tri.quantize_fp8_row(a, torch.tensor([2.0])), _expected(a, torch.tensor([2.0])))
    b = _rand((5, 8, 2, 4096), torch.bfloat16, seed=6)[:, :, 1]  # [5, 8, 4096], row stride 8192
    zsi = torch.tensor([8, 0, 3, 7, 1])
    _check(
        tri.quantize_fp8_row(b[..., :4000], None, zsi, DEFAULT_EPS, 4032), _expected(b[..., :4000], zsi=zsi, align=64)
    )
    c = b.transpose(0, 1)  # leading dims that need two-level row addressing
    assert tri.row_layout(c).inner != 1 and tri.row_layout(b).inner == 1
    _check(tri.quantize_fp8_row(c), _expected(c))


@pytest.mark.interpreter
def test_split_row_tiles_interpreter(pin_knobs):
    """Rows covered by two power-of-two tiles (2880 = 2048 + 1024 with a masked tail; 5000
    padded to 5120 = 4096 + 1024, the padding in the second tile): the persistent path's."""
    from moekit.ops._triton import quantize as tri

    pin_knobs(PIPE_MIN_BYTES=0)
    cpu = torch.device("cpu")
    cfg = tri.pipe_row_config(6, 2880, 2, 1, cpu, split=True)
    assert (cfg.block_c, cfg.block_c2, cfg.one_pass) == (2048, 1024, True) and cfg.stages > 1
    assert tri.quantize_config(6, 2880, 2, cpu) == cfg  # the launcher's plan
    a = _rand((6, 2880), torch.bfloat16, seed=8)
    a[2, 2100:].mul_(50.0)  # the row max in the tail tile
    _check(tri.quantize_fp8_row(a), _expected(a))
    b = _rand((3, 5000), torch.float16, seed=9)
    zsi = torch.tensor([2])
    _check(tri.quantize_fp8_row(b, None, zsi, DEFAULT_EPS, 5120), _expected(b, zsi=zsi, align=128))


@pytest.mark.reference
def test_row_configs():
    """Launch plans: power-of-two blocks covering the row, stage buffers within the shared-memory
    budget, grids no larger than the work."""
    from moekit.ops._triton import quantize as tri

    assert tri.row_tiles(5120, 8, True) == (4096, 1024) and tri.row_tiles(7168, 8, True) == (8192, 0)
    assert tri.row_tiles(2880, 8, True) == (2048, 1024) and tri.row_tiles(5120, 8, False) == (8192, 0)
    assert tri.row_tiles(768, 8, True) == (1024, 0)
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    for rows in (1, 7, 128, 2048, 16384):
        for cols in (1, 8, 24, 72, 768, 2880, 5120, 7168, 8192, 10000, 20000):
            for elem, n_in, split in ((2, 1, True), (4, 1, True), (2, 2, False), (4, 2, False)):
                cfg = tri.pipe_row_config(rows, cols, elem, n_in, torch.device("cpu"), split)
                assert pow2(cfg.block_t) and pow2(cfg.block_c) and (cfg.block_c2 == 0 or pow2(cfg.block_c2))
                assert 1 <= cfg.grid <= -(-rows // cfg.block_t) and pow2(cfg.num_warps) and cfg.num_warps <= 16
                if cfg.one_pass:
                    assert cfg.block_c + cfg.block_c2 >= cols
                if cfg.stages > 1:
                    stage = n_in * cfg.block_t * (cfg.block_c + cfg.block_c2) * elem
                    assert (cfg.stages - 1) * stage * 2 <= tri.PIPE_SMEM_BYTES  # two programs per SM fit
                npc = tri.np_row_config(rows, cols, elem, n_in, 512 * n_in, torch.device("cpu"))
                assert npc.stages == 1 and npc.block_c2 == 0 and pow2(npc.block_t) and pow2(npc.block_c)
                assert npc.grid == -(-rows // npc.block_t) and pow2(npc.num_warps) and npc.num_warps <= 16
                assert npc.block_c >= cols if npc.one_pass else npc.block_t == 1


@pytest.mark.interpreter
def test_two_pass_and_empty_interpreter():
    from moekit.ops._triton import quantize as tri

    a = _rand((2, 8200), torch.float32, seed=4)
    assert not tri.pipe_row_config(2, 8200, 4, 1, a.device).one_pass
    _check(tri.quantize_fp8_row(a), _expected(a))
    _check(tri.quantize_fp8_row(a, k_out=8208), _expected(a, align=16))
    q, s = tri.quantize_fp8_row(torch.empty(0, 16))
    assert q.shape == (0, 16) and s.shape == (0,)
    _check(tri.quantize_fp8_row(torch.empty(3, 0)), _expected(torch.empty(3, 0)))


def _check_nan_row(quantize, shape, dtype, device="cpu"):
    """A row holding a NaN (in its last column) quantizes to a NaN scale and NaN values, as the
    reference (``torch.amax`` keeps it; a float max instruction would drop it); the other rows
    are unaffected."""
    a = _rand(shape, dtype, device, seed=shape[-1])
    a[1, -1] = float("nan")
    q, s = quantize(a)
    rq, rs = _expected(a)
    assert torch.isnan(rs[1]) and torch.isnan(s[1].cpu()), f"scale of the NaN row: {float(s[1])}"
    assert torch.isnan(q[1].float()).all() and torch.isnan(rq[1].float()).all()
    keep = torch.arange(shape[0]) != 1
    _check((q[keep], s[keep]), (rq[keep], rs[keep]))


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "shape,dtype", [((3, 40), torch.bfloat16), ((3, 8200), torch.float32)], ids=["one_pass", "two_pass"]
)
def test_nan_row_interpreter(shape, dtype):
    from moekit.ops._triton import quantize as tri

    elem = torch.empty(0, dtype=dtype).element_size()
    assert tri.quantize_config(*shape, elem, torch.device("cpu")).one_pass == (shape[1] == 40)
    _check_nan_row(tri.quantize_fp8_row, shape, dtype)


# ----------------------------------------------------------------------------- reference tier


@pytest.mark.reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_cpu(dtype):
    a = _rand((3, 4, 24), dtype)
    ub = torch.tensor([1.5])
    _check(quantize_fp8_row(a), _expected(a))
    _check(quantize_fp8_row(a, ub, use_triton=False), _expected(a, ub))
    _check(quantize_fp8_row(a, eps=FUSED_EPS), _expected(a, eps=FUSED_EPS))
    zsi = torch.tensor([1, 0, 4])
    _check(quantize_fp8_row(a, None, zsi, output_device="cpu"), _expected(a, zsi=zsi))
    _check(triton_quantize_fp8_row(a, ub, zsi, align_rows_to=16), _expected(a, ub, zsi, align=16))
    assert DEFAULT_EPS == 1.0 / 512.0 and FUSED_EPS == 1e-12


@pytest.mark.reference
def test_opcheck_cpu():
    a = _rand((2, 3, 40), torch.bfloat16)
    ub, zsi = torch.tensor([2.0]), torch.tensor([1, 3], dtype=torch.int32)
    op = torch.ops.moekit.quantize_fp8_row.default
    torch.library.opcheck(op, (a, None, None, True, DEFAULT_EPS, 1))
    torch.library.opcheck(op, (a, ub, zsi, True, FUSED_EPS, 16))
    torch.library.opcheck(op, (a[0], ub, None, False, DEFAULT_EPS, 1))


@pytest.mark.reference
def test_compile_fullgraph_cpu():
    torch._dynamo.reset()

    def f(a, ub, zsi):
        return quantize_fp8_row(a, ub, zsi), triton_quantize_fp8_row(a[..., :16], None, None, 32)

    a = _rand((2, 3, 40), torch.bfloat16)
    ub, zsi = torch.tensor([2.0]), torch.tensor([1, 3], dtype=torch.int32)
    got, want = torch.compile(f, fullgraph=True)(a, ub, zsi), f(a, ub, zsi)
    for (q, s), (rq, rs) in zip(got, want):
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The CUDA path, compiled on the CPU for sm_90 with Python floats typed fp64 as inductor
    passes them (``eps`` once reached ``div_rn`` as fp64 and failed under torch.compile)."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import quantize as Q
        bf, i32, m = torch.bfloat16, torch.int32, "meta"
        Q.quantize_fp8_row(torch.empty(2048, 5120, dtype=bf, device=m))  # one row per program
        Q.quantize_fp8_row(torch.empty(16384, 5120, dtype=bf, device=m))  # persistent, pipelined
        a = torch.empty(130, 4, 5120, dtype=bf, device=m).transpose(0, 1)  # two-level rows
        Q.quantize_fp8_row(a, torch.empty(1, device=m), torch.empty(4, dtype=i32, device=m), 1e-12, 5248)
        a = torch.empty(4000, 4, 5120, dtype=bf, device=m).transpose(0, 1)
        Q.quantize_fp8_row(a, torch.empty(1, device=m), torch.empty(4, dtype=i32, device=m), 1e-12, 5248)
        Q.quantize_fp8_row(torch.empty(64, 20000, dtype=torch.float32, device=m))  # two passes
        """,
        ["moekit.ops._triton.quantize"],
    )
    assert_all_compiled(records, 5)
    got = [(r["constants"]["STAGES"], r["constants"]["BLOCK_K"], r["constants"]["BLOCK_K2"]) for r in records]
    assert got == [
        ("1", "8192", "0"),
        ("3", "4096", "1024"),
        ("1", "8192", "0"),
        ("3", "4096", "2048"),
        ("1", "4096", "0"),
    ], got


def _bad_cases():
    a = _rand((4, 16), torch.bfloat16)
    return [
        ("a", TypeError, lambda: quantize_fp8_row(a.to(torch.int32))),
        ("a", TypeError, lambda: quantize_fp8_row([1.0])),
        ("a", ValueError, lambda: quantize_fp8_row(torch.tensor(1.0))),
        ("a", ValueError, lambda: quantize_fp8_row(a.T)),
        ("scale_ub", TypeError, lambda: quantize_fp8_row(a, torch.tensor([1.0], dtype=torch.bfloat16))),
        ("scale_ub", ValueError, lambda: quantize_fp8_row(a, torch.tensor([1.0, 2.0]))),
        ("zero_start_index_M", TypeError, lambda: quantize_fp8_row(a, None, torch.tensor([1.0]))),
        ("zero_start_index_M", ValueError, lambda: quantize_fp8_row(a, None, torch.tensor([1, 2]))),
        ("zero_start_index_M", ValueError, lambda: quantize_fp8_row(a.reshape(2, 2, 16), None, torch.tensor([1]))),
        ("eps", ValueError, lambda: quantize_fp8_row(a, eps=0.0)),
        ("eps", ValueError, lambda: quantize_fp8_row(a, eps=math.inf)),
        ("eps", TypeError, lambda: quantize_fp8_row(a, eps="x")),
        ("use_triton", TypeError, lambda: quantize_fp8_row(a, use_triton=1)),
        ("output_device", ValueError, lambda: quantize_fp8_row(a, output_device="nowhere")),
        ("align_rows_to", ValueError, lambda: triton_quantize_fp8_row(a, align_rows_to=0)),
        ("align_rows_to", TypeError, lambda: triton_quantize_fp8_row(a, align_rows_to=2.0)),
    ]


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    name, exc, call = _bad_cases()[case]
    with pytest.raises(exc, match=name):
        call()


# ----------------------------------------------------------------------------- gpu tier

T_GPU = [0, 1, 7, 128, 2048]
K_GPU = [8, 24, 768, 2048, 8192]


def _gpu_cases():
    cases = [(torch.bfloat16, (T, K)) for T in T_GPU for K in K_GPU]
    cases += [(d, s) for d in (torch.float16, torch.float32) for s in [(1, 24), (7, 8192), (128, 768), (2048, 5120)]]
    cases += [(torch.bfloat16, (4, 33, 5120)), (torch.bfloat16, (3, 20000)), (torch.float32, (3, 10000))]
    cases += [(torch.bfloat16, (300, 2880)), (torch.bfloat16, (16384, 5120)), (torch.float16, (1000, 7168))]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: f"{str(c[0])[6:]}-{'x'.join(map(str, c[1]))}")
def test_quantize_gpu(case, cuda):
    dtype, shape = case
    a = _rand(shape, dtype, cuda, seed=sum(shape))
    if a.numel():
        a.reshape(-1, shape[-1])[-1].zero_()
    got = quantize_fp8_row(a)
    assert got[0].device.type == "cuda"
    _check(got, _expected(a))
    again = quantize_fp8_row(a)
    assert torch.equal(got[0].view(torch.uint8), again[0].view(torch.uint8)) and torch.equal(got[1], again[1])
    ub = torch.tensor([0.75], device=cuda)
    _check(quantize_fp8_row(a, ub), _expected(a, ub))
    _check(quantize_fp8_row(a, ub, eps=FUSED_EPS), _expected(a, ub, eps=FUSED_EPS))
    _check(quantize_fp8_row(a, use_triton=False), _expected(a))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_jagged_strided_padded_gpu(dtype, cuda):
    base = _rand((6, 130, 2, 5120), dtype, cuda, seed=7)
    a = base[:, :, 1, :]  # [6, 130, 5120], row stride 10240
    zsi = torch.tensor([0, 1, 64, 129, 130, 500], dtype=torch.int32, device=cuda)
    _check(quantize_fp8_row(a, None, zsi), _expected(a, zsi=zsi))
    _check(triton_quantize_fp8_row(a, None, zsi.long(), align_rows_to=128), _expected(a, zsi=zsi, align=128))
    _check(triton_quantize_fp8_row(a[..., :5000], None, None, 128), _expected(a[..., :5000], align=128))
    b = base.permute(1, 0, 2, 3)[:, :, 0, 8:]  # leading dims that do not collapse
    _check(quantize_fp8_row(b), _expected(b))
    q, s = quantize_fp8_row(a, output_device="cpu")
    assert q.device.type == "cpu" and s.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 5120), (300, 768), (2048, 8192)])
def test_cuda_graph_replay_gpu(shape, cuda):
    a = torch.randn(*shape, device=cuda, dtype=torch.bfloat16)
    ub = torch.tensor([4.0], device=cuda)
    quantize_fp8_row(a, ub)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = quantize_fp8_row(a, ub)
    for rep in range(3):
        a.copy_(torch.randn(*shape, device=cuda, dtype=torch.bfloat16) * (rep + 1))
        ub.fill_(2.0 + rep)
        g.replay()
        torch.cuda.synchronize()
        _check((q, s), _expected(a, ub))


@pytest.mark.gpu
def test_opcheck_and_compile_gpu(cuda):
    a = _rand((3, 64, 768), torch.bfloat16, cuda)
    ub = torch.tensor([2.0], device=cuda)
    zsi = torch.tensor([10, 64, 0], device=cuda)
    torch.library.opcheck(torch.ops.moekit.quantize_fp8_row.default, (a, ub, zsi, True, DEFAULT_EPS, 1))
    torch._dynamo.reset()
    f = torch.compile(lambda x: quantize_fp8_row(x, ub, zsi), fullgraph=True)
    _check(f(a), _expected(a, ub, zsi))


@pytest.mark.gpu
def test_int64_offsets_gpu(cuda):
    K = 4096
    T = (1 << 31) // K + 8
    try:
        a = torch.empty(T, K, dtype=torch.bfloat16, device=cuda)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a > 2**31-element test")
    a.uniform_(-4, 4)
    q, s = quantize_fp8_row(a)
    tail = slice(T - 16, T)
    _check((q[tail], s[tail]), _expected(a[tail]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 5120), (3, 20000), (16384, 5120)], ids=str)
def test_nan_row_gpu(shape, cuda):
    _check_nan_row(quantize_fp8_row, shape, torch.bfloat16, cuda)
