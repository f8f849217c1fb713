"""Llama 4 text MoE blocks in the transformers integration: their experts do not go through
transformers' ``ExpertsInterface``, so moekit replaces the block's forward (``register()`` wraps
``Llama4TextMoe.forward`` to follow the config's experts implementation; ``enable`` patches each
block)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from moekit.integrations import _graphs
from moekit.integrations._hf_common import (
    _DET_ATTR,
    _DISPATCH_ATTR,
    _FLOATS,
    _GRAPH_ATTR,
    _ORIG_FWD_ATTR,
    GRAPH_EXACT_TOKENS,
    GRAPH_MAX_TOKENS,
    IMPLEMENTATION,
    _is_silu,
    _needs_autograd,
    _rows,
    _warn_autograd_fallback,
    _weight,
)


def _install_llama4_dispatch() -> None:
    """Wrap ``Llama4TextMoe.forward`` (idempotent): a block whose config's experts implementation
    is ``"moekit"`` (``from_pretrained`` / ``from_config(..., experts_implementation="moekit")``)
    runs ``_llama4_moe_forward``; any other value runs the model's own forward, unchanged."""
    try:
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    except ImportError:  # no Llama 4 in this transformers
        return
    orig = Llama4TextMoe.__dict__.get("forward")
    if orig is None or hasattr(orig, _DISPATCH_ATTR):
        return

    @functools.wraps(orig)
    def forward(self, hidden_states):
        if _config_impl(self) == IMPLEMENTATION:
            return _llama4_moe_forward(self, hidden_states)
        return orig(self, hidden_states)

    setattr(forward, _DISPATCH_ATTR, orig)
    Llama4TextMoe.forward = forward


def _block_config(module: torch.nn.Module) -> Any:
    """The model config of an experts module or a Llama 4 MoE block (which holds none itself: its
    shared expert does)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        cfg = getattr(getattr(module, "shared_expert", None), "config", None)
    return cfg


def _config_impl(module: torch.nn.Module) -> Optional[str]:
    return getattr(_block_config(module), "_experts_implementation", None)


def _llama4_own_forward(module: torch.nn.Module):
    """The model's own ``forward`` of a Llama 4 MoE block (under moekit's dispatch wrapper)."""
    fwd = type(module).forward
    return getattr(fwd, _DISPATCH_ATTR, fwd)


def _is_llama4_moe(module: torch.nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return type(module).__name__ == "Llama4TextMoe" and type(experts).__name__ == "Llama4TextExperts"


def _llama4_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Validate a Llama 4 text MoE block; ``(w13 [E * 2F, D], w2 [E * D, F], E, F)`` in moekit's
    layout (cached repacked copies). Errors name the block's and the experts' classes."""
    ex = module.experts
    where = f"{type(module).__name__}.experts ({type(ex).__name__})"
    if not _is_silu(getattr(ex, "act_fn", None)):
        raise TypeError(
            f"{where}: moekit runs Llama 4 experts with SwiGLU (hidden_act='silu') only, got "
            f"{type(getattr(ex, 'act_fn', None)).__name__}"
        )
    up, down = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    for attr, p in (("gate_up_proj", up), ("down_proj", down)):
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"{where}.{attr} must be a 3-D tensor of stacked expert weights, got {got}")
        if p.dtype not in _FLOATS:
            raise TypeError(
                f"{where}.{attr}: moekit supports bfloat16 / float16 / float32 expert weights, got {p.dtype} "
                "(quantized experts are not supported)"
            )
    E, D, F2 = up.shape
    if F2 % 2 or tuple(down.shape) != (E, F2 // 2, D):
        raise ValueError(
            f"{where}: gate_up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, D, 2F] and [E, F, D]"
        )
    if down.dtype != up.dtype:
        raise TypeError(f"{where}: gate_up_proj is {up.dtype} but down_proj is {down.dtype}; they must match")
    if D % 8 or F2 % 16:
        raise ValueError(f"{where}: moekit needs D and F multiples of 8, got D={D}, F={F2 // 2}")
    w13 = _weight(ex, "gate_up_proj", transposed=True)  # [E * 2F, D]
    w2 = _weight(ex, "down_proj", transposed=True)  # [E * D, F]
    return w13, w2, E, F2 // 2


def _llama4_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """moekit replacement of ``Llama4TextMoe.forward``: the router's dense sigmoid scores (0 off
    the top-k) both select the experts and scale their inputs, as in the model."""
    if _needs_autograd(self, hidden_states):
        _warn_autograd_fallback("the model's own Llama 4 MoE forward")
        own = self.__dict__.get(_ORIG_FWD_ATTR)  # an instance forward ``enable`` replaced
        return own(hidden_states) if own is not None else _llama4_own_forward(self)(self, hidden_states)
    w13, w2, E, F = _llama4_weights(self)
    deterministic = bool(getattr(self, _DET_ATTR, False))
    rows = hidden_states.numel() // self.hidden_dim if hidden_states.dim() else 0
    # No padding for these blocks: their router reads every row (padding rows would make rows).
    limit = min(getattr(self, _GRAPH_ATTR, GRAPH_MAX_TOKENS), GRAPH_EXACT_TOKENS)
    if _graphs.eligible((hidden_states,), rows, limit):
        fwd = functools.partial(_llama4_block, self, w13, w2, E, F, deterministic)
        return _graphs.call(self, fwd, (hidden_states,), extra=(w13, w2, deterministic), exact=GRAPH_EXACT_TOKENS)
    return _llama4_block(self, w13, w2, E, F, deterministic, hidden_states)


def _llama4_block(self: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor, E: int, F: int, deterministic: bool,
                  hidden_states: torch.Tensor):  # fmt: skip
    """The moekit Llama 4 MoE block on validated weights (eager, or captured by ``_graphs``)."""
    from moekit.ops import gather_scale_dense_tokens, grouped_gemm, index_shuffling, silu_mul

    x = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(x)
    out = self.shared_expert(x)
    T = x.shape[0]
    if T == 0:
        return out, router_logits
    # A selected expert whose score underflowed to 0 may be swapped for another zero-score one:
    # its input is then scaled to 0 and, with no biases, so is its output (the same result).
    counts, expert_ids, token_ids = index_shuffling(router_scores, top_k=self.top_k)
    xg = gather_scale_dense_tokens(_rows(x.to(w13.dtype)), token_ids, expert_ids, router_scores)
    h = grouped_gemm(xg, w13, counts[:E])
    z = silu_mul(h[:, :F], h[:, F:])
    routed = torch.zeros((T, x.shape[1]), dtype=w13.dtype, device=x.device)
    grouped_gemm(
        z, w2, counts[:E], _output_tensor=routed, _scatter_add_indices=token_ids, deterministic=deterministic,
    )  # fmt: skip
    out.add_(routed.to(out.dtype))
    return out, router_logits


def _set_llama4_impl(blocks: list[torch.nn.Module], impl: str) -> None:
    """The experts implementation of Llama 4 blocks' config (``set_experts_implementation`` skips
    these models: their experts are no ``ExpertsInterface`` class). Only ``"moekit"`` changes what
    they run (``_install_llama4_dispatch``)."""
    for m in blocks:
        cfg = _block_config(m)
        if cfg is not None and getattr(cfg, "_experts_implementation", None) != impl:
            cfg._experts_implementation = impl
