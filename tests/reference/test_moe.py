"""The whole-layer oracle (moe_forward, swiglu_expert) against a per-token loop."""

from __future__ import annotations

import pytest
import torch

from moekit import reference as ref
from moekit.testing import MODEL_SHAPES, ModelShape, assert_close, random_expert_weights, rel_error
from tests.reference import _naive as naive

pytestmark = pytest.mark.reference


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def naive_moe(x_TD, p, s: ModelShape, top_k, apply_on_input, use_shared=True):
    """Token by token: router logits, routing, each selected expert's SwiGLU, weighted sum,
    plus the shared expert."""
    D = x_TD.shape[-1]
    xs = x_TD.float().reshape(-1, D).double().tolist()
    router_ED = p["router_DE"].double().T.tolist()
    w13 = p["w13_e2FD"].double().tolist()
    w2 = p["w2_eDF"].double().tolist()
    bias = p.get("e_score_correction_bias")
    out = []
    for x in xs:
        logits = [naive.dot(x, router_ED[e]) for e in range(len(router_ED))]
        (w,), (ids,) = naive.routing(
            torch.tensor([logits], dtype=torch.float64),
            top_k,
            s.score_func,
            s.renormalize,
            n_group=s.n_group,
            topk_group=s.topk_group,
            bias=bias,
            routed_scaling_factor=s.routed_scaling_factor,
        )
        y = [0.0] * D
        for wk, e in zip(w, ids):
            if apply_on_input:
                contrib = naive.swiglu([v * wk for v in x], w13[e], w2[e])
            else:
                contrib = [wk * v for v in naive.swiglu(x, w13[e], w2[e])]
            y = [a + b for a, b in zip(y, contrib)]
        if use_shared and "shared_w13_2FD" in p:
            sh = naive.swiglu(x, p["shared_w13_2FD"].double().tolist(), p["shared_w2_DF"].double().tolist())
            y = [a + b for a, b in zip(y, sh)]
        out.append(y)
    return torch.tensor(out, dtype=torch.float64).reshape(x_TD.shape)


SMALL = dict(D=32, F=16)
MODES = {
    # Llama 4: sigmoid top-1, weight on the expert input, shared expert
    "llama4": (
        ModelShape("l4", E=6, top_k=1, shared_F=16, score_func="sigmoid", apply_router_weight_on_input=True, **SMALL),
        True,
    ),
    # Mixtral / Qwen3: softmax + renormalize, weight on the output, no shared expert
    "mixtral": (ModelShape("mx", E=6, top_k=2, score_func="softmax", renormalize=True, **SMALL), False),
    "topk_softmax": (ModelShape("ts", E=6, top_k=2, score_func="topk_softmax", **SMALL), False),
    # DeepSeek-V3: grouped sigmoid routing, selection bias, renormalize, scaling, shared expert
    "deepseek": (
        ModelShape(
            "ds",
            E=24,
            top_k=4,
            shared_F=16,
            score_func="sigmoid",
            renormalize=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            **SMALL,
        ),
        False,
    ),
    # every expert for every token, weight on the input
    "k_equals_e": (ModelShape("ke", E=6, top_k=6, shared_F=8, score_func="softmax", **SMALL), True),
}


def call_oracle(x, p, s: ModelShape, apply_on_input, use_shared=True):
    return ref.moe_forward(
        x,
        p["router_DE"],
        p["w13_e2FD"],
        p["w2_eDF"],
        top_k=s.top_k,
        score_func=s.score_func,
        renormalize=s.renormalize,
        n_group=s.n_group,
        topk_group=s.topk_group,
        e_score_correction_bias=p.get("e_score_correction_bias"),
        routed_scaling_factor=s.routed_scaling_factor,
        apply_router_weight_on_input=apply_on_input,
        shared_w13_2FD=p.get("shared_w13_2FD") if use_shared else None,
        shared_w2_DF=p.get("shared_w2_DF") if use_shared else None,
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("x_shape", [(0, 32), (1, 32), (5, 32), (2, 3, 32)])
def test_moe_forward_matches_per_token_loop(mode, x_shape):
    s, on_input = MODES[mode]
    p = random_expert_weights(s, dtype=torch.float32, seed=len(mode))
    x = rand(*x_shape, seed=x_shape[0])
    y = call_oracle(x, p, s, on_input)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, naive_moe(x, p, s, s.top_k, on_input).float(), dtype=torch.float32)


