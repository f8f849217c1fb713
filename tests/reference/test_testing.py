"""The test helpers in ``moekit.testing`` themselves."""

from __future__ import annotations

import pytest
import torch

from moekit.testing import (
    MODEL_SHAPES,
    TOLERANCES,
    assert_close,
    assert_poisoned,
    poison,
    random_expert_weights,
    random_m_sizes,
    random_routing,
    rel_error,
    tie_free_scores,
)

pytestmark = pytest.mark.reference


# ----------------------------------------------------------------------------- tie_free_scores


@pytest.mark.parametrize("E", [1, 6, 24, 128, 129, 257, 512])
def test_tie_free_scores_no_ties_and_exact_in_bf16(E):
    T = 9
    s32 = tie_free_scores(T, E, dtype=torch.float32, seed=E)
    sbf = tie_free_scores(T, E, dtype=torch.bfloat16, seed=E)
    s16 = tie_free_scores(T, E, dtype=torch.float16, seed=E)
    assert s32.shape == (T, E) and sbf.dtype == torch.bfloat16
    assert torch.equal(sbf.float(), s32) and torch.equal(s16.float(), s32)  # exact in bf16 and fp16
    assert (s32 > 0).all()
    for row in s32.tolist():
        assert len(set(row)) == E  # no ties inside a row
    # Each row is a permutation of the same E values (a random order per row).
    srt = s32.sort(dim=1).values
    assert torch.equal(srt, srt[:1].expand_as(srt))
    if E >= 24:
        assert not torch.equal(s32.argmax(dim=1), torch.full((T,), s32[0].argmax().item()))


def test_tie_free_scores_column_major_and_seeds():
    a = tie_free_scores(7, 24, seed=3)
    b = tie_free_scores(7, 24, seed=3, column_major=True)
    assert b.shape == (7, 24) and b.stride() == (1, 7) and not b.is_contiguous()
    assert torch.equal(a, b)
    assert torch.equal(a, tie_free_scores(7, 24, seed=3))  # deterministic per seed
    assert not torch.equal(a, tie_free_scores(7, 24, seed=4))
    assert tie_free_scores(0, 6).shape == (0, 6)


def test_tie_free_scores_rejects_too_many_experts():
    with pytest.raises(ValueError, match="E"):
        tie_free_scores(2, 4096)


# ----------------------------------------------------------------------------- assert_close / rel_error


def test_assert_close_passes_within_tolerance_and_returns_error():
    ref = torch.randn(64)
    out = ref * (1 + 1e-6)
    err = assert_close(out, ref)
    assert 0 < err <= TOLERANCES[torch.float32]
    assert assert_close(ref.bfloat16(), ref) <= TOLERANCES[torch.bfloat16]  # tolerance of out's dtype
    assert assert_close(torch.empty(0), torch.empty(0)) == 0.0


def test_assert_close_fails_on_real_mismatch():
    ref = torch.randn(64)
    out = ref.clone()
    out[5] += 1.0
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(out, ref)
    with pytest.raises(AssertionError):
        assert_close(ref * 1.05, ref, dtype=torch.bfloat16)  # 5% is over the bf16 budget
    assert_close(ref * 1.05, ref, tol=0.06)  # an explicit tolerance wins


@pytest.mark.parametrize("where", ["out", "ref", "both"])
def test_assert_close_fails_on_nan(where):
    a = torch.randn(16)
    b = a.clone()
    if where in ("out", "both"):
        a[3] = float("nan")
    if where in ("ref", "both"):
        b[3] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(a, b)
    with pytest.raises(AssertionError):
        assert_close(a, b, tol=1e9)


def test_assert_close_fails_on_inf_and_zero_ref():
    a = torch.zeros(4)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([0.0, 1e-30, 0.0, 0.0]), a)  # nonzero vs an all-zero reference
    assert_close(a.clone(), a)
    b = torch.ones(4)
    b[0] = float("inf")
    with pytest.raises(AssertionError):
        assert_close(b, torch.ones(4))


def test_assert_close_integers_are_exact_and_shapes_checked():
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert_close(a, a.long())
    with pytest.raises(AssertionError, match="integer mismatch"):
        assert_close(a, torch.tensor([1, 2, 4]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close(a, a[:2])
    assert rel_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0])) == pytest.approx(1 / 5**0.5)


