"""SwiGLU activation oracles (silu_mul, silu_mul_quant) and FP8 row-wise quantization
(quantize_fp8_row, dequantize_fp8_row) against naive element loops."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.testing import assert_close
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference

FP8 = torch.float8_e4m3fn


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def i32(v):
    return None if v is None else torch.tensor([v], dtype=torch.int32)


def halves(T, F, seed, dtype):
    """x0, x1 as column slices of one [T, 2F] tensor (unit last stride, row stride 2F)."""
    h = rand(T, 2 * F, seed=seed, dtype=dtype, scale=2.0)
    return h, h[:, :F], h[:, F:]


def naive_silu_mul(x0, x1, vtc):
    a, b = x0.double().tolist(), x1.double().tolist()
    out = []
    for t in range(len(a)):
        if vtc is not None and t >= vtc:
            out.append([0.0] * len(a[t]))
        else:
            out.append([naive.silu(u) * v for u, v in zip(a[t], b[t])])
    return out


ACT_CASES = [(0, 8, None), (1, 8, None), (1, 5, 0), (7, 24, None), (7, 24, 3), (9, 16, 12)]


@pytest.mark.parametrize("T,F,vtc", ACT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_naive(T, F, vtc, dtype):
    h, x0, x1 = halves(T, F, seed=T + F, dtype=dtype)
    assert x0.stride() == (2 * F, 1) and not x0.is_contiguous() or T <= 1
    y = ref.silu_mul(x0, x1, i32(vtc))
    assert y.dtype == dtype and y.shape == (T, F)
    want = torch.tensor(naive_silu_mul(x0, x1, vtc), dtype=torch.float64).reshape(T, F)
    if dtype == torch.float32:
        assert_close(y, want.float(), dtype=torch.float32)
    else:  # one rounding of the float32 result: equal to the rounded float64 one but for rare flips
        assert_close(y, want.float().to(dtype), dtype=torch.float32, tol=1e-3)
    if vtc is not None:
        assert (y[vtc:] == 0).all()
    # Column slices give the same result as contiguous copies (up to torch's vectorized vs
    # strided sigmoid, which may differ in the last float32 bit).
    assert_close(
        y,
        ref.silu_mul(x0.contiguous(), x1.contiguous(), i32(vtc)),
        dtype=torch.float32,
        tol=1e-6 if dtype == torch.float32 else 1e-3,
    )


@pytest.mark.parametrize("T,F,vtc", ACT_CASES)
@pytest.mark.parametrize("scale_ub", [None, 0.5])
def test_silu_mul_quant_matches_naive(T, F, vtc, scale_ub):
    h, x0, x1 = halves(T, F, seed=T * F + 1, dtype=torch.bfloat16)
    if T > 1:
        h[1] = 0.0  # a zero row: scale from eps = 1e-12
    ub = i32(None) if scale_ub is None else torch.tensor([scale_ub])
    q, s = ref.silu_mul_quant(x0, x1, ub, i32(vtc))
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == (T, F) and s.shape == (T,)
    rows = naive_silu_mul(x0, x1, vtc)
    want_q, want_s = [], []
    for t, row in enumerate(rows):
        if vtc is not None and t >= vtc:
            want_q.append([0.0] * F)
            want_s.append(0.0)
            continue
        qr, sr = naive.quantize_row(row, ref.FUSED_EPS, scale_ub)
        want_q.append(qr)
        want_s.append(sr)
    # silu is computed in float32 by the oracle and float64 here: scales agree to float32
    # precision, fp8 values within one e4m3 step (almost all exactly).
    assert_close(s, torch.tensor(want_s, dtype=torch.float32), dtype=torch.float32)
    naive.assert_fp8_within_one_step(q, torch.tensor(want_q, dtype=torch.float32).reshape(T, F))
    if T > 1 and (vtc is None or vtc > 1):
        assert s[1].item() == pytest.approx(ref.FUSED_EPS / 448.0, rel=1e-6)
        assert (q[1].float() == 0).all()


# ----------------------------------------------------------------------------- quantize_fp8_row


def naive_quantize(a: torch.Tensor, eps: float, scale_ub=None):
    K = a.shape[-1]
    flat = a.float().reshape(-1, K).tolist()
    qs, ss = [], []
    for row in flat:
        q, s = naive.quantize_row(row, eps, scale_ub)
        qs.append(q)
        ss.append(s)
    return (
        torch.tensor(qs, dtype=torch.float32).reshape(a.shape),
        torch.tensor(ss, dtype=torch.float32).reshape(a.shape[:-1]),
    )


QUANT_SHAPES = [(0, 16), (1, 16), (7, 24), (5, 1), (2, 3, 16), (33,)]


@pytest.mark.parametrize("shape", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [None, ref.FUSED_EPS])
@pytest.mark.parametrize("scale_ub", [None, 1.5])
def test_quantize_fp8_row_matches_naive(shape, dtype, eps, scale_ub):
    a = rand(*shape, seed=len(shape) + shape[0], dtype=dtype, scale=2.0)
    ub = None if scale_ub is None else torch.tensor([scale_ub])
    kw = {} if eps is None else {"eps": eps}
    q, s = ref.quantize_fp8_row(a, ub, **kw)
    assert q.dtype == FP8 and q.shape == a.shape
    assert s.dtype == torch.float32 and s.shape == a.shape[:-1]
    want_q, want_s = naive_quantize(a, ref.DEFAULT_EPS if eps is None else eps, scale_ub)
    assert torch.equal(q.float(), want_q)  # float32 intermediates: bit exact
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_within_one_step(dtype):
    a = rand(9, 64, seed=1, dtype=dtype, scale=5.0)
    a[3] *= 1e-3  # a small row
    q, s = ref.quantize_fp8_row(a)
    deq = ref.dequantize_fp8_row(q, s)
    af = a.float().tolist()
    for t in range(a.shape[0]):
        inv = 1.0 / s[t].item()
        for k in range(a.shape[1]):
            step = naive.e4m3_step(af[t][k] * inv) * s[t].item()
            assert abs(deq[t, k].item() - af[t][k]) <= step, (t, k)
            # nearest rounding: within half a step (plus float32 slack)
            assert abs(deq[t, k].item() - af[t][k]) <= 0.5 * step * (1 + 1e-5), (t, k)
    assert_close(deq, a.float(), dtype=torch.float8_e4m3fn)


def test_scale_ub_clamps_and_saturates():
    a = torch.tensor([[10.0, -8.0, 0.5, 1.0], [0.25, -0.5, 0.125, 0.0]])
    ub = torch.tensor([2.0])
    q, s = ref.quantize_fp8_row(a, ub)
    # Row 0: amax 10 clamped to 2 -> scale 2/448; |a| > 2 saturates at +-448 (dequant +-2).
    assert s[0].item() == pytest.approx(2.0 / 448.0, rel=1e-7)
    assert q[0, 0].float().item() == 448.0 and q[0, 1].float().item() == -448.0
    deq = ref.dequantize_fp8_row(q, s)
    assert deq[0, 0].item() == pytest.approx(2.0, rel=1e-6) and deq[0, 1].item() == pytest.approx(-2.0, rel=1e-6)
    assert deq[0, 2].item() == pytest.approx(0.5, rel=1 / 16) and deq[0, 3].item() == pytest.approx(1.0, rel=1 / 16)
    # Row 1: amax 0.5 below the bound: unclamped.
    assert s[1].item() == pytest.approx(0.5 / 448.0, rel=1e-7)
    assert q[1, 1].float().item() == -448.0


def test_zero_rows_use_eps_and_the_two_eps_differ():
    a = torch.zeros(3, 8)
    a[1] = 1e-4  # below DEFAULT_EPS (1/512), above FUSED_EPS
    a[2, 0] = 1.0
    q_d, s_d = ref.quantize_fp8_row(a)
    q_f, s_f = ref.quantize_fp8_row(a, eps=ref.FUSED_EPS)
    assert ref.DEFAULT_EPS == 1.0 / 512 and ref.FUSED_EPS == 1e-12
    assert s_d[0].item() == pytest.approx(ref.DEFAULT_EPS / 448, rel=1e-7) and (q_d[0].float() == 0).all()
    assert s_f[0].item() == pytest.approx(ref.FUSED_EPS / 448, rel=1e-6) and (q_f[0].float() == 0).all()
    # The small row: the default eps floors the scale, so values stay far below 448;
    # the fused eps uses the row's own max.
    assert s_d[1].item() == pytest.approx(ref.DEFAULT_EPS / 448, rel=1e-7)
    assert q_d[1].float().max().item() == naive.e4m3_round(1e-4 * 448 * 512)
    assert s_f[1].item() == pytest.approx(1e-4 / 448, rel=1e-6) and q_f[1].float().max().item() == 448.0
    assert torch.equal(s_d[2], s_f[2])  # rows above both eps agree
    # The fused ops use FUSED_EPS: a zero row of silu_mul_quant gets 1e-12 / 448.
    _, s = ref.silu_mul_quant(torch.zeros(1, 8), torch.ones(1, 8))
    assert s[0].item() == pytest.approx(ref.FUSED_EPS / 448, rel=1e-6)


@pytest.mark.parametrize("shape", [(0, 4), (3, 16), (2, 2, 8)])
def test_dequantize_matches_naive(shape):
    q, s = ref.quantize_fp8_row(rand(*shape, seed=2))
    deq = ref.dequantize_fp8_row(q, s)
    K = shape[-1]
    qf, sf = q.float().reshape(-1, K).tolist(), s.reshape(-1).tolist()
    want = [[v * sf[r] for v in qf[r]] for r in range(len(qf))]
    assert deq.dtype == torch.float32
    assert torch.equal(deq, torch.tensor(want, dtype=torch.float32).reshape(shape))


# ----------------------------------------------------------------------------- argument errors

H = torch.rand(4, 16)
A0, A1 = H[:, :8], H[:, 8:]
Q, S = ref.quantize_fp8_row(H)

BAD_CALLS = [
    (lambda: ref.silu_mul(A0.int(), A1), TypeError, "x0"),
    (lambda: ref.silu_mul(A0[0], A1[0]), ValueError, "x0"),
    (lambda: ref.silu_mul(A0, A1[:3]), ValueError, "x1"),
    (lambda: ref.silu_mul(A0, A1.double()), TypeError, "x1"),
    (lambda: ref.silu_mul(H.T[:8], H.T[8:]), ValueError, "x0"),
    (lambda: ref.silu_mul(A0, A1.T.contiguous().T), ValueError, "x1"),
    (lambda: ref.silu_mul(A0, A1, torch.tensor([1.0])), TypeError, "valid_token_count"),
    (lambda: ref.silu_mul(A0, A1, torch.tensor([1, 2])), ValueError, "valid_token_count"),
    (lambda: ref.silu_mul_quant(A0, A1, torch.tensor([1.0, 2.0])), ValueError, "scale_ub"),
    (lambda: ref.silu_mul_quant(A0, A1, torch.tensor([1.0], dtype=torch.bfloat16)), TypeError, "scale_ub"),
    (lambda: ref.quantize_fp8_row(H.int()), TypeError, "a"),
    (lambda: ref.quantize_fp8_row(torch.tensor(1.0)), ValueError, "a"),
    (lambda: ref.quantize_fp8_row(H, torch.tensor([1.0], dtype=torch.float64)), TypeError, "scale_ub"),
    (lambda: ref.quantize_fp8_row(H, eps=0.0), ValueError, "eps"),
    (lambda: ref.dequantize_fp8_row(H, S), TypeError, "q"),
    (lambda: ref.dequantize_fp8_row(Q, S[:3]), ValueError, "scale"),
    (lambda: ref.dequantize_fp8_row(Q, S.double()), TypeError, "scale"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)
