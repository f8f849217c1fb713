"""grouped_gemm_swiglu (gate|up GEMM reading rows by index, SwiGLU fused) and the weight-only
FP8 grouped GEMM (16-bit x, FP8 w with row scales): kernels in the interpreter and on the GPU,
public ops on the CPU, against ``moekit.reference``."""

from __future__ import annotations

import re

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops import grouped_gemm, grouped_gemm_combine, grouped_gemm_swiglu
from moekit.reference.quantize import quantize_fp8_row
from moekit.testing import assert_close, assert_poisoned, poison, random_m_sizes

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FP8 = torch.float8_e4m3fn


def _case(T, k, G, F, K, x_dtype, w_kind, seed=0, device="cpu", bad_rows=True):
    """x [T, K]; w13 [G*2F, K] (w_kind: 'same' dtype as x, 'fp8' weight-only, 'fp8x' both FP8);
    a top-k routing's sizes and token indices (the last row -1 when ``bad_rows``)."""
    g = torch.Generator().manual_seed(seed)
    M = T * k
    x = torch.randn(T, K, generator=g)
    w = torch.randn(G * 2 * F, K, generator=g) / K**0.5
    ms = random_m_sizes(M, G, top_k=1, seed=seed) if M else torch.zeros(G, dtype=torch.int32)
    gi = torch.randint(0, max(T, 1), (M,), generator=g, dtype=torch.int32)
    if bad_rows and M >= 2:
        gi[-1] = -1
        gi[0] = T  # out of range: skipped
    rs = torch.rand(M, generator=g) + 0.5
    xs = ws = None
    if w_kind == "same":
        x, w = x.to(x_dtype), w.to(x_dtype)
    elif w_kind == "fp8":
        x = x.to(x_dtype)
        w, ws = quantize_fp8_row(w)
    else:
        x, xs = quantize_fp8_row(x)
        w, ws = quantize_fp8_row(w)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(x), mv(w), mv(ms), mv(gi), mv(rs), mv(xs), mv(ws)


def _valid_rows(gi, T):
    return (gi >= 0) & (gi < T)


def _config(kind):
    from moekit.ops._triton.gg_config import GemmConfig

    return {
        "gemv": GemmConfig("gemv", 1, 8, 16, 3, 4, use_tma=False),
        "stream": GemmConfig("stream", 16, 16, 16, 2, 4, use_tma=False),
        "tiled": GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=False),
    }[kind]


# ---------------------------------------------------------------------------- interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gemv", "stream", "tiled"])
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("T,k,G,F,K", [(3, 2, 4, 24, 40), (6, 3, 5, 16, 64), (1, 1, 1, 8, 16), (20, 3, 3, 40, 48)])
def test_interp_swiglu(kind, w_kind, T, k, G, F, K):
    from moekit.ops._triton import gg_swiglu as SW

    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, w_kind, seed=T * 7 + k)
    got = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=_config(kind))
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    ok = _valid_rows(gi, T)
    assert_close(got[ok].float(), want[ok].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)  # bf16 out for FP8 x


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gemv", "stream", "tiled"])
def test_interp_swiglu_unwritten_rows_and_no_gather(kind):
    """Rows with a bad index and rows past sum(m_sizes) keep the output's previous contents; without
    gather_indices x holds the rows themselves."""
    from moekit.ops._triton import gg_swiglu as SW

    x, w, ms, gi, rs, _, _ = _case(5, 2, 3, 16, 32, torch.float32, "same", seed=2)
    ms = ms.clone()
    ms[0] -= 1  # the last row is past sum(m_sizes)
    got = SW.grouped_gemm_swiglu(x, w, ms, gi, None, None, None, config=_config(kind))
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi)
    ok = _valid_rows(gi, 5)
    ok[-1] = False
    assert_close(got[ok], want[ok], tol=2e-3)
    rows = x[gi.clamp(0, 4).long()]
    got2 = SW.grouped_gemm_swiglu(rows, w, ms, None, rs, None, None, config=_config(kind))
    want2 = ref.grouped_gemm_swiglu(rows, w, ms, row_scales=rs)
    keep = torch.arange(10) < int(ms.sum())
    assert_close(got2[keep], want2[keep], tol=2e-3)


def _spy_kwargs(module, keys: tuple, seen: list):
    """Replace ``module.launch`` by a recorder of each launch's keyword arguments ``keys`` (a
    tuple per launch, appended to ``seen``); returns the original to put back."""
    orig = module.launch

    def spy(kernel):
        launcher = orig(kernel)

        def run(grid):
            def go(*args, **kw):
                seen.append(tuple(kw.get(k) for k in keys))
                return launcher[grid](*args, **kw)

            return go

        return type("L", (), {"__getitem__": lambda self, grid: run(grid)})()

    module.launch = spy
    return orig


@pytest.mark.interpreter
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("pair", [False, True], ids=["two_mma", "pair"])
def test_interp_swiglu_rows_through_tma(w_kind, pair, pin_knobs):
    """Rows given in order (no gather_indices): the tiled kernel reads whole row tiles through a
    TMA descriptor (``X_TMA``): row tiles that run into the next group's rows or past M (zeros)
    write only their own group's rows, and rows past sum(m_sizes) stay unwritten."""
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, G, F, K = 45, 4, 24, 48
    x, w, _, _, rs, xs, ws = _case(T, 1, G, F, K, torch.float16, w_kind, seed=9, bad_rows=False)
    ms = torch.tensor([13, 0, 21, 9], dtype=torch.int32)  # 43 of 45 rows; tiles of 16 straddle groups
    cfg = GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=True)
    pin_knobs(SWIGLU_PAIR=pair)
    seen = []
    orig = _spy_kwargs(SW, ("X_TMA", "PAIR"), seen)
    try:
        out = poison(torch.empty(T, F, dtype=torch.bfloat16 if w_kind == "fp8x" else torch.float16))
        SW.grouped_gemm_swiglu(x, w, ms, None, rs, xs, ws, config=cfg, out=out)
    finally:
        SW.launch = orig
    assert seen == [(True, pair)], seen
    want = ref.grouped_gemm_swiglu(x, w, ms, row_scales=rs, x_scale=xs, w_scale=ws)
    assert_poisoned(out, torch.arange(T) < 43, msg="rows past sum(m_sizes)")
    assert_close(out[:43].float(), want[:43].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("gather", [True, False], ids=["by_index", "in_order"])
def test_interp_swiglu_pair(pin_knobs, w_kind, gather):
    """Knob ``SWIGLU_PAIR``: the tiled kernel loads a column block's gate and up rows through one
    descriptor of the weights viewed ``[G, 2, F, K]`` and runs one MMA of twice the width; F = 24
    leaves the second block half past F (read as zeros, never stored)."""
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, F, K = 20, 3, 3, 24, 48
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, w_kind, seed=13)
    cfg = GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=True)
    pin_knobs(SWIGLU_PAIR=True)
    if gather:
        got = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
        want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
        ok = _valid_rows(gi, T)
    else:
        rows = x[gi.clamp(0, T - 1).long()].contiguous()
        rxs = None if xs is None else xs[gi.clamp(0, T - 1).long()].contiguous()
        got = SW.grouped_gemm_swiglu(rows, w, ms, None, rs, rxs, ws, config=cfg)
        want = ref.grouped_gemm_swiglu(rows, w, ms, row_scales=rs, x_scale=rxs, w_scale=ws)
        ok = torch.ones(T * k, dtype=torch.bool)
    assert_close(got[ok].float(), want[ok].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("flatten", [False, True], ids=["tile_loop", "fused_loop"])
def test_interp_swiglu_pair_through_pointers(pin_knobs, w_kind, flatten):
    """Knob ``SWIGLU_PTR_PAIR`` with no TMA descriptor (``gg_tma`` off, as torch.compile's traced
    graphs run): the paired gate|up tile through masked pointers, rows gate then up of each
    column block, F = 24 leaving the second block half past F and K = 40 a masked last K step;
    ragged groups read by index, on both tile loops. Off, the two-MMA tiles."""
    from moekit import settings
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, F, K = 20, 3, 3, 24, 40
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, w_kind, seed=17)
    cfg = GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=True, flatten=flatten)
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    ok = _valid_rows(gi, T)
    seen = []
    orig = _spy_kwargs(SW, ("USE_TMA", "PAIR", "FLATTEN"), seen)
    try:
        for ptr_pair in (True, False):
            pin_knobs(SWIGLU_PAIR=True, SWIGLU_PTR_PAIR=ptr_pair)
            with settings.override(gg_tma=False):
                got = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
            assert_close(got[ok].float(), want[ok].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)
    finally:
        SW.launch = orig
    assert seen == [(False, True, flatten), (False, False, flatten)], seen


