"""route_and_shuffle: the fused router (Triton kernel in the interpreter and on the GPU, the
composite beyond its sizes, the public op on the CPU) against ``moekit.reference``.

Integer outputs must match exactly; the row weights within float32 rounding (rel 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops import route_and_shuffle

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# (name, E, top_k, score_func, renormalize, n_group, topk_group, bias, scale)
ROUTINGS = [
    ("qwen3", 128, 8, "softmax", True, None, None, False, 1.0),
    ("deepseek", 256, 8, "sigmoid", True, 8, 4, True, 2.5),
    ("gpt-oss", 128, 4, "topk_softmax", False, None, None, False, 1.0),
    ("llama4", 16, 1, "sigmoid", False, None, None, False, 1.0),
    ("mixtral", 8, 2, "softmax", True, None, None, False, 1.0),
    ("odd-E", 24, 5, "sigmoid", False, None, None, True, 1.0),
    ("k=E", 12, 12, "softmax", False, None, None, False, 1.0),
    ("k16-E512", 512, 16, "softmax", True, None, None, False, 1.0),
    ("grouped-16", 16, 3, "softmax", False, 4, 2, False, 1.5),
]


def tie_free_logits(T: int, E: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Logits whose scores (and biased scores) have no ties: a random permutation per row,
    spaced 1/16 apart."""
    g = torch.Generator().manual_seed(seed)
    p = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    return ((p - E / 2) / 16).to(dtype)


def _inputs(r, T, seed, dtype=torch.float32, device="cpu"):
    _, E, k, sf, renorm, ng, tg, bias, scale = r
    logits = tie_free_logits(T, E, seed, dtype).to(device)
    b = None
    if bias:  # multiples of 2**-12: the biased choice stays tie-free
        g = torch.Generator().manual_seed(seed + 1)
        b = (torch.randint(0, 64, (E,), generator=g).float() / 4096).to(device)
    kw = dict(n_group=ng, topk_group=tg, e_score_correction_bias=b, routed_scaling_factor=scale)
    return logits, k, sf, renorm, kw


def check(got, want, msg=""):
    names = ("token_counts", "expert_indices", "token_indices")
    for g, w, n in zip(got[:3], want[:3], names):
        assert g.dtype == torch.int32, f"{msg} {n} dtype {g.dtype}"
        g, w = g.cpu(), w.cpu()
        assert torch.equal(g, w), f"{msg} {n}: {(g != w).sum().item()} mismatches\n{g}\n{w}"
    assert torch.equal(got[4].cpu(), want[4].cpu()), f"{msg} selection_rows\n{got[4]}\n{want[4]}"
    gw, ww = got[3].cpu(), want[3].cpu()
    assert gw.dtype == torch.float32
    err = ((gw - ww).abs().max() / ww.abs().max().clamp(min=1e-30)).item() if ww.numel() else 0.0
    assert err <= 1e-6, f"{msg} row weights: max rel error {err:.2e}"


def _launch_interp(logits, k, sf, renorm, kw, start=0, end=None, zero=None):
    from moekit.ops._triton import route as R

    E = logits.shape[1]
    return R.route_and_shuffle(logits, kw["e_score_correction_bias"], k, sf, renorm, kw["n_group"],
                               kw["topk_group"], kw["routed_scaling_factor"], start, E if end is None else end,
                               zero)  # fmt: skip


# ---------------------------------------------------------------------------- interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize("r", ROUTINGS, ids=[r[0] for r in ROUTINGS])
@pytest.mark.parametrize("T", [0, 1, 5, 37])
def test_interp_matches_reference(r, T):
    logits, k, sf, renorm, kw = _inputs(r, T, seed=T)
    zero = torch.full((max(T, 1), 24), 7.0, dtype=torch.bfloat16)
    got = _launch_interp(logits, k, sf, renorm, kw, zero=zero)
    check(got, ref.route_and_shuffle(logits, k, sf, renorm, **kw), r[0])
    assert (zero == 0).all(), "zero_buffer not zeroed"


