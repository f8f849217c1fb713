"""moekit as a Hugging Face transformers experts implementation (``experts_implementation="moekit"``).

Tiny random models built from configs (no downloads): the moekit forward must match the model's
own "eager" experts. CPU tests (``reference``) run the ops' float32 references; ``gpu`` tests run
the Triton kernels in bf16 and capture the experts call in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface  # noqa: E402

from moekit.integrations import transformers as mt  # noqa: E402
from moekit.testing import rel_error  # noqa: E402

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_hidden_layers=2)


def _config(family: str, top_k: int = 2):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=top_k, norm_topk_prob=True, **_ATTN,
        )  # fmt: skip
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=top_k, **_ATTN,
        )  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(
            hidden_size=64, intermediate_size=40, num_local_experts=6, num_experts_per_tok=top_k, **_ATTN
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=top_k, n_group=2, topk_group=1,
            n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128,
        )  # fmt: skip
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=top_k,
            layer_types=["full_attention", "sliding_attention"], **_ATTN,
        )  # fmt: skip
    if family == "llama4":
        return transformers.Llama4TextConfig(
            hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=8,
            num_experts_per_tok=top_k, interleave_moe_layer_step=1, **_ATTN,
        )  # fmt: skip
    if family == "inkling":  # routed ExpertsInterface experts + shared experts holding 3-D weights
        if not hasattr(transformers, "InklingTextConfig"):
            pytest.skip(f"transformers {transformers.__version__} has no Inkling")
        return transformers.InklingTextConfig(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=top_k, n_shared_experts=2, swa_num_attention_heads=4, swa_num_key_value_heads=2,
            swa_head_dim=16, sliding_window_size=8, rel_extent=16, **_ATTN,
        )  # fmt: skip
    raise KeyError(family)


# Every architecture the README lists (+ Inkling: shared experts with 3-D weights).
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4", "inkling"]
# The ExpertsInterface ones (Llama 4's router gives dense scores: no duplicate ids there).
IFACE_FAMILIES = [f for f in FAMILIES if f != "llama4"]
N_EXPERTS = {"mixtral": 6}


def _model(family: str, dtype=torch.float32, device="cpu", top_k: int = 2, seed: int = 0, **load):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, top_k), **load).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:  # stacked expert weights: large enough to matter in the logits
                p.normal_(0.0, 0.15)
            elif name.endswith("_bias"):
                p.normal_(0.0, 0.1)
    return model.to(device=device, dtype=dtype)


def _inputs(batch: int, seq: int, pad: int, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, :pad] = 0  # left padding of the last sequence
    return ids.to(device), mask.to(device)


def _logits(model, ids, mask, impl: str):
    if impl == "moekit":
        mt.enable(model)
    else:
        mt.disable(model, impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def _first_experts(model):
    name, mod = mt.experts_modules(model)[0]
    return mod.experts if type(mod).__name__ == "Llama4TextMoe" else mod


def _routing(T: int, E: int, K: int, seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :K]
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return idx.to(device), w.to(device=device, dtype=dtype)


def _call(experts, impl: str, x, idx, w):
    experts.config._experts_implementation = impl
    with torch.no_grad():
        return experts(x, idx, w).float()


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
def test_register_is_idempotent():
    mt.register()
    mt.register()
    assert ExpertsInterface._global_mapping["moekit"] is mt.moekit_experts_forward
    assert "moekit" in ALL_EXPERTS_FUNCTIONS.valid_keys()
    assert ALL_EXPERTS_FUNCTIONS.get_interface("moekit", None) is mt.moekit_experts_forward


@pytest.mark.reference
def test_from_pretrained_with_moekit(tmp_path):
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    mt.register()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moekit").eval()
    assert loaded.config._experts_implementation == "moekit"
    ids, mask = _inputs(2, 5, 2)
    with torch.no_grad():
        out = loaded(input_ids=ids, attention_mask=mask).logits
    ref = _logits(model, ids, mask, "eager")
    assert rel_error(out.float(), ref) < 1e-4


def _count_routings(monkeypatch) -> list:
    """Calls of moekit's routing ops (``shuffle_top_k``; Llama 4's blocks: ``index_shuffling``):
    one per MoE layer forward that ran moekit."""
    import moekit.ops

    calls = []
    for name in ("index_shuffling", "shuffle_top_k"):
        real = getattr(moekit.ops, name)
        monkeypatch.setattr(moekit.ops, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_from_config_with_moekit(family, monkeypatch):
    """``from_config(..., experts_implementation="moekit")`` runs moekit in every MoE layer
    (Llama 4 too: its blocks read the config), and ``disable`` switches it back."""
    calls = _count_routings(monkeypatch)
    ref_model = _model(family)
    ids, mask = _inputs(2, 6, 2)
    ref = _logits(ref_model, ids, mask, "eager")
    assert not calls
    mt.register()
    model = _model(family, experts_implementation="moekit")
    model.load_state_dict(ref_model.state_dict())
    assert model.config._experts_implementation == "moekit"
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits.float()
    n_moe = len(mt.experts_modules(model))
    assert len(calls) == n_moe > 0, f"{family}: moekit ran in {len(calls)} of {n_moe} MoE layers"
    assert rel_error(out, ref) < 1e-4
    mt.disable(model, "eager")
    with torch.no_grad():
        back = model(input_ids=ids, attention_mask=mask).logits.float()
    assert len(calls) == n_moe  # the model's own experts again
    assert rel_error(back, ref) < 1e-6


@pytest.mark.reference
def test_llama4_dispatch_leaves_other_implementations_alone(monkeypatch):
    """The Llama 4 wrapper ``register()`` installs only acts on ``"moekit"`` configs."""
    mt.register()
    calls = _count_routings(monkeypatch)
    model = _model("llama4")  # default implementation
    ids, mask = _inputs(1, 4, 0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert not calls
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    assert Llama4TextMoe.forward.__name__ == "forward"
    mt.register()  # idempotent: no second wrapper
    assert not hasattr(mt._llama4_own_forward(_first_experts_block(model)), "_moekit_dispatch_original")


def _first_experts_block(model):
    return mt.experts_modules(model)[0][1]


def _dup_routing(T: int, E: int, K: int, seed: int, dtype=torch.float32):
    """Top-k ids with repeats: every token names some expert 2+ times (one names a single expert
    in all K slots), plus weights that are not normalized (a repeat's weights add up)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[:, 1] = idx[:, 0]
    idx[0] = idx[0, 0]
    w = torch.rand(T, K, generator=g) + 0.1
    return idx, w.to(dtype)


@pytest.mark.reference
@pytest.mark.parametrize("family", IFACE_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_duplicate_expert_ids(family, dtype):
    """A top-k naming the same expert twice: eager and grouped_mm add both slots; so does moekit
    (one row with the summed weight). Also K > E (only possible with repeats) and T = 1."""
    model = _model(family, dtype=dtype)
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    g = torch.Generator().manual_seed(7)
    for T, K in [(9, 2), (1, 3), (12, 4), (5, E + 2)]:
        x = torch.randn(T, D, generator=g).to(dtype)
        idx, w = _dup_routing(T, E, K, seed=T * 10 + K, dtype=dtype)
        ref = _call(experts, "eager", x, idx, w)
        grouped = _call(experts, "grouped_mm", x, idx, w)
        out = _call(experts, "moekit", x, idx, w)
        assert rel_error(grouped, ref) < tol  # the contract: both slots count
        assert rel_error(out, ref) < tol, f"{family} {dtype} T={T} K={K}: rel err {rel_error(out, ref):.2e}"


@pytest.mark.reference
def test_duplicate_expert_ids_deterministic():
    """deterministic=True stays bitwise reproducible with repeated ids (the summed weights take no
    atomics), in the batched model path too."""
    model = _model("qwen3_moe")
    mt.enable(model, deterministic=True)
    experts = _first_experts(model)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(2))
    idx, w = _dup_routing(33, 8, 3, seed=2)
    a, b = _call(experts, "moekit", x, idx, w), _call(experts, "moekit", x, idx, w)
    assert torch.equal(a, b)
    assert rel_error(a, _call(experts, "eager", x, idx, w)) < 1e-5


# ----------------------------------------------------------------------------------------------
# Whole models, float32 on the CPU (reference ops)
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", [(2, 7, 3), (1, 1, 0)], ids=["batch_padded", "T1"])
def test_model_matches_eager_fp32(family, shape, monkeypatch):
    calls = _count_routings(monkeypatch)
    model = _model(family)
    ids, mask = _inputs(*shape)
    ref = _logits(model, ids, mask, "eager")
    assert not calls
    out = _logits(model, ids, mask, "moekit")
    assert len(calls) == len(mt.experts_modules(model)) > 0  # one moekit routing per MoE layer
    assert model.config._experts_implementation == "moekit"
    if family == "llama4":
        assert "forward" in mt.experts_modules(model)[0][1].__dict__  # patched block
    err = rel_error(out, ref)
    assert err < 1e-4, f"{family}: rel error {err:.2e}"
    back = _logits(model, ids, mask, "eager")  # disable() restores the model's own path
    assert torch.equal(back, ref)


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "llama4"])
def test_top1_and_top_all(family):
    E = 6 if family == "mixtral" else 8
    for k in (1, E):
        model = _model(family, top_k=k, seed=k)
        ids, mask = _inputs(2, 4, 1)
        ref = _logits(model, ids, mask, "eager")
        out = _logits(model, ids, mask, "moekit")
        assert rel_error(out, ref) < 1e-4, f"{family} top_k={k}"


