"""The MetaShuffling forward built from moekit ops vs the whole-layer reference."""

import logging

import pytest
import torch

from moekit import reference as ref
from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights, route
from moekit.testing import MODEL_SHAPES, assert_close, random_expert_weights


def _cfg(s):
    cfg = s.routing_config
    assert isinstance(cfg, RoutingConfig)
    return cfg


def _small(name, **kw):
    s = MODEL_SHAPES[name]
    from dataclasses import replace

    return replace(s, D=64, F=32, shared_F=32 if s.shared_F else 0, **kw)


CASES = [
    _small("llama4-scout"),
    _small("deepseek-v3", E=16, n_group=4, topk_group=2, top_k=4),
    _small("qwen3-30b-a3b", E=12, top_k=3),
    _small("mixtral-8x7b"),
    _small("tiny", score_func="topk_softmax"),
    _small("qwen3-30b-a3b", E=64, top_k=8),  # decode: the per-token combine at T=1
]


def _shared(x, w):
    if "shared_w13_2FD" not in w:
        return None
    return ref.swiglu_expert(x, w["shared_w13_2FD"], w["shared_w2_DF"]).to(x.dtype)


def _reference(x, w, s):
    return ref.moe_forward(
        x,
        w["router_DE"],
        w["w13_e2FD"],
        w["w2_eDF"],
        top_k=s.top_k,
        score_func=s.score_func,
        renormalize=s.renormalize,
        n_group=s.n_group,
        topk_group=s.topk_group,
        e_score_correction_bias=w.get("e_score_correction_bias"),
        routed_scaling_factor=s.routed_scaling_factor,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
        shared_w13_2FD=w.get("shared_w13_2FD"),
        shared_w2_DF=w.get("shared_w2_DF"),
    )


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.name}-E{s.E}-k{s.top_k}-{s.score_func}")
@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.reference
def test_route_matches_reference_routing(s, T):
    w = random_expert_weights(s, dtype=torch.float32, seed=T)
    x = torch.randn(T, s.D)
    logits = x @ w["router_DE"]
    sel, weights = route(logits, _cfg(s), w.get("e_score_correction_bias"))
    rw, rids = ref.routing_weights(
        logits,
        s.top_k,
        s.score_func,
        s.renormalize,
        n_group=s.n_group,
        topk_group=s.topk_group,
        e_score_correction_bias=w.get("e_score_correction_bias"),
        routed_scaling_factor=s.routed_scaling_factor,
    )
    ids = ref.topk(sel, s.top_k)[1]
    assert torch.equal(ids.sort(dim=1).values, rids.sort(dim=1).values)
    assert_close(weights.gather(1, ids).sort(dim=1).values, rw.sort(dim=1).values)


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.name}-E{s.E}-k{s.top_k}-{s.score_func}")
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.reference
def test_moe_forward_cpu_matches_reference(s, T, deterministic):
    w = random_expert_weights(s, dtype=torch.float32, seed=T)
    x = torch.randn(T, s.D)
    got = moe_forward(
        x,
        w["router_DE"],
        w["w13_e2FD"],
        w["w2_eDF"],
        _cfg(s),
        e_score_correction_bias=w.get("e_score_correction_bias"),
        shared_out_TD=_shared(x, w),
        deterministic=deterministic,
    )
    assert_close(got, _reference(x, w, s), tol=1e-4)


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.name}-E{s.E}-k{s.top_k}-{s.score_func}")
@pytest.mark.parametrize("path", ["decode", "sorted"])
@pytest.mark.reference
def test_moe_forward_cpu_down_sum_matches_reference(s, path):
    """The down projection as stored rows + combine_rows (no scatter-add), both pipelines."""
    from moekit import settings

    w = random_expert_weights(s, dtype=torch.float32, seed=3)
    x = torch.randn(9, s.D)
    with settings.override(down_sum="sum", moe_path=path):
        got = moe_forward(x, w["router_DE"], w["w13_e2FD"], w["w2_eDF"], _cfg(s),
                          e_score_correction_bias=w.get("e_score_correction_bias"), shared_out_TD=_shared(x, w))  # fmt: skip
    assert_close(got, _reference(x, w, s), tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.name}-E{s.E}-k{s.top_k}-{s.score_func}")
@pytest.mark.parametrize("T", [1, 33, 512])
def test_moe_forward_gpu_bf16(s, T):
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=T)
    x = torch.randn(T, s.D, device="cuda").bfloat16()
    got = moe_forward(
        x,
        None,
        w["w13_e2FD"],
        w["w2_eDF"],
        _cfg(s),
        logits_TE=x.float() @ w["router_DE"].float(),  # same routing decisions as the fp32 reference
        e_score_correction_bias=w.get("e_score_correction_bias"),
        shared_out_TD=_shared(x, w),
    )
    want = _reference(x.float(), {k: v.float() for k, v in w.items()}, s)
    assert_close(got.float(), want.float(), dtype=torch.bfloat16, tol=2e-2)