def test_assert_close_fp8_tolerance():
    ref = torch.randn(256)
    q = ref.to(torch.float8_e4m3fn)
    assert assert_close(q, ref) <= TOLERANCES[torch.float8_e4m3fn]


# ----------------------------------------------------------------------------- poison / assert_poisoned


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32, torch.int64]
)
def test_poison_marks_every_element(dtype):
    t = torch.zeros(5, 3, dtype=dtype)
    assert poison(t) is t
    assert_poisoned(t, torch.zeros(5, dtype=torch.bool))  # nothing written: all poisoned
    if dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        assert torch.isnan(t).all()
    elif dtype == torch.float8_e4m3fn:
        assert (t.view(torch.uint8) == 0x7F).all() and torch.isnan(t.float()).all()
    else:
        assert (t == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_assert_poisoned_catches_unwritten_and_overwritten_rows(dtype):
    def fresh():
        return poison(torch.empty(6, 4, dtype=dtype))

    written = torch.tensor([True, True, False, True, False, False])
    val = torch.ones(4).to(dtype)
    good = fresh()
    good[written] = val
    assert_poisoned(good, written)

    unwritten = fresh()
    unwritten[[0, 1]] = val  # row 3 must be written but was not
    with pytest.raises(AssertionError, match="still hold poison"):
        assert_poisoned(unwritten, written)

    partial = fresh()
    partial[written] = val
    partial[3, 2:] = poison(torch.empty(2, dtype=dtype))  # a row written only in part
    with pytest.raises(AssertionError, match="still hold poison"):
        assert_poisoned(partial, written)

    overwritten = fresh()
    overwritten[written] = val
    overwritten[4, 1] = val[0]  # one element of an untouched row
    with pytest.raises(AssertionError, match="untouched"):
        assert_poisoned(overwritten, written)


def test_assert_poisoned_with_slice_and_3d():
    t = poison(torch.empty(5, 2, 3))
    t[:2] = 1.0
    assert_poisoned(t, slice(0, 2))
    with pytest.raises(AssertionError):
        assert_poisoned(t, slice(0, 3))
    with pytest.raises(AssertionError):
        assert_poisoned(t, slice(0, 1))


# ----------------------------------------------------------------------------- random data helpers


@pytest.mark.parametrize("M,G,K", [(0, 4, 1), (12, 6, 2), (30, 24, 3), (7, 7, 1)])
def test_random_m_sizes(M, G, K):
    m = random_m_sizes(M, G, top_k=K, seed=1)
    assert m.dtype == torch.int32 and m.shape == (G,)
    assert int(m.sum()) == M and (m >= 0).all()
    with pytest.raises(ValueError, match="top_k"):
        random_m_sizes(5, G, top_k=2)


def test_random_routing_distinct_experts():
    w, ids = random_routing(20, 8, 3, seed=2)
    assert w.shape == ids.shape == (20, 3)
    assert ((w > 0) & (w <= 1)).all()
    for row in ids.tolist():
        assert len(set(row)) == 3 and all(0 <= e < 8 for e in row)


def test_random_expert_weights_shapes():
    s = MODEL_SHAPES["tiny"]
    p = random_expert_weights(s, seed=0)
    assert p["router_DE"].shape == (s.D, s.E)
    assert p["w13_e2FD"].shape == (s.E, 2 * s.F, s.D) and p["w2_eDF"].shape == (s.E, s.D, s.F)
    assert p["shared_w13_2FD"].shape == (2 * s.shared_F, s.D) and p["shared_w2_DF"].shape == (s.D, s.shared_F)
    assert p["w13_e2FD"].dtype == torch.bfloat16
    ds = MODEL_SHAPES["deepseek-v3"]
    assert ds.E == 256 and ds.n_group == 8 and ds.topk_group == 4 and ds.top_k == 8


def _fp8_data(seed: int = 0) -> torch.Tensor:
    """Row-scaled values spanning e4m3's range (as a row-wise quantizer produces them)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    return x * (448 / x.abs().amax(dim=1, keepdim=True))


def _truncate_fp8(v: torch.Tensor) -> torch.Tensor:
    """Round toward zero: one e4m3 code down in magnitude wherever round-to-nearest rounded up."""
    rne = v.to(torch.float8_e4m3fn)
    up = rne.float().abs() > v.abs()
    bits = rne.view(torch.uint8).clone()
    bits[up] -= 1  # e4m3 magnitudes are monotone in their low 7 bits
    return bits.view(torch.float8_e4m3fn)


def test_assert_fp8_close_catches_a_truncating_quantizer():
    """+-1 e4m3 step on every element with no cap let a truncating quantizer pass (issue 16):
    it is one step off on about half of the values, far above the cap."""
    from moekit.testing import assert_fp8_close

    v = _fp8_data()
    ref_q = v.to(torch.float8_e4m3fn)
    assert_fp8_close(ref_q, ref_q)
    trunc_q = _truncate_fp8(v)
    off = float((trunc_q.float() != ref_q.float()).float().mean())
    assert 0.3 < off < 0.7, off
    with pytest.raises(AssertionError, match="one step off the reference"):
        assert_fp8_close(trunc_q, ref_q)
    # a few rows are enough to catch it (the cap allows at least one value, not one per row)
    with pytest.raises(AssertionError, match="one step off the reference"):
        assert_fp8_close(trunc_q[:1, :32], ref_q[:1, :32])


def test_assert_fp8_close_accepts_round_to_nearest_implementations():
    """Round-to-nearest-even quantizers whose float32 inputs differ by a few ulps (another
    product order, a multiply by 1 / scale instead of a division) disagree on about 1e-5 of the
    values, a float16 intermediate on ~0.4%: all under the cap. A bfloat16 intermediate (double
    rounding, ~3%) and values two steps off are not."""
    from moekit.testing import assert_fp8_close
    from moekit.testing.compare import FP8_MAX_OFF_FRACTION

    for seed in range(3):
        v = _fp8_data(seed)
        ref_q = v.to(torch.float8_e4m3fn)
        for other in (v * (1 + 2.0**-23), v * (1 - 4 * 2.0**-23), v.half().float()):
            assert_fp8_close(other.to(torch.float8_e4m3fn), ref_q)
        off = float((v.bfloat16().float().to(torch.float8_e4m3fn).float() != ref_q.float()).float().mean())
        assert off > FP8_MAX_OFF_FRACTION
        with pytest.raises(AssertionError, match="one step off the reference"):
            assert_fp8_close(v.bfloat16().float().to(torch.float8_e4m3fn), ref_q)
    # a single value one step off in a tiny tensor is tolerated; two steps never are
    ref_q = torch.tensor([1.0, 2.0, 3.0, -4.0]).to(torch.float8_e4m3fn)
    assert_fp8_close(torch.tensor([1.0, 2.0, 3.25, -4.0]).to(torch.float8_e4m3fn), ref_q)
    with pytest.raises(AssertionError, match="more than one step"):
        assert_fp8_close(torch.tensor([1.0, 2.0, 3.5, -4.0]).to(torch.float8_e4m3fn), ref_q)
    with pytest.raises(AssertionError, match="NaN"):
        assert_fp8_close(torch.tensor([1.0, float("nan"), 3.0, -4.0]).to(torch.float8_e4m3fn), ref_q)


@pytest.mark.gpu
def test_gpu_random_expert_weights_one_expert_at_a_time(monkeypatch):
    """Stacked GPU weights past ``_ONE_DRAW_BYTES`` of float32 are drawn per expert (Llama 4
    Maverick's w13 in one draw is 43 GB): same shapes and dtype, the same scale, experts that
    differ, and the same values for the same seed."""
    from moekit.testing import data

    s = MODEL_SHAPES["tiny"]
    whole = random_expert_weights(s, device="cuda", seed=3)
    monkeypatch.setattr(data, "_ONE_DRAW_BYTES", 1024)
    per = random_expert_weights(s, device="cuda", seed=3)
    again = random_expert_weights(s, device="cuda", seed=3)
    for k in ("w13_e2FD", "w2_eDF"):
        assert per[k].shape == whole[k].shape and per[k].dtype == whole[k].dtype == torch.bfloat16
        assert not torch.equal(per[k], whole[k])  # the chunked path ran
        assert torch.equal(per[k], again[k])
        assert not torch.equal(per[k][0], per[k][1])
        fan_in = s.D if k == "w13_e2FD" else s.F
        std = per[k].float().std().item() * fan_in**0.5
        assert 0.9 < std < 1.1, (k, std)
    assert torch.equal(per["router_DE"], whole["router_DE"])  # 2-D: one draw as before