@pytest.mark.reference
def test_deterministic_option():
    model = _model("mixtral")
    ids, mask = _inputs(2, 6, 0)
    ref = _logits(model, ids, mask, "eager")
    mt.enable(model, deterministic=True)
    assert all(m.__dict__["_moekit_deterministic"] for _, m in mt.experts_modules(model))
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert rel_error(a.float(), ref) < 1e-4


def _median_position_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    per_pos = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    return per_pos.median().item()


def _check_bf16_model(family: str, device: str) -> None:
    """bf16 logits against the float32 model. A random bf16 model is chaotic: a rounding
    difference in one layer can flip a later router's choice and change a few positions
    entirely, for eager and moekit alike. So the whole-model check is the median per-position
    error (the bulk of positions), for moekit and for eager; the exact check with one routing
    is ``test_experts_module`` (bf16: 1e-2)."""
    m32 = _model(family, device=device)
    m16 = _model(family, dtype=torch.bfloat16, device=device)
    for shape in [(4, 33, 5), (1, 1, 0)]:
        ids, mask = _inputs(*shape, device=device)
        ref = _logits(m32, ids, mask, "eager")
        eager = _median_position_error(_logits(m16, ids, mask, "eager"), ref)
        moekit = _median_position_error(_logits(m16, ids, mask, "moekit"), ref)
        assert moekit < max(2e-2, 1.5 * eager), f"{family} {shape}: moekit {moekit:.2e}, eager {eager:.2e}"


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_model_bf16(family):
    _check_bf16_model(family, "cpu")


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_grad_mode_falls_back_with_correct_gradients(family):
    """The moekit ops have no backward: with autograd needed the call falls back (with a warning)
    and the gradients match the eager model's."""
    model = _model(family)
    ids, _ = _inputs(1, 4, 0)
    experts = _first_experts(model)
    grads = {}
    for impl in ("eager", "moekit"):
        model.zero_grad()
        mt.enable(model) if impl == "moekit" else mt.disable(model, "eager")
        if impl == "moekit":
            with pytest.warns(UserWarning, match="inference-only"):
                loss = model(input_ids=ids).logits.square().mean()
        else:
            loss = model(input_ids=ids).logits.square().mean()
        loss.backward()
        grads[impl] = (experts.gate_up_proj.grad.clone(), model.model.embed_tokens.weight.grad.clone())
    assert rel_error(grads["moekit"][0], grads["eager"][0]) < 1e-4
    assert rel_error(grads["moekit"][1], grads["eager"][1]) < 1e-4