def test_quantize_expert_weights_in_steps_same_bits(monkeypatch):
    """``quantize_expert_weights`` converts a few experts at a time (``_QUANT_STEP_BYTES``): the
    bits and scales of one pass, for a step of one expert and of two (a partial last step)."""
    from moekit.layers import functional
    from moekit.reference.quantize import quantize_rows

    w = (torch.randn(5, 48, 40, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    q0, s0 = quantize_rows(w.float(), eps=1e-12)
    for step in (4 * 48 * 40, 2 * 4 * 48 * 40):
        monkeypatch.setattr(functional, "_QUANT_STEP_BYTES", step)
        q, sc = quantize_expert_weights(w)
        assert q.dtype == torch.float8_e4m3fn and sc.shape == (5, 48)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(sc, s0)


def test_layer_bench_reference_dequantizes_per_expert():
    """The layer benchmark's float32 reference takes FP8 weights as (weights, row scales) and
    dequantizes one expert at a time: the same output as the weights dequantized whole."""
    from moekit.layer_bench import _reference_routed

    g = torch.Generator().manual_seed(2)
    E, F, D, T, k = 4, 16, 32, 6, 2
    w13, w2 = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    q13, s13 = quantize_expert_weights(w13)
    q2, s2 = quantize_expert_weights(w2)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, generator=g)
    whole = _reference_routed(x, q13.float() * s13[..., None], q2.float() * s2[..., None], ids, wts, False)
    per = _reference_routed(x, (q13, s13), (q2, s2), ids, wts, False)
    assert torch.equal(per, whole)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_moe_forward_gpu_fp8(T):
    s = _small("llama4-scout")
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=T)
    x = torch.randn(T, s.D, device="cuda").bfloat16()
    w13q, w13s = quantize_expert_weights(w["w13_e2FD"])
    w2q, w2s = quantize_expert_weights(w["w2_eDF"])
    got = moe_forward(
        x,
        None,
        w13q,
        w2q,
        _cfg(s),
        logits_TE=x.float() @ w["router_DE"].float(),
        shared_out_TD=_shared(x, w),
        w13_scale_e2F=w13s,
        w2_scale_eD=w2s,
    )
    want = _reference(x.float(), {k: v.float() for k, v in w.items()}, s)
    assert_close(got.float(), want.float(), tol=6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name, T", [("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 256), ("deepseek-v3", 256)])
def test_gpu_route_launch_quantize_same_bits(name, T):
    """On the H200 at the models' expert shapes (DeepSeek-V3: its TP8 shard), FP8: the token rows
    quantized by the routing launch (knob ``ROUTE_QUANT``) give the layer's output bit for bit as
    the experts quantizing them (``deterministic=True``: no atomics' order)."""
    from dataclasses import replace

    from moekit import settings
    from moekit.ops.routing import quantize_rides

    s = replace(MODEL_SHAPES[name], shared_F=0, **({"F": 256} if name == "deepseek-v3" else {}))
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=T)
    x = torch.randn(T, s.D, device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    assert quantize_rides(logits, s.top_k, s.n_group, T, s.D)
    w13, w13s = quantize_expert_weights(w["w13_e2FD"])
    w2, w2s = quantize_expert_weights(w["w2_eDF"])
    outs = []
    for on in (False, True):
        with settings.override(knobs={"ROUTE_QUANT": on}):
            outs.append(moe_forward(x, None, w13, w2, _cfg(s), logits_TE=logits, deterministic=True,
                                    e_score_correction_bias=w.get("e_score_correction_bias"), w13_scale_e2F=w13s,
                                    w2_scale_eD=w2s))  # fmt: skip
    assert torch.equal(outs[0], outs[1])


@pytest.mark.reference
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", ["llama4-scout", "deepseek-v3"])
def test_sorted_pipeline_prefill_fused_swiglu_cpu(name, fused, fp8):
    """The sorted pipeline with many rows per expert: gate/up through ``grouped_gemm_swiglu``
    (rows read by index; FP8: token rows quantized once, the SwiGLU output after) or gather ->
    GEMM -> silu_mul, both against the float32 layer (FP8: its dequantized weights)."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu

    s = _small(name, E=4, top_k=2, n_group=None, topk_group=None) if name == "deepseek-v3" else _small(name, E=4)
    T = 400
    w = random_expert_weights(s, dtype=torch.float32, seed=5)
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(5))
    kw = dict(e_score_correction_bias=w.get("e_score_correction_bias"))
    w13, w2 = w["w13_e2FD"], w["w2_eDF"]
    if fp8:
        w13, w13s = quantize_expert_weights(w13)
        w2, w2s = quantize_expert_weights(w2)
        kw.update(w13_scale_e2F=w13s, w2_scale_eD=w2s)
        w = {**w, "w13_e2FD": w13.float() * w13s[..., None], "w2_eDF": w2.float() * w2s[..., None]}
    with settings.override(sorted_swiglu=fused, moe_path="sorted"):
        assert _fused_swiglu(T * s.top_k, s.E, s.F, s.D, fp8, 1 if fp8 else 4, x.device) is fused
        got = moe_forward(x, w["router_DE"], w13, w2, _cfg(s), **kw)
    routed = {k: v for k, v in w.items() if not k.startswith("shared")}
    assert_close(got.float(), _reference(x, routed, s), tol=6e-2 if fp8 else 1e-4)


@pytest.mark.reference
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_fp8_stream_swiglu_knob_cpu(name):
    """Knob ``FP8_STREAM_SWIGLU``: the FP8 sorted pipeline at streaming sizes (a few rows per
    expert) takes ``grouped_gemm_swiglu`` (token rows quantized once, read by index); off, the
    gathered copy and ``silu_mul_quant``. Both against the float32 layer on the dequantized
    weights."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu

    s = _small(name, E=16, top_k=4, n_group=None, topk_group=None) if name == "deepseek-v3" else _small(name, E=16)
    T = 24  # 96 rows over 16 experts: 6 per expert, the streaming kernel's range
    w = random_expert_weights(s, dtype=torch.float32, seed=9)
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(9))
    w13, w13s = quantize_expert_weights(w["w13_e2FD"])
    w2, w2s = quantize_expert_weights(w["w2_eDF"])
    kw = dict(e_score_correction_bias=w.get("e_score_correction_bias"), w13_scale_e2F=w13s, w2_scale_eD=w2s)
    deq = {**w, "w13_e2FD": w13.float() * w13s[..., None], "w2_eDF": w2.float() * w2s[..., None]}
    routed = {k: v for k, v in deq.items() if not k.startswith("shared")}
    want = _reference(x, routed, s)
    for on in (False, True):
        with settings.override(moe_path="sorted", knobs={"FP8_STREAM_SWIGLU": on}):
            assert _fused_swiglu(T * s.top_k, s.E, s.F, s.D, True, 1, x.device) is on
            # 16-bit weights follow their own knob (BF16_STREAM_SWIGLU), not this one
            assert _fused_swiglu(T * s.top_k, s.E, s.F, s.D, False, 4, x.device)
            got = moe_forward(x, w["router_DE"], w13, w2, _cfg(s), **kw)
        assert_close(got.float(), want, tol=6e-2, msg=f"FP8_STREAM_SWIGLU={on}")