@pytest.mark.interpreter
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("F", [32, 20], ids=["whole_blocks", "ragged_block"])
def test_interp_swiglu_pair_mixed_order(pin_knobs, w_kind, F):
    """Knob ``SWIGLU_PAIR_MIX``: the paired tile's gate and up rows in blocks of BN / 2 (host
    descriptor of the ``[G, F / h, 2, h, K]`` view, the descriptor made in the kernel, and masked
    pointers) compute bit for bit what the ``[gate | up]`` order does, and the reference's values;
    with F not a multiple of h = 8 the TMA paths keep the plain order (the view's last block would
    run into the up rows) while the pointer path mixes (its rows past F masked)."""
    from moekit import settings
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, K = 20, 3, 3, 48
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, w_kind, seed=29)
    cfg = GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=True, flatten=True)
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    ok = _valid_rows(gi, T)
    mixes = []
    orig = _spy_kwargs(SW, ("MIX",), mixes)
    try:
        for path, knobs, tma in (("host", {}, True), ("device", {"GG_DEVICE_TMA": 2}, True),
                                 ("pointers", {}, False)):  # fmt: skip
            got = {}
            for mix in (False, True):
                pin_knobs(SWIGLU_PAIR=True, SWIGLU_PAIR_MIX=mix, **knobs)
                with settings.override(gg_tma=tma):
                    got[mix] = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
            assert mixes[-2:] == [(False,), (F % 8 == 0 or not tma,)], (path, mixes)
            assert torch.equal(got[True][ok], got[False][ok]), path
            assert_close(got[True][ok].float(), want[ok].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)
    finally:
        SW.launch = orig


@pytest.mark.interpreter
def test_interp_small_tile_stages_past_four_only_in_mixed_order(pin_knobs, monkeypatch):
    """The rules' 64-row tiles take more than 4 stages (knob ``SWIGLU_SMALL_STAGES``) only where
    the launch takes the mixed order: in the [gate | up] order 5 stages are over a block's shared
    memory on sm_90, so the launchers cut them to 4 there (the knob off, F not a multiple of BN / 2
    on the TMA path, the quantizing kernel); a config the caller gives keeps its stages."""
    from moekit import settings
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, K = 20, 3, 3, 48
    rule = GemmConfig("tiled", 64, 16, 16, 5, 4, use_tma=True, flatten=True)
    monkeypatch.setattr(SW, "swiglu_config", lambda *a, **kw: rule)
    seen = []
    orig = _spy_kwargs(SW, ("STAGES", "MIX"), seen)
    try:
        for F, mix, want in ((32, True, (5, True)), (32, False, (4, False)), (20, True, (4, False))):
            x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, "fp8x", seed=31)
            pin_knobs(SWIGLU_PAIR=True, SWIGLU_PAIR_MIX=mix)
            with settings.override(gg_tma=True):
                got = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws)
                assert seen[-1] == want, (F, mix, seen)
                ok = _valid_rows(gi, T)
                exp = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
                assert_close(got[ok].float(), exp[ok].float(), tol=1e-2)
                SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=rule)
                assert seen[-1] == (5, want[1]), (F, mix, seen)
                if F == 32 and mix:  # the quantizing kernel never mixes
                    SW.grouped_gemm_swiglu_quant(x, w, ms, gi, rs, xs, ws)
                    assert seen[-1] == (4, False), seen
    finally:
        SW.launch = orig


@pytest.mark.interpreter
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("case", ["pair_by_index", "pair_in_order", "two_mmas_in_order", "stream"])
def test_interp_swiglu_descriptors_made_in_the_kernel(pin_knobs, w_kind, case):
    """Knob ``GG_DEVICE_TMA=2``: the SwiGLU kernels make their TMA descriptors themselves from the
    tensors (``DEV_TMA``; the paired tile's ``[G, 2, F, K]`` view, the rows given in order through
    an x descriptor too) and compute bit for bit what the host descriptors give; F = 24 leaves the
    second column block half past F, K = 48 a masked last K step, rows -1 / out of range skipped."""
    from tests.ops.test_grouped_gemm import _spy_launches
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, F, K = 20, 3, 3, 24, 48
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, torch.float16, w_kind, seed=23)
    in_order = case.endswith("in_order")
    if in_order:  # the sorted rows themselves (no index): x through its descriptor too
        gi = None
        x = x.repeat(k, 1)
        xs = xs.repeat(k) if xs is not None else None
    kind = "stream" if case == "stream" else "tiled"
    cfg = GemmConfig(kind, 16, 16, 16, 2, 4, group_m=2, use_tma=True, flatten=True)
    pin_knobs(SWIGLU_PAIR=case.startswith("pair"))
    seen = []
    orig = _spy_launches(SW, seen)
    try:
        host = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
        pin_knobs(GG_DEVICE_TMA=2, SWIGLU_PAIR=case.startswith("pair"))
        dev = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
    finally:
        SW.launch = orig
    x_tma = None if kind == "stream" else in_order  # (the streaming kernel reads its rows by pointer)
    assert [s[1:4] for s in seen] == [(False, True, x_tma), (True, True, x_tma)], seen
    assert seen[0][5] == "TensorDescriptor" and seen[1][4:] == ("Tensor", "Tensor"), seen
    ok = _valid_rows(gi, T) if gi is not None else torch.ones(x.shape[0], dtype=torch.bool)
    assert torch.equal(dev[ok], host[ok])
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    assert_close(dev[ok].float(), want[ok].float(), tol=1e-2 if w_kind == "fp8x" else 2e-3)