# ----------------------------------------------------------------------------------------------
# Experts modules directly (given routing; edge cases; other activations / norms)
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_module(family, dtype):
    model = _model(family, dtype=dtype)
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    g = torch.Generator().manual_seed(3)
    for T, case in [(1, "T1"), (13, "random"), (16, "one_expert_set"), (5, "K=E")]:
        K = E if case == "K=E" else 2
        x = torch.randn(T, D, generator=g).to(dtype)
        idx, w = _routing(T, E, K, seed=T)
        if case == "one_expert_set":
            idx = torch.tensor([[5, 2]]).expand(T, 2).contiguous()
        w = w.to(dtype)
        ref = _call(experts, "eager", x, idx, w)
        out = _call(experts, "moekit", x, idx, w)
        assert rel_error(out, ref) < tol, f"{family} {dtype} {case}"
    # T = 0
    z = _call(experts, "moekit", torch.randn(0, D).to(dtype), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert z.shape == (0, D)


@pytest.mark.reference
@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_experts_module_stored_sums_skip_the_zeroing(path, monkeypatch):
    """Where the down rows are summed per token (from ``DOWN_SUM_MIN_ROWS`` rows, pinned to 1 here)
    the output is stored without being zeroed first (``shuffle_top_k`` gets no zero buffer), as in
    ``moe_forward``; elsewhere it is zeroed; both equal transformers' eager experts. Duplicate
    expert ids included."""
    import moekit.ops as ops
    from moekit import settings

    model = _model("qwen3_moe")
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(4))
    idx, w = _dup_routing(11, E, 2, seed=4)
    ref = _call(experts, "eager", x, idx, w)
    zero = []
    real = ops.shuffle_top_k
    monkeypatch.setattr(ops, "shuffle_top_k", lambda *a, **k: zero.append(k.get("zero_buffer")) or real(*a, **k))
    for min_rows, stored in ((1, True), (10**9, False)):
        zero.clear()
        with settings.override(moe_path=path, knobs={"DOWN_SUM_MIN_ROWS": min_rows}):
            out = _call(experts, "moekit", x, idx, w)
        assert rel_error(out, ref) < 1e-5, (path, min_rows)
        # (top-2 is under the decode pipeline's per-token combine, COMBINE_MIN_TOP_K = 6: both
        # pipelines store the sums)
        assert len(zero) == 1 and (zero[0] is None) == stored, (path, min_rows, zero)