@pytest.mark.reference
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_gathered_swiglu_knob_cpu(fp8):
    """Knob ``GATHERED_SWIGLU`` (0 / 1 / 2): which gate/up the sorted pipeline runs at the tiled
    kernel's sizes (128 rows per expert here), and the layer against the float32 layer each way.
    Mode 1 changes only where the rows are gathered (the wide rows of gpt-oss-120b: D = F = 2880,
    the balance rule of ``_fused_swiglu``); mode 2 also where the fused kernel read them by index;
    the default (-1) takes 16-bit weights with top-k >= 2."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu, _gathered_swiglu

    s = _small("qwen3-30b-a3b", E=8, top_k=2)
    T = 512  # 1024 rows over 8 experts
    M, e = T * s.top_k, 1 if fp8 else 4
    dev = torch.device("cpu")
    # the default rule: 16-bit weights with top-k >= 2
    assert _gathered_swiglu(2 * 2880, 4, 2880, 2880, fp8, e, dev, top_k=2) is not fp8
    assert _gathered_swiglu(2 * 2880, 4, 2880, 2880, fp8, e, dev, top_k=1) is False
    for knob, fused, gathered in ((0, True, False), (1, True, True), (2, False, True)):
        with settings.override(knobs={"GATHERED_SWIGLU": knob}):
            assert _fused_swiglu(M, s.E, s.F, s.D, fp8, e, dev) is fused
            assert _gathered_swiglu(M, s.E, s.F, s.D, fp8, e, dev) is gathered  # (reached when not fused)
            assert _fused_swiglu(2 * 2880, 4, 2880, 2880, fp8, e, dev) is False  # wide rows: gathered
            assert _gathered_swiglu(2 * 2880, 4, 2880, 2880, fp8, e, dev) is (knob > 0)
            assert _gathered_swiglu(8, 4, 2880, 2880, fp8, e, dev) is False  # streaming sizes: the GEMM
    w = random_expert_weights(s, dtype=torch.float32, seed=3)
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(3))
    w13, w2, kw = w["w13_e2FD"], w["w2_eDF"], {}
    if fp8:
        w13, w13s = quantize_expert_weights(w13)
        w2, w2s = quantize_expert_weights(w2)
        kw = dict(w13_scale_e2F=w13s, w2_scale_eD=w2s)
        w = {**w, "w13_e2FD": w13.float() * w13s[..., None], "w2_eDF": w2.float() * w2s[..., None]}
    routed = {k: v for k, v in w.items() if not k.startswith("shared")}
    want = _reference(x, routed, s)
    for knob in (0, 2):
        with settings.override(moe_path="sorted", knobs={"GATHERED_SWIGLU": knob}):
            got = moe_forward(x, w["router_DE"], w13, w2, _cfg(s), **kw)
        assert_close(got.float(), want, tol=6e-2 if fp8 else 1e-4, msg=f"GATHERED_SWIGLU={knob}")


@pytest.mark.reference
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_bf16_stream_swiglu_knob_cpu(name):
    """Knob ``BF16_STREAM_SWIGLU``: the 16-bit sorted pipeline at streaming sizes takes
    ``grouped_gemm_swiglu`` (token rows read by index, SiLU * up in the epilogue); off, the
    gathered copy, the GEMM and ``silu_mul``. Both against the float32 layer; FP8 weights are
    untouched by it."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu
    from moekit.ops._triton.gg_swiglu import swiglu_config

    s = _small(name, E=16, top_k=4, n_group=None, topk_group=None) if name == "deepseek-v3" else _small(name, E=16)
    T = 24  # 96 rows over 16 experts: 6 per expert, the streaming kernel's range
    w = random_expert_weights(s, dtype=torch.float32, seed=9)  # the CPU path's 16/32-bit rule is the same
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(9))
    kw = dict(e_score_correction_bias=w.get("e_score_correction_bias"))
    routed = {k: v for k, v in w.items() if not k.startswith("shared")}
    want = _reference(x, routed, s)
    M = T * s.top_k
    for on in (False, True):
        with settings.override(moe_path="sorted", knobs={"BF16_STREAM_SWIGLU": on}):
            assert _fused_swiglu(M, s.E, s.F, s.D, False, 4, x.device) is on
            assert _fused_swiglu(M, s.E, s.F, s.D, True, 1, x.device)
            cfg = swiglu_config(M, s.F, s.D, s.E, False, 4, 132)
            assert cfg.kind == "stream"
            got = moe_forward(x, w["router_DE"], w["w13_e2FD"], w["w2_eDF"], _cfg(s), **kw)
        assert_close(got.float(), want, tol=1e-4, msg=f"BF16_STREAM_SWIGLU={on}")


