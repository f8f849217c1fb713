"""MoE layer modules: MetaShufflingMoE == BaselineMoE == the float32 whole-layer oracle."""

from __future__ import annotations

import copy

import pytest
import torch

from moekit import reference as ref
from moekit.layers.experts import decode_fused
from moekit.layers import BaselineMoE, MetaShufflingMoE, MoEArgs, RoutedExperts, ScaledParameter, SharedExperts
from moekit.testing import MODEL_SHAPES, assert_close, random_expert_weights

# Tiny CPU cases: every routing function, top_k 1/2/8, E not a power of two, with/without shared.
CASES = {
    "llama4-k1": dict(num_experts=6, top_k=1, shared_hidden_dim=16, score_func="sigmoid",
                      apply_router_weight_on_input=True),
    "mixtral-k2": dict(num_experts=10, top_k=2, score_func="softmax", renormalize=True,
                       apply_router_weight_on_input=False),
    "deepseek-k8": dict(num_experts=24, top_k=8, shared_hidden_dim=32, score_func="sigmoid", renormalize=True,
                        n_group=4, topk_group=2, score_correction_bias=True, routed_scaling_factor=2.5,
                        apply_router_weight_on_input=False),
    "qwen-k8": dict(num_experts=12, top_k=8, score_func="softmax", renormalize=True,
                    apply_router_weight_on_input=False),
    "topk-softmax-k2": dict(num_experts=7, top_k=2, shared_hidden_dim=8, score_func="topk_softmax",
                            apply_router_weight_on_input=False),
}  # fmt: skip

# (precision, dtype, tolerance vs the oracle, tolerance MetaShuffling vs baseline). FP8 vs the
# dequantized-weights oracle: DESIGN's 6e-2 plus slack, since both activations are also quantized
# (e4m3 keeps 3 mantissa bits) and a single token's error is not averaged; MetaShuffling vs the
# baseline (same quantization points) stays tight.
FP8_ORACLE_TOL = 8e-2
PRECISIONS = {
    "fp32": ("bf16", torch.float32, 1e-5, 1e-5),
    "bf16": ("bf16", torch.bfloat16, 1e-2, 1e-2),
    "fp8": ("fp8_rowwise", torch.bfloat16, FP8_ORACLE_TOL, 2e-2),
}


def _args(case: str, prec: str, D: int = 64, F: int = 32, **kw) -> MoEArgs:
    precision, dtype, _, _ = PRECISIONS[prec]
    return MoEArgs(**{"dim": D, "hidden_dim": F, "precision": precision, "dtype": dtype, **CASES[case], **kw})


def _oracle(layer: BaselineMoE, x: torch.Tensor, routed_only: bool = False) -> torch.Tensor:
    """``moekit.reference.moe_forward`` in float32 with the layer's (dequantized) weights; the
    routed experts alone with ``routed_only``."""
    a = layer.args
    w = {n: t for n, t in layer.reference_weights().items() if not (routed_only and n.startswith("shared_"))}
    return ref.moe_forward(
        x.float(), top_k=a.top_k, score_func=a.score_func, renormalize=a.renormalize, n_group=a.n_group,
        topk_group=a.topk_group, routed_scaling_factor=a.routed_scaling_factor,
        apply_router_weight_on_input=a.apply_router_weight_on_input, **w,
    )  # fmt: skip