def _nemotron_experts():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = transformers.NemotronHConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    return NemotronHExperts(cfg)


def _muse_spark_experts():
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    cfg = MuseSparkTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_hidden_size=64,
        moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    return MuseSparkExperts(cfg)


@pytest.mark.reference
@pytest.mark.parametrize("build", [_nemotron_experts, _muse_spark_experts], ids=["no_gate_relu2", "post_expert_norm"])
def test_experts_module_model_activation_path(build):
    """Experts without a SwiGLU gate (Nemotron-H: up -> relu^2 -> down) and with a post-expert
    norm (Muse Spark) run moekit's GEMMs with the model's own activation / norm."""
    torch.manual_seed(0)
    experts = build().eval()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.15) if p.dim() == 3 else p.uniform_(0.5, 1.5)
    mt.enable(experts)
    E, D = experts.down_proj.shape[0], experts.down_proj.shape[1]
    x = torch.randn(11, D)
    idx, w = _routing(11, E, 2, seed=5)
    ref = _call(experts, "eager", x, idx, w)
    out = _call(experts, "moekit", x, idx, w)
    assert rel_error(out, ref) < 1e-5


# ----------------------------------------------------------------------------------------------
# Weight layout: no copy per call
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
def test_standard_layout_is_a_view_not_a_copy():
    model = _model("qwen3_moe")
    mt.enable(model)
    experts = _first_experts(model)
    before = mt.repack_count()
    ids, mask = _inputs(2, 5, 0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)
    assert mt.repack_count() == before
    plan = mt._plan(experts)
    assert plan.w13.data_ptr() == experts.gate_up_proj.data_ptr()
    assert plan.w2.data_ptr() == experts.down_proj.data_ptr()
    assert plan.fast_swiglu


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
@pytest.mark.reference
def test_transposed_layout_is_repacked_once(family):
    model = _model(family)
    ids, mask = _inputs(2, 5, 1)
    mt.enable(model)
    n_moe = len(mt.experts_modules(model))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    after_first = mt.repack_count()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)
    assert mt.repack_count() == after_first, "weights were repacked on a later call"
    # An in-place update of one weight (new version) refreshes exactly that copy.
    experts = _first_experts(model)
    with torch.no_grad():
        experts.down_proj.mul_(1.5)
    out = _logits(model, ids, mask, "moekit")
    assert mt.repack_count() == after_first + 1
    ref = _logits(model, ids, mask, "eager")
    assert rel_error(out, ref) < 1e-4
    assert n_moe == 2
    mt.release_cache(model)
    assert all("_moekit_weight_cache" not in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.reference
def test_enable_errors():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mt.enable(object())
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        mt.enable(_model("qwen3_moe"), deterministic=1)
    dense = AutoModelForCausalLM.from_config(transformers.LlamaConfig(hidden_size=64, intermediate_size=64, **_ATTN))
    with pytest.raises(TypeError, match="no MoE experts module"):
        mt.enable(dense)

    class FooExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 16, 8))

    with pytest.raises(TypeError, match="FooExperts"):
        mt.enable(torch.nn.Sequential(FooExperts()))


