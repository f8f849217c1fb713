"""moe_decode (two launches from router logits: routing inside the gate/up GEMV, then the per-token
combine): kernels in the interpreter and on the GPU against ``moekit.reference.moe_decode`` and
against the sorted decode pipeline's kernels (the same bits), the public op on the CPU, its
errors, and ``moe_forward``'s choice of it."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit import settings
from moekit.ops import moe_decode
from moekit.ops.decode import moe_decode_supports
from moekit.reference.quantize import quantize_fp8_row
from moekit.testing import assert_close

FP8 = torch.float8_e4m3fn

# (score_func, renormalize, n_group, topk_group, bias, scale): the routing families of the models
ROUTINGS = {
    "softmax_renorm": ("softmax", True, None, None, False, 1.0),  # Qwen3-MoE, Mixtral
    "deepseek": ("sigmoid", True, 4, 2, True, 2.5),  # grouped top-k, correction bias, scaling
    "topk_softmax": ("topk_softmax", False, None, None, False, 1.0),  # gpt-oss
    "sigmoid": ("sigmoid", False, None, None, False, 1.0),  # Llama 4 (k=1, weight on the input)
}


def _case(T, E, D, F, k, routing, w_kind="bf16", seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    score, renorm, ng, tg, has_bias, scale = ROUTINGS[routing]
    x = torch.randn(T, D, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    w13 = torch.randn(E, 2 * F, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, F, generator=g) / F**0.5
    s13 = s2 = None
    if w_kind == "fp8":
        q13, s13 = quantize_fp8_row(w13.reshape(-1, D))
        q2, s2 = quantize_fp8_row(w2.reshape(-1, F))
        w13, w2 = q13.view(E, 2 * F, D), q2.view(E, D, F)
        s13, s2 = s13.view(E, 2 * F), s2.view(E, D)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    bias = torch.randn(E, generator=g) / 10 if has_bias else None
    kw = dict(score_func=score, renormalize=renorm, n_group=ng, topk_group=tg, e_score_correction_bias=bias,
              routed_scaling_factor=scale, w13_scale_e2F=s13, w2_scale_eD=s2)  # fmt: skip
    mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return mv(x), mv(logits), mv(w13), mv(w2), {n: mv(v) for n, v in kw.items()}


def _launch(x, logits, w13, w2, out, k, kw, on_input=False, accumulate=True):
    """The Triton launcher itself (the interpreter on the CPU)."""
    from moekit.ops._triton import decode as dec

    E, twoF, D = w13.shape
    s13, s2 = kw["w13_scale_e2F"], kw["w2_scale_eD"]
    dec.moe_decode(
        x, logits, kw["e_score_correction_bias"], w13.reshape(-1, D), w2.reshape(-1, twoF // 2),
        None if s13 is None else s13.reshape(-1), None if s2 is None else s2.reshape(-1), out, k, kw["score_func"],
        kw["renormalize"], kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"], on_input, accumulate,
    )  # fmt: skip
    return out


def _sorted_decode(x, logits, w13, w2, out, k, kw, on_input=False):
    """The sorted decode pipeline's kernels on the same inputs: route_and_shuffle, the gate/up
    GEMV on the sorted rows, the per-token combine."""
    from moekit.ops._triton import gg_combine, gg_swiglu, route
    from moekit.ops._triton.gg_config import GemmConfig
    from moekit.ops._triton.decode import decode_swiglu_config

    E, twoF, D = w13.shape
    F = twoF // 2
    T = x.shape[0]
    s13, s2 = kw["w13_scale_e2F"], kw["w2_scale_eD"]
    counts, eidx, tidx, rw, srow = route.route_and_shuffle(
        logits, kw["e_score_correction_bias"], k, kw["score_func"], kw["renormalize"], kw["n_group"],
        kw["topk_group"], kw["routed_scaling_factor"], 0, E, None,
    )  # fmt: skip
    bn, bk, stages, warps = decode_swiglu_config(T * k, F, D, w13.element_size(), 132)
    cfg = GemmConfig("gemv", 1, bn, bk, stages, warps, use_tma=False)
    z = gg_swiglu.grouped_gemm_swiglu(x, w13.reshape(-1, D), counts[:E], tidx, rw if on_input else None, None,
                                      None if s13 is None else s13.reshape(-1), config=cfg)  # fmt: skip
    gg_combine.grouped_gemm_combine(z, w2.reshape(-1, F), eidx, srow, out, None if on_input else rw,
                                    None if s2 is None else s2.reshape(-1))  # fmt: skip
    return out


# ---------------------------------------------------------------------------- interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("w_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2), (2, 1)])
def test_interp_matches_reference_and_sorted_pipeline(routing, w_kind, T, k):
    E, D, F = 16, 64, 24  # F not a power of two: masked columns; D = 64 takes whole K tiles
    on_input = routing == "sigmoid"
    x, logits, w13, w2, kw = _case(T, E, D, F, k, routing, w_kind, seed=T * 10 + k)
    got = _launch(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16), k, kw, on_input, accumulate=False)
    want = ref.moe_decode(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16), top_k=k,
                          apply_router_weight_on_input=on_input, accumulate=False, **kw)  # fmt: skip
    assert_close(got.float(), want.float(), tol=2e-2, msg=routing)
    # The sorted decode pipeline on the same routing: the same bits (same products, same slot order).
    base = torch.zeros(T, D, dtype=torch.bfloat16)
    assert torch.equal(got, _sorted_decode(x, logits, w13, w2, base, k, kw, on_input)), routing


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", ["softmax_renorm", "deepseek", "sigmoid", "topk_softmax"])
def test_interp_lazy_routing_gives_the_same_bits(routing):
    """The ``lazy`` first launch (rounds up to each program's own slot, weights only where stored
    or used) chooses and weighs exactly as the full one, ties between logits (keys equal but for
    the expert index) across the top-k boundary included."""
    from moekit.ops._triton import decode as dec

    T, E, D, F, k = 3, 16, 32, 24, 4
    on_input = routing == "sigmoid"
    x, logits, w13, w2, kw = _case(T, E, D, F, k, routing, seed=11)
    logits[2, 5:9] = logits[2, 3]
    args = (x, logits, kw["e_score_correction_bias"], w13.reshape(-1, D), None, F, k, kw["score_func"],
            kw["renormalize"], kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"], on_input)  # fmt: skip
    full = dec.decode_swiglu(*args, config=(8, 16, 2, 4, False))
    lazy = dec.decode_swiglu(*args, config=(8, 16, 2, 4, True))
    for a, b in zip(full, lazy):
        assert torch.equal(a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize(
    "E,logits_dtype,perm_s",
    [(64, torch.float32, 0), (64, torch.bfloat16, 0), (256, torch.float32, 128), (512, torch.bfloat16, 256)],
    ids=["e64_f32", "e64_bf16", "e256_f32_halves", "e512_bf16_halves"],
)
def test_interp_routing_on_a_row_per_warp_gives_the_same_bits(routing, E, logits_dtype, perm_s):
    """Knob ``DECODE_ROUTE_ROWS``: the first launch routes on one copy of the token's logits row
    per warp (``ROWS`` = 4), a row of two warps' width loaded as two joined halves (``PERM_S``:
    blocks of half a group where experts are grouped, DeepSeek's 4 groups here), and stores the
    experts, weights and SwiGLU rows that one row in expert order gives, bit for bit, ties across
    the top-k boundary and across the halves included; the whole layer matches the reference."""
    from moekit.ops._triton import decode as dec
    from tests.ops.test_grouped_gemm_swiglu import _spy_kwargs

    T, D, F, k = 3, 32, 24, 4
    on_input = routing == "sigmoid"
    x, logits, w13, w2, kw = _case(T, E, D, F, k, routing, seed=17)
    logits = logits.to(logits_dtype)
    logits[1, 5:9] = logits[1, 3]  # ties across the top-k boundary
    logits[2, [3, E // 2 + 1, E - 2]] = logits[2].max() + 1  # equal maxima in both halves
    if kw["n_group"] and perm_s:
        perm_s = E // kw["n_group"] // 2
    args = (x, logits, kw["e_score_correction_bias"], w13.reshape(-1, D), None, F, k, kw["score_func"],
            kw["renormalize"], kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"], on_input)  # fmt: skip
    seen = []
    orig = _spy_kwargs(dec, ("ROWS", "PERM_S"), seen)
    try:
        got = {}
        for rows in (False, True):
            with settings.override(knobs={"DECODE_ROUTE_ROWS": rows}):
                got[rows] = dec.decode_swiglu(*args, config=(8, 16, 2, 4, True))
                out = _launch(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16), k, kw, on_input, False)
    finally:
        dec.launch = orig
    assert seen == [(1, 0)] * 2 + [(4, perm_s)] * 2, seen
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b), routing
    want = ref.moe_decode(x, logits.float(), w13, w2, torch.zeros(T, D, dtype=torch.bfloat16), top_k=k,
                          apply_router_weight_on_input=on_input, accumulate=False, **kw)  # fmt: skip
    assert_close(out.float(), want.float(), tol=2e-2, msg=routing)


@pytest.mark.interpreter
def test_interp_accumulates_into_out_and_stores_without_reading():
    T, E, D, F, k = 2, 8, 32, 16, 2
    x, logits, w13, w2, kw = _case(T, E, D, F, k, "softmax_renorm", seed=5)
    prev = torch.randn(T, D).bfloat16()
    added = _launch(x, logits, w13, w2, prev.clone(), k, kw, accumulate=True)
    want = ref.moe_decode(x, logits, w13, w2, prev.clone(), top_k=k, **kw)
    assert_close(added.float(), want.float(), tol=2e-2)
    stored = _launch(x, logits, w13, w2, torch.full((T, D), float("nan")).bfloat16(), k, kw, accumulate=False)
    assert not stored.isnan().any()  # out is never read
    assert torch.equal(stored, _launch(x, logits, w13, w2, torch.zeros(T, D).bfloat16(), k, kw, accumulate=True))


# ---------------------------------------------------------------------------- reference (CPU op)


@pytest.mark.reference
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_cpu_op_is_the_reference_and_the_dense_layer(routing):
    """The public op on CPU tensors runs the reference; both equal the dense float32 layer (routing
    from the same logits) within bf16 rounding of z."""
    T, E, D, F, k = 3, 16, 32, 16, 4
    on_input = routing == "sigmoid"
    x, logits, w13, w2, kw = _case(T, E, D, F, k, routing, seed=2)
    out = moe_decode(x, logits, w13, w2, torch.zeros(T, D).bfloat16(), k, apply_router_weight_on_input=on_input, **kw)
    want = ref.moe_decode(x, logits, w13, w2, torch.zeros(T, D).bfloat16(), top_k=k,
                          apply_router_weight_on_input=on_input, **kw)  # fmt: skip
    assert torch.equal(out, want)
    weights, ids = ref.routing_weights(
        logits, k, kw["score_func"], kw["renormalize"], n_group=kw["n_group"], topk_group=kw["topk_group"],
        e_score_correction_bias=kw["e_score_correction_bias"], routed_scaling_factor=kw["routed_scaling_factor"],
    )  # fmt: skip
    dense = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            xin = x[t].float() * (weights[t, j] if on_input else 1.0)
            y = ref.swiglu_expert(xin[None], w13[e].float(), w2[e].float())[0]
            dense[t] += y * (1.0 if on_input else weights[t, j])
    assert_close(out.float(), dense, tol=2e-2)


@pytest.mark.reference
def test_errors_name_what_was_expected():
    T, E, D, F, k = 2, 8, 32, 16, 2
    x, logits, w13, w2, kw = _case(T, E, D, F, k, "softmax_renorm")
    out = torch.zeros(T, D).bfloat16()
    base = {n: v for n, v in kw.items() if n not in ("w13_scale_e2F", "w2_scale_eD")}
    with pytest.raises(ValueError, match="logits_TE must have shape"):
        moe_decode(x, logits[:1], w13, w2, out, k, **base)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode(x, logits, w13, w2, out, E + 1, **base)
    with pytest.raises(ValueError, match="E <= 512"):
        big = torch.randn(T, 1024)
        moe_decode(x, big, w13, w2, out, k, **base)
    with pytest.raises(TypeError, match="out_TD must have dtype bfloat16"):
        moe_decode(x, logits, w13, w2, out.float(), k, **base)
    with pytest.raises(ValueError, match="out_TD"):
        moe_decode(x, logits, w13, w2, out[:1], k, **base)
    with pytest.raises(ValueError, match="w2_eDF"):
        moe_decode(x, logits, w13, w2[:, :, :8], out, k, **base)
    with pytest.raises(TypeError, match="w13_e2FD must have x_TD's dtype"):
        moe_decode(x, logits, w13.float(), w2.float(), out, k, **base)
    with pytest.raises(ValueError, match="FP8 expert weights need"):
        moe_decode(x, logits, w13.to(FP8), w2.to(FP8), out, k, **base)
    with pytest.raises(ValueError, match="go with FP8"):
        moe_decode(x, logits, w13, w2, out, k, w13_scale_e2F=torch.ones(E, 2 * F), w2_scale_eD=torch.ones(E, D),
                   **base)  # fmt: skip
    assert not moe_decode_supports(1024, 8) and not moe_decode_supports(128, 17) and moe_decode_supports(256, 8, 8)


@pytest.mark.reference
def test_moe_forward_takes_it_up_to_four_tokens():
    """``decode_fused``: ``auto`` for any top-k up to 4 tokens, bf16 or FP8, at most 256 experts,
    unless the path is pinned to ``sorted``; ``on`` up to 64 rows of any top-k on the decode path;
    ``off`` never; the knobs ``DECODE_FUSED_MIN_TOP_K`` / ``DECODE_FUSED_MAX_TOKENS`` move the
    bounds; and ``moe_forward`` on CPU gives the same result either way."""
    from moekit.layers.experts import decode_fused
    from moekit.layers.functional import RoutingConfig, moe_forward

    assert decode_fused(8, 128, 8, False)  # T=1, Qwen3-30B
    assert decode_fused(8, 256, 8, False, n_group=8)  # DeepSeek-V3 TP8: 256 scores, grouped
    assert not decode_fused(8, 512, 8, False)  # past DECODE_FUSED_MAX_EXPERTS
    assert decode_fused(8, 128, 8, True) and decode_fused(8, 256, 8, True, n_group=8)  # FP8 weights
    assert decode_fused(32, 128, 8, False) and decode_fused(32, 256, 8, True, n_group=8)  # T=4
    assert not decode_fused(40, 128, 8, False)  # T=5: the sorted pipelines
    assert decode_fused(4, 128, 4, False) and decode_fused(16, 128, 4, True)  # gpt-oss-120b T=1, 4
    assert not decode_fused(20, 128, 4, False)
    assert decode_fused(1, 16, 1, False) and decode_fused(2, 8, 2, True)  # Llama 4 Scout, Mixtral T=1
    assert decode_fused(4, 128, 1, True) and not decode_fused(5, 16, 1, False)  # top-1 to T=4
    assert not decode_fused(8, 128, 8, False, path="sorted")
    with settings.override(moe_path="sorted"):
        assert not decode_fused(8, 128, 8, False)
    with settings.override(knobs={"DECODE_FUSED_MIN_TOP_K": 2, "DECODE_FUSED_MAX_TOKENS": 1}):
        assert decode_fused(2, 8, 2, False) and not decode_fused(4, 128, 1, False)
        assert not decode_fused(16, 128, 8, False)
    with settings.override(knobs={"DECODE_FUSED_MIN_TOP_K": 6}):
        assert not decode_fused(4, 128, 4, False) and decode_fused(8, 128, 8, False)
    with settings.override(knobs={"DECODE_FUSED_MIN_TOP_K": 4}):  # session 18's bound
        assert not decode_fused(1, 16, 1, False) and not decode_fused(2, 8, 2, False)
    assert not decode_fused(8, 1024, 8, False)  # past the routing kernel's experts
    with settings.override(decode_fused="on"):
        assert decode_fused(4, 128, 4, False) and decode_fused(32, 128, 8, False) and decode_fused(8, 128, 8, True)
        assert decode_fused(8, 256, 8, False, n_group=8)
        assert not decode_fused(128, 128, 8, False)
    with settings.override(decode_fused="off"):
        assert not decode_fused(8, 128, 8, False)
    E, D, F, k = 32, 32, 16, 8
    cfg = RoutingConfig(top_k=k, score_func="softmax", renormalize=True, apply_router_weight_on_input=False)
    for T in (4, 1):
        x, logits, w13, w2, kw = _case(T, E, D, F, k, "softmax_renorm", seed=3)
        got = moe_forward(x, None, w13, w2, cfg, logits_TE=logits)
        with settings.override(decode_fused="off"):
            want = moe_forward(x, None, w13, w2, cfg, logits_TE=logits)
        assert torch.equal(got, want), T
    shared = torch.randn(T, D).bfloat16()
    got = moe_forward(x, None, w13, w2, cfg, logits_TE=logits, shared_out_TD=shared.clone())
    assert_close(got.float(), (shared.float() + want.float()), tol=2e-2)


# ---------------------------------------------------------------------------- GPU

# (E, D, F, k, routing): Qwen3-30B-A3B, DeepSeek-V3 TP8 experts (grouped: 8 groups, 4 kept),
# gpt-oss-120b; top-1 and top-2 (the combine's 4 KB tiles, ``COMBINE_FEW_4KB``): Llama 4's routing
# with 512-wide F tiles, and a Mixtral-like top-2 whose F = 1000 masks the last 512-wide tile
GPU_SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, "softmax_renorm", None),
    "deepseek-v3-tp8": (256, 7168, 256, 8, "deepseek", (8, 4)),
    "gpt-oss-120b": (128, 2880, 2880, 4, "topk_softmax", None),
    "top1-f2048": (16, 2048, 2048, 1, "sigmoid", None),
    "top2-f1000": (8, 1024, 1000, 2, "softmax_renorm", None),
}


def _gpu_case(name, T, w_kind, seed=0):
    E, D, F, k, routing, groups = GPU_SHAPES[name]
    x, logits, w13, w2, kw = _case(T, E, D, F, k, routing, w_kind, seed=seed, device="cuda")
    if groups is not None:
        kw["n_group"], kw["topk_group"] = groups
    return x, logits, w13, w2, kw, k


def _choices(x, logits, w13, w2, k, kw):
    """``(ids [T, K], weights [T, K])`` from moe_decode's first launch and from the routing launch
    (its sorted rows read back in token-major order through ``selection_rows``)."""
    from moekit.ops._triton import decode as dec
    from moekit.ops._triton import route

    E, twoF, D = w13.shape
    s13 = kw["w13_scale_e2F"]
    args = (kw["score_func"], kw["renormalize"], kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"])
    _, ids, rw = dec.decode_swiglu(x, logits, kw["e_score_correction_bias"], w13.reshape(-1, D),
                                   None if s13 is None else s13.reshape(-1), twoF // 2, k, *args, False)  # fmt: skip
    _, eidx, _, rws, srow = route.route_and_shuffle(logits, kw["e_score_correction_bias"], k, *args, 0, E, None)
    T = x.shape[0]
    return ids.view(T, k), rw.view(T, k), eidx[srow.long()].view(T, k), rws[srow.long()].view(T, k)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("w_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_gpu_matches_reference_and_sorted_pipeline(name, w_kind, T):
    """Against the float32 reference; the same experts in the same slots as the routing launch,
    weights within float32 rounding (the two reduce a row's scores in different thread layouts), and
    the sorted decode pipeline's output within bf16 rounding."""
    x, logits, w13, w2, kw, k = _gpu_case(name, T, w_kind, seed=T)
    D = x.shape[1]
    got = moe_decode(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16, device="cuda"), k, **kw)
    want = ref.moe_decode(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), torch.zeros(T, D).bfloat16(), top_k=k,
                          **{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in kw.items()})  # fmt: skip
    assert_close(got.cpu().float(), want.float(), tol=2e-2, msg=f"{name} {w_kind} T={T}")
    ids, rw, ids_r, rw_r = _choices(x, logits, w13, w2, k, kw)
    assert torch.equal(ids, ids_r.to(ids.dtype)), f"{name} {w_kind} T={T}"
    assert_close(rw, rw_r, tol=1e-6, msg=f"{name} weights")
    base = torch.zeros(T, D, dtype=torch.bfloat16, device="cuda")
    assert_close(got.float(), _sorted_decode(x, logits, w13, w2, base, k, kw).float(), tol=1e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3-tp8", "gpt-oss-120b"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_routing_on_a_row_per_warp(name, logits_dtype, T):
    """Knob ``DECODE_ROUTE_ROWS`` on the GPU (a row per warp; DeepSeek's 256 float32 logits as two
    joined halves): the same experts in the same slots as the routing launch, weights within
    float32 rounding of it, and moe_decode's output within bf16 rounding of the knob off and of the
    reference; the launch took the row per warp."""
    from moekit.ops._triton import decode as dec
    from tests.ops.test_grouped_gemm_swiglu import _spy_kwargs

    x, logits, w13, w2, kw, k = _gpu_case(name, T, "fp8", seed=40 + T)
    logits = logits.to(logits_dtype)
    D = x.shape[1]
    seen = []
    orig = _spy_kwargs(dec, ("ROWS", "PERM_S"), seen)
    try:
        with settings.override(knobs={"DECODE_ROUTE_ROWS": True}):
            on = moe_decode(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16, device="cuda"), k, **kw)
            ids, rw, ids_r, rw_r = _choices(x, logits, w13, w2, k, kw)
        with settings.override(knobs={"DECODE_ROUTE_ROWS": False}):
            off = moe_decode(x, logits, w13, w2, torch.zeros(T, D, dtype=torch.bfloat16, device="cuda"), k, **kw)
    finally:
        dec.launch = orig
    wide = name == "deepseek-v3-tp8" and logits_dtype == torch.float32
    assert seen[0] == (4, 16 if wide else 0) and seen[-1] == (1, 0), seen
    assert torch.equal(ids, ids_r.to(ids.dtype)), (name, T)
    assert_close(rw, rw_r, tol=1e-6, msg=f"{name} weights")
    assert_close(on.float(), off.float(), tol=1e-2, msg=name)
    want = ref.moe_decode(x.cpu(), logits.float().cpu(), w13.cpu(), w2.cpu(), torch.zeros(T, D).bfloat16(), top_k=k,
                          **{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in kw.items()})  # fmt: skip
    assert_close(on.cpu().float(), want.float(), tol=2e-2, msg=f"{name} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["bf16", "fp8"])
def test_gpu_moe_forward_graph_replays_new_routing_bitwise(w_kind):
    """moe_forward at T=1 of Qwen3-30B's shapes takes moe_decode (auto) where ``decode_fused``
    says so; captured in a CUDA graph it follows new logits: each replay gives the bits of an
    eager call on the same inputs, and the reference within bf16 rounding."""
    from moekit.layers.experts import decode_fused
    from moekit.layers.functional import RoutingConfig, moe_forward

    x, logits, w13, w2, kw, k = _gpu_case("qwen3-30b-a3b", 1, w_kind)
    E = logits.shape[1]
    cfg = RoutingConfig(top_k=k, score_func="softmax", renormalize=True, apply_router_weight_on_input=False)
    scales = dict(w13_scale_e2F=kw["w13_scale_e2F"], w2_scale_eD=kw["w2_scale_eD"])
    with settings.override(decode_fused="on"):
        assert decode_fused(k, E, k, w_kind == "fp8")
        fwd = lambda: moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **scales)  # noqa: E731
        fwd()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fwd()
        for seed in range(3):
            gen = torch.Generator().manual_seed(100 + seed)
            x.copy_(torch.randn(x.shape, generator=gen).bfloat16())
            logits.copy_(torch.randn(logits.shape, generator=gen))
            g.replay()
            assert torch.equal(out, fwd()), f"replay {seed}"
            want = ref.moe_decode(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), torch.zeros(1, x.shape[1]).bfloat16(),
                                  top_k=k, score_func="softmax", renormalize=True,
                                  **{n: v.cpu() for n, v in scales.items() if v is not None})  # fmt: skip
            assert_close(out.cpu().float(), want.float(), tol=2e-2, msg=f"replay {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["bf16", "fp8"])
def test_gpu_moe_forward_deepseek_auto_is_moe_decode(w_kind):
    """DeepSeek-V3 TP8 at T=1 (256 experts, grouped routing with a correction bias): ``auto`` takes
    moe_decode (``decode_fused`` up to 256 experts, bf16 and FP8) and gives its bits, within bf16
    rounding of the sorted pipeline and the reference."""
    from moekit.layers.experts import decode_fused
    from moekit.layers.functional import RoutingConfig, moe_forward

    x, logits, w13, w2, kw, k = _gpu_case("deepseek-v3-tp8", 1, w_kind, seed=7)
    E = logits.shape[1]
    cfg = RoutingConfig(top_k=k, score_func="sigmoid", renormalize=True, n_group=kw["n_group"],
                        topk_group=kw["topk_group"], routed_scaling_factor=kw["routed_scaling_factor"],
                        apply_router_weight_on_input=False)  # fmt: skip
    extra = dict(logits_TE=logits, e_score_correction_bias=kw["e_score_correction_bias"],
                 w13_scale_e2F=kw["w13_scale_e2F"], w2_scale_eD=kw["w2_scale_eD"])  # fmt: skip
    fused = decode_fused(k, E, k, w_kind == "fp8", n_group=kw["n_group"])
    assert fused
    got = moe_forward(x, None, w13, w2, cfg, **extra)
    with settings.override(decode_fused="on"):
        on = moe_forward(x, None, w13, w2, cfg, **extra)
    with settings.override(decode_fused="off"):
        off = moe_forward(x, None, w13, w2, cfg, **extra)
    assert torch.equal(got, on if fused else off)
    assert_close(got.float(), off.float(), tol=1e-2, msg=w_kind)
    want = ref.moe_decode(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), torch.zeros(1, x.shape[1]).bfloat16(),
                          top_k=k, **{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in kw.items()})  # fmt: skip
    assert_close(got.cpu().float(), want.float(), tol=2e-2, msg=w_kind)


