"""The architectures ``moekit bench --hf`` builds: each transformers config class with the released
model's dims (``full``) and a scaled-down version for CPUs (``tiny``), and the random-weight model
built from one (no download)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Arch:
    """One architecture: the transformers config class, the released model's dims (``full``)
    and a scaled-down version for CPUs (``tiny``), both without the layer count and vocab."""

    name: str
    model: str  # the released model whose dims ``full`` holds
    config_class: str
    full: dict
    tiny: dict
    aliases: tuple = ()
    fixed: dict = field(default_factory=dict)  # applied to both sizes


_TINY_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch(
            "qwen3-moe",
            "Qwen3-30B-A3B",
            "Qwen3MoeConfig",
            full=dict(
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
            ),
            tiny=dict(
                hidden_size=128,
                intermediate_size=256,
                moe_intermediate_size=64,
                num_experts=16,
                num_experts_per_tok=8,
                **_TINY_ATTN,
            ),
            aliases=("qwen3_moe", "qwen3moe", "qwen3"),
            fixed=dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        ),
        Arch(
            "mixtral",
            "Mixtral-8x7B",
            "MixtralConfig",
            full=dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_local_experts=8,
                num_experts_per_tok=2,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
            ),
            tiny=dict(hidden_size=128, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, **_TINY_ATTN),
        ),
        Arch(
            "deepseek-v3",
            "DeepSeek-V3",
            "DeepseekV3Config",
            full=dict(
                hidden_size=7168,
                intermediate_size=18432,
                moe_intermediate_size=2048,
                n_routed_experts=256,
                num_experts_per_tok=8,
                n_group=8,
                topk_group=4,
                n_shared_experts=1,
                num_attention_heads=128,
                num_key_value_heads=128,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
            ),
            tiny=dict(
                hidden_size=128,
                intermediate_size=256,
                moe_intermediate_size=64,
                n_routed_experts=16,
                num_experts_per_tok=8,
                n_group=8,
                topk_group=4,
                n_shared_experts=1,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=64,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=16,
                v_head_dim=16,
            ),
            aliases=("deepseek_v3", "deepseekv3", "deepseek"),
            # Every layer an MoE layer (the released model's first 3 are dense).
            fixed=dict(first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True),
        ),
        Arch(
            "gpt-oss",
            "gpt-oss-120b",
            "GptOssConfig",
            full=dict(
                hidden_size=2880,
                intermediate_size=2880,
                num_local_experts=128,
                num_experts_per_tok=4,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                sliding_window=128,
            ),
            tiny=dict(
                hidden_size=128,
                intermediate_size=64,
                num_local_experts=16,
                num_experts_per_tok=4,
                sliding_window=16,
                **_TINY_ATTN,
            ),
            aliases=("gpt_oss", "gptoss"),
        ),
        Arch(
            "llama4",
            "Llama-4-Scout-17B-16E (text)",
            "Llama4TextConfig",
            full=dict(
                hidden_size=5120,
                intermediate_size=8192,
                intermediate_size_mlp=16384,
                num_local_experts=16,
                num_experts_per_tok=1,
                num_attention_heads=40,
                num_key_value_heads=8,
                head_dim=128,
            ),
            tiny=dict(
                hidden_size=128,
                intermediate_size=64,
                intermediate_size_mlp=256,
                num_local_experts=16,
                num_experts_per_tok=1,
                **_TINY_ATTN,
            ),
            aliases=("llama4_text", "llama4-text", "llama-4", "llama4-scout"),
            fixed=dict(interleave_moe_layer_step=1),
        ),
    ]
}


def resolve_arch(name: str) -> str:
    """The canonical name of ``name`` (case, ``-`` / ``_`` and aliases accepted), else a
    ``ValueError`` listing the choices."""
    key = name.strip().lower()
    for a in ARCHS.values():
        if key == a.name or key in a.aliases or key.replace("_", "-") == a.name:
            return a.name
    raise ValueError(f"unknown architecture {name!r} for --hf; choose from: {', '.join(ARCHS)} (or 'all')")


def parse_archs(spec: str) -> list[str]:
    """``--hf`` value: one name, several comma-separated, or ``all``."""
    if spec.strip().lower() == "all":
        return list(ARCHS)
    names = [resolve_arch(s) for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--hf needs an architecture; choose from: {', '.join(ARCHS)} (or 'all')")
    return list(dict.fromkeys(names))


def build_config(arch: str, *, size: str, layers: int, vocab: int):
    """The transformers config of ``arch`` at ``size`` ("full" or "tiny")."""
    import transformers

    a = ARCHS[arch]
    dims = dict(a.full if size == "full" else a.tiny)
    dims.update(a.fixed)
    dims.update(num_hidden_layers=layers, vocab_size=vocab, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                tie_word_embeddings=False)  # fmt: skip
    if arch == "gpt-oss":
        dims["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return getattr(transformers, a.config_class)(**dims)


def _fan_in(name: str, shape: torch.Size, hidden: int) -> int:
    """Input width of a stacked expert weight (``[E, out, in]`` or transposed ``[E, in, out]``)."""
    if name.endswith(("gate_up_proj", "up_proj")):
        return hidden
    other = [d for d in shape[1:] if d != hidden]
    return other[0] if other else hidden


def build_model(arch: str, *, size: str, layers: int, vocab: int, dtype: torch.dtype, device: torch.device,
                seed: int):  # fmt: skip
    """A random-weight causal LM of ``arch``, built directly on ``device`` in ``dtype``. The
    stacked expert weights get a 1/sqrt(fan-in) scale so that the experts carry a large part of
    each layer's output (with transformers' 0.02 init they would barely move the logits, and a
    broken experts implementation could pass the token check)."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(arch, size=size, layers=layers, vocab=vocab)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3:
                std = 1.0 / math.sqrt(_fan_in(name, p.shape, cfg.hidden_size))
                p.normal_(0.0, std, generator=g)
    gc_cfg = model.generation_config
    gc_cfg.eos_token_id = None
    gc_cfg.pad_token_id = 0
    gc_cfg.bos_token_id = None
    gc_cfg.do_sample = False
    for k in ("temperature", "top_p", "top_k"):
        if hasattr(gc_cfg, k):
            setattr(gc_cfg, k, None)
    return model


def expert_dims(model) -> dict:
    """D, F, E, top-k of ``model``'s first experts module (for the rows)."""
    from moekit.integrations import transformers as mt

    _, mod = mt.experts_modules(model)[0]
    ex = mod.experts if type(mod).__name__ == "Llama4TextMoe" else mod
    up = ex.gate_up_proj
    transposed = getattr(ex, "is_transposed", False) or type(ex).__name__ == "Llama4TextExperts"
    F = (up.shape[2] if transposed else up.shape[1]) // 2  # [E, D, 2F] or [E, 2F, D]
    cfg = model.config
    D = cfg.hidden_size
    E = up.shape[0]
    return dict(D=D, F=F, E=E, top_k=cfg.num_experts_per_tok, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size)