@pytest.mark.reference
def test_unsupported_experts_modules():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    odd = Qwen3MoeExperts(transformers.Qwen3MoeConfig(hidden_size=36, moe_intermediate_size=20, num_experts=4,
                                                      num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="multiples of 8, got D=36, F=20"):
        mt.enable(odd)

    model = _model("qwen3_moe")
    experts = _first_experts(model)
    with torch.no_grad():
        experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"layers\.0\.mlp\.experts.*quantized"):
        mt.enable(model)

    model = _model("qwen3_moe")
    mt.enable(model)
    experts = _first_experts(model)
    experts._is_expert_parallel = True
    x = torch.randn(3, 64)
    idx, w = _routing(3, 8, 2, seed=0)
    with pytest.raises(ValueError, match="expert parallelism"):
        _call(experts, "moekit", x, idx, w)
    experts._is_expert_parallel = False
    with pytest.raises(ValueError, match="top_k_index and top_k_weights"):
        _call(experts, "moekit", x, idx, w[:, :1])


@pytest.mark.reference
def test_shared_experts_with_3d_weights():
    """Experts-like modules next to supported routed experts (Inkling's shared_experts, 3-D
    weights) keep their own forward; the same class anywhere else is refused by name."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class FooSharedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 16, 64))

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    block = torch.nn.Module()
    block.experts, block.shared_experts = Qwen3MoeExperts(cfg), FooSharedExperts()
    mt.enable(torch.nn.ModuleDict({"mlp": block}))  # accepted
    stray = torch.nn.ModuleDict({"mlp": block, "side": torch.nn.ModuleDict({"extra": FooSharedExperts()})})
    with pytest.raises(TypeError, match=r"side\.extra \(FooSharedExperts\)"):
        mt.enable(stray)
    model = _model("inkling")
    mt.enable(model)
    names = [n for n, _ in mt.experts_modules(model)]
    assert names and all(n.endswith("mlp.experts") for n in names)


@pytest.mark.reference
def test_load_time_refusals_name_the_module():
    """experts_implementation="moekit" at load defers validation to the first forward: the error
    names the experts class (enable names the module path)."""
    mt.register()
    cfg = _config("qwen3_moe")
    cfg.moe_intermediate_size = 20
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moekit").eval()
    ids, _ = _inputs(1, 3, 0)
    with pytest.raises(ValueError, match="multiples of 8, got D=64, F=20 in Qwen3MoeExperts"), torch.no_grad():
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: .*F=20"):
        mt.enable(model)
    cfg = _config("llama4")
    cfg.intermediate_size = 20
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moekit").eval()
    with pytest.raises(ValueError, match=r"Llama4TextMoe\.experts \(Llama4TextExperts\).*F=20"), torch.no_grad():
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.feed_forward: Llama4TextMoe"):
        mt.enable(model)


# ----------------------------------------------------------------------------------------------
# GPU tier (bf16 Triton kernels, CUDA graphs)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_model_bf16_cuda(family):
    _check_bf16_model(family, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_experts_module_bf16_cuda(family, T):
    model = _model(family, dtype=torch.bfloat16, device="cuda")
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    K = model.config.num_experts_per_tok
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx, w = _routing(T, E, K, seed=T, device="cuda")
    ref = _call(experts, "eager", x, idx, w)
    out = _call(experts, "moekit", x, idx, w)
    assert rel_error(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "inkling"])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_duplicate_expert_ids_bf16_cuda(family, T):
    model = _model(family, dtype=torch.bfloat16, device="cuda")
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    for K in (2, 8):
        idx, w = _dup_routing(T, E, K, seed=T + K, dtype=torch.bfloat16)
        idx, w = idx.cuda(), w.cuda()
        ref = _call(experts, "eager", x, idx, w)
        out = _call(experts, "moekit", x, idx, w)
        assert rel_error(out, ref) < 1e-2, f"{family} T={T} K={K}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_cuda_graph_replay(family):
    model = _model(family, dtype=torch.bfloat16, device="cuda")
    mt.enable(model)
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    T, K = 48, 2
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx, w = _routing(T, E, K, seed=0, device="cuda")
    experts.config._experts_implementation = "moekit"
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up: Triton compiles, transposed weights get repacked
                experts(x, idx, w)
        torch.cuda.current_stream().wait_stream(s)
        before = mt.repack_count()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(x, idx, w)
        for seed in (1, 2):
            x.copy_(torch.randn(T, D, device="cuda", dtype=torch.bfloat16))
            new_idx, new_w = _routing(T, E, K, seed=seed, device="cuda")
            idx.copy_(new_idx)
            w.copy_(new_w)
            graph.replay()
            torch.cuda.synchronize()
            ref = _call(experts, "eager", x, idx, w)
            assert rel_error(out.float(), ref) < 1e-2, f"replay {seed}"
        assert mt.repack_count() == before


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
@pytest.mark.parametrize("T", [1, 5])
def test_decode_calls_replay_internal_cuda_graphs(family, T):
    """Eager calls of at most GRAPH_MAX_TOKENS tokens: the first runs eagerly, the second captures
    a graph, later ones replay it; every output matches the eager forward on its own inputs."""
    from moekit.integrations import _graphs

    model = _model(family, dtype=torch.bfloat16, device="cuda")
    mt.enable(model)
    block = _first_experts_block(model)
    experts = _first_experts(model)
    D = model.config.hidden_size
    E = experts.gate_up_proj.shape[0]
    K = model.config.num_experts_per_tok
    llama = type(block).__name__ == "Llama4TextMoe"
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            if llama:
                out = block(x)[0]
                block.__dict__[mt._GRAPH_ATTR] = 0  # the same block, eager, as the reference
                ref = block(x)[0]
                block.__dict__[mt._GRAPH_ATTR] = mt.GRAPH_MAX_TOKENS
            else:
                idx, w = _routing(T, E, K, seed=10 + i, device="cuda", dtype=torch.bfloat16)
                out = _call(experts, "moekit", x, idx, w)
                experts.__dict__[mt._GRAPH_ATTR] = 0
                ref = _call(experts, "moekit", x, idx, w)
                experts.__dict__[mt._GRAPH_ATTR] = mt.GRAPH_MAX_TOKENS
            assert torch.equal(out.float(), ref.float()), f"call {i}"
            assert _graphs.count(block if llama else experts) == (1 if i >= 1 else 0)
    mt.enable(model, cuda_graphs=False)
    assert _graphs.count(block if llama else experts) == 0
    with torch.no_grad():
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            block(x) if llama else _call(experts, "moekit", x, *_routing(T, E, K, 0, "cuda", torch.bfloat16))
    assert _graphs.count(block if llama else experts) == 0


def test_cuda_graphs_option_is_a_bool():
    model = _model("qwen3_moe")
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        mt.enable(model, cuda_graphs="yes")


def test_cpu_calls_never_take_graphs():
    from moekit.integrations import _graphs

    x = torch.randn(2, 8)
    assert not _graphs.eligible((x,), 2, 32)
    assert not _graphs.eligible((x,), 2, 0)


@pytest.mark.reference
def test_graph_buckets():
    """Exact sizes up to ``exact``; beyond, powers of two and 1.5x powers of two, so at most a
    third of a bucket is padding."""
    from moekit.integrations._graphs import bucket

    assert [bucket(t, 32) for t in (1, 7, 32)] == [1, 7, 32]
    assert [bucket(t, 32) for t in (33, 48, 49, 64, 65, 96, 97, 500, 512, 513, 2047)] == [
        48, 48, 64, 64, 96, 96, 128, 512, 512, 768, 2048,
    ]  # fmt: skip
    assert bucket(5, 4) == 6 and bucket(7, 4) == 8 and bucket(3, 0) == 3 and bucket(1, 0) == 1
    for t in range(33, 3000):
        b = bucket(t, 32)
        assert t <= b < 1.5 * t + 1 and b > 32


def _padded_forward(experts, x, idx, w, Tb: int, path=None):
    """The integration's forward on inputs padded to ``Tb`` rows as its graphs pad them (stale
    hidden rows, expert id -1, weight 0): the first rows; the padding rows must come out 0 (they
    made no row)."""
    from moekit import settings

    T = x.shape[0]
    xp = torch.cat([x, torch.randn(Tb - T, x.shape[1], dtype=x.dtype, device=x.device)])
    ip = torch.cat([idx, torch.full((Tb - T, idx.shape[1]), -1, dtype=idx.dtype, device=idx.device)])
    wp = torch.cat([w, torch.zeros(Tb - T, w.shape[1], dtype=w.dtype, device=w.device)])
    plan = mt._plan(experts)
    with torch.no_grad(), settings.override(**({"moe_path": path} if path else {})):
        out = mt._experts_forward(experts, plan, False, None, xp, ip, wp).float()
    assert out.shape == (Tb, x.shape[1]) and torch.equal(out[T:], torch.zeros_like(out[T:]))
    return out[:T]


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_padded_rows_change_nothing(family):
    """What the prompt graphs rely on: padding rows with expert id -1 make no row, so the first
    rows of a padded call equal the unpadded call's (stale hidden rows are never read)."""
    model = _model(family)
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    T = 37
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    idx, w = _routing(T, E, 2, seed=5)
    ref = _call(experts, "moekit", x, idx, w)
    assert rel_error(_padded_forward(experts, x, idx, w, 48), ref) < 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_padded_rows_change_nothing_kernels_interpreted(path, monkeypatch):
    """The same on the Triton kernels (CPU interpreter), both pipelines."""
    import importlib

    for fam in ("routing", "gather_scatter", "grouped_gemm", "activation"):
        monkeypatch.setattr(importlib.import_module(f"moekit.ops.{fam}"), "use_triton", lambda t: True)
    model = _model("qwen3_moe")
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    T = 9
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    idx, w = _dup_routing(T, E, 2, seed=6)
    ref = _call(experts, "eager", x, idx, w)
    assert rel_error(_padded_forward(experts, x, idx, w, 12, path=path), ref) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("T", [40, 300])