@pytest.mark.reference
def test_tiled_tiles_keep_their_mmas_in_flight_on_sm90():
    """The tiled SwiGLU tiles at prefill sizes (64-row tiles on the fused loop and 128-row ones,
    bf16 and FP8), compiled for sm_90 with the weights through TMA descriptors (the GPU's eager
    path) and through pointers (torch.compile's traced graphs): ptxas keeps their wgmma
    instructions asynchronous. Two accumulators on the fused loop made it serialize every one
    (C7515), the pointer path's tiles until ``SWIGLU_PTR_PAIR``; still so with the knob off."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    snippet = """
        from moekit import settings
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        m = "meta"
        f8 = torch.float8_e4m3fn
        plain = GG._tma_ok
        for tma in (False, True):
            GG._tma_ok = (lambda t, block: t.stride(-1) == 1) if tma else plain  # meta tensors: never TMA
            for T, k, G, F, D in ((2048, 8, 128, 768, 2048), (8192, 8, 256, 256, 7168)):
                for dt in (torch.bfloat16, f8):
                    x = torch.empty(T, D, dtype=dt, device=m)
                    w13 = torch.empty(G * 2 * F, D, dtype=dt, device=m)
                    xs = torch.empty(T, device=m) if dt == f8 else None
                    ws = torch.empty(G * 2 * F, device=m) if dt == f8 else None
                    with settings.override(knobs=KNOBS):
                        SW.grouped_gemm_swiglu(x, w13, torch.empty(G, dtype=torch.int32, device=m),
                                               torch.empty(T * k, dtype=torch.int32, device=m), None, xs, ws)
    """
    records = compile_launches(snippet.replace("KNOBS", "{}"), ["moekit.ops._triton.gg_swiglu"], serialized=True)
    assert_all_compiled(records, 8)
    assert {(r["constants"]["USE_TMA"], r["constants"]["PAIR"]) for r in records} == {("False", "True"),
                                                                                   ("True", "True")}  # fmt: skip
    assert [r["constants"]["FLATTEN"] for r in records].count("True") == 4, records
    assert all(r["serialized"] is False and not r["stack"] for r in records), [
        (r["constants"], r["serialized"], r["stack"]) for r in records]  # fmt: skip
    off = compile_launches(snippet.replace("KNOBS", '{"SWIGLU_PTR_PAIR": False}'), ["moekit.ops._triton.gg_swiglu"],
                           serialized=True)  # fmt: skip
    bad = [r for r in off if r["serialized"]]
    assert {(r["constants"]["USE_TMA"], r["constants"]["PAIR"], r["constants"]["FLATTEN"]) for r in bad} == {
        ("False", "False", "True")}, [(r["constants"], r["serialized"]) for r in off]  # fmt: skip


@pytest.mark.reference
def test_mixed_pair_order_splits_in_registers_on_sm90(tmp_path, monkeypatch):
    """Knob ``SWIGLU_PAIR_MIX`` on Qwen3-30B's gate|up at T=2048 (64-row paired tiles on the fused
    loop, FP8 and bf16), compiled for sm_90: no ``convert_layout`` of the accumulator before the
    split (the plain order converts the 64 x 256 float32 tile), 16 KB less shared memory, and
    only with it do 5 stages fit a block's 227 KB (knob ``SWIGLU_SMALL_STAGES``); no stack, the
    wgmma instructions asynchronous."""
    from tests.ops._sm90 import compile_launches

    monkeypatch.setenv("SM90_DUMP_DIR", str(tmp_path))
    snippet = """
        from moekit import settings
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        m = "meta"
        f8 = torch.float8_e4m3fn
        GG._tma_ok = GG._tma_fits = lambda t, block: t.stride(-1) == 1  # meta tensors: never TMA
        SW._PLAIN_SMALL_STAGES = 5  # the plain order's 5-stage builds too (the launchers cut them)
        T, k, G, F, D = 2048, 8, 128, 768, 2048
        for dt in (f8, torch.bfloat16):
            fp8 = dt == f8
            for stages in (4, 5):
                for mix in (False, True):
                    with settings.override(knobs={"SWIGLU_PAIR_MIX": mix, "SWIGLU_SMALL_STAGES": stages}):
                        SW.grouped_gemm_swiglu(torch.empty(T, D, dtype=dt, device=m),
                                               torch.empty(G * 2 * F, D, dtype=dt, device=m),
                                               torch.empty(G, dtype=torch.int32, device=m),
                                               torch.empty(T * k, dtype=torch.int32, device=m), None,
                                               torch.empty(T, device=m) if fp8 else None,
                                               torch.empty(G * 2 * F, device=m) if fp8 else None)
    """
    records = compile_launches(snippet, ["moekit.ops._triton.gg_swiglu"], serialized=True)
    # (not assert_all_compiled: the plain order's 5-stage builds are over the block's limit here)
    assert len(records) == 8 and not [r["error"] for r in records if r["error"]], records
    block_smem = 227 * 1024
    for i, r in enumerate(records):
        c = r["constants"]
        mix, stages = c["MIX"] == "True", int(c["STAGES"])
        assert (c["BLOCK_M"], c["PAIR"], c["FLATTEN"], stages) == ("64", "True", "True", 4 + (i // 2) % 2), c
        assert not r["stack"] and r["serialized"] is False, (c, r["stack"], r["serialized"])
        ttgir = open(tmp_path / f"_swiglu_tiled_kernel_{i}.ttgir").read()
        # the accumulator's split (not the prologue's split of a constant): its operand's layout
        splits = re.findall(r"tt\.split %(?!cst)\S+ : tensor<64x128x2xf32, #(\w+)>", ttgir)
        assert len(splits) == 1, splits
        assert splits[0].startswith("blocked") is not mix, (mix, splits)
        assert (r["shared"] <= block_smem) is (mix or stages == 4), (c, r["shared"])
    for a, b in zip(records[::2], records[1::2]):  # plain, mixed at the same stages and dtype
        assert a["shared"] - b["shared"] >= 16 * 1024, (a["shared"], b["shared"])


@pytest.mark.reference
def test_kernel_made_descriptors_compile_as_the_host_ones_on_sm90():
    """Knob ``GG_DEVICE_TMA=2`` at prefill sizes (Qwen3-30B's gate|up with the SwiGLU on 64-row
    paired tiles and its down GEMM on 128 x 256 tiles, DeepSeek-V3 TP8's at T=8192; bf16 and FP8),
    compiled for sm_90: the kernels that make their TMA descriptors take the same shared memory
    as with host descriptors, at most 8 registers more, no stack, and their wgmma instructions
    stay asynchronous."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    snippet = """
        from moekit import settings
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        m = "meta"
        f8 = torch.float8_e4m3fn
        GG._tma_ok = GG._tma_fits = lambda t, block: t.stride(-1) == 1  # meta tensors: never TMA
        for dev in (0, 2):
            with settings.override(knobs={"GG_DEVICE_TMA": dev}):
                for T, k, G, F, D in ((2048, 8, 128, 768, 2048), (8192, 8, 256, 256, 7168)):
                    for dt in (torch.bfloat16, f8):
                        fp8 = dt == f8
                        ms = torch.empty(G, dtype=torch.int32, device=m)
                        SW.grouped_gemm_swiglu(torch.empty(T, D, dtype=dt, device=m),
                                               torch.empty(G * 2 * F, D, dtype=dt, device=m), ms,
                                               torch.empty(T * k, dtype=torch.int32, device=m), None,
                                               torch.empty(T, device=m) if fp8 else None,
                                               torch.empty(G * 2 * F, device=m) if fp8 else None)
                        GG.grouped_gemm(torch.empty(T * k, F, dtype=dt, device=m),
                                        torch.empty(G * D, F, dtype=dt, device=m), ms,
                                        x_scale=torch.empty(T * k, device=m) if fp8 else None,
                                        w_scale=torch.empty(G * D, device=m) if fp8 else None)
    """
    records = compile_launches(snippet, ["moekit.ops._triton.gg_swiglu", "moekit.ops._triton.grouped_gemm"],
                               serialized=True)  # fmt: skip
    assert_all_compiled(records, 16)
    host, dev = records[:8], records[8:]
    assert all(r["constants"]["DEV_TMA"] == "False" for r in host), [r["constants"] for r in host]
    assert all(r["constants"]["DEV_TMA"] == "True" and r["constants"]["USE_TMA"] == "True" for r in dev)
    for h, d in zip(host, dev):
        same = {k: v for k, v in h["constants"].items() if k != "DEV_TMA"}
        assert same == {k: v for k, v in d["constants"].items() if k != "DEV_TMA"}, (h["constants"], d["constants"])
        assert d["shared"] == h["shared"] and d["regs"] <= h["regs"] + 8, (h["kernel"], h["regs"], d["regs"])
        assert not d["stack"] and d["serialized"] is False, (d["kernel"], d["constants"], d["stack"], d["serialized"])


@pytest.mark.interpreter
@pytest.mark.parametrize("pair", [False, True], ids=["two_mmas", "pair"])
@pytest.mark.parametrize("gather", [True, False], ids=["by_index", "in_order"])
def test_interp_swiglu_quantized_rows(pin_knobs, pair, gather):
    """``grouped_gemm_swiglu_quant``: the tiled tiles with their rows quantized to FP8 in the same
    launch are bit for bit ``quantize_fp8_row`` of the 16-bit rows the plain kernel writes (the
    float32 reference's scales), row tiles of ragged groups (an empty one, F past the last
    column tile, rows -1 / out of range skipped), fewer programs than row tiles (each reuses its
    scratch)."""
    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, F, K = 24, 3, 4, 40, 48
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, K, None, "fp8x", seed=5)
    ms = torch.tensor([30, 0, 17, 25], dtype=torch.int32)
    cfg = GemmConfig("tiled", 16, 16, 16, 2, 4, group_m=2, use_tma=pair)
    pin_knobs(SWIGLU_PAIR=pair)
    if not gather:
        gi = gi.clamp(0, T - 1)
        x, xs = x[gi.long()].contiguous(), xs[gi.long()].contiguous()
    idx = gi if gather else None
    z = SW.grouped_gemm_swiglu(x, w, ms, idx, rs, xs, ws, config=cfg)
    zq, zs = SW.grouped_gemm_swiglu_quant(x, w, ms, idx, rs, xs, ws, config=cfg)
    ok = _valid_rows(gi, T) if gather else torch.ones(T * k, dtype=torch.bool)
    ok &= torch.arange(T * k) < int(ms.sum())
    want_q, want_s = quantize_fp8_row(z[ok])
    assert torch.equal(zs[ok], want_s)
    assert torch.equal(zq[ok].view(torch.uint8), want_q.view(torch.uint8))
    # the plain SwiGLU against the reference still (the quantized rows' 16-bit values)
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=idx, row_scales=rs, x_scale=xs, w_scale=ws)
    assert_close((zq[ok].float() * zs[ok, None]), want[ok].float(), tol=7e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gemv", "stream", "tiled"])
def test_interp_swiglu_poisoned_output(kind):
    """Exactly the rows with a valid index are written."""
    from moekit.ops._triton import gg_swiglu as SW

    x, w, ms, gi, _, _, _ = _case(4, 2, 3, 16, 32, torch.float32, "same", seed=4)
    out = poison(torch.empty(8, 16))
    SW.grouped_gemm_swiglu(x, w, ms, gi, None, None, None, config=_config(kind), out=out)
    assert_poisoned(out, _valid_rows(gi, 4))


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gemv", "stream"])
@pytest.mark.parametrize("scatter", [False, True])
def test_interp_weight_only_fp8_grouped_gemm(kind, scatter):
    from moekit.ops._triton import grouped_gemm as GG

    g = torch.Generator().manual_seed(3)
    M, G, N, K = 10, 4, 32, 48
    x = torch.randn(M, K, generator=g).half()
    wq, ws = quantize_fp8_row(torch.randn(G * N, K, generator=g))
    ms = random_m_sizes(M, G, seed=2)
    tw = torch.rand(M, generator=g)
    if not scatter:
        y = GG.grouped_gemm(x, wq, ms, w_scale=ws, token_weights=tw, config=_config(kind))
        assert_close(y.float(), ref.grouped_gemm(x, wq, ms, token_weights=tw, w_scale=ws).float(), tol=2e-3)
        return
    idx = torch.randint(-1, 5, (M,), generator=g, dtype=torch.int32)
    out = torch.randn(5, N, generator=g).half()
    want = out.clone()
    GG.grouped_gemm(x, wq, ms, w_scale=ws, token_weights=tw, out=out, scatter_indices=idx, config=_config(kind))
    ref.grouped_gemm(x, wq, ms, token_weights=tw, w_scale=ws, _output_tensor=want, _scatter_add_indices=idx)
    assert_close(out.float(), want.float(), tol=2e-3)


def _combine_case(T, K, G, N, F, dtype, fp8, seed=0, device="cpu"):
    """A routing's sorted rows z [T*K, F], their experts and weights, the inverse map (one choice
    dropped: -1), w [G*N, F] (FP8 with row scales), out [T, N] with prior contents."""
    from moekit.reference import route_and_shuffle

    g = torch.Generator().manual_seed(seed)
    logits = torch.argsort(torch.rand(T, G, generator=g), dim=1).float()
    counts, eidx, tidx, rw, srow = route_and_shuffle(logits, K, "softmax", True)
    z = torch.randn(T * K, F, generator=g).to(dtype)
    w = torch.randn(G * N, F, generator=g) / F**0.5
    ws = None
    if fp8:
        w, ws = quantize_fp8_row(w)
    else:
        w = w.to(dtype)
    if T * K > 1:
        srow = srow.clone()
        srow[1] = -1
    out = torch.randn(T, N, generator=g).to(dtype)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(z), mv(w), mv(eidx), mv(srow), mv(rw), mv(ws), mv(out)


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,K,G,N,F", [(1, 8, 16, 24, 40), (3, 2, 5, 32, 64), (2, 1, 3, 16, 16)])
@pytest.mark.parametrize("config", [(8, 16, 3), (4, 32, 2, 8)])  # (BLOCK_N, BLOCK_F, STAGES[, warps])
def test_interp_combine(fp8, T, K, G, N, F, config):
    from moekit.ops._triton import gg_combine as CB

    z, w, eidx, srow, rw, ws, out = _combine_case(T, K, G, N, F, torch.float32, fp8, seed=T + K)
    want = ref.grouped_gemm_combine(z, w, eidx, srow, out.clone(), row_weights=rw, w_scale=ws)
    CB.grouped_gemm_combine(z, w, eidx, srow, out, rw, ws, config=config)
    assert_close(out, want, tol=1e-5)


@pytest.mark.interpreter
def test_interp_combine_skips_expert_ids_past_G():
    """A row whose expert id is >= G (or negative) adds nothing: its weight rows lie past w."""
    from moekit.ops._triton import gg_combine as CB

    z, w, eidx, srow, rw, ws, out = _combine_case(3, 2, 5, 32, 64, torch.float32, False, seed=7)
    eidx = eidx.clone()
    eidx[0], eidx[3] = 5, -2
    big = torch.cat([w, torch.full((32, 64), 1e6)])  # what an unchecked id 5 would read
    want = ref.grouped_gemm_combine(z, w, eidx, srow, out.clone(), row_weights=rw)
    CB.grouped_gemm_combine(z, big[: w.shape[0]], eidx, srow, out, rw, None, config=(8, 16, 3))
    assert_close(out, want, tol=1e-5)


# ---------------------------------------------------------------------------- reference tier


@pytest.mark.reference
def test_combine_public_op_and_bad_arguments():
    z, w, eidx, srow, rw, ws, out = _combine_case(3, 2, 5, 32, 64, torch.float32, False)
    want = out.clone()
    for t in range(3):  # the definition, spelled out
        for j in range(2):
            r = int(srow[t * 2 + j])
            if r >= 0:
                want[t] += rw[r] * (z[r] @ w.view(5, 32, 64)[int(eidx[r])].T)
    got = grouped_gemm_combine(z, w, eidx, srow, out, row_weights=rw)
    assert got is out
    assert_close(out, want, tol=1e-5)
    with pytest.raises(ValueError, match="selection_rows"):
        grouped_gemm_combine(z, w, eidx, srow[:-1], out)
    with pytest.raises(ValueError, match="w must have shape"):
        grouped_gemm_combine(z, w[:, :32], eidx, srow, out)
    with pytest.raises(TypeError, match="out must have dtype"):
        grouped_gemm_combine(z, w, eidx, srow, out.double())
    with pytest.raises(TypeError, match="w must have dtype float8"):
        grouped_gemm_combine(z, w, eidx, srow, out, w_scale=torch.ones(160))


@pytest.mark.reference
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
def test_public_cpu_matches_reference(w_kind):
    x, w, ms, gi, rs, xs, ws = _case(7, 2, 3, 16, 32, torch.bfloat16, w_kind, seed=1)
    got = grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    assert torch.equal(got, want)
    # swiglu == the unfused pipeline of the reference ops
    if w_kind == "same":
        ok = _valid_rows(gi, 7)
        rows = x[gi.clamp(0, 6).long()]
        h = ref.grouped_gemm(rows, w, ms, token_weights=rs).float()
        z = torch.nn.functional.silu(h[:, :16]) * h[:, 16:]
        assert_close(got[ok].float(), z[ok], tol=1e-2)


@pytest.mark.reference
def test_weight_only_public_op():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g).bfloat16()
    wq, ws = quantize_fp8_row(torch.randn(2 * 16, 32, generator=g))
    ms = torch.tensor([4, 2], dtype=torch.int32)
    y = grouped_gemm(x, wq, ms, w_scale=ws)
    dq = wq.float() * ws[:, None]
    assert_close(y.float(), ref.grouped_gemm(x.float(), dq, ms), tol=1e-2)


@pytest.mark.reference
@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(x=None), TypeError, "x must be a torch.Tensor"),
        (dict(x=torch.zeros(4, 32, dtype=torch.int32)), TypeError, "x must have dtype"),
        (dict(w13=torch.zeros(66, 32, dtype=torch.bfloat16)), ValueError, "w13 must have shape"),
        (dict(w13=torch.zeros(2 * 32, 24, dtype=torch.bfloat16)), ValueError, "w13 must have shape"),
        (dict(w13=torch.zeros(2 * 32, 32, dtype=torch.float16)), TypeError, "w13 must have dtype"),
        (dict(m_sizes=torch.zeros(2)), TypeError, "m_sizes"),
        (dict(gather_indices=torch.zeros(3)), TypeError, "gather_indices"),
        (dict(row_scales=torch.zeros(5)), ValueError, "row_scales"),
        (dict(x_scale=torch.zeros(4)), ValueError, "x_scale is for FP8"),
        (dict(w_scale=torch.zeros(64)), TypeError, "w13 must have dtype float8"),
    ],
)
def test_bad_arguments(change, exc, match):
    args = dict(x=torch.zeros(4, 32, dtype=torch.bfloat16), w13=torch.zeros(2 * 32, 32, dtype=torch.bfloat16),
                m_sizes=torch.tensor([2, 2], dtype=torch.int32), gather_indices=None, row_scales=None,
                x_scale=None, w_scale=None)  # fmt: skip
    args.update(change)
    x, w, ms = args.pop("x"), args.pop("w13"), args.pop("m_sizes")
    with pytest.raises(exc, match=match):
        grouped_gemm_swiglu(x, w, ms, **args)


@pytest.mark.reference
def test_opcheck_and_compile_cpu():
    x, w, ms, gi, rs, _, _ = _case(5, 2, 3, 16, 32, torch.float32, "same", seed=6, bad_rows=False)
    torch.library.opcheck(torch.ops.moekit.grouped_gemm_swiglu.default, (x, w, ms, gi, rs, None, None))
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: grouped_gemm_swiglu(a[0], a[1], a[2], gather_indices=a[3], row_scales=a[4]),
                       fullgraph=True)  # fmt: skip
    assert_close(fn(x, w, ms, gi, rs), grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs), tol=1e-6)


@pytest.mark.reference
def test_fp8_gemv_tiles_keep_the_grid_in_one_wave():
    """The FP8 gate/up GEMV's rule on 132 SMs: 4096-weight tiles (<= 128 registers, 4 programs per
    SM) unless the grid is at most two programs per SM, ~32 KB in flight, no short-row limit on
    the columns; the knob ``SWIGLU_GEMV_FP8_WAVE`` off gives the 16-bit rule's tiles."""
    from moekit.ops._triton.gg_swiglu import swiglu_gemv_config

    tile = lambda c: (c.block_n, c.block_k, c.stages, c.warps)  # noqa: E731
    assert tile(swiglu_gemv_config(8, 768, 2048, 1, 132)) == (16, 256, 5, 4)  # Qwen3-30B T=1: 384 programs
    assert tile(swiglu_gemv_config(8, 256, 7168, 1, 132)) == (8, 1024, 3, 4)  # DeepSeek-V3 TP8: 256
    assert tile(swiglu_gemv_config(4, 2880, 2880, 1, 132)) == (16, 256, 5, 4)  # gpt-oss-120b, K masked
    assert tile(swiglu_gemv_config(1, 8192, 5120, 1, 132)) == (16, 256, 5, 4)  # Llama 4 Scout: 512
    assert tile(swiglu_gemv_config(1, 40, 96, 1, 132)) == (1, 128, 7, 4)  # tiny: K tile from K
    assert tile(swiglu_gemv_config(8, 768, 2048, 2, 132)) == (16, 256, 3, 4)  # bf16: unchanged
    with settings.override(knobs={"SWIGLU_GEMV_FP8_WAVE": False}):
        assert tile(swiglu_gemv_config(8, 768, 2048, 1, 132)) == (8, 512, 5, 4)