def _x(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


# ----------------------------------------------------------------------------------------------
# Reference tier (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (9, 64), (2, 3, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("prec", list(PRECISIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_layers_match_oracle(case, prec, shape):
    _, dtype, tol_ref, tol_base = PRECISIONS[prec]
    args = _args(case, prec)
    base = BaselineMoE(args, seed=3)
    ms = MetaShufflingMoE(args, seed=3)
    x = _x(shape, dtype, seed=len(shape) * 100 + shape[0])
    y_ms, y_base = ms(x), base(x)
    assert y_ms.shape == x.shape and y_ms.dtype == dtype
    assert y_base.shape == x.shape and y_base.dtype == dtype
    want = _oracle(base, x)
    assert_close(y_base.float(), want, tol=tol_ref, msg="baseline vs oracle")
    assert_close(y_ms.float(), want, tol=tol_ref, msg="metashuffling vs oracle")
    T = x.numel() // x.shape[-1]
    if prec == "fp8" and decode_fused(T * args.top_k, args.num_experts, args.top_k, True, n_group=args.n_group):
        # moe_decode's FP8 is weight-only (the activations and the SwiGLU output stay 16-bit): its
        # routed part follows the float32 oracle, not the baseline's quantized activations (qwen-k8
        # 1x64: 0.4% from the oracle, 4.8% from the baseline, which is itself 4.7% from the
        # oracle). A shared expert keeps its FP8 activations (llama4-k1 1x64: 6.1% from the
        # oracle's), so that part is the layer's own shared expert.
        shared = ms.shared_forward(x.reshape(T, -1)).float().reshape(x.shape) if ms.shared_experts is not None else 0.0
        assert_close(y_ms.float(), _oracle(base, x, routed_only=True) + shared, tol=tol_base,
                     msg="weight-only metashuffling vs oracle")  # fmt: skip
    else:
        assert_close(y_ms.float(), y_base.float(), tol=tol_base, msg="metashuffling vs baseline")


@pytest.mark.reference
@pytest.mark.parametrize("shared_precision", ["bf16", "fp8_rowwise"])
def test_mixed_precision_shared_expert(shared_precision):
    args = _args("deepseek-k8", "fp8", shared_precision=shared_precision, precision="bf16")
    ms, base = MetaShufflingMoE(args, seed=1), BaselineMoE(args, seed=1)
    assert ms.routed_experts.precision == "bf16"
    assert ms.shared_experts.precision == shared_precision
    x = _x((7, 64), torch.bfloat16)
    tol = FP8_ORACLE_TOL if shared_precision == "fp8_rowwise" else 1e-2
    assert_close(ms(x).float(), _oracle(base, x), tol=tol)
    assert_close(base(x).float(), _oracle(base, x), tol=tol)


@pytest.mark.reference
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp8"])
def test_deterministic_is_bitwise_reproducible(prec):
    args = _args("deepseek-k8", prec, deterministic=True)
    ms, base = MetaShufflingMoE(args, seed=0), BaselineMoE(args, seed=0)
    x = _x((2, 5, 64), args.dtype, seed=4)
    assert torch.equal(ms(x), ms(x))
    assert torch.equal(base(x), base(x))
    assert_close(ms(x).float(), _oracle(base, x), tol=PRECISIONS[prec][2])


@pytest.mark.reference
def test_seeded_init_is_deterministic():
    args = _args("llama4-k1", "bf16")
    a, b, c = BaselineMoE(args, seed=5), BaselineMoE(args, seed=5), BaselineMoE(args, seed=6)
    for (n, p), (_, q), (_, r) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(p, q), n
        assert not torch.equal(p, r), n
    # Unit-variance inputs give outputs of about unit scale (a trained layer's scaling).
    y = a(_x((64, 64), torch.bfloat16)).float()
    assert 0.05 < y.std().item() < 5


@pytest.mark.reference
@pytest.mark.parametrize("prec", ["bf16", "fp8"])
def test_parameter_names_and_shapes(prec):
    args = _args("deepseek-k8", prec)
    E, D, F, Fs = 24, 64, 32, 32
    m = MetaShufflingMoE(args, seed=0)
    params = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert params == {
        "router_DE": (D, E),
        "routed_experts.w13_e2FD": (E, 2 * F, D),
        "routed_experts.w2_eDF": (E, D, F),
        "shared_experts.w13_2FD": (2 * Fs, D),
        "shared_experts.w2_DF": (D, Fs),
    }
    assert not any(p.requires_grad for p in m.parameters())
    buffers = {n: (tuple(b.shape), b.dtype) for n, b in m.named_buffers()}
    want_buffers = {"e_score_correction_bias_E": ((E,), torch.float32)}
    fp8 = prec == "fp8"
    if fp8:
        want_buffers.update({
            "routed_experts.w13_scale_e2F": ((E, 2 * F), torch.float32),
            "routed_experts.w2_scale_eD": ((E, D), torch.float32),
            "shared_experts.w13_scale_2F": ((2 * Fs,), torch.float32),
            "shared_experts.w2_scale_D": ((D,), torch.float32),
        })  # fmt: skip
    assert buffers == want_buffers
    for ex in (m.routed_experts, m.shared_experts):
        assert isinstance(ex.w13, ScaledParameter) and isinstance(ex.w2, ScaledParameter)
        assert ex.is_fp8_rowwise == fp8 and ex.w13.is_scaled == fp8
        assert ex.w13.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        if fp8:
            assert ex.w13.scales is ex.w13_scale and ex.w2.scales is ex.w2_scale
        else:
            with pytest.raises(ValueError, match="not scaled"):
                ex.w13.scales
    assert m.router_DE.dtype == torch.bfloat16
    # .to() moves the scale buffers and ScaledParameter.scales follows them; deepcopy keeps scales.
    m.to("cpu")
    m2 = copy.deepcopy(m)
    x = _x((5, 64), torch.bfloat16)
    assert torch.equal(m(x), m2(x))
    if fp8:
        assert m2.routed_experts.w13.scales is m2.routed_experts.w13_scale
        assert torch.equal(m2.routed_experts.w13.scales, m.routed_experts.w13.scales)


@pytest.mark.reference
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp8"])
def test_state_dict_round_trip(prec):
    args = _args("deepseek-k8", prec)
    a, b = MetaShufflingMoE(args, seed=0), MetaShufflingMoE(args, seed=1)
    x = _x((6, 64), args.dtype)
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))
    if prec == "fp8":
        assert b.routed_experts.w13.scales is b.routed_experts.w13_scale