def test_prompt_calls_replay_padded_cuda_graphs(family, T):
    """Prompt-sized eager calls: padded to a bucket, captured the second time, replayed after with
    new routing and new sizes of the same bucket; two layers replaying in turn share the static
    tensors and pool and stay right."""
    from moekit.integrations import _graphs

    model = _model(family, dtype=torch.bfloat16, device="cuda")
    mt.enable(model)
    layers = [m for _, m in mt.experts_modules(model)]
    assert len(layers) == 2
    D = model.config.hidden_size
    E = layers[0].gate_up_proj.shape[0]
    K = model.config.num_experts_per_tok
    with torch.no_grad():
        for i, t in enumerate([T, T, T, T - 3, T - 1]):
            outs, refs = [], []
            for j, ex in enumerate(layers):
                x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
                idx, w = _routing(t, E, K, seed=100 * i + j, device="cuda", dtype=torch.bfloat16)
                outs.append(_call(ex, "moekit", x, idx, w))
                ex.__dict__[mt._GRAPH_ATTR] = 0
                refs.append(_call(ex, "moekit", x, idx, w))
                ex.__dict__[mt._GRAPH_ATTR] = mt.GRAPH_MAX_TOKENS
            for j, (out, ref) in enumerate(zip(outs, refs)):
                assert out.shape == ref.shape
                assert rel_error(out, ref) < 1e-2, f"call {i} layer {j}"
            assert [_graphs.count(ex) for ex in layers] == [1 if i >= 1 else 0] * 2
    mt.enable(model, cuda_graphs=False)
    assert [_graphs.count(ex) for ex in layers] == [0, 0]