@pytest.mark.reference
def test_combine_tiles_hold_about_8kb():
    """The per-token combine's rule on 132 SMs (``combine_config``): one wave of 16-column programs
    where they fit (FP8: 4-column programs there), else ``[K, BLOCK_N, BLOCK_F]`` tiles of about 8
    KB: 128-wide F tiles, 256 for FP8 top-4, whose 8 columns of 128 bytes would make 4 KB."""
    from moekit.ops._triton.gg_combine import combine_config

    assert combine_config(1, 2048, 768, 8, 2, 132) == (16, 64, 3)  # Qwen3-30B bf16 T=1: one wave
    assert combine_config(4, 2048, 768, 8, 2, 132) == (4, 128, 4)  # 8 x 4 x 128 x 2 bytes
    assert combine_config(4, 2048, 768, 8, 1, 132) == (8, 128, 4)  # FP8 top-8: 8 x 8 x 128
    assert combine_config(1, 7168, 256, 8, 1, 132) == (8, 128, 4)  # DeepSeek-V3 TP8 FP8
    assert combine_config(1, 2880, 2880, 4, 2, 132) == (8, 128, 4)  # gpt-oss-120b bf16: 4 x 8 x 128 x 2
    for T in (1, 2, 4):
        assert combine_config(T, 2880, 2880, 4, 1, 132) == (8, 256, 4)  # gpt-oss-120b FP8: 4 x 8 x 256
    assert combine_config(1, 2048, 768, 8, 1, 132) == (4, 256, 3)  # Qwen3-30B FP8 T=1: 4x the programs
    assert combine_config(1, 64, 96, 4, 2, 132) == (16, 64, 3)  # small N: one wave, F tile from F
    assert combine_config(1, 64, 96, 4, 1, 132) == (4, 128, 3)  # FP8: 4 columns, F tile from F