@pytest.mark.reference
@pytest.mark.interpreter
def test_route_quant_knob_same_bits():
    """Knob ``ROUTE_QUANT`` (on by default): the FP8 sorted pipeline's token rows quantized by
    the routing launch's extra programs (the route kernel in the interpreter) give the layer
    output bit for bit as ``run_experts`` quantizing them itself; ``x_fp8`` where the experts do
    not quantize the token rows is a ValueError."""
    from moekit import settings
    from moekit.layers.experts import quantizes_token_rows, run_experts

    s = _small("qwen3-30b-a3b", E=16)
    T = 24
    w = random_expert_weights(s, dtype=torch.float32, seed=4)
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    w13, w13s = quantize_expert_weights(w["w13_e2FD"])
    w2, w2s = quantize_expert_weights(w["w2_eDF"])
    kw = dict(w13_scale_e2F=w13s, w2_scale_eD=w2s)
    outs = []
    for on in (True, False):
        with settings.override(moe_path="sorted", knobs={"ROUTE_QUANT": on}):
            assert quantizes_token_rows(x, w13, T * s.top_k, s.top_k)
            outs.append(moe_forward(x, w["router_DE"].to(torch.bfloat16), w13, w2, _cfg(s), **kw))
    assert torch.equal(outs[0], outs[1])
    with settings.override(moe_path="decode"):
        assert not quantizes_token_rows(x, w13, T * s.top_k, s.top_k)
    assert not quantizes_token_rows(x, w["w13_e2FD"], T * s.top_k, s.top_k)  # 16-bit weights
    m = torch.zeros(s.E, dtype=torch.int32)
    with pytest.raises(ValueError, match="x_fp8 is taken only"):
        run_experts(x, w["w13_e2FD"].to(torch.bfloat16), w["w2_eDF"].to(torch.bfloat16), m,
                    token_ids=torch.zeros(T * s.top_k, dtype=torch.int32),
                    expert_ids=torch.zeros(T * s.top_k, dtype=torch.int32), x_fp8=(x, x))  # fmt: skip


@pytest.mark.reference
def test_down_sum_rule():
    """``auto``: stored rows + per-token sums for ``deterministic`` and from
    ``DOWN_SUM_MIN_ROWS`` rows of top-k >= 2 (never for top-1, whose rows need no sum); the
    setting's ``atomic`` / ``sum`` win over both."""
    from moekit import settings
    from moekit.layers.experts import DOWN_SUM_MIN_ROWS, down_sums_rows

    big = DOWN_SUM_MIN_ROWS
    assert down_sums_rows(False, big, 8) and down_sums_rows(True, 16, 8) and down_sums_rows(True, big, 1)
    assert not down_sums_rows(False, big - 1, 8) and not down_sums_rows(False, 4 * big, 1)
    with settings.override(down_sum="atomic"):
        assert not down_sums_rows(True, big, 8)
    with settings.override(down_sum="sum"):
        assert down_sums_rows(False, 16, 1)