@pytest.mark.parametrize("mode", ["llama4", "deepseek"])
def test_router_weight_side_and_shared_expert_matter(mode):
    s, on_input = MODES[mode]
    p = random_expert_weights(s, dtype=torch.float32, seed=1)
    x = rand(4, 32, seed=2)
    a = call_oracle(x, p, s, on_input)
    b = call_oracle(x, p, s, not on_input)
    assert rel_error(a, b) > 1e-3  # SwiGLU is not linear: the side of the weight matters
    assert_close(b, naive_moe(x, p, s, s.top_k, not on_input).float(), dtype=torch.float32)
    c = call_oracle(x, p, s, on_input, use_shared=False)
    assert_close(c, naive_moe(x, p, s, s.top_k, on_input, use_shared=False).float(), dtype=torch.float32)
    assert rel_error(a, c) > 1e-3


def test_moe_forward_bf16_model_tiny():
    s = MODEL_SHAPES["tiny"]
    p = random_expert_weights(s, dtype=torch.bfloat16, seed=4)
    x = rand(3, s.D, seed=5, dtype=torch.bfloat16)
    y = call_oracle(x, p, s, s.apply_router_weight_on_input)
    assert y.dtype == torch.bfloat16
    want = naive_moe(x, p, s, s.top_k, s.apply_router_weight_on_input)
    assert_close(y, want.float().to(torch.bfloat16), dtype=torch.float32, tol=1e-3)


@pytest.mark.parametrize("T,D,F", [(0, 8, 4), (1, 8, 4), (5, 16, 8)])
def test_swiglu_expert_matches_naive(T, D, F):
    x = rand(T, D, seed=1)
    w13 = rand(2 * F, D, seed=2)
    w2 = rand(D, F, seed=3)
    y = ref.swiglu_expert(x, w13, w2)
    want = [naive.swiglu(row, w13.double().tolist(), w2.double().tolist()) for row in x.double().tolist()]
    assert_close(y, torch.tensor(want, dtype=torch.float32).reshape(T, D), dtype=torch.float32)


# ----------------------------------------------------------------------------- argument errors

_S = ModelShape("err", D=8, F=4, E=4, top_k=2, shared_F=4)
P = random_expert_weights(_S, dtype=torch.float32, seed=0)
X = torch.rand(3, 8)


def _fwd(**over):
    args = dict(x_TD=X, router_DE=P["router_DE"], w13_e2FD=P["w13_e2FD"], w2_eDF=P["w2_eDF"], top_k=2)
    args.update(over)
    return lambda: ref.moe_forward(**args)


BAD_CALLS = [
    (_fwd(x_TD=X.tolist()), TypeError, "x_TD"),
    (_fwd(router_DE=P["router_DE"][:7]), ValueError, "router_DE"),
    (_fwd(router_DE=P["router_DE"][0]), ValueError, "router_DE"),
    (_fwd(w13_e2FD=P["w13_e2FD"][:3]), ValueError, "w13_e2FD"),
    (_fwd(w13_e2FD=P["w13_e2FD"][:, :7]), ValueError, "w13_e2FD"),
    (_fwd(w2_eDF=P["w2_eDF"][:, :, :3]), ValueError, "w2_eDF"),
    (_fwd(top_k=5), ValueError, "top_k"),
    (_fwd(score_func="tanh"), ValueError, "score_func"),
    (_fwd(shared_w13_2FD=P["shared_w13_2FD"]), ValueError, "shared_w2_DF"),
    (_fwd(shared_w2_DF=P["shared_w2_DF"]), ValueError, "shared_w13_2FD"),
    (_fwd(shared_w13_2FD=P["shared_w13_2FD"][:, :7], shared_w2_DF=P["shared_w2_DF"]), ValueError, "shared_w13_2FD"),
    (_fwd(shared_w13_2FD=P["shared_w13_2FD"], shared_w2_DF=P["shared_w2_DF"][:, :3]), ValueError, "shared_w2_DF"),
    (_fwd(n_group=3, topk_group=1), ValueError, "n_group"),
]


@pytest.mark.parametrize("call,exc,name", BAD_CALLS, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)


SW_BAD = [
    (lambda: ref.swiglu_expert(X.tolist(), P["shared_w13_2FD"], P["shared_w2_DF"]), TypeError, "x"),
    (lambda: ref.swiglu_expert(X, P["shared_w13_2FD"][:, :7], P["shared_w2_DF"]), ValueError, "w13_2FD"),
    (lambda: ref.swiglu_expert(X, P["shared_w13_2FD"][:7], P["shared_w2_DF"]), ValueError, "w13_2FD"),
    (lambda: ref.swiglu_expert(X, P["shared_w13_2FD"], P["shared_w2_DF"][:, :3]), ValueError, "w2_DF"),
]


@pytest.mark.parametrize("call,exc,name", SW_BAD, ids=[f"{i}-{c[2]}" for i, c in enumerate(SW_BAD)])
def test_swiglu_bad_arguments_raise_naming_the_argument(call, exc, name):
    naive.assert_raises_naming(call, exc, name)