@pytest.mark.reference
def test_combine_tiles_for_one_or_two_choices_hold_4kb_per_choice():
    """Top-1 and top-2 (``COMBINE_FEW_4KB``): 512-wide F tiles (a power of two dividing F, else F's
    next power of two, at most 512), the columns that fill 4 KB per choice, 3 stages, at any token
    count; the knob off gives session 17's widest slices of 8 KB tiles."""
    from moekit.ops._triton.gg_combine import combine_config

    for T in (1, 2, 4, 64):
        assert combine_config(T, 5120, 8192, 1, 2, 132) == (4, 512, 3)  # Llama 4 Scout bf16
        assert combine_config(T, 5120, 8192, 1, 1, 132) == (8, 512, 3)  # FP8
        assert combine_config(T, 4096, 14336, 2, 2, 132) == (4, 512, 3)  # Mixtral-8x7B bf16
        assert combine_config(T, 4096, 14336, 2, 1, 132) == (8, 512, 3)
    assert combine_config(1, 4096, 1792, 2, 2, 132) == (8, 256, 3)  # Mixtral TP8: F = 7 x 256
    assert combine_config(1, 64, 96, 1, 2, 132) == (16, 128, 3)  # F = 3 x 32: masked 128-wide tiles
    assert combine_config(1, 64, 40, 2, 1, 132) == (16, 64, 3)  # at most 16 columns
    with settings.override(knobs={"COMBINE_FEW_4KB": False}):
        assert combine_config(1, 5120, 8192, 1, 2, 132) == (16, 256, 5)
        assert combine_config(1, 5120, 8192, 1, 1, 132) == (16, 256, 7)
        assert combine_config(4, 4096, 14336, 2, 2, 132) == (16, 128, 5)


@pytest.mark.reference
def test_kernels_compile_for_sm90():
    """The decode shapes of the benchmark's models (GEMV and streaming; bf16, FP8, weight-only
    FP8), the fused SwiGLU kernels and the weight-only down GEMM, compiled for sm_90 (ptxas)."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        from moekit.ops._triton import gg_combine as CB
        m = "meta"
        f8 = torch.float8_e4m3fn
        for T, k, G, F, D in ((1, 8, 128, 768, 2048), (64, 8, 128, 768, 2048), (1, 8, 256, 256, 7168),
                              (16, 4, 128, 2880, 2880), (256, 1, 16, 8192, 5120)):
            M = T * k
            for xdt, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, f8), (f8, f8)):
                x = torch.empty(T, D, dtype=xdt, device=m)
                w13 = torch.empty(G * 2 * F, D, dtype=wdt, device=m)
                ms = torch.empty(G, dtype=torch.int32, device=m)
                gi = torch.empty(M, dtype=torch.int32, device=m)
                xs = torch.empty(T, device=m) if xdt == f8 else None
                ws = torch.empty(G * 2 * F, device=m) if wdt == f8 else None
                SW.grouped_gemm_swiglu(x, w13, ms, gi, torch.empty(M, device=m), xs, ws)
                if xdt == f8:
                    continue
                z = torch.empty(M, F, dtype=xdt, device=m)
                w2 = torch.empty(G * D, F, dtype=wdt, device=m)
                GG.grouped_gemm(z, w2, ms, w_scale=torch.empty(G * D, device=m) if wdt == f8 else None,
                                token_weights=torch.empty(M, device=m), out=torch.empty(T, D, dtype=xdt, device=m),
                                scatter_indices=gi)
                CB.grouped_gemm_combine(z, w2, gi, gi, torch.empty(T, D, dtype=xdt, device=m),
                                        torch.empty(M, device=m),
                                        torch.empty(G * D, device=m) if wdt == f8 else None)
        """,
        ["moekit.ops._triton.gg_swiglu", "moekit.ops._triton.grouped_gemm", "moekit.ops._triton.gg_combine"],
        pdl=True,
    )
    assert_all_compiled(records, 35)
    kinds = {r["kernel"] for r in records}
    assert {"_swiglu_gemv_kernel", "_swiglu_stream_kernel", "_gg_gemv_kernel", "_gg_stream_kernel",
            "_combine_kernel"} <= kinds, kinds  # fmt: skip
    assert all(not r.get("stack") for r in records if r["kernel"] == "_combine_kernel"), records


@pytest.mark.reference
def test_tiled_kernel_compiles_for_sm90_without_spills():
    """The persistent tensor-core SwiGLU tiles at prefill sizes of the benchmark's models (bf16 and
    FP8), compiled for sm_90: no register spills, shared memory in bounds."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import gg_swiglu as SW
        m = "meta"
        f8 = torch.float8_e4m3fn
        for T, k, G, F, D in ((2048, 8, 128, 768, 2048), (8192, 8, 256, 256, 7168), (2048, 4, 128, 2880, 2880)):
            M = T * k
            for dt in (torch.bfloat16, f8):
                x = torch.empty(T, D, dtype=dt, device=m)
                w13 = torch.empty(G * 2 * F, D, dtype=dt, device=m)
                xs = torch.empty(T, device=m) if dt == f8 else None
                ws = torch.empty(G * 2 * F, device=m) if dt == f8 else None
                SW.grouped_gemm_swiglu(x, w13, torch.empty(G, dtype=torch.int32, device=m),
                                       torch.empty(M, dtype=torch.int32, device=m), None, xs, ws)
        """,
        ["moekit.ops._triton.gg_swiglu"],
        pdl=True,
    )
    assert_all_compiled(records, 6)
    assert {r["kernel"] for r in records} == {"_swiglu_tiled_kernel"}, records
    # 128-row tiles; the 64-row ones of the small-tile rule at 64-128 rows per expert where K < 4F
    # (Qwen3-30B and gpt-oss-120b at T=2048)
    assert [r["constants"]["BLOCK_M"] for r in records] == ["64", "64", "128", "128", "64", "64"], records
    assert all(not r.get("stack") for r in records), [(r["constants"], r["stack"]) for r in records]