@pytest.mark.interpreter
@pytest.mark.parametrize("r", [ROUTINGS[0], ROUTINGS[1], ROUTINGS[5]], ids=["qwen3", "deepseek", "odd-E"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interp_expert_range_and_dtypes(r, dtype):
    T = 19
    logits, k, sf, renorm, kw = _inputs(r, T, seed=3, dtype=dtype)
    E = logits.shape[1]
    start, end = E // 4, E // 2 + 1
    got = _launch_interp(logits, k, sf, renorm, kw, start, end)
    want = ref.route_and_shuffle(logits, k, sf, renorm, expert_index_start=start, expert_index_end=end, **kw)
    check(got, want, r[0])
    n = int(want[0][E + 1])
    assert (got[1][n:] == -1).all() and (got[2][n:] == -1).all() and (got[3][n:] == 0).all()


@pytest.mark.interpreter
def test_interp_strided_logits_and_one_expert():
    """Column-major logits; every token's top choice the same expert (one long group)."""
    r = ROUTINGS[0]
    logits, k, sf, renorm, kw = _inputs(r, 40, seed=5)
    logits[:, 77] = 100.0
    cm = logits.T.contiguous().T
    got = _launch_interp(cm, k, sf, renorm, kw)
    want = ref.route_and_shuffle(logits, k, sf, renorm, **kw)
    check(got, want)
    assert int(got[0][77]) == 40


@pytest.mark.interpreter
def test_interp_sub_tiles_carry_ranks():
    """More tokens than one sub-tile (E = 512: 4 tokens per tile) in the one-program path: ranks
    carried across tiles."""
    from moekit import settings

    r = ROUTINGS[7]
    logits, k, sf, renorm, kw = _inputs(r, 23, seed=9)
    with settings.override(route_fused_max_t=64):
        check(_launch_interp(logits, k, sf, renorm, kw), ref.route_and_shuffle(logits, k, sf, renorm, **kw))


@pytest.mark.interpreter
@pytest.mark.parametrize("r", [ROUTINGS[0], ROUTINGS[1], ROUTINGS[7]], ids=["qwen3", "deepseek", "k16-E512"])
@pytest.mark.parametrize("fused_max_t", [0, 4, 1000])
def test_interp_split_and_fused_paths_agree(r, fused_max_t):
    """One program for the whole batch, or blocks of tokens + the placing launch (blocks of 1, 2
    and 4 tokens at T = 70, 130, 300 of E = 128; an expert range; a zero buffer): same bits."""
    from moekit import settings

    with settings.override(route_fused_max_t=fused_max_t):
        for T in (3, 70):
            logits, k, sf, renorm, kw = _inputs(r, T, seed=T + 1)
            E = logits.shape[1]
            zero = torch.full((T, 40), 7.0)
            got = _launch_interp(logits, k, sf, renorm, kw, E // 8, E - 3, zero)
            check(got, ref.route_and_shuffle(logits, k, sf, renorm, expert_index_start=E // 8,
                                             expert_index_end=E - 3, **kw), f"T={T}")  # fmt: skip
            assert (zero == 0).all()


@pytest.mark.interpreter
def test_interp_split_blocks_of_several_tokens():
    """T = 300 over E = 16: blocks of 8 tokens (38 programs, the last one partial)."""
    from moekit.ops._triton import route as R

    r = ROUTINGS[3]
    logits, k, sf, renorm, kw = _inputs(r, 300, seed=4)
    assert R.split_plan(300, 16, k)[:3] == (8, 8, 38)
    check(_launch_interp(logits, k, sf, renorm, kw), ref.route_and_shuffle(logits, k, sf, renorm, **kw))


@pytest.mark.interpreter
@pytest.mark.parametrize("r", [ROUTINGS[0], ROUTINGS[1], ROUTINGS[3]], ids=["qwen3", "deepseek", "llama4"])
@pytest.mark.parametrize("fused_scan", [True, False], ids=["fused_scan", "scan_launch"])
def test_interp_split_blocks_of_several_sub_tiles(r, fused_scan):
    """More sub-tiles than ``SPLIT_MAX_BLOCKS`` (pinned to 4) of a pinned ``ROUTE_SPLIT_TILE``:
    each program routes several sub-tiles of tokens, its ranks carried across them; the count
    rows scanned by the placing programs or by the column-scan launch; an expert range and a zero
    buffer."""
    from moekit.ops._triton import route as R

    T = 150
    logits, k, sf, renorm, kw = _inputs(r, T, seed=11)
    E = logits.shape[1]
    knobs = {"SPLIT_MAX_BLOCKS": 4, "ROUTE_SPLIT_TILE": 512, "FUSED_SCAN_MAX": 1 << 14 if fused_scan else 0}
    knobs["ZERO_RIDE_MAX"] = 1 << 20 if fused_scan else 0  # the zero buffer: extra programs, or a memset
    with settings.override(route_fused_max_t=0, knobs=knobs):
        p = R.split_plan(T, E, k)
        assert p.n <= 4 and p.tpb >= 2 * p.bt and p.bt * max(16, E) <= 512 and p.fused_scan == fused_scan, p
        zero = torch.full((T, 40), 7.0)
        got = _launch_interp(logits, k, sf, renorm, kw, 1, E - 1, zero)
    check(got, ref.route_and_shuffle(logits, k, sf, renorm, expert_index_start=1, expert_index_end=E - 1, **kw))
    assert (zero == 0).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("T, D, fused_max_t", [(1, 24, 8), (6, 300, 8), (37, 2048, 8), (37, 1030, 0), (9, 5000, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interp_quantize_rides_along(T, D, fused_max_t, dtype):
    """``quantize=(x, q, s)``: programs after the routing and zeroing ones write
    ``quantize_fp8_row(x)``'s very bits (row maxima over several chunks, a NaN row, a row of
    zeros, strided rows), and the routing and the zeroed buffer are unchanged."""
    from moekit.ops import quantize_fp8_row

    r = ROUTINGS[1]
    logits, k, sf, renorm, kw = _inputs(r, T, seed=T + D)
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(T, D + 8, generator=g) * 4).to(dtype)[:, 3 : D + 3]
    x[0, D // 2] = 1e-6 if T == 1 else 300.0
    if T > 2:
        x[1] = 0.0
        x[2, D - 1] = float("nan")
    q = torch.full((T, D), 1.0, dtype=torch.float8_e4m3fn)
    s = torch.full((T,), -1.0)
    zero = torch.full((T, 40), 7.0, dtype=torch.bfloat16)
    from moekit.ops._triton import route as R

    with settings.override(route_fused_max_t=fused_max_t):
        got = R.route_and_shuffle(logits, kw["e_score_correction_bias"], k, sf, renorm, kw["n_group"],
                                  kw["topk_group"], kw["routed_scaling_factor"], 0, 256, zero, (x, q, s))  # fmt: skip
    check(got, ref.route_and_shuffle(logits, k, sf, renorm, **kw), "with quantize")
    wq, ws = quantize_fp8_row(x)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), (q.float() - wq.float()).abs().max()
    assert torch.equal(torch.nan_to_num(s), torch.nan_to_num(ws))
    assert (zero == 0).all()


@pytest.mark.reference
def test_quantize_through_the_public_op_cpu():
    """The public op on the CPU (reference routing): ``quantize`` filled as ``quantize_fp8_row``
    does it; ``quantize_rides`` is False off the kernels."""
    from moekit.ops.routing import quantize_rides

    from moekit.ops import quantize_fp8_row

    logits, k, sf, renorm, kw = _inputs(ROUTINGS[0], 7, seed=1)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    q = torch.empty(7, 64, dtype=torch.float8_e4m3fn)
    s = torch.empty(7)
    assert not quantize_rides(logits, k, None, 7, 64)
    got = route_and_shuffle(logits, k, sf, renorm, quantize=(x, q, s), **kw)
    check(got, ref.route_and_shuffle(logits, k, sf, renorm, **kw))
    wq, ws = quantize_fp8_row(x)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)


@pytest.mark.reference
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(quantize=torch.zeros(3, 4)), TypeError, "quantize must be a tuple"),
        (dict(quantize=(torch.zeros(3, 4, dtype=torch.int32), None, None)), TypeError, "quantize x"),
        (dict(quantize=(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3))), TypeError, "x_fp8"),
        (
            dict(quantize=(torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.float8_e4m3fn), torch.zeros(3))),
            ValueError,
            "x_fp8",
        ),
        (
            dict(quantize=(torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.zeros(2))),
            ValueError,
            "x_scale",
        ),
        (
            dict(quantize=(torch.zeros(3, 8)[:, ::2], torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.zeros(3))),
            ValueError,
            "quantize x",
        ),
    ],
)
def test_quantize_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        route_and_shuffle(torch.randn(3, 16), 2, "softmax", **kw)