@pytest.mark.gpu
def test_prompt_graphs_take_the_bound():
    """Calls past ``GRAPH_MAX_TOKENS`` stay eager; Llama 4 blocks take graphs up to
    ``GRAPH_EXACT_TOKENS`` only (their router reads every row)."""
    from moekit.integrations import _graphs

    model = _model("llama4", dtype=torch.bfloat16, device="cuda")
    mt.enable(model)
    block = _first_experts_block(model)
    D = model.config.hidden_size
    with torch.no_grad():
        for _ in range(3):
            block(torch.randn(mt.GRAPH_EXACT_TOKENS + 1, D, device="cuda", dtype=torch.bfloat16))
    assert _graphs.count(block) == 0
    model = _model("qwen3_moe", dtype=torch.bfloat16, device="cuda")
    mt.enable(model)
    ex = _first_experts(model)
    T = mt.GRAPH_MAX_TOKENS + 1
    E, K = ex.gate_up_proj.shape[0], model.config.num_experts_per_tok
    x = torch.randn(T, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    idx, w = _routing(T, E, K, seed=0, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        _call(ex, "moekit", x, idx, w)
    assert _graphs.count(ex) == 0


# ----------------------------------------------------------------------------------------------
# Interpreter tier: the Triton kernels of the whole pipeline on CPU tensors (float32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("path", ["decode", "sorted"])
@pytest.mark.parametrize("routing", ["distinct", "repeated_ids"])
def test_experts_module_triton_kernels_interpreted(family, path, routing, monkeypatch):
    """Force every moekit op onto its Triton launcher (run by the CPU interpreter): the kernel
    composition the CUDA path uses (index_shuffling, then the decode pipeline: gate|up GEMM with
    the fused SwiGLU, down GEMM with the weighted scatter-add; or the sorted one: the same fused
    gate|up GEMM at streaming sizes, else gather, grouped GEMM with bias and silu_mul; then the
    down GEMM's fused weighted scatter-add) must match the model's eager experts."""
    import importlib

    from moekit import settings

    for fam in ("routing", "gather_scatter", "grouped_gemm", "activation"):
        monkeypatch.setattr(importlib.import_module(f"moekit.ops.{fam}"), "use_triton", lambda t: True)
    tri = importlib.import_module("moekit.ops._triton.grouped_gemm")
    sw = importlib.import_module("moekit.ops._triton.gg_swiglu")
    launches = []
    real, real_sw = tri.grouped_gemm, sw.grouped_gemm_swiglu
    monkeypatch.setattr(tri, "grouped_gemm", lambda *a, **k: launches.append("gg") or real(*a, **k))
    monkeypatch.setattr(sw, "grouped_gemm_swiglu", lambda *a, **k: launches.append("swiglu") or real_sw(*a, **k))
    model = _model(family)
    mt.register()
    experts = _first_experts(model)
    E, D = experts.gate_up_proj.shape[0], model.config.hidden_size
    T = 9
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    idx, w = _routing(T, E, 2, seed=4) if routing == "distinct" else _dup_routing(T, E, 2, seed=4)
    ref = _call(experts, "eager", x, idx, w)
    with settings.override(moe_path=path):
        out = _call(experts, "moekit", x, idx, w)
    # GPT-OSS (biases, clamped gate) always takes the general composition; Qwen3's sorted path at
    # these sizes (a row or two per expert) fuses its gate/up too (knob BF16_STREAM_SWIGLU, on).
    fused = family == "qwen3_moe"
    assert launches == (["swiglu", "gg"] if fused else ["gg", "gg"])
    assert rel_error(out, ref) < 2e-3  # tl.dot in the interpreter: fp32 (tf32 on GPUs)


@pytest.mark.reference
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_compile_fullgraph(family):
    """Dynamo traces the moekit experts forward without a graph break (aot_eager keeps the CPU
    test fast; the repacked GPT-OSS weights come from the cache ``enable`` filled)."""
    torch._dynamo.reset()
    model = _model(family)
    mt.enable(model)
    experts = _first_experts(model)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    idx, w = _routing(9, 8, 2, seed=6)
    ref = _call(experts, "eager", x, idx, w)
    experts.config._experts_implementation = "moekit"
    before = mt.repack_count()
    with torch.no_grad():
        out = torch.compile(experts, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert mt.repack_count() == before
    assert rel_error(out.float(), ref) < 1e-5


@pytest.mark.gpu
def test_graphs_capture_again_after_every_graph_is_gone():
    """The shared pool outlives its graphs: dropping every graph (``enable`` with new options,
    ``release_cache``, a deleted model) and capturing again works, and the CUDA generator is left
    usable (a failed capture once left it mid-capture: every later ``randn`` raised)."""
    import warnings

    from moekit.integrations import _graphs

    for round_ in range(3):
        model = _model("qwen3_moe", dtype=torch.bfloat16, device="cuda", seed=round_)
        mt.enable(model)
        ex = _first_experts(model)
        E, D, K = ex.gate_up_proj.shape[0], model.config.hidden_size, model.config.num_experts_per_tok
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a failed capture warns
            for T in (1, 1, 1, 40, 40, 40):
                x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
                _call(ex, "moekit", x, *_routing(T, E, K, seed=T, device="cuda", dtype=torch.bfloat16))
        assert _graphs.count(ex) == 2
        if round_ == 0:
            mt.enable(model, deterministic=True)  # new options: graphs dropped, pool kept
            assert _graphs.count(ex) == 0
        else:
            mt.release_cache(model)
        del model, ex
        torch.cuda.synchronize()
        torch.randn(4, device="cuda")