@pytest.mark.reference
def test_small_tiles_knob_rule_and_sm90_compile():
    """Knob ``SWIGLU_SMALL_TILES``: the tiled kernel takes 64-row tiles (4 stages, the fused tile
    loop) below 192 rows per expert (Qwen3-30B T = 1024 and 2048, DeepSeek-V3 TP8 T=2048) and
    128-row tiles above (T=8192); off, 128 rows everywhere; by default (the rule) where K < 4F:
    Qwen3's, not DeepSeek's deep, narrow gate/up, and rows read by index only. Its 64 x 128 paired
    tiles on the fused loop, bf16 and FP8, compile for sm_90 with no stack frame, weights through
    TMA descriptors as on the GPU."""
    from moekit import settings
    from moekit.ops._triton.gg_swiglu import swiglu_config
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    cases = [(1024 * 8, 768, 2048, 128), (2048 * 8, 768, 2048, 128), (2048 * 8, 256, 7168, 256),
             (8192 * 8, 768, 2048, 128)]  # fmt: skip
    for fp8, elem in ((True, 1), (False, 2)):
        with settings.override(knobs={"SWIGLU_SMALL_TILES": True}):
            got = [swiglu_config(M, F, K, G, fp8, elem, 132) for M, F, K, G in cases]
        assert [(c.kind, c.block_m, c.stages, c.flatten) for c in got] == [("tiled", 64, 4, True)] * 3 + [
            ("tiled", 128, 3, False)
        ], got
        with settings.override(knobs={"SWIGLU_SMALL_TILES": False}):
            assert all(swiglu_config(M, F, K, G, fp8, elem, 132).block_m == 128 for M, F, K, G in cases)
        assert [swiglu_config(M, F, K, G, fp8, elem, 132).block_m for M, F, K, G in cases] == [64, 64, 128, 128]
        # rows given in order (the gathered copy through TMA): 128-row tiles by default
        assert all(swiglu_config(M, F, K, G, fp8, elem, 132, by_index=False).block_m == 128 for M, F, K, G in cases)
    records = compile_launches(
        """
        from moekit import settings
        from moekit.ops._triton import gg_swiglu as SW, grouped_gemm as GG
        GG._tma_ok = lambda t, block: t.stride(-1) == 1  # descriptors for meta tensors too
        m = "meta"
        f8 = torch.float8_e4m3fn
        with settings.override(knobs={"SWIGLU_SMALL_TILES": True}):
            for T, k, G, F, D in ((2048, 8, 128, 768, 2048), (2048, 8, 256, 256, 7168)):
                M = T * k
                for dt in (torch.bfloat16, f8):
                    x = torch.empty(T, D, dtype=dt, device=m)
                    w13 = torch.empty(G * 2 * F, D, dtype=dt, device=m)
                    xs = torch.empty(T, device=m) if dt == f8 else None
                    ws = torch.empty(G * 2 * F, device=m) if dt == f8 else None
                    SW.grouped_gemm_swiglu(x, w13, torch.empty(G, dtype=torch.int32, device=m),
                                           torch.empty(M, dtype=torch.int32, device=m), torch.empty(M, device=m),
                                           xs, ws)
        """,
        ["moekit.ops._triton.gg_swiglu"],
    )
    assert_all_compiled(records, 4)
    assert all(r["kernel"] == "_swiglu_tiled_kernel" and r["constants"]["BLOCK_M"] == "64" for r in records), records
    assert all(r["constants"]["PAIR"] == "True" and r["constants"]["FLATTEN"] == "True" for r in records), records
    assert all(not r["stack"] for r in records), [(r["constants"], r["regs"], r["stack"]) for r in records]


@pytest.mark.reference
def test_swiglu_pair_rule(pin_knobs):
    """The paired gate/up tiles from 128 rows per expert (Qwen3-30B: T=1024 has 64, T=2048 128),
    and on the 64-row tiles (``small``) at any size; knob ``SWIGLU_PAIR`` pins either way."""
    from moekit.ops._triton.gg_swiglu import swiglu_pair

    assert not swiglu_pair(1024 * 8, 128) and swiglu_pair(2048 * 8, 128) and swiglu_pair(8192 * 8, 128)
    assert swiglu_pair(1024 * 8, 128, small=True)
    assert not swiglu_pair(100, 1) and swiglu_pair(128, 1)
    pin_knobs(SWIGLU_PAIR=True)
    assert swiglu_pair(1024 * 8, 128)
    pin_knobs(SWIGLU_PAIR=False)
    assert not swiglu_pair(8192 * 8, 128)


@pytest.mark.reference
def test_tiled_kernel_compiles_for_sm90():
    """The tiled kernel as the layer runs it at prefill sizes (gpt-oss-120b's and Qwen3-30B's
    gate/up, about 256 rows per expert), bf16 and FP8: rows by index (pointer tiles) and rows given
    in order (``X_TMA``: row tiles through the descriptor), compiled for sm_90 with no stack frame
    and within shared memory."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        GG._tma_ok = lambda t, block: t.stride(-1) == 1  # descriptors for meta tensors too
        m = "meta"
        for fp8 in (False, True):
            dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
            for T, F, K, G, k in ((8192, 2880, 2880, 128, 4), (8192, 768, 2048, 128, 8)):
                M = T * k
                w = torch.empty(G * 2 * F, K, dtype=dt, device=m)
                ms = torch.empty(G, dtype=torch.int32, device=m)
                ws = torch.empty(G * 2 * F, device=m) if fp8 else None
                x = torch.empty(T, K, dtype=dt, device=m)
                xs = torch.empty(T, device=m) if fp8 else None
                SW.grouped_gemm_swiglu(x, w, ms, torch.empty(M, dtype=torch.int32, device=m), None, xs, ws)
                rows = torch.empty(M, K, dtype=dt, device=m)
                rs = torch.empty(M, device=m) if fp8 else None
                SW.grouped_gemm_swiglu(rows, w, ms, None, None, rs, ws)
        """,
        ["moekit.ops._triton.gg_swiglu"],
    )
    assert_all_compiled(records, 8)
    got = [(r["kernel"], r["constants"]["X_TMA"], r["constants"]["GATHER"], r["stack"]) for r in records]
    assert all(k == "_swiglu_tiled_kernel" for k, *_ in got), got
    assert all((xt == "True") == (ga == "False") for _, xt, ga, _ in got), got  # in-order rows: TMA
    assert all(not st for *_, st in got), got


# ---------------------------------------------------------------------------- GPU tier