@pytest.mark.reference
def test_quant_rides_rule():
    """The token rows ride along while a row is at most ``QUANT_RIDE_MAX_CHUNKS`` chunks of the
    routing programs' 16 values per thread and the copy at most ``QUANT_RIDE_MAX`` elements:
    Qwen3-30B's rows (D=2048) at T = 16-1024, DeepSeek-V3's (D=7168) at T=256 only."""
    from moekit.ops._triton.route import QUANT_RIDE_MAX, quant_rides

    assert all(quant_rides(T, 128, 8, T, 2048) for T in (1, 16, 64, 256, 1024))
    assert [quant_rides(T, 256, 8, T, 7168) for T in (16, 64, 256, 1024)] == [False, False, True, False]
    assert not quant_rides(64, 128, 8, 64, 0) and not quant_rides(2048, 128, 8, 2048, QUANT_RIDE_MAX // 2048 + 1)


@pytest.mark.reference
def test_split_plan_bounds():
    """Sub-tiles within ``ROUTE_SPLIT_TILE`` elements, blocks within ``SPLIT_MAX_BLOCKS`` until a
    block's rows would pass the packed 15-bit rank (then more blocks), count rows scanned in place
    only while all placing programs together read at most ``FUSED_SCAN_TOTAL`` entries."""
    from moekit.ops._triton import route as R
    from moekit.ops._triton.routing import FUSED_SCAN_TOTAL

    for T in (9, 64, 300, 2048, 8192, 65536, 1 << 22):
        for E, k in ((16, 1), (128, 8), (256, 8), (512, 16)):
            p = R.split_plan(T, E, k)
            assert p.bt * max(16, E) <= R.ROUTE_SPLIT_TILE and p.tpb % p.bt == 0 and p.n == -(-T // p.tpb), p
            assert p.tpb * k < 1 << 15 and (p.n <= R.SPLIT_MAX_BLOCKS or p.tpb * k * 2 >= 1 << 15), (T, E, p)
            assert p.hs == -(-E // 16) * 16 and 1 <= p.warps <= R.ROUTE_SPLIT_WARPS
            assert not p.fused_scan or p.n * p.n * p.hs <= FUSED_SCAN_TOTAL


@pytest.mark.interpreter
def test_interp_public_op_uses_kernel_and_composite(monkeypatch):
    """The registered op's CUDA branch (forced onto the interpreter): the kernels for what they
    take (one program; blocks of several sub-tiles past ``SPLIT_MAX_BLOCKS``), the composite
    (dense scores + index_shuffling) for groups that are not powers of two, same results."""
    import moekit.ops.routing as ops_routing
    from moekit.ops._triton import route as R

    monkeypatch.setattr(ops_routing, "use_triton", lambda t: True)
    calls = []
    real = R.route_and_shuffle
    monkeypatch.setattr(R, "route_and_shuffle", lambda *a: calls.append(1) or real(*a))
    odd_groups = ("odd-groups", 24, 3, "sigmoid", True, 4, 2, True, 1.0)
    for r, T, blocks in ((ROUTINGS[1], 5, 64), (ROUTINGS[1], 37, 2), (odd_groups, 9, 64)):
        logits, k, sf, renorm, kw = _inputs(r, T, seed=T)
        with settings.override(knobs={"SPLIT_MAX_BLOCKS": blocks}):
            got = route_and_shuffle(logits, k, sf, renorm, **kw)
        check(got, ref.route_and_shuffle(logits, k, sf, renorm, **kw))
    assert calls == [1, 1]


@pytest.mark.reference
def test_kernel_supports():
    from moekit.ops._triton.route import kernel_supports

    assert kernel_supports(256, 512, 16, None) and kernel_supports(2048, 128, 8, None)
    assert kernel_supports(16384, 256, 8, 8) and kernel_supports(1 << 22, 256, 8, 8)  # blocks of several sub-tiles
    assert kernel_supports(2097153, 16, 1, None)  # any batch: more blocks past the packed rank
    assert not kernel_supports(1, 513, 1, None) and not kernel_supports(1, 16, 17, None)
    assert kernel_supports(4, 256, 8, 8) and not kernel_supports(4, 24, 2, 4)  # groups: powers of two


# ---------------------------------------------------------------------------- reference tier


@pytest.mark.reference
@pytest.mark.parametrize("r", ROUTINGS[:6], ids=[r[0] for r in ROUTINGS[:6]])
def test_public_cpu_matches_reference(r):
    logits, k, sf, renorm, kw = _inputs(r, 11, seed=1)
    zero = torch.ones(11, 8)
    check(route_and_shuffle(logits, k, sf, renorm, zero_buffer=zero, **kw),
          ref.route_and_shuffle(logits, k, sf, renorm, **kw))  # fmt: skip
    assert (zero == 0).all()


@pytest.mark.reference
def test_reference_layout_is_index_shuffling_of_routing_weights():
    logits, k, sf, renorm, kw = _inputs(ROUTINGS[1], 9, seed=2)
    counts, eidx, tidx, rw, srow = ref.route_and_shuffle(logits, k, sf, renorm, **kw)
    w, ids = ref.routing_weights(logits, k, sf, renorm, **kw)
    want = ref.index_shuffling(ref.dense_scores(torch.arange(k, 0, -1).float().expand(9, k), ids, 256), top_k=k)
    for a, b in zip((counts, eidx, tidx), want):
        assert torch.equal(a, b)
    dense = torch.zeros(9, 256).scatter_(1, ids, w)
    assert torch.equal(rw, dense[tidx.long(), eidx.long()])
    # selection_rows: token t's j-th choice sits at that sorted row
    assert torch.equal(tidx[srow.long()], torch.arange(9).repeat_interleave(k).int())
    assert torch.equal(eidx[srow.long()].long(), ids.reshape(-1))


@pytest.mark.reference
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=17, E=16), ValueError, "top_k"),
        (dict(score_func="relu"), ValueError, "score_func"),
        (dict(renormalize="yes"), TypeError, "renormalize"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
        (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
        (dict(n_group=4), ValueError, "n_group and topk_group"),
        (dict(n_group=0, topk_group=1), ValueError, "n_group"),
        (dict(n_group=4, topk_group=5), ValueError, "topk_group"),
        (dict(n_group=5, topk_group=2), ValueError, "divide"),
        (dict(n_group=4, topk_group=1, top_k=5), ValueError, "topk_group \\* experts per group"),
        (dict(score_func="topk_softmax", n_group=4, topk_group=2), ValueError, "topk_softmax"),
        (dict(bias=torch.zeros(17)), ValueError, "e_score_correction_bias"),
        (dict(score_func="topk_softmax", bias=torch.zeros(16)), ValueError, "topk_softmax"),
        (dict(logits=torch.zeros(3, 16, dtype=torch.int32)), TypeError, "logits_TE"),
        (dict(logits=torch.zeros(16)), ValueError, "logits_TE"),
        (dict(expert_index_start=5, expert_index_end=3), ValueError, "expert range"),
        (dict(zero_buffer=torch.zeros(4, 8)[:, ::2]), ValueError, "zero_buffer"),
    ],
)
def test_bad_arguments(kw, exc, match):
    kw = dict(kw)
    E = kw.pop("E", 16)
    logits = kw.pop("logits", torch.randn(3, E))
    args = dict(top_k=kw.pop("top_k", 2), score_func=kw.pop("score_func", "softmax"))
    if "bias" in kw:
        kw["e_score_correction_bias"] = kw.pop("bias")
    with pytest.raises(exc, match=match):
        route_and_shuffle(logits, **args, **kw)


@pytest.mark.reference
def test_opcheck_and_compile_cpu():
    logits, k, sf, renorm, kw = _inputs(ROUTINGS[1], 6, seed=0)
    args = (logits, kw["e_score_correction_bias"], k, sf, renorm, 8, 4, 2.5, 0, 256, torch.ones(6, 8))
    torch.library.opcheck(torch.ops.moekit.route_and_shuffle.default, args + (None, None, None))
    quant = (torch.randn(6, 32), torch.empty(6, 32, dtype=torch.float8_e4m3fn), torch.empty(6))
    # (opcheck's schema test compares the FP8 output by arithmetic, which the CPU lacks for e4m3)
    torch.library.opcheck(
        torch.ops.moekit.route_and_shuffle.default,
        args + quant,
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
    torch._dynamo.reset()
    fn = torch.compile(lambda l, b: route_and_shuffle(l, k, sf, renorm, n_group=8, topk_group=4,
                                                      e_score_correction_bias=b, routed_scaling_factor=2.5),
                       fullgraph=True)  # fmt: skip
    check(fn(logits, kw["e_score_correction_bias"]), ref.route_and_shuffle(logits, k, sf, renorm, **kw))


@pytest.mark.reference
def test_kernel_compiles_for_sm90():
    """Every routing family's kernel, compiled on the CPU for sm_90 through ptxas (the split
    path's column-scan launch at 8192 tokens of E = 256 among them)."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import route as R
        m = "meta"
        for T, E, k, sf, renorm, ng, tg, bias in ((1, 128, 8, "softmax", True, None, None, False),
                                                 (64, 256, 8, "sigmoid", True, 8, 4, True),
                                                 (256, 128, 4, "topk_softmax", False, None, None, False),
                                                 (16, 16, 1, "sigmoid", False, None, None, False),
                                                 (3, 512, 16, "softmax", True, None, None, False),
                                                 (8192, 256, 8, "sigmoid", True, 8, 4, True)):
            logits = torch.empty(T, E, dtype=torch.bfloat16, device=m)
            b = torch.empty(E, device=m) if bias else None
            R.route_and_shuffle(logits, b, k, sf, renorm, ng, tg, 1.0, 0, E,
                                torch.empty(T, 2048, dtype=torch.bfloat16, device=m))
        # The quantizing programs beside the routing ones (the layer's FP8 streaming sizes).
        for T, D, E in ((256, 2048, 128), (16, 7168, 256), (4, 2048, 128)):
            logits = torch.empty(T, E, dtype=torch.float32, device=m)
            quant = (torch.empty(T, D, dtype=torch.bfloat16, device=m),
                     torch.empty(T, D, dtype=torch.float8_e4m3fn, device=m), torch.empty(T, device=m))
            R.route_and_shuffle(logits, None, 8, "softmax", True, None, None, 1.0, 0, E,
                                torch.empty(T, D, dtype=torch.bfloat16, device=m), quant)
        """,
        ["moekit.ops._triton.route"],
        pdl=True,
    )
    assert_all_compiled(records, 8)


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("r", ROUTINGS, ids=[r[0] for r in ROUTINGS])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 256, 300, 2500, 9000])
def test_gpu_matches_reference(r, T, cuda):
    logits, k, sf, renorm, kw = _inputs(r, T, seed=T)
    want = ref.route_and_shuffle(logits, k, sf, renorm, **kw)
    kw_gpu = {**kw, "e_score_correction_bias": None if kw["e_score_correction_bias"] is None
              else kw["e_score_correction_bias"].to(cuda)}  # fmt: skip
    zero = torch.full((T, 520), 3.0, dtype=torch.bfloat16, device=cuda)
    got = route_and_shuffle(logits.to(cuda), k, sf, renorm, zero_buffer=zero, **kw_gpu)
    check(got, want, f"{r[0]} T={T}")
    assert (zero == 0).all()
    check(route_and_shuffle(logits.to(cuda).to(torch.bfloat16), k, sf, renorm, **kw_gpu),
          ref.route_and_shuffle(logits.to(torch.bfloat16), k, sf, renorm, **kw), f"{r[0]} bf16")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("T, D", [(1, 2048), (16, 7168), (256, 2048), (256, 7168), (300, 2880)])