@pytest.mark.reference
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("case", ["llama4-k1", "deepseek-k8"])
def test_from_weights(case, prec):
    args = _args(case, prec)
    shape = MODEL_SHAPES["tiny"]
    from dataclasses import replace

    shape = replace(shape, D=64, F=32, E=args.num_experts, shared_F=args.shared_hidden_dim,
                    n_group=args.n_group, topk_group=args.topk_group)  # fmt: skip
    w = random_expert_weights(shape, dtype=torch.float32, seed=11)
    if args.shared_hidden_dim == 0:
        w = {k: v for k, v in w.items() if not k.startswith("shared")}
    if not args.score_correction_bias:
        w.pop("e_score_correction_bias", None)
    ms = MetaShufflingMoE.from_weights(args, **w)
    base = BaselineMoE.from_weights(args, **w)
    x = _x((9, 64), args.dtype, seed=2)
    _, _, tol_ref, tol_base = PRECISIONS[prec]
    want = _oracle(base, x)
    if prec != "fp8":  # loaded as given: the oracle of the raw tensors
        raw = ref.moe_forward(
            x.float(), w["router_DE"].to(args.dtype).float(),
            w["w13_e2FD"].to(args.dtype).float(), w["w2_eDF"].to(args.dtype).float(), top_k=args.top_k,
            score_func=args.score_func, renormalize=args.renormalize, n_group=args.n_group,
            topk_group=args.topk_group, e_score_correction_bias=w.get("e_score_correction_bias"),
            routed_scaling_factor=args.routed_scaling_factor,
            apply_router_weight_on_input=args.apply_router_weight_on_input,
            shared_w13_2FD=None if "shared_w13_2FD" not in w else w["shared_w13_2FD"].to(args.dtype).float(),
            shared_w2_DF=None if "shared_w2_DF" not in w else w["shared_w2_DF"].to(args.dtype).float(),
        )  # fmt: skip
        assert_close(want, raw, tol=1e-6)
    assert_close(ms(x).float(), want, tol=tol_ref)
    assert_close(ms(x).float(), base(x).float(), tol=tol_base)
    # Round trip: the layer's own (possibly FP8) tensors load back bit-exactly.
    re, se = ms.routed_experts, ms.shared_experts
    kw = dict(router_DE=ms.router_DE.data, w13_e2FD=re.w13.data, w2_eDF=re.w2.data,
              w13_scale_e2F=re.w13_scale, w2_scale_eD=re.w2_scale)  # fmt: skip
    if se is not None:
        kw.update(shared_w13_2FD=se.w13.data, shared_w2_DF=se.w2.data, shared_w13_scale_2F=se.w13_scale,
                  shared_w2_scale_D=se.w2_scale)  # fmt: skip
    if args.score_correction_bias:
        kw["e_score_correction_bias"] = ms.e_score_correction_bias_E
    again = MetaShufflingMoE.from_weights(args, **kw)
    assert torch.equal(again(x), ms(x))