# (T, k, G, F, D): Qwen3-30B, DeepSeek-V3 TP8 experts, gpt-oss-120b, Llama 4 Scout decode sizes (fewer
# experts for the largest, so that the float32 reference of several test workers fits the GPU)
GPU_SHAPES = [
    (1, 8, 128, 768, 2048),
    (4, 8, 128, 768, 2048),
    (64, 8, 128, 768, 2048),
    (1, 8, 64, 256, 7168),
    (16, 8, 64, 256, 7168),
    (4, 4, 16, 2880, 2880),
    (256, 4, 16, 2880, 2880),
    (1, 1, 4, 8192, 5120),
    (64, 1, 4, 8192, 5120),
    (512, 8, 64, 256, 7168),
    (2048, 8, 128, 768, 2048),
    (1024, 1, 4, 8192, 5120),
]  # fmt: skip (the last three: the persistent tiled kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}k{}G{}F{}D{}".format(*s))
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
def test_gpu_swiglu_and_down(shape, w_kind, cuda):
    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=T + k, device=cuda)
    z = grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    ok = _valid_rows(gi, T)
    assert_close(z[ok].float(), want[ok].float(), tol=1e-2)
    if w_kind == "fp8x":
        return
    # the down GEMM on z (weight-only FP8 for FP8 weights), weighted scatter-add into out
    g = torch.Generator().manual_seed(1)
    w2 = (torch.randn(G * D, F, generator=g) / F**0.5).to(cuda)
    w2s = None
    if w_kind == "fp8":
        w2, w2s = quantize_fp8_row(w2)
    else:
        w2 = w2.to(torch.bfloat16)
    zz = torch.where(ok[:, None], z, 0).contiguous()
    out = torch.randn(T, D, generator=g).to(cuda).to(torch.bfloat16)
    want_out = out.clone()
    grouped_gemm(zz, w2, ms, token_weights=rs, _output_tensor=out, _scatter_add_indices=gi, w_scale=w2s)
    ref.grouped_gemm(zz, w2, ms, token_weights=rs, w_scale=w2s, _output_tensor=want_out, _scatter_add_indices=gi)
    assert_close(out.float(), want_out.float(), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("gather", [True, False], ids=["by_index", "in_order"])
@pytest.mark.parametrize("shape", GPU_SHAPES[-3:], ids=lambda s: "T{}k{}G{}F{}D{}".format(*s))
def test_gpu_swiglu_pair_matches(shape, gather, w_kind, pin_knobs, cuda):
    """Knob ``SWIGLU_PAIR`` (gate and up rows in one ``[G, 2, F, K]`` descriptor load, one MMA of
    twice the width) against the reference and against the two-MMA tiles."""
    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=T + 5, device=cuda, bad_rows=False)
    if not gather:
        x, xs, gi = x[gi.long()].contiguous(), None if xs is None else xs[gi.long()].contiguous(), None
    args = dict(gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    two = grouped_gemm_swiglu(x, w, ms, **args)
    pin_knobs(SWIGLU_PAIR=True)
    one = grouped_gemm_swiglu(x, w, ms, **args)
    want = ref.grouped_gemm_swiglu(x, w, ms, **args)
    assert_close(one.float(), want.float(), tol=1e-2)
    assert_close(one.float(), two.float(), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8", "fp8x"])
@pytest.mark.parametrize("shape", [(1024, 8, 128, 768, 2048), (2048, 8, 128, 768, 2048), (1024, 1, 4, 8192, 5120)],
                         ids=["qwen3-64rows", "qwen3-128rows", "llama4"])  # fmt: skip
def test_gpu_swiglu_pair_through_pointers(shape, w_kind, cuda):
    """Knob ``SWIGLU_PTR_PAIR`` with TMA off (``gg_tma``, as in torch.compile's traced graphs): the
    paired tiles through pointers (64-row ones on the fused loop, 128-row ones) against the
    reference, and against the TMA path's paired tiles bit for bit (same tiles, same K order)."""
    from moekit import settings

    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=T + 11, device=cuda)
    args = dict(gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    with settings.override(knobs={"SWIGLU_PAIR": True}):
        tma = grouped_gemm_swiglu(x, w, ms, **args)
        with settings.override(gg_tma=False):
            ptr = grouped_gemm_swiglu(x, w, ms, **args)
            with settings.override(knobs={"SWIGLU_PTR_PAIR": False}):
                two = grouped_gemm_swiglu(x, w, ms, **args)
    ok = _valid_rows(gi, T)
    want = ref.grouped_gemm_swiglu(x, w, ms, **args)
    assert_close(ptr[ok].float(), want[ok].float(), tol=1e-2)
    assert_close(two[ok].float(), want[ok].float(), tol=1e-2)
    assert torch.equal(ptr[ok], tma[ok])


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("shape", [(1024, 8, 128, 768, 2048), (2048, 8, 128, 768, 2048), (1024, 1, 4, 8192, 5120),
                                   (2048, 8, 64, 256, 7168)],
                         ids=["qwen3-64rows", "qwen3-128rows", "llama4", "deepseek"])  # fmt: skip
def test_gpu_swiglu_pair_mixed_order_same_bits(shape, w_kind, cuda):
    """Knob ``SWIGLU_PAIR_MIX`` (the paired tile's rows through the ``[G, F / h, 2, h, K]`` view's
    descriptor, whose strides do not fall with the dimensions; made on the host, in the kernel, or
    rows through pointers): the same bits as the ``[gate | up]`` order on the rule's tiles (64-row
    fused-loop ones, 128-row ones), and the reference's values."""
    from moekit import settings

    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=T + 13, device=cuda)
    args = dict(gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    ok = _valid_rows(gi, T)
    want = ref.grouped_gemm_swiglu(x, w, ms, **args)
    for name, over in (("host", {}), ("device", {"knobs": {"GG_DEVICE_TMA": 2}}), ("pointers", {"gg_tma": False})):
        got = {}
        for mix in (False, True):
            knobs = {"SWIGLU_PAIR": True, "SWIGLU_PAIR_MIX": mix, **over.get("knobs", {})}
            with settings.override(knobs=knobs, **{k_: v for k_, v in over.items() if k_ != "knobs"}):
                got[mix] = grouped_gemm_swiglu(x, w, ms, **args)
        assert torch.equal(got[True][ok], got[False][ok]), name
        assert_close(got[True][ok].float(), want[ok].float(), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("shape", GPU_SHAPES[-3:], ids=lambda s: "T{}k{}G{}F{}D{}".format(*s))
def test_gpu_swiglu_rows_in_order_same_bits(shape, w_kind, cuda):
    """The tiled kernel on rows given in order (the gathered copy: row tiles through the TMA
    descriptor, ``X_TMA``) writes the bits it writes reading the same rows by index."""
    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=T + 3, device=cuda, bad_rows=False)
    by_index = grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    rows = x[gi.long()].contiguous()
    in_order = grouped_gemm_swiglu(rows, w, ms, row_scales=rs, x_scale=None if xs is None else xs[gi.long()],
                                   w_scale=ws)  # fmt: skip
    assert torch.equal(in_order, by_index)


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("shape", [(2048, 8, 128, 768, 2048), (1024, 8, 256, 256, 7168)], ids=["qwen3", "deepseek"])
def test_gpu_swiglu_tiled_fused_loop_same_bits(shape, w_kind, cuda):
    """The persistent tiled kernel with its tile loop fused into the K loop (``flatten``, a
    sweep candidate) writes the same bits as the plain loop: same tiles, same K order."""
    from dataclasses import replace

    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton.gg_config import GemmConfig

    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=5, device=cuda)
    bk = 128 if w_kind == "fp8x" else 64
    for stages in (3, 2):
        cfg = GemmConfig("tiled", 128, min(128, F), bk, stages, 8, flatten=False)
        a = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=cfg)
        b = SW.grouped_gemm_swiglu(x, w, ms, gi, rs, xs, ws, config=replace(cfg, flatten=True))
        ok = _valid_rows(gi, T)
        assert torch.equal(a[ok], b[ok]), f"stages={stages}"


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["same", "fp8x"])
@pytest.mark.parametrize("shape", [(1024, 8, 128, 768, 2048), (2048, 8, 256, 256, 7168)], ids=["qwen3", "deepseek"])
def test_gpu_swiglu_small_tiles_same_bits(shape, w_kind, cuda):
    """Knob ``SWIGLU_SMALL_TILES`` (64-row tiles at 64 rows per expert), pair and fused loop pinned
    off: the same bits as the 128-row tiles (same K order per output); with them on (the rule's
    tiles), the reference's values."""
    from moekit import settings

    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, torch.bfloat16, w_kind, seed=7, device=cuda)
    got = []
    for knobs in ({"SWIGLU_SMALL_TILES": False, "SWIGLU_PAIR": False},
                  {"SWIGLU_SMALL_TILES": True, "SWIGLU_PAIR": False, "SWIGLU_FLATTEN": False},
                  {"SWIGLU_SMALL_TILES": True}):  # fmt: skip
        with settings.override(knobs=knobs):
            got.append(grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws))
    ok = _valid_rows(gi, T)
    assert torch.equal(got[0][ok], got[1][ok])
    want = ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs, x_scale=xs, w_scale=ws)
    assert_close(got[1][ok].float(), want[ok].float(), tol=1e-2)
    assert_close(got[2][ok].float(), want[ok].float(), tol=1e-2)


@pytest.mark.gpu
def test_gpu_swiglu_cuda_graph_replays_new_rows(cuda):
    T, k, G, F, D = 4, 8, 128, 768, 2048
    x, w, ms, gi, rs, _, _ = _case(T, k, G, F, D, torch.bfloat16, "same", seed=0, device=cuda, bad_rows=False)
    grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        z = grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs)
    for seed in (1, 2):
        x2, _, ms2, gi2, rs2, _, _ = _case(T, k, G, F, D, torch.bfloat16, "same", seed=seed, device=cuda,
                                           bad_rows=False)  # fmt: skip
        x.copy_(x2), ms.copy_(ms2), gi.copy_(gi2), rs.copy_(rs2)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(z.float(), ref.grouped_gemm_swiglu(x, w, ms, gather_indices=gi, row_scales=rs).float(), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,G,N,F", [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768), (1, 8, 256, 7168, 256),
                                       (2, 4, 128, 2880, 2880), (1, 1, 16, 5120, 8192),
                                       (2, 2, 8, 4096, 1000)])  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_combine(T, K, G, N, F, fp8, cuda):
    z, w, eidx, srow, rw, ws, out = _combine_case(T, K, G, N, F, torch.bfloat16, fp8, seed=T, device=cuda)
    want = ref.grouped_gemm_combine(z, w, eidx, srow, out.clone(), row_weights=rw, w_scale=ws)
    again = out.clone()
    grouped_gemm_combine(z, w, eidx, srow, out, row_weights=rw, w_scale=ws)
    assert_close(out.float(), want.float(), tol=1e-2)
    grouped_gemm_combine(z, w, eidx, srow, again, row_weights=rw, w_scale=ws)
    assert torch.equal(out, again)  # no atomics: bitwise reproducible


