"""The MetaShuffling forward built from moekit ops vs the whole-layer reference."""

import pytest
import torch

from moekit import reference as ref
from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights, route
from moekit.testing import MODEL_SHAPES, assert_close, random_expert_weights


def _cfg(s):
    return RoutingConfig(
        top_k=s.top_k,
        score_func=s.score_func,
        renormalize=s.renormalize,
        n_group=s.n_group,
        topk_group=s.topk_group,
        routed_scaling_factor=s.routed_scaling_factor,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
    )


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


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_moe_forward_gpu_fp8(T):
    s = _small("llama4-scout")
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=T)
    x = torch.randn(T, s.D, device="cuda").bfloat16()
    w13q, w13s = quantize_expert_weights(w["w13_e2FD"])
    w2q, w2s = quantize_expert_weights(w["w2_eDF"])
    got = moe_forward(
        x, None, w13q, w2q, _cfg(s), logits_TE=x.float() @ w["router_DE"].float(),
        shared_out_TD=_shared(x, w), w13_scale_e2F=w13s, w2_scale_eD=w2s,
    )
    want = _reference(x.float(), {k: v.float() for k, v in w.items()}, s)
    assert_close(got.float(), want.float(), tol=6e-2)


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