def test_gpu_quantize_rides_along(T, D, cuda):
    """On the H200: the token rows' FP8 copy from the routing launch (or its own launch where it
    does not ride) equals ``quantize_fp8_row`` bit for bit, in an eager call and in a CUDA graph
    replayed with new tokens and logits."""
    from moekit.ops import quantize_fp8_row

    r = ROUTINGS[1]
    logits, k, sf, renorm, kw = _inputs(r, T, seed=T)
    b = kw["e_score_correction_bias"]
    kw = {**kw, "e_score_correction_bias": b.to(cuda)}
    x = torch.randn(T, D, device=cuda, dtype=torch.bfloat16) * 3
    q = torch.zeros(T, D, dtype=torch.float8_e4m3fn, device=cuda)
    s = torch.empty(T, device=cuda)
    got = route_and_shuffle(logits.to(cuda), k, sf, renorm, quantize=(x, q, s), **kw)
    check(got, ref.route_and_shuffle(logits, k, sf, renorm, **{**kw, "e_score_correction_bias": b}))
    wq, ws = quantize_fp8_row(x)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    static = logits.to(cuda)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = route_and_shuffle(static, k, sf, renorm, quantize=(x, q, s), **kw)
    for seed in (5, 6):
        new = tie_free_logits(T, 256, seed)
        static.copy_(new)
        x.copy_(torch.randn(T, D, device=cuda) * seed)
        g.replay()
        torch.cuda.synchronize()
        check(outs, ref.route_and_shuffle(new, k, sf, renorm, **{**kw, "e_score_correction_bias": b}))
        wq, ws = quantize_fp8_row(x)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_cuda_graph_replays_new_routing(T, cuda):
    r = ROUTINGS[1]
    logits, k, sf, renorm, kw = _inputs(r, T, seed=0)
    b = kw["e_score_correction_bias"].to(cuda)
    kw = {**kw, "e_score_correction_bias": b}
    static = logits.to(cuda)
    route_and_shuffle(static, k, sf, renorm, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = route_and_shuffle(static, k, sf, renorm, **kw)
    for seed in (1, 2, 3):
        new = tie_free_logits(T, 256, seed)
        static.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        check(outs, ref.route_and_shuffle(new, k, sf, renorm, **{**kw, "e_score_correction_bias": b.cpu()}))


@pytest.mark.reference
def test_fallbacks_are_said_once(monkeypatch, pin_knobs):
    """Silent fallbacks are explicit (issue 16): E past the kernels on CUDA, CUDA without Triton."""
    import warnings

    from moekit.ops import _common
    from moekit.ops import routing as ops_routing

    monkeypatch.setattr(_common, "_WARNED", set())
    monkeypatch.setattr(ops_routing, "use_triton", lambda t: True)  # the CUDA branch, on CPU tensors
    pin_knobs(MAX_KERNEL_E=8)
    s = torch.rand(3, 16)
    with pytest.warns(UserWarning, match="PyTorch reference serves it"):
        ops_routing.index_shuffling(s, top_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops_routing.index_shuffling(s, top_k=2)  # once only

    class _Cuda:
        is_cuda = True

    monkeypatch.setattr(_common, "HAS_TRITON", False)
    with pytest.warns(UserWarning, match="Triton is not installed"):
        assert not _common.use_triton(_Cuda())


# ---------------------------------------------------------------------------- traced (torch.compile's AOT path)

_TRACE_BODY = """
from torch._functorch.aot_autograd import aot_function
from tests.ops.test_route_and_shuffle import ROUTINGS, _inputs

from moekit import settings

op = torch.ops.moekit.route_and_shuffle.default
launches = set()
# The last case: the count rows scanned by their own launch, the zero buffer by a memset.
scan_memset = {"FUSED_SCAN_MAX": 0, "ZERO_RIDE_MAX": 0}
for r, T, knobs in ((ROUTINGS[0], 5, {}), (ROUTINGS[0], 40, {}), (ROUTINGS[1], 37, {}), (ROUTINGS[2], 70, {}),
                    (ROUTINGS[1], 45, scan_memset)):
    logits, k, sf, renorm, kw = _inputs(r, T, seed=T)
    E = logits.shape[1]
    args = (logits, kw["e_score_correction_bias"], k, sf, renorm, kw["n_group"], kw["topk_group"],
            kw["routed_scaling_factor"], 0, E, torch.ones(T, 16))
    nodes = []

    def inspect(gm, _):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target):
                kwn = n.kwargs["kwargs"]
                tensors = [x for x in kwn.values() if isinstance(x, torch.fx.Node)]
                assert len(tensors) == len(set(tensors)), f"one tensor passed twice: {kwn}"
                for name in n.kwargs.get("tensors_to_clone", []):
                    assert kwn[name].op != "placeholder" or name == "zero_ptr", f"input {name} taken as written"
                nodes.append(n)
        return gm

    with settings.override(knobs=knobs):
        traced = aot_function(lambda *t: op(*t, None, None, None), inspect)(*args)
        eager = op(*args[:-1], torch.ones(T, 16), None, None, None)
    launches.add(len(nodes))
    for x, y in zip(traced, eager):
        assert torch.equal(x, y)
assert launches == {1, 2, 3}, launches  # one program up to 8 tokens; blocks (+ scan) + placement past it
# The token rows' FP8 copy riding along: the quantize outputs are the only inputs taken as written.
for T in (5, 40):
    logits, k, sf, renorm, kw = _inputs(ROUTINGS[0], T, seed=T)
    x = torch.randn(T, 48)
    def quant():
        return (x, torch.zeros(T, 48, dtype=torch.float8_e4m3fn), torch.zeros(T))
    args = (logits, None, k, sf, renorm, None, None, 1.0, 0, 128, None)
    nodes = []

    def inspect_q(gm, _):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target):
                kwn = n.kwargs["kwargs"]
                for name in n.kwargs.get("tensors_to_clone", []):
                    assert kwn[name].op != "placeholder" or name in ("qq_ptr", "qs_ptr"), f"input {name} taken as written"
                nodes.append(n)
        return gm

    tq = quant()
    traced = aot_function(lambda *t: op(*t), inspect_q)(*args, *tq)
    eq = quant()
    eager = op(*args, *eq)
    assert nodes and all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert torch.equal(tq[1].view(torch.uint8), eq[1].view(torch.uint8)) and torch.equal(tq[2], eq[2])
print("TRACED OK")
"""


@pytest.mark.interpreter
def test_interp_traced_cuda_branch_matches_eager():
    """The CUDA branch traced by AOT autograd (what torch.compile runs): the one-launch path and
    the split path with the count rows scanned by the placing programs or by their own launch
    (the zero buffer then zeroed by a memset): the launches are captured, no input but the zero
    buffer is taken as written, and the traced results equal the eager ones."""
    import os
    import subprocess
    import sys

    from tests.ops.test_routing import _TRACE_SCRIPT

    harness = _TRACE_SCRIPT.split("from torch._functorch.aot_autograd import aot_function")[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", harness + _TRACE_BODY], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # fmt: skip
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and "TRACED OK" in r.stdout, (r.stdout[-3000:], r.stderr[-6000:])