@pytest.mark.reference
@pytest.mark.parametrize("fn", ["grouped_gemm", "grouped_gemm_fp8_rowwise", "grouped_gemm_swiglu"])
def test_none_x_is_a_type_error(fn):
    """``grouped_gemm(None, ...)`` read x.dtype before validating (AttributeError; issue 16)."""
    from moekit import ops

    w, ms = torch.zeros(16, 16), torch.zeros(1, dtype=torch.int32)
    args = (None, w, ms) if fn != "grouped_gemm_fp8_rowwise" else (None, w, ms, None, None)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        getattr(ops, fn)(*args)


@pytest.mark.gpu
def test_gpu_private_launcher_keeps_no_reference_to_its_rows():
    """``grouped_gemm_swiglu``'s launcher called directly (as the sweeps do) on rows in order,
    read through a TMA descriptor: no reference to the rows outlives the call, and torch's kernel
    side table does not grow (session 31: every call's descriptor stayed there with its rows)."""
    import gc
    import sys

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu as launcher

    g = torch.Generator(device="cuda").manual_seed(0)
    G, F, K, per = 4, 128, 256, 256
    x = torch.randn(G * per, K, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(G * 2 * F, K, generator=g, device="cuda") / 16).bfloat16()
    m = torch.full((G,), per, dtype=torch.int32, device="cuda")
    launcher(x, w13, m, None, None, None, None)  # compile outside the count
    torch.cuda.synchronize()
    gc.collect()
    refs, table = sys.getrefcount(x), len(kernel_side_table.constant_args)
    for _ in range(3):
        launcher(x, w13, m, None, None, None, None)
    torch.cuda.synchronize()
    gc.collect()
    assert sys.getrefcount(x) == refs
    assert len(kernel_side_table.constant_args) == table


@pytest.mark.reference
def test_quantized_rows_kernel_compiles_for_sm90():
    """``grouped_gemm_swiglu_quant``'s kernel at the FP8 layer's prefill sizes (Qwen3-30B,
    DeepSeek-V3 TP8, gpt-oss-120b at T=8192, rows by index; Qwen3-30B rows in order), compiled for
    sm_90: the tiles the plain kernel takes there, shared memory in bounds, no local memory
    inside the MMA loops (the 128 x 256 paired FP8 tiles keep an 8-byte stack frame: the row
    tile's running max, spilled around the K loop, not inside it)."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import gg_swiglu as SW
        from moekit.ops._triton import grouped_gemm as GG
        GG._tma_ok = lambda t, block: t.stride(-1) == 1  # descriptors for meta tensors too
        m = "meta"
        f8 = torch.float8_e4m3fn
        for T, F, K, G, k in ((8192, 768, 2048, 128, 8), (8192, 256, 7168, 256, 8), (8192, 2880, 2880, 128, 4)):
            M = T * k
            w = torch.empty(G * 2 * F, K, dtype=f8, device=m)
            ms = torch.empty(G, dtype=torch.int32, device=m)
            ws = torch.empty(G * 2 * F, device=m)
            x = torch.empty(T, K, dtype=f8, device=m)
            SW.grouped_gemm_swiglu_quant(x, w, ms, torch.empty(M, dtype=torch.int32, device=m), None,
                                         torch.empty(T, device=m), ws)
            if F == 768:
                SW.grouped_gemm_swiglu_quant(torch.empty(M, K, dtype=f8, device=m), w, ms, None, None,
                                             torch.empty(M, device=m), ws)
        """,
        ["moekit.ops._triton.gg_swiglu"],
        pdl=True,
    )
    assert_all_compiled(records, 4)
    got = [(r["kernel"], r["constants"]["BLOCK_M"], r["stack"], r["loop_spills"]) for r in records]
    assert all(k == "_swiglu_tiled_quant_kernel" for k, *_ in got), got
    assert all(st <= 8 and ls == 0 for *_, st, ls in got), got


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [True, False], ids=["by_index", "in_order"])
@pytest.mark.parametrize(
    "shape",
    [(2048, 8, 128, 768, 2048), (8192, 8, 128, 768, 2048), (2048, 8, 64, 256, 7168), (1024, 4, 16, 2880, 2880)],
    ids=["qwen3-2048", "qwen3-8192", "deepseek-2048", "gptoss-1024"],
)
def test_gpu_swiglu_quantized_rows_same_bits(shape, gather, cuda):
    """``grouped_gemm_swiglu_quant`` on the GPU at the layer's sizes (64- and 128-row tiles,
    paired): bit for bit ``quantize_fp8_row`` (the layer's pass) of ``grouped_gemm_swiglu``'s
    rows."""
    from moekit.ops import quantize_fp8_row as quantize_op
    from moekit.ops._triton import gg_swiglu as SW

    T, k, G, F, D = shape
    x, w, ms, gi, rs, xs, ws = _case(T, k, G, F, D, None, "fp8x", seed=T + 11, device=cuda)
    ok = _valid_rows(gi, T)
    if not gather:
        gi = gi.clamp(0, T - 1)
        x, xs = x[gi.long()].contiguous(), xs[gi.long()].contiguous()
        ok = torch.ones_like(ok)
    idx = gi if gather else None
    z = SW.grouped_gemm_swiglu(x, w, ms, idx, rs, xs, ws)
    got = SW.grouped_gemm_swiglu_quant(x, w, ms, idx, rs, xs, ws)
    assert got is not None
    want_q, want_s = quantize_op(z)
    assert torch.equal(got[1][ok], want_s[ok])
    assert torch.equal(got[0][ok].view(torch.uint8), want_q[ok].view(torch.uint8))


@pytest.mark.gpu
def test_gpu_layer_with_the_quantized_swiglu_rows(monkeypatch, cuda):
    """``moe_forward`` (FP8 experts) with knob ``SWIGLU_QUANT`` (the gate/up GEMM quantizes its
    rows in the same launch): the launcher ran, and the layer's output is bit for bit the one
    with the separate quantization pass (the down rows stored and combined: no atomics); CUDA-graph
    replay too."""
    from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights
    from moekit.ops._triton import gg_swiglu as SW

    calls = []
    real = SW.grouped_gemm_swiglu_quant
    monkeypatch.setattr(SW, "grouped_gemm_swiglu_quant", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    T, E, D, F, k = 2048, 16, 512, 256, 8
    x = torch.randn(T, D, device=cuda).bfloat16()
    logits = torch.randn(T, E, device=cuda)
    w13, s13 = quantize_expert_weights((torch.randn(E, 2 * F, D, device=cuda) / D**0.5).bfloat16())
    w2, s2 = quantize_expert_weights((torch.randn(E, D, F, device=cuda) / F**0.5).bfloat16())
    cfg = RoutingConfig(top_k=k, score_func="softmax", renormalize=True, apply_router_weight_on_input=False)
    kw = dict(logits_TE=logits, w13_scale_e2F=s13, w2_scale_eD=s2)
    with settings.override(knobs={"SWIGLU_QUANT": 0, "DOWN_SUM_MIN_ROWS": 1, "GLUON_SWIGLU": 0}):
        base = moe_forward(x, None, w13, w2, cfg, **kw)
    assert not calls
    with settings.override(knobs={"SWIGLU_QUANT": 1, "DOWN_SUM_MIN_ROWS": 1}):
        got = moe_forward(x, None, w13, w2, cfg, **kw)
        assert calls
        assert torch.equal(got, base)
        xg = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gout = moe_forward(xg, None, w13, w2, cfg, **kw)
        xg.copy_(x.flip(0))
        graph.replay()
    with settings.override(knobs={"SWIGLU_QUANT": 0, "DOWN_SUM_MIN_ROWS": 1, "GLUON_SWIGLU": 0}):
        want = moe_forward(x.flip(0), None, w13, w2, cfg, **kw)
    assert torch.equal(gout, want)