@pytest.mark.gpu
def test_gpu_moe_forward_compiles_fullgraph_with_moe_decode():
    from moekit.layers.functional import RoutingConfig, moe_forward

    x, logits, w13, w2, kw, k = _gpu_case("qwen3-30b-a3b", 1, "bf16")
    cfg = RoutingConfig(top_k=k, score_func="softmax", renormalize=True, apply_router_weight_on_input=False)
    with settings.override(decode_fused="on"):
        torch._dynamo.reset()
        fn = torch.compile(lambda x, l: moe_forward(x, None, w13, w2, cfg, logits_TE=l), fullgraph=True)
        got = fn(x, logits)
        want = moe_forward(x, None, w13, w2, cfg, logits_TE=logits)
    assert torch.equal(got, want)


@pytest.mark.reference
def test_kernels_compile_without_spills_for_sm90():
    """Both launches for the benchmark's model shapes (bf16 and weight-only FP8; grouped routing
    with a bias; top-8, top-4, top-1), compiled on the CPU for sm_90 through ptxas: no stack."""
    from tests.ops._sm90 import assert_all_compiled, compile_launches

    records = compile_launches(
        """
        from moekit.ops._triton import decode as DEC
        m = "meta"
        for E, D, F, k, ng in ((128, 2048, 768, 8, None), (256, 7168, 256, 8, 8), (128, 2880, 2880, 4, None),
                               (16, 5120, 1024, 1, None)):
            for fp8 in (False, True):
                dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
                x = torch.empty(1, D, dtype=torch.bfloat16, device=m)
                lg = torch.empty(1, E, dtype=torch.float32, device=m)
                w13 = torch.empty(E * 2 * F, D, dtype=dt, device=m)
                w2 = torch.empty(E * D, F, dtype=dt, device=m)
                s13 = torch.empty(E * 2 * F, device=m) if fp8 else None
                s2 = torch.empty(E * D, device=m) if fp8 else None
                b = torch.empty(E, device=m) if ng else None
                out = torch.empty(1, D, dtype=torch.bfloat16, device=m)
                for lazy in (False, True):
                    DEC.moe_decode(x, lg, b, w13, w2, s13, s2, out, k, "sigmoid" if ng else "softmax", True, ng,
                                   4 if ng else None, 2.5, False, False,
                                   DEC.decode_swiglu_config(k, F, D, 1 if fp8 else 2, 132) + (lazy,))
        """,
        ["moekit.ops._triton.decode", "moekit.ops._triton.gg_combine"],
    )
    assert_all_compiled(records, 32)
    assert {r["kernel"] for r in records} == {"_decode_swiglu_kernel", "_combine_kernel"}
    assert all(not r["stack"] for r in records), [(r["kernel"], r["stack"]) for r in records]
    # The FP8 GEMV's tile rule (gg_swiglu._fp8_gemv_config) counts on 4096-weight tiles fitting 4
    # programs per SM (<= 128 registers at 4 warps): the grid then runs in one wave.
    # (constants are recorded as their repr)
    tile = lambda r: int(r["constants"]["BLOCK_N"]) * int(r["constants"]["BLOCK_K"])  # noqa: E731
    fp8_small = [r for r in records if r["kernel"] == "_decode_swiglu_kernel" and r["constants"]["HAS_WS"] == "True"
                 and tile(r) <= 4096]  # fmt: skip
    assert len(fp8_small) >= 4, len(fp8_small)
    assert all(r["regs"] is None or r["regs"] <= 128 for r in fp8_small), [(tile(r), r["regs"]) for r in fp8_small]