@pytest.mark.reference
def test_down_sum_rule_with_column_slabs(pin_knobs):
    """Where the scatter-add's tiles take column slabs (DeepSeek-V3 TP8's down GEMM: K = 256,
    D = 7168) its rows stay scatter-added up to ``DOWN_SUM_MIN_ROWS_SLABS`` - 1 rows (T = 16384 at
    top-8), stored from there; other shapes keep ``DOWN_SUM_MIN_ROWS``. ``will_store_rows`` and
    ``_down_mode`` agree; knob GG_N_SLAB=0 (no slabs) and a pinned DOWN_SUM_MIN_ROWS restore the
    plain bound."""
    from moekit.layers import experts

    big, slab_big = experts.DOWN_SUM_MIN_ROWS, experts.DOWN_SUM_MIN_ROWS_SLABS
    assert slab_big > big

    def mode(T, k, D, F, fp8=False, dtype=torch.bfloat16):
        out = torch.empty(T, D, dtype=dtype, device="meta")
        stored = experts.will_store_rows(out, T * k, 256, k, fp8, path="sorted", down_k=F)
        got = experts._down_mode(out, True, torch.bfloat16, T * k, 256, k, False, False, F, 1 if fp8 else 2)
        assert stored == (got == "rows"), (T, k, D, F)
        return got

    for fp8 in (False, True):
        assert mode(4096, 8, 7168, 256, fp8) == "scatter"  # 32768 rows: slabs keep the atomics
        assert mode(8192, 8, 7168, 256, fp8) == "scatter"
        assert mode(16384, 8, 7168, 256, fp8) == "scatter"
        assert mode(16385, 8, 7168, 256, fp8) == "rows"
        assert mode(4096, 8, 2048, 768, fp8) == "rows"  # Qwen3-30B: no slabs, the plain bound
        assert mode(8192, 4, 2880, 2880, fp8) == "rows"  # gpt-oss-120b
    assert mode(slab_big // 8, 8, 7168, 256) == "scatter" and mode(-(-slab_big // 8), 8, 7168, 256) == "rows"
    assert mode(4095, 8, 2048, 768) == "scatter"
    pin_knobs(GG_N_SLAB=0)
    assert mode(4096, 8, 7168, 256) == "rows"
    pin_knobs(GG_N_SLAB=-1, DOWN_SUM_MIN_ROWS=big)
    assert mode(4096, 8, 7168, 256) == "rows"


@pytest.mark.reference
@pytest.mark.parametrize("min_rows", [900, 901], ids=["sum", "atomic"])
def test_sorted_pipeline_many_rows_sums_down_rows_cpu(min_rows):
    """From ``DOWN_SUM_MIN_ROWS`` rows (the knob pinned around a small layer's 900) the sorted
    pipeline's down projection stores its rows and sums them per token, below it scatter-adds:
    the float32 layer's result either way."""
    from moekit import settings
    from moekit.layers import experts

    s = _small("qwen3-30b-a3b", E=6, top_k=3)
    w = random_expert_weights(s, dtype=torch.float32, seed=7)
    x = torch.randn(300, s.D, generator=torch.Generator().manual_seed(7))
    calls = []
    real = experts.combine_rows
    try:
        experts.combine_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
        with settings.override(moe_path="sorted", knobs={"DOWN_SUM_MIN_ROWS": min_rows}):
            got = moe_forward(x, w["router_DE"], w["w13_e2FD"], w["w2_eDF"], _cfg(s))
    finally:
        experts.combine_rows = real
    assert calls == ([1] if min_rows <= 900 else [])
    routed = {k: v for k, v in w.items() if not k.startswith("shared")}
    assert_close(got.float(), _reference(x, routed, s), tol=1e-4)


@pytest.mark.reference
def test_run_experts_into_an_empty_out_every_down_mode():
    """``out_empty=True`` (out full of NaN here): the summed rows stored into it, the per-token
    combine and the scatter-add into it zeroed first; each down-projection mode gives the layer's
    result. ``will_store_rows`` names the stored mode beforehand."""
    from moekit import settings
    from moekit.layers import experts
    from moekit.ops import route_and_shuffle

    s = _small("qwen3-30b-a3b", E=64, top_k=8)
    cfg = _cfg(s)
    w = random_expert_weights(s, dtype=torch.float32, seed=8)
    T = 1  # 8 rows over 64 experts: the decode pipeline's per-token combine pays
    x = torch.randn(T, s.D, generator=torch.Generator().manual_seed(8))
    logits = x @ w["router_DE"]
    counts, eidx, tidx, rw, srow = route_and_shuffle(logits, s.top_k, cfg.score_func, cfg.renormalize)
    want = _reference(x, {k: v for k, v in w.items() if not k.startswith("shared")}, s)
    N = T * s.top_k
    cases = (("decode", False, {}, "combine"), ("decode", True, {"DOWN_SUM_MIN_ROWS": 1 << 30}, "combine"),
             ("sorted", True, {}, "rows"), ("sorted", False, {"DOWN_SUM_MIN_ROWS": 1}, "rows"),
             ("sorted", False, {}, "scatter"))  # fmt: skip
    for path, det, knobs, mode in cases:
        with settings.override(moe_path=path, knobs=knobs):
            out = torch.full((T, s.D), float("nan"))
            decode = experts.choose_path(N, s.E, top_k=s.top_k) == "decode"
            F = w["w2_eDF"].shape[-1]
            assert experts._down_mode(out, True, out.dtype, N, s.E, s.top_k, decode, det, F, 4) == mode, (path, det)
            assert experts.will_store_rows(out, N, s.E, s.top_k, False, det, down_k=F) == (mode == "rows")
            got = experts.run_experts(
                x, w["w13_e2FD"], w["w2_eDF"], counts[: s.E], token_ids=tidx, expert_ids=eidx, row_weights=rw,
                selection_rows=srow, weight_on_input=cfg.apply_router_weight_on_input, out=out, out_empty=True,
                deterministic=det,
            )  # fmt: skip
        assert got is out
        assert_close(got, want, tol=1e-4)


@pytest.mark.reference
def test_combine_min_top_k_knob_takes_the_per_token_combine():
    """Top-4 decode rows take the scatter-add GEMV by default and the per-token combine with the
    ``COMBINE_MIN_TOP_K`` knob pinned below 4; both give the layer's result."""
    from moekit import settings
    from moekit.layers import experts

    s = _small("gpt-oss-120b", E=32, top_k=4)
    w = random_expert_weights(s, dtype=torch.float32, seed=3)
    x = torch.randn(1, s.D, generator=torch.Generator().manual_seed(3))
    want = _reference(x, {k: v for k, v in w.items() if not k.startswith("shared")}, s)
    out = torch.empty(1, s.D)
    for knobs, mode in (({}, "scatter"), ({"COMBINE_MIN_TOP_K": 4}, "combine")):
        with settings.override(moe_path="decode", knobs=knobs):
            assert experts._down_mode(out, True, out.dtype, s.top_k, s.E, s.top_k, True, False, s.F, 4) == mode
            got = moe_forward(x, w["router_DE"], w["w13_e2FD"], w["w2_eDF"], _cfg(s))
        assert_close(got, want, tol=1e-4)


@pytest.mark.gpu
def test_moe_forward_gpu_cuda_graph_replay():
    s = _small("qwen3-30b-a3b", E=12, top_k=3)
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
    x = torch.randn(64, s.D, device="cuda").bfloat16()
    fwd = lambda: moe_forward(  # noqa: E731
        x, None, w["w13_e2FD"], w["w2_eDF"], _cfg(s), logits_TE=x.float() @ w["router_DE"].float()
    )
    fwd()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fwd()
    for seed in range(3):
        x.copy_(torch.randn(64, s.D, generator=torch.Generator().manual_seed(seed)).bfloat16())
        g.replay()
        want = _reference(x.float(), {k: v.float() for k, v in w.items()}, s)
        assert_close(out.float(), want.float(), dtype=torch.bfloat16, tol=2e-2)


# ----------------------------------------------------------------------------------------------
# GPU tier: the decode and sorted pipelines at the benchmark's model sizes
# ----------------------------------------------------------------------------------------------

DECODE_MODELS = ["qwen3-30b-a3b", "deepseek-v3-tp8", "gpt-oss-120b", "llama4-scout"]
_WEIGHTS: dict = {}
# The full-size tests hold one model's weights (bf16, FP8 and dequantized copies: 30-40 GB for
# gpt-oss-120b) per pytest worker: four workers each holding one ran an H200 out of memory
# (session 15). With ``--dist loadgroup`` (scripts/device_session.sh) they all run on one worker.
FULL_SIZE = pytest.mark.xdist_group("full_size_models")


def _gpu_weights(name, fp8):
    """Random weights of a full-size model shape, made on the GPU (cached per model)."""
    key = (name, fp8)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        s = MODEL_SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *d, fan: (torch.randn(*d, generator=g, device="cuda") / fan**0.5).bfloat16()  # noqa: E731
        w = {"router_DE": rnd(s.D, s.E, fan=s.D), "w13_e2FD": rnd(s.E, 2 * s.F, s.D, fan=s.D),
             "w2_eDF": rnd(s.E, s.D, s.F, fan=s.F)}  # fmt: skip
        if s.n_group is not None:
            w["e_score_correction_bias"] = torch.rand(s.E, generator=g, device="cuda") * 0.1
        if fp8:  # quantized 16 experts at a time: the float32 copy of a whole gpt-oss w13 is 8.5 GB

            def quant(t):
                parts = [quantize_expert_weights(t[i : i + 16]) for i in range(0, t.shape[0], 16)]
                return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

            w13q, w13s = quant(w["w13_e2FD"])
            w2q, w2s = quant(w["w2_eDF"])
            w.update(w13q=w13q, w13s=w13s, w2q=w2q, w2s=w2s)
            # the reference multiplies the dequantized weights
            w["w13_e2FD"] = (w13q.float() * w13s[..., None]).bfloat16()
            w["w2_eDF"] = (w2q.float() * w2s[..., None]).bfloat16()
        _WEIGHTS[key] = w
    return _WEIGHTS[key]


def _reference_hit(x, w, s, logits):
    """The float32 routed experts, converting only the hit experts' weights (full-size models)."""
    from moekit.layer_bench import _reference_routed

    wts, ids = ref.routing_weights(logits, s.top_k, s.score_func, s.renormalize, n_group=s.n_group,
                                   topk_group=s.topk_group, e_score_correction_bias=w.get("e_score_correction_bias"),
                                   routed_scaling_factor=s.routed_scaling_factor)  # fmt: skip
    return _reference_routed(x, w["w13_e2FD"], w["w2_eDF"], ids, wts, s.apply_router_weight_on_input)


def _forward(s, w, x, logits, fp8, **kw):
    if fp8:
        return moe_forward(
            x,
            None,
            w["w13q"],
            w["w2q"],
            _cfg(s),
            logits_TE=logits,
            w13_scale_e2F=w["w13s"],
            w2_scale_eD=w["w2s"],
            e_score_correction_bias=w.get("e_score_correction_bias"),
            **kw,
        )
    return moe_forward(x, None, w["w13_e2FD"], w["w2_eDF"], _cfg(s), logits_TE=logits,
                       e_score_correction_bias=w.get("e_score_correction_bias"), **kw)  # fmt: skip


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODE_MODELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 256])
def test_gpu_decode_and_sorted_pipelines_match_reference(name, fp8, T):
    """Both pipelines at full model sizes against the float32 layer (dequantized FP8 weights):
    bf16 within 2e-2; FP8 weight-only (decode) within 2e-2, FP8 activations (sorted) within 8e-2."""
    from moekit import settings

    s = MODEL_SHAPES[name]
    w = _gpu_weights(name, fp8)
    x = torch.randn(T, s.D, generator=torch.Generator(device="cuda").manual_seed(T), device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    want = _reference_hit(x, w, s, logits)
    for path, tol in (("decode", 2e-2), ("sorted", 8e-2 if fp8 else 2e-2)):
        # the down projection's scatter-add and its stored rows + combine_rows, where they differ
        for down in ("atomic", "sum") if T >= 64 else ("auto",):
            with settings.override(moe_path=path, down_sum=down):
                got = _forward(s, w, x, logits, fp8)
            assert_close(got.float(), want, tol=tol, msg=f"{name} T={T} {path} down={down}")


def _prefill_case(name, fp8, seed):
    """A prefill batch of about 64 rows per expert (the tiled kernel's range) for a model's shapes:
    ``(shapes, T, weights, x, logits, the float32 layer's output)``."""
    s = MODEL_SHAPES[name]
    T = max(1024, 64 * s.E // s.top_k)
    w = _gpu_weights(name, fp8)
    x = torch.randn(T, s.D, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    return s, T, w, x, logits, _reference_hit(x, w, s, logits)


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODE_MODELS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_sorted_prefill_fused_swiglu_matches_reference(name, fp8):
    """Prefill-sized batches (64-512 rows per expert): the sorted pipeline with the gate/up GEMM
    fused (rows by index, SwiGLU epilogue) and unfused, against the float32 layer."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu

    s, T, w, x, logits, want = _prefill_case(name, fp8, seed=7)
    for fused in (True, False):
        with settings.override(sorted_swiglu=fused):
            # gpt-oss's and Scout's wide rows: the unfused GEMM's TMA tiles win (FUSED_SWIGLU_MIN_SAVING)
            expect = fused and name not in ("llama4-scout", "gpt-oss-120b")
            assert _fused_swiglu(T * s.top_k, s.E, s.F, s.D, fp8, 1 if fp8 else 2, x.device) is expect
            got = _forward(s, w, x, logits, fp8)
        assert_close(got.float(), want, tol=8e-2 if fp8 else 2e-2, msg=f"{name} fused={fused}")


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("name,mode", [("gpt-oss-120b", 1), ("llama4-scout", 1), ("qwen3-30b-a3b", 2)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_gathered_swiglu_matches_reference(name, mode, fp8):
    """Knob ``GATHERED_SWIGLU``: the gathered rows' gate/up through ``grouped_gemm_swiglu`` (row
    tiles through TMA, SiLU * up in the epilogue) where the sorted pipeline gathers (mode 1: the
    wide rows of gpt-oss-120b and Scout) or instead of the fused kernel's rows by index (mode 2:
    Qwen3-30B), against the float32 layer and the knob off on the same rows."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu, _gathered_swiglu

    s, T, w, x, logits, want = _prefill_case(name, fp8, seed=5)
    M, e = T * s.top_k, 1 if fp8 else 2
    outs = {}
    for knob in (0, mode):
        with settings.override(moe_path="sorted", knobs={"GATHERED_SWIGLU": knob}):
            assert _fused_swiglu(M, s.E, s.F, s.D, fp8, e, x.device) is (name == "qwen3-30b-a3b" and knob < 2)
            assert _gathered_swiglu(M, s.E, s.F, s.D, fp8, e, x.device) is (knob > 0)
            outs[knob] = _forward(s, w, x, logits, fp8)
        assert_close(outs[knob].float(), want, tol=8e-2 if fp8 else 2e-2, msg=f"{name} GATHERED_SWIGLU={knob}")
    assert_close(outs[mode].float(), outs[0].float(), tol=8e-2 if fp8 else 2e-2, msg=f"{name} knob on vs off")


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3-tp8"])
@pytest.mark.parametrize("T", [16, 256, 1024])
def test_gpu_bf16_stream_swiglu_matches_reference(name, T):
    """Knob ``BF16_STREAM_SWIGLU`` (the bf16 sorted pipeline at streaming sizes through
    ``grouped_gemm_swiglu``'s streaming kernel, rows read by index) against the float32 layer,
    and against the unfused pipeline on the same rows."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu
    from moekit.ops._triton.gg_config import heuristic_config

    s = MODEL_SHAPES[name]
    w = _gpu_weights(name, False)
    x = torch.randn(T, s.D, generator=torch.Generator(device="cuda").manual_seed(11), device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    want = _reference_hit(x, w, s, logits)
    M = T * s.top_k
    stream = heuristic_config(M, s.F, s.D, s.E, False, 2, torch.cuda.get_device_properties(0).multi_processor_count,
                              persist=False).kind == "stream"  # fmt: skip
    outs = {}
    for on in (False, True):
        with settings.override(moe_path="sorted", knobs={"BF16_STREAM_SWIGLU": on}):
            outs[on] = _forward(s, w, x, logits, False)
            if stream:
                assert _fused_swiglu(M, s.E, s.F, s.D, False, 2, x.device) is on
        assert_close(outs[on].float(), want, tol=2e-2, msg=f"{name} T={T} BF16_STREAM_SWIGLU={on}")
    assert_close(outs[True].float(), outs[False].float(), tol=2e-2, msg=f"{name} T={T} fused vs unfused")


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODE_MODELS)
@pytest.mark.parametrize("T", [16, 256])
def test_gpu_fp8_stream_swiglu_matches_reference(name, T):
    """Knob ``FP8_STREAM_SWIGLU`` (the FP8 sorted pipeline at streaming sizes through
    ``grouped_gemm_swiglu``'s streaming kernel, FP8 rows read by index) against the float32
    layer, and against the unfused pipeline on the same rows."""
    from moekit import settings
    from moekit.layers.experts import _fused_swiglu

    s = MODEL_SHAPES[name]
    w = _gpu_weights(name, True)
    x = torch.randn(T, s.D, generator=torch.Generator(device="cuda").manual_seed(11), device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    want = _reference_hit(x, w, s, logits)
    outs = {}
    for on in (False, True):
        with settings.override(moe_path="sorted", knobs={"FP8_STREAM_SWIGLU": on}):
            assert _fused_swiglu(T * s.top_k, s.E, s.F, s.D, True, 1, x.device) is on
            outs[on] = _forward(s, w, x, logits, True)
        assert_close(outs[on].float(), want, tol=8e-2, msg=f"{name} T={T} FP8_STREAM_SWIGLU={on}")
    assert_close(outs[True].float(), outs[False].float(), tol=3e-2, msg=f"{name} T={T} fused vs unfused")


@FULL_SIZE
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_cuda_graph_replays_new_routing_and_is_deterministic(fp8):
    s = MODEL_SHAPES["qwen3-30b-a3b"]
    w = _gpu_weights(s.name, fp8)
    x = torch.randn(4, s.D, device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    fwd = lambda: _forward(s, w, x, logits, fp8)  # noqa: E731
    fwd()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fwd()
    # T=4 with FP8 weights takes the sorted pipeline (FP8 activations): the oracle's FP8 tolerance
    tol = 8e-2 if fp8 else 2e-2
    for seed in range(3):
        x.copy_(torch.randn(4, s.D, generator=torch.Generator().manual_seed(seed)).bfloat16())
        logits.copy_(x.float() @ w["router_DE"].float())
        g.replay()
        assert_close(out.float(), _reference_hit(x, w, s, logits), tol=tol, msg=f"replay {seed}")
    a = _forward(s, w, x, logits, fp8, deterministic=True)
    b = _forward(s, w, x, logits, fp8, deterministic=True)
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_decode_compiles_fullgraph():
    s = _small("qwen3-30b-a3b", E=12, top_k=3)
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
    x = torch.randn(3, s.D, device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, l: moe_forward(x, None, w["w13_e2FD"], w["w2_eDF"], _cfg(s), logits_TE=l),
                       fullgraph=True)  # fmt: skip
    assert_close(fn(x, logits).float(), _reference(x.float(), {k: v.float() for k, v in w.items()}, s), tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_compiled_prefill_makes_its_descriptors(pin_knobs, dtype):
    """Knob ``GG_DEVICE_TMA``: 1, torch.compile(fullgraph=True) of the sorted pipeline at a
    prefill size (Qwen3-30B's routing, experts scaled down, 512 rows per expert: the tiled
    kernels) traces its TMA launches with the descriptors made in the kernel (``DEV_TMA``, the
    tensors passed), and its output matches eager's; 2, the eager layer (the same kernels that
    take host descriptors by default) gives the default's bits (``deterministic=True``: no atomics),
    CUDA-graph replays included; knob ``GG_TRACED_HOST``, the compiled graph launches the tiled
    kernels at run time with host descriptors."""
    from dataclasses import replace

    from moekit.ops._triton import gg_swiglu as SW
    from moekit.ops._triton import grouped_gemm as GG
    from tests.ops.test_grouped_gemm import _spy_launches

    s = replace(MODEL_SHAPES["qwen3-30b-a3b"], D=512, F=256, E=16)
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=3)
    fp8 = dtype == "fp8"
    if fp8:
        (w13, w13s), (w2, w2s) = quantize_expert_weights(w["w13_e2FD"]), quantize_expert_weights(w["w2_eDF"])
        kw = dict(w13_scale_e2F=w13s, w2_scale_eD=w2s)
    else:
        w13, w2, kw = w["w13_e2FD"], w["w2_eDF"], {}
    x = torch.randn(1024, s.D, device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()

    def f(x, l, det=False):
        return moe_forward(x, None, w13, w2, s.routing_config, logits_TE=l, deterministic=det, **kw)

    want = f(x, logits)
    bits = f(x, logits, True)  # (bit for bit: the deterministic sum, no atomics)
    pin_knobs(GG_DEVICE_TMA=2)
    assert torch.equal(f(x, logits, True), bits)
    out = torch.empty_like(want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(f(x, logits, True))
    g.replay()
    assert torch.equal(out, bits)
    pin_knobs(GG_DEVICE_TMA=1, GG_TRACED_HOST=0)
    seen, gave_up = [], []
    origs = [_spy_launches(GG, seen), _spy_launches(SW, seen)]
    # inductor's analysis of what a kernel writes, where it fails, takes every tensor as written
    # and clones and copies back the weights (torch 2.11, the paired SwiGLU tile, session 45)
    log = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap")
    handler = logging.Handler()
    handler.emit = lambda r: gave_up.append(r.getMessage()) if "Encountered an exception" in r.getMessage() else None
    log.addHandler(handler)
    try:
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(x, logits, True)
    finally:
        GG.launch, SW.launch = origs
        log.removeHandler(handler)
    assert not gave_up, gave_up
    tma = [r for r in seen if r[2]]  # the launches through TMA, traced: descriptors made in the kernel
    assert {r[0] for r in tma} >= {"_gg_tiled_kernel", "_swiglu_tiled_kernel"} and all(r[1] for r in tma), seen
    # Against eager's deterministic sum (H100, session 45: the atomic sums of two runs differed by
    # 1.4% of the largest output in bf16, one rounding of eight adds in another order).
    err = ((got.float() - bits.float()).abs().max() / bits.float().abs().max()).item()
    assert err < (8e-2 if fp8 else 1e-2), err  # (FP8: a rounding flip of the activations' quantization)
    # knob GG_TRACED_HOST: the graph launches those kernels at run time, with host descriptors
    pin_knobs(GG_TRACED_HOST=1)
    seen.clear()
    origs = [_spy_launches(GG, seen), _spy_launches(SW, seen)]
    try:
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(x, logits, True)
    finally:
        GG.launch, SW.launch = origs
    tma = [r for r in seen if r[2]]
    assert {r[0] for r in tma} >= {"_gg_tiled_kernel", "_swiglu_tiled_kernel"}, seen
    assert all(r[1] is False and r[5] == "TensorDescriptor" for r in tma if "tiled" in r[0]), seen
    err = ((got.float() - bits.float()).abs().max() / bits.float().abs().max()).item()
    assert err < (8e-2 if fp8 else 1e-2), err


# The first moekit call of a process, made under torch.compile: every lazily filled cache
# (multiprocessor count, L2 size, compiled kernels) is filled while Dynamo traces. Session 37 found
# torch 2.11 failing such a compile ("Guard failed on the same frame it was created") on the
# multiprocessor-count cache, which a test run that had made an eager call first never showed.
_FRESH_COMPILE = """
import sys, torch
from dataclasses import replace
from moekit.layers.functional import moe_forward, quantize_expert_weights
from moekit.testing import MODEL_SHAPES, random_expert_weights
s = replace(MODEL_SHAPES["qwen3-30b-a3b"], D=256, F=128, E=16)
w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
fp8 = sys.argv[1] == "fp8"
if fp8:
    (w13, w13s), (w2, w2s) = quantize_expert_weights(w["w13_e2FD"]), quantize_expert_weights(w["w2_eDF"])
    kw = dict(w13_scale_e2F=w13s, w2_scale_eD=w2s)
else:
    w13, w2, kw = w["w13_e2FD"], w["w2_eDF"], {}
fn = torch.compile(lambda x, l: moe_forward(x, None, w13, w2, s.routing_config, logits_TE=l, **kw), fullgraph=True)
for T in (3, 512):  # the decode pipeline, then the sorted one
    x = torch.randn(T, s.D, device="cuda").bfloat16()
    logits = x.float() @ w["router_DE"].float()
    got = fn(x, logits)
    want = moe_forward(x, None, w13, w2, s.routing_config, logits_TE=logits, **kw)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
    assert err < (8e-2 if fp8 else 1e-2), (T, err)  # FP8: a rounding flip of the activations' quantization
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_first_call_under_compile_fresh_process(dtype):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", _FRESH_COMPILE, dtype], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-4000:])


@pytest.mark.reference
def test_choose_path_size_rules():
    """The measured bounds (RESULTS.md session 8): bf16 top-8 decode up to 2048 rows spread thin,
    top-1 / top-4 and FP8 only at GEMV sizes; a pinned path wins."""
    from moekit import settings
    from moekit.layers.experts import choose_path

    assert choose_path(2048, 128, top_k=8) == "decode"  # Qwen3-30B T=256
    assert choose_path(4096, 128, top_k=8) == "sorted"  # past decode_max_rows
    assert choose_path(4096, 128, top_k=8, max_rows=4096) == "decode"  # an eager caller's bound
    assert choose_path(2048, 16, top_k=8) == "sorted"  # 128 rows per expert
    assert choose_path(64, 128, top_k=4) == "sorted" and choose_path(4, 128, top_k=4) == "decode"
    assert choose_path(2048, 128, fp8=True, top_k=8) == "sorted" and choose_path(8, 128, fp8=True, top_k=8) == "decode"
    with settings.override(moe_path="sorted"):
        assert choose_path(1, 128, top_k=8) == "sorted"
    with pytest.raises(ValueError, match="path"):
        choose_path(1, 128, path="fast")