@pytest.mark.reference
def test_tensor_parallel_shards_sum_to_the_full_layer():
    args = _args("deepseek-k8", "fp32")
    full = MetaShufflingMoE(args, seed=4)
    F, Fs = args.hidden_dim, args.shared_hidden_dim
    w = {k: v for k, v in full.reference_weights().items()}
    x = _x((2, 5, 64), torch.float32, seed=8)
    total = torch.zeros_like(x)
    for r in range(2):
        f, fs = slice(r * F // 2, (r + 1) * F // 2), slice(r * Fs // 2, (r + 1) * Fs // 2)
        up, sup = slice(F + f.start, F + f.stop), slice(Fs + fs.start, Fs + fs.stop)
        shard = MetaShufflingMoE.from_weights(
            _args("deepseek-k8", "fp32", tp_size=2, tp_rank=r), router_DE=w["router_DE"],
            w13_e2FD=torch.cat([w["w13_e2FD"][:, f], w["w13_e2FD"][:, up]], dim=1), w2_eDF=w["w2_eDF"][:, :, f],
            shared_w13_2FD=torch.cat([w["shared_w13_2FD"][fs], w["shared_w13_2FD"][sup]]),
            shared_w2_DF=w["shared_w2_DF"][:, fs], e_score_correction_bias=w["e_score_correction_bias"],
        )  # fmt: skip
        assert shard.routed_experts.w2_eDF.shape == (24, 64, F // 2)
        total += shard(x)  # each TP rank returns its partial sum
    assert_close(total, full(x), tol=1e-5)


@pytest.mark.reference
def test_args_from_model_shape():
    a = MoEArgs.from_model_shape(MODEL_SHAPES["deepseek-v3"], precision="fp8_rowwise", ep_size=8, ep_rank=3)
    assert (a.dim, a.hidden_dim, a.num_experts, a.top_k, a.shared_hidden_dim) == (7168, 2048, 256, 8, 2048)
    assert a.score_correction_bias and a.n_group == 8 and a.num_local_experts == 32 and a.expert_start == 96
    cfg = a.routing_config
    assert (cfg.top_k, cfg.score_func, cfg.renormalize, cfg.routed_scaling_factor) == (8, "sigmoid", True, 2.5)
    assert not cfg.apply_router_weight_on_input
    with pytest.raises(TypeError, match="bogus"):
        MoEArgs.from_model_shape(MODEL_SHAPES["tiny"], bogus=1)


@pytest.mark.reference
def test_experts_from_unfused_matches_fused_layout():
    g = torch.Generator().manual_seed(0)
    e, D, F = 3, 16, 8
    w_in, w_sw, w_out = (
        torch.randn(e, D, F, generator=g),
        torch.randn(e, D, F, generator=g),
        torch.randn(e, F, D, generator=g),
    )
    r = RoutedExperts.from_unfused(w_in, w_sw, w_out)
    x = torch.randn(5, D, generator=g)
    for i in range(e):  # expert i: silu(x @ w_in) * (x @ w_swiglu) @ w_out
        want = (torch.nn.functional.silu(x @ w_in[i]) * (x @ w_sw[i])) @ w_out[i]
        got = ref.swiglu_expert(x, r.w13_e2FD[i], r.w2_eDF[i])
        assert_close(got, want, tol=1e-5)
    s_in, s_sw, s_out = torch.randn(F, D, generator=g), torch.randn(F, D, generator=g), torch.randn(D, F, generator=g)
    s = SharedExperts.from_unfused(s_in, s_sw, s_out, precision="fp8_rowwise")
    assert s.is_fp8_rowwise and s.w13_2FD.shape == (2 * F, D) and s.w13_scale_2F.shape == (2 * F,)
    want = (torch.nn.functional.silu(x @ s_in.T) * (x @ s_sw.T)) @ s_out.T
    assert_close(ref.swiglu_expert(x, *s.dequantized()), want, tol=FP8_ORACLE_TOL)


@pytest.mark.reference
@pytest.mark.parametrize(
    "kw, exc, field",
    [
        (dict(dim=0), ValueError, "dim"),
        (dict(dim=64.0), TypeError, "dim"),
        (dict(hidden_dim=-1), ValueError, "hidden_dim"),
        (dict(num_experts=0, top_k=1), ValueError, "num_experts"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=9), ValueError, "top_k"),
        (dict(shared_hidden_dim=-8), ValueError, "shared_hidden_dim"),
        (dict(score_func="relu"), ValueError, "score_func"),
        (dict(renormalize=1), TypeError, "renormalize"),
        (dict(deterministic="yes"), TypeError, "deterministic"),
        (dict(n_group=2), ValueError, "topk_group"),
        (dict(n_group=3, topk_group=1), ValueError, "n_group"),
        (dict(n_group=4, topk_group=5), ValueError, "topk_group"),
        (dict(n_group=4, topk_group=1, top_k=3), ValueError, "top_k"),
        (dict(score_func="topk_softmax", score_correction_bias=True), ValueError, "score_correction_bias"),
        (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
        (dict(precision="int4"), ValueError, "precision"),
        (dict(shared_precision="fp4"), ValueError, "shared_precision"),
        (dict(dtype="bf16"), TypeError, "dtype"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
        (dict(precision="fp8_rowwise", dtype=torch.float32), ValueError, "dtype"),
        (dict(ep_size=3), ValueError, "ep_size"),
        (dict(ep_size=2, ep_rank=2), ValueError, "ep_rank"),
        (dict(tp_size=3), ValueError, "tp_size"),
        (dict(tp_size=2, tp_rank=-1), ValueError, "tp_rank"),
    ],
)
def test_bad_args_raise_naming_the_field(kw, exc, field):
    base = dict(dim=64, hidden_dim=32, num_experts=8, top_k=2)
    with pytest.raises(exc, match=field):
        MoEArgs(**{**base, **kw})


@pytest.mark.reference
def test_bad_layer_inputs_raise():
    args = _args("llama4-k1", "bf16")
    with pytest.raises(TypeError, match="args"):
        MetaShufflingMoE(dict(dim=64))
    with pytest.raises(ValueError, match="dim"):
        MetaShufflingMoE(MoEArgs(dim=60, hidden_dim=32, num_experts=4))
    with pytest.raises(ValueError, match="hidden_dim"):
        MetaShufflingMoE(MoEArgs(dim=64, hidden_dim=12, num_experts=4))
    BaselineMoE(MoEArgs(dim=60, hidden_dim=12, num_experts=4))  # the baseline takes any size
    with pytest.raises(ValueError, match="ep_group"):
        MetaShufflingMoE(MoEArgs(dim=64, hidden_dim=32, num_experts=4, ep_size=2))
    m = MetaShufflingMoE(args)
    with pytest.raises(TypeError, match="x"):
        m(torch.randn(3, 64))  # float32 into a bf16 layer
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(3, 32).bfloat16())
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(64).bfloat16())
    args = _args("llama4-k1", "bf16", shared_hidden_dim=32)  # the "tiny" model shape
    w = random_expert_weights("tiny", dtype=torch.float32, seed=0)
    MetaShufflingMoE.from_weights(args, **w)
    with pytest.raises(ValueError, match="shared_w13_2FD"):
        MetaShufflingMoE.from_weights(args, **{k: v for k, v in w.items() if k != "shared_w13_2FD"})
    with pytest.raises(ValueError, match="w13_e2FD"):
        MetaShufflingMoE.from_weights(args, **{**w, "w13_e2FD": w["w13_e2FD"][:, :, :32]})
    with pytest.raises(ValueError, match="router_DE"):
        MetaShufflingMoE.from_weights(args, **{**w, "router_DE": w["router_DE"][:, :5]})
    with pytest.raises(ValueError, match="w13_e2FD"):
        MetaShufflingMoE.from_weights(args, **{**w, "w13_e2FD": w["w13_e2FD"][:4], "w2_eDF": w["w2_eDF"][:4]})
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        MetaShufflingMoE.from_weights(args, **w, e_score_correction_bias=torch.zeros(6))
    q13, s13 = torch.zeros(6, 64, 64, dtype=torch.float8_e4m3fn), torch.ones(6, 64)
    with pytest.raises(ValueError, match="w2_scale_eD"):
        RoutedExperts.from_weights(q13, torch.zeros(6, 64, 32, dtype=torch.float8_e4m3fn), w13_scale_e2F=s13)
    with pytest.raises(TypeError, match="w2_eDF"):
        RoutedExperts.from_weights(q13, torch.zeros(6, 64, 32), w13_scale_e2F=s13)
    with pytest.raises(TypeError, match="w13_e2FD"):
        RoutedExperts.from_weights(torch.zeros(6, 64, 64, dtype=torch.int32), torch.zeros(6, 64, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="precision"):
        RoutedExperts(2, 64, 32, precision="fp16")


@pytest.mark.reference
def test_torch_compile_fullgraph_cpu():
    args = _args("deepseek-k8", "bf16", deterministic=True)
    m = MetaShufflingMoE(args, seed=0)
    x = _x((2, 3, 64), torch.bfloat16, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    assert_close(compiled(x).float(), m(x).float(), tol=1e-2)


# ----------------------------------------------------------------------------------------------
# Expert parallelism: static all-gather path, 2 gloo ranks on the CPU
# ----------------------------------------------------------------------------------------------

EP_CONFIGS = [("llama4-k1", "fp32", 5), ("deepseek-k8", "fp32", 4), ("qwen-k8", "fp32", 0), ("mixtral-k2", "bf16", 3)]
NCCL_EP_CONFIGS = [("llama4-k1", "bf16", 33), ("deepseek-k8", "bf16", 64), ("deepseek-k8", "fp8", 17)]


def _ep_rank_outputs(rank: int, world: int, backend: str, configs: list) -> list:
    """One rank's static-EP outputs (run by ``tests.comm._dist.run_distributed``)."""
    import torch.distributed as dist

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    outs = []
    for i, (case, prec, T) in enumerate(configs):
        args = _args(case, prec, ep_size=world, ep_rank=rank)
        m = MetaShufflingMoE(args, seed=9, ep_group=dist.group.WORLD, device=device)
        assert m.routed_experts.w13_e2FD.shape[0] == args.num_experts // world
        x = _x((world * T, 64), args.dtype, seed=i, device=device)[rank * T : (rank + 1) * T]
        outs.append(m(x).cpu())
    return outs


def _run_ep(backend: str, configs: list, device: str) -> None:
    from tests.comm._dist import run_distributed

    world = 2
    results = run_distributed(_ep_rank_outputs, world, backend, args=(backend, configs), timeout_s=300.0)
    for i, (case, prec, T) in enumerate(configs):
        args = _args(case, prec)
        single = MetaShufflingMoE(args, seed=9, device=device)
        x = _x((world * T, 64), args.dtype, seed=i, device=device)
        got = torch.cat([results[r][i] for r in range(world)]).to(device)
        assert got.shape == x.shape
        assert_close(got.float(), single(x).float(), tol=PRECISIONS[prec][3], msg=case)
        assert_close(got.float(), _oracle(single, x), tol=PRECISIONS[prec][2], msg=case)


@pytest.mark.reference
def test_expert_parallel_static_path_matches_single_process():
    _run_ep("gloo", EP_CONFIGS, "cpu")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_expert_parallel_static_path_nccl_matches_single_gpu():
    _run_ep("nccl", NCCL_EP_CONFIGS, "cuda:0")


# ----------------------------------------------------------------------------------------------
# GPU tier
# ----------------------------------------------------------------------------------------------

GPU_CASES = {
    # Llama 4 Scout-like: sigmoid top-1 on the input, shared expert.
    "scout": dict(dim=1024, hidden_dim=512, num_experts=16, top_k=1, shared_hidden_dim=512, score_func="sigmoid",
                  apply_router_weight_on_input=True),
    # DeepSeek-V3-like: grouped sigmoid top-8 with bias, renormalized, scaled, shared expert; E=72 (not 2**k).
    "deepseek": dict(dim=1024, hidden_dim=256, num_experts=72, top_k=8, shared_hidden_dim=256, score_func="sigmoid",
                     renormalize=True, n_group=8, topk_group=4, score_correction_bias=True,
                     routed_scaling_factor=2.5, apply_router_weight_on_input=False),
}  # fmt: skip
GPU_TOL = {"bf16": (2e-2, 2e-2), "fp8_rowwise": (FP8_ORACLE_TOL, 3e-2)}


def _gpu_layers(case: str, precision: str, **kw):
    args = MoEArgs(precision=precision, dtype=torch.bfloat16, **{**GPU_CASES[case], **kw})
    return MetaShufflingMoE(args, seed=0, device="cuda"), BaselineMoE(args, seed=0, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 1024])
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_matches_baseline_and_oracle(case, precision, T):
    ms, base = _gpu_layers(case, precision)
    x = _x((T, ms.args.dim), torch.bfloat16, seed=T, device="cuda")
    tol_ref, tol_base = GPU_TOL[precision]
    want = _oracle(base, x)
    y_ms = ms(x)
    assert y_ms.shape == x.shape and y_ms.dtype == torch.bfloat16
    assert_close(y_ms.float(), want, tol=tol_ref, msg="metashuffling vs oracle")
    assert_close(base(x).float(), want, tol=tol_ref, msg="baseline vs oracle")
    assert_close(y_ms.float(), base(x).float(), tol=tol_base, msg="metashuffling vs baseline")
    y3 = ms(x.view(1, T, -1))
    assert y3.shape == (1, T, ms.args.dim)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_side_stream_equals_sequential(case, precision):
    ms, _ = _gpu_layers(case, precision)
    x = _x((256, ms.args.dim), torch.bfloat16, seed=1, device="cuda")
    ms.overlap_shared_expert = True
    overlapped = ms(x)
    ms.overlap_shared_expert = False
    sequential = ms(x)
    torch.cuda.synchronize()
    assert_close(overlapped.float(), sequential.float(), tol=1e-2)
    assert_close(overlapped.float(), _oracle(ms, x), tol=GPU_TOL[precision][0])


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_gpu_cuda_graph_capture_and_replay(precision, overlap):
    ms, _ = _gpu_layers("deepseek", precision)
    ms.overlap_shared_expert = overlap
    T, D = 96, ms.args.dim
    x = _x((T, D), torch.bfloat16, seed=0, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compilation) outside the capture
        ms(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ms(x)
    for seed in range(1, 4):
        x.copy_(_x((T, D), torch.bfloat16, seed=seed, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out.float(), _oracle(ms, x), tol=GPU_TOL[precision][0], msg=f"replay {seed}")
        assert_close(out.float(), ms(x).float(), tol=1e-2, msg=f"replay {seed} vs eager")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_gpu_deterministic_bitwise(precision):
    ms, _ = _gpu_layers("deepseek", precision, deterministic=True)
    x = _x((512, ms.args.dim), torch.bfloat16, seed=2, device="cuda")
    first = ms(x)
    for _ in range(3):
        assert torch.equal(ms(x), first)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    ms, _ = _gpu_layers("deepseek", "bf16")
    x = _x((64, ms.args.dim), torch.bfloat16, seed=3, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(ms, fullgraph=True)
    assert_close(compiled(x).float(), _oracle(ms, x), tol=GPU_TOL["bf16"][0])


@pytest.mark.reference
@pytest.mark.parametrize("group", ["x", 3, object()])
def test_ep_group_of_the_wrong_type_is_a_type_error(group):
    """``MetaShufflingMoE(args, ep_group='x')`` raised AttributeError from inside (issue 16)."""
    args = MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, ep_rank=0)
    with pytest.raises(TypeError, match="ep_group must be a torch.distributed.ProcessGroup"):
        MetaShufflingMoE(args, ep_group=group)


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["ep", "tp"])
@pytest.mark.parametrize("group", ["x", 3, object()], ids=["str", "int", "object"])
def test_unused_group_of_the_wrong_type_is_a_type_error(kind, group):
    """Without EP (or dedup_comm) the group is unused, but a non-ProcessGroup is still a wrong
    argument: TypeError naming it, not silently kept (issue 16)."""
    args = MoEArgs(dim=64, hidden_dim=32, num_experts=8)
    with pytest.raises(TypeError, match=rf"^{kind}_group must be a torch\.distributed\.ProcessGroup.*, got "
                                        rf"{type(group).__name__}$"):  # fmt: skip
        MetaShufflingMoE(args, **{f"{kind}_group": group})


@pytest.mark.reference
@pytest.mark.parametrize("group", ["x", 3], ids=["str", "int"])
def test_tp_group_of_the_wrong_type_with_dedup_comm_is_a_type_error(group):
    """With dedup_comm in effect the TP group is checked like the EP group (the constructor needs
    a live EP group first: the check itself here)."""
    args = MoEArgs(dim=64, hidden_dim=32, num_experts=8, ep_size=2, tp_size=2, dedup_comm=True)
    assert args.uses_dedup_comm
    with pytest.raises(TypeError, match=rf"^tp_group must be a torch\.distributed\.ProcessGroup, got "
                                        rf"{type(group).__name__}$"):  # fmt: skip
        BaselineMoE._check_tp_group(args, group)
    with pytest.raises(TypeError, match="^ep_group must be a torch.distributed.ProcessGroup, got str$"):
        MetaShufflingMoE(args, ep_group="x", tp_group=group)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that reports ``is_cuda``: BaselineMoE._per_expert's grouped-GEMM branch on
    the CPU."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.reference
def test_baseline_grouped_mm_fallback_warns_once(monkeypatch):
    """BaselineMoE's per-expert GEMMs fell back to a Python loop in silence when
    torch._grouped_mm failed (issue 16): same result, with one warning naming the exception."""
    import warnings

    from moekit.ops import _common

    monkeypatch.setattr(_common, "_WARNED", set())

    def broken(*a, **k):
        raise RuntimeError("grouped_mm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    E, N, K = 3, 16, 8
    counts = torch.tensor([2, 0, 3])
    xs = torch.randn(5, K).bfloat16()
    w = torch.randn(E, N, K).bfloat16()
    want = torch.cat([xs[:2] @ w[0].T, xs[2:] @ w[2].T])
    with pytest.warns(UserWarning, match=r"torch\._grouped_mm failed \(RuntimeError: grouped_mm is not supported.*"
                                         r"Python loop over experts"):  # fmt: skip
        got = BaselineMoE._per_expert(xs.as_subclass(_CudaLooking), w, None, counts, 0.0)
    assert torch.equal(got.as_subclass(torch.Tensor), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        BaselineMoE._per_expert(xs.as_subclass(_CudaLooking), w, None, counts, 0.0)  # once
