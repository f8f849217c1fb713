"""The weight-only FP8 GEMVs in packed float16 products (``moekit.ops._triton._half``): the gate/up
GEMV (``grouped_gemm_swiglu`` and ``moe_decode``'s first launch), the per-token combine and the
grouped GEMM's GEMV, each against the float32 reference and against its own float32 form
(``FP8_GEMV_HALF`` off), at row magnitudes where unscaled float16 would overflow or flush to
zero, with NaN rows, and the rule that picks the form."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops._triton import _half
from moekit.ops._triton import gg_combine, gg_swiglu
from moekit.ops._triton import grouped_gemm as GG
from moekit.ops._triton.gg_config import GemmConfig
from moekit.reference.quantize import quantize_fp8_row
from moekit.testing import assert_close, assert_poisoned, poison

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FP8 = torch.float8_e4m3fn
# Scales of x's rows: typical, large (unscaled float16 products of 448-sized weights would
# overflow), small (products below float16's smallest normal without the scale). bf16 rows span
# float32's range; float16 rows (and outputs) only float16's.
MAGNITUDES = [1.0, 3e4, 1e-9]
F16_MAGNITUDES = [1.0, 30.0, 1e-2]
CASES = [(torch.bfloat16, m) for m in MAGNITUDES] + [(torch.float16, m) for m in F16_MAGNITUDES]


def _weights(rows: int, K: int, g: torch.Generator, device):
    w = torch.randn(rows, K, generator=g) / K**0.5
    q, s = quantize_fp8_row(w)
    return q.to(device), s.to(device)


def _rows(M: int, K: int, mag: float, dtype, g: torch.Generator, device):
    x = torch.randn(M, K, generator=g) * mag
    x[0, 3] = 4.0 * mag  # one outlier per row 0: the scale follows the row's largest value
    return x.to(dtype).to(device)


def _both(fn):
    """``fn()`` with packed float16 products and with the float32 form."""
    out = {}
    for half in (True, False):
        with settings.override(knobs={"FP8_GEMV_HALF": half}):
            out[half] = fn()
    return out[True], out[False]


def _swiglu_case(mag, dtype, device, K=512, F=48, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = 3
    x = _rows(T, K, mag, dtype, g, device)
    w, ws = _weights(G * 2 * F, K, g, device)
    ms = torch.tensor([2, 0, 3, 0], dtype=torch.int32, device=device)
    gi = torch.tensor([0, 2, 1, 0, 2], dtype=torch.int32, device=device)
    return x, w, ws, ms, gi


def _run_swiglu(x, w, ws, ms, gi, block_k=128):
    cfg = GemmConfig("gemv", 1, 8, block_k, 3, 4, use_tma=False)
    return gg_swiglu.grouped_gemm_swiglu(x, w, ms, gi, None, None, ws, config=cfg)


def _check_swiglu(x, w, ws, ms, gi, mag, dtype, tol):
    got, f32 = _both(lambda: _run_swiglu(x, w, ws, ms, gi))
    want = ref.grouped_gemm_swiglu(x.cpu(), w.cpu(), ms.cpu(), gather_indices=gi.cpu(), w_scale=ws.cpu())
    assert torch.isfinite(got).all(), mag
    assert_close(got.float().cpu(), want.float(), tol=tol, msg=f"half vs reference, {mag}")
    # Within the output dtype's rounding of the float32 form.
    assert_close(got.float(), f32.float(), tol=tol, msg=f"half vs float32 form, {mag}")


def _check_combine(mag, dtype, device, top_k, F, tol, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, G, N = 3, 6, 40
    M = T * top_k
    z = _rows(M, F, mag, dtype, g, device)
    w, ws = _weights(G * N, F, g, device)
    e = torch.randint(0, G, (M,), generator=g, dtype=torch.int32).to(device)
    srow = torch.randperm(M, generator=g).to(torch.int32).to(device)
    rw = (torch.rand(M, generator=g) + 0.5).to(device)
    prev = (torch.randn(T, N, generator=g) * mag).to(dtype).to(device)

    def run():
        out = prev.clone()
        gg_combine.grouped_gemm_combine(z, w, e, srow, out, rw, ws, config=(8, 32, 3))
        return out

    got, f32 = _both(run)
    want = ref.grouped_gemm_combine(z.cpu(), w.cpu(), e.cpu(), srow.cpu(), prev.cpu().clone(), row_weights=rw.cpu(),
                                    w_scale=ws.cpu())  # fmt: skip
    assert torch.isfinite(got).all(), mag
    assert_close((got - prev).float().cpu(), (want - prev.cpu()).float(), tol=tol, msg=f"combine {mag}")
    assert_close((got - prev).float(), (f32 - prev).float(), tol=tol, msg=f"combine vs float32 form {mag}")


def _check_gemv(mag, dtype, device, K, tol, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, G, N = 4, 3, 40
    x = _rows(M, K, mag, dtype, g, device)
    w, ws = _weights(G * N, K, g, device)
    ms = torch.tensor([1, 0, 3], dtype=torch.int32, device=device)
    cfg = GemmConfig("gemv", 1, 8, 64, 3, 4, use_tma=False)
    got, f32 = _both(lambda: GG.grouped_gemm(x, w, ms, w_scale=ws, config=cfg))
    want = ref.grouped_gemm(x.cpu(), w.cpu(), ms.cpu(), w_scale=ws.cpu())
    assert torch.isfinite(got).all(), mag
    assert_close(got.float().cpu(), want.float(), tol=tol, msg=f"gemv {mag}")
    assert_close(got.float(), f32.float(), tol=tol, msg=f"gemv vs float32 form {mag}")


# ---------------------------------------------------------------------------- reference tier


@pytest.mark.reference
def test_rule_takes_fp8_weights_with_16_bit_rows_only():
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert _half.half_gemv(FP8, bf, 2048, 256) == (True, 2048)
    assert _half.half_gemv(FP8, f16, 7168, 1024) == (True, 8192)
    assert _half.half_gemv(FP8, bf, 20000, 256) == (True, _half.X_BLOCK_MAX)  # the pass over x loops
    assert _half.half_gemv(FP8, f32, 2048, 256)[0] is False  # float32 rows keep float32 products
    assert _half.half_gemv(bf, bf, 2048, 256)[0] is False  # 16-bit weights: memory-bound as they are
    assert _half.half_gemv(FP8, FP8, 2048, 256)[0] is False  # FP8 rows: tensor cores / their own path
    # More K tiles than the float16 sums can hold below 65504 (448 per product).
    assert 448 * _half.HALF_MAX_STEPS < 65504
    assert _half.half_gemv(FP8, bf, 256 * (_half.HALF_MAX_STEPS + 1), 256)[0] is False
    with settings.override(knobs={"FP8_GEMV_HALF": False}):
        assert _half.half_gemv(FP8, bf, 2048, 256)[0] is False


# ---------------------------------------------------------------------------- interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,mag", CASES)
def test_interp_swiglu_gemv(dtype, mag):
    x, w, ws, ms, gi = _swiglu_case(mag, dtype, "cpu")
    _check_swiglu(x, w, ws, ms, gi, mag, dtype, tol=4e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.interpreter
def test_interp_swiglu_gemv_masked_k_and_rows_past_the_sizes():
    """K not a multiple of the tile (masked tail), a pass over x in several vectors, rows past
    sum(m_sizes) left unwritten."""
    x, w, ws, ms, gi = _swiglu_case(1.0, torch.float16, "cpu", K=200)
    ms = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    cfg = GemmConfig("gemv", 1, 8, 64, 3, 4, use_tma=False)
    F = w.shape[0] // (2 * ms.shape[0])
    for x_block in (16, 256):  # 13 vectors of 16, or one
        with settings.override(knobs={"FP8_GEMV_HALF": True, "HALF_X_BLOCK_MAX": x_block}):
            z = poison(torch.empty(gi.shape[0], F, dtype=torch.float16))
            gg_swiglu.grouped_gemm_swiglu(x, w, ms, gi, None, None, ws, config=cfg, out=z)
        want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, w_scale=ws)
        assert_close(z[:3].float(), want[:3].float(), tol=4e-3, msg=str(x_block))
        assert_poisoned(z, slice(0, 3))


@pytest.mark.interpreter
def test_interp_nan_row_stays_nan():
    x, w, ws, ms, gi = _swiglu_case(1.0, torch.bfloat16, "cpu")
    x[1, 7] = float("nan")
    with settings.override(knobs={"FP8_GEMV_HALF": True}):
        z = _run_swiglu(x, w, ws, ms, gi)
    nan_rows = gi == 1
    assert torch.isnan(z[nan_rows]).all()
    assert torch.isfinite(z[~nan_rows]).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,mag", CASES)
@pytest.mark.parametrize("top_k,F", [(4, 96), (2, 40)])
def test_interp_combine(dtype, mag, top_k, F):
    _check_combine(mag, dtype, "cpu", top_k, F, tol=4e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,mag", CASES)
@pytest.mark.parametrize("K", [256, 200])
def test_interp_grouped_gemm_gemv(dtype, mag, K):
    _check_gemv(mag, dtype, "cpu", K, tol=4e-3 if dtype == torch.float16 else 1e-2)


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("mag", MAGNITUDES)
@pytest.mark.parametrize("K,block_k", [(2048, 256), (7168, 1024), (2880, 256)])
def test_gpu_swiglu_gemv(cuda, mag, K, block_k):
    x, w, ws, ms, gi = _swiglu_case(mag, torch.bfloat16, cuda, K=K, F=64)
    got, f32 = _both(lambda: _run_swiglu(x, w, ws, ms, gi, block_k))
    want = ref.grouped_gemm_swiglu(x.cpu(), w.cpu(), ms.cpu(), gather_indices=gi.cpu(), w_scale=ws.cpu())
    assert torch.isfinite(got).all()
    assert_close(got.float().cpu(), want.float(), tol=1e-2)
    assert_close(got.float(), f32.float(), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mag", MAGNITUDES)
@pytest.mark.parametrize("top_k,F", [(8, 768), (8, 256), (4, 2880)])
def test_gpu_combine(cuda, mag, top_k, F):
    _check_combine(mag, torch.bfloat16, cuda, top_k, F, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mag", MAGNITUDES)
def test_gpu_grouped_gemm_gemv(cuda, mag):
    _check_gemv(mag, torch.bfloat16, cuda, 5120, tol=1e-2)