@pytest.mark.reference
def test_routing_on_a_row_per_warp_drops_the_block_barriers_on_sm90():
    """Knob ``DECODE_ROUTE_ROWS`` on the first launch of Qwen3-30B, DeepSeek-V3 TP8 (grouped, with
    a bias) and gpt-oss-120b at T=1 (FP8 weights), bf16 and float32 logits, compiled for sm_90: a
    row per warp (DeepSeek's 256 float32 logits as two joined halves of half a group's width each)
    leaves at most 8 block barriers ahead of the first weight copy, against 18-56 on one row, with
    no more registers and no stack."""
    from tests.ops._sm90 import compile_launches

    records = compile_launches(
        """
        from moekit import settings
        from moekit.ops._triton import decode as DEC
        m = "meta"
        for E, D, F, k, ng in ((128, 2048, 768, 8, None), (256, 7168, 256, 8, 8), (128, 2880, 2880, 4, None)):
            for ldt in (torch.bfloat16, torch.float32):
                for rows in (False, True):
                    with settings.override(knobs={"DECODE_ROUTE_ROWS": rows}):
                        DEC.decode_swiglu(torch.empty(1, D, dtype=torch.bfloat16, device=m),
                                          torch.empty(1, E, dtype=ldt, device=m), torch.empty(E, device=m) if ng else None,
                                          torch.empty(E * 2 * F, D, dtype=torch.float8_e4m3fn, device=m),
                                          torch.empty(E * 2 * F, device=m), F, k, "sigmoid" if ng else "softmax", True, ng,
                                          4 if ng else None, 2.5, False)
        """,
        ["moekit.ops._triton.decode"],
    )
    assert len(records) == 12 and not [r["error"] for r in records if r["error"]], records
    if records[0]["lead_bars"] is None:
        pytest.skip("cuobjdump is not available")
    for i, (one, per_warp) in enumerate(zip(records[::2], records[1::2])):
        c1, c4 = one["constants"], per_warp["constants"]
        assert (c1["ROWS"], c1["PERM_S"]) == ("1", "0"), (i, c1)
        assert (c4["ROWS"], c4["PERM_S"]) == ("4", "16" if i == 3 else "0"), (i, c4)  # (DeepSeek, float32)
        assert not one["stack"] and not per_warp["stack"], i
        assert per_warp["lead_bars"] <= 8 < 18 <= one["lead_bars"], (i, one["lead_bars"], per_warp["lead_bars"])
        assert per_warp["regs"] <= one["regs"], (i, one["regs"], per_warp["regs"])
