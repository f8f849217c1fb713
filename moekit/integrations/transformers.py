"""Hugging Face transformers integration: moekit as an experts implementation.

transformers 5 dispatches the routed experts of most MoE models (the classes decorated with
``@use_experts_implementation``: Qwen2/Qwen3-MoE, Mixtral, DeepSeek-V2/V3, OLMoE, GPT-OSS, ...)
through ``ExpertsInterface``: the model computes its routing (top-k ids and weights) and calls
``experts_forward(module, hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K])``.
``register()`` adds moekit there under the name ``"moekit"``; then either

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit")

or ``enable(model)`` on a loaded model. Llama 4 text MoE blocks (whose experts do not go through
the interface) honour the same switch: ``register()`` wraps ``Llama4TextMoe.forward`` so that a
block whose config says ``"moekit"`` runs moekit (any other value: the model's own forward), and
``enable`` also patches each block. Other experts-like modules (a class named ``*Experts`` with 3-D
weights) next to supported routed experts, e.g. Inkling's ``shared_experts`` (dense: every token),
keep their own forward; elsewhere they are refused with their names.

The moekit forward (host-sync free, static shapes, CUDA-graph capturable) runs the MetaShuffling
pipeline on the routing the model already computed:

1. ``shuffle_top_k`` turns the model's choice into moekit's sorted rows, their router weights,
   the token-major inverse map and a zeroed output, in one launch (two past 64 tokens; no host
   sync). A token whose top-k names an expert twice gets a row per slot, each with its slot's
   weight, as eager / grouped_mm add one output per slot;
2. ``gather_scale_dense_tokens`` (unit scale: these models weight the expert *outputs*);
3. ``grouped_gemm`` on the fused gate|up weights (+ the model's bias, if any);
4. ``silu_mul`` when the model's gate is the standard concatenated SwiGLU, otherwise the model's
   own ``_apply_gate`` / ``act_fn`` on the GEMM output (e.g. GPT-OSS's clamped, interleaved
   SwiGLU);
5. ``grouped_gemm`` on the down weights with the router weights as ``token_weights`` and the
   fused scatter-add into the output (or, with a post-expert norm, GEMM -> norm -> weight ->
   ``scatter_add_dense_tokens``).

Weights: the usual ``[E, N, K]`` layout (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``) is
already moekit's ``w [E * N, K]``: a view, no copy. Transposed layouts (``[E, D, 2F]``, GPT-OSS,
Llama 4) are repacked once into a cached contiguous copy (extra memory: one copy of the experts),
keyed on the parameter's storage pointer, version counter, shape, strides, dtype and device, so a
load, an in-place update or ``.to()`` refreshes it on the next call (``enable`` makes the copies;
under ``torch.compile`` the cached copy is used as is: re-run ``enable`` after changing weights).
``repack_count()`` counts the repacks; ``release_cache(model)`` frees the copies.

Inference only: the moekit ops have no autograd formula. When autograd would need one (grad mode
on and the input or an expert weight requires grad, e.g. a forward outside ``torch.no_grad()``),
the call falls back to transformers' ``"grouped_mm"`` experts (Llama 4: the model's own forward)
with a warning, so gradients stay correct; ``generate`` and ``torch.no_grad()`` run moekit.
Not supported (clear ``TypeError``/``ValueError``): expert parallelism (``_is_expert_parallel``),
quantized (e.g. FP8) expert weights, ``D`` or ``F`` not multiples of 8.

Eager calls of at most ``GRAPH_MAX_TOKENS`` tokens on CUDA replay CUDA graphs of this forward
(``moekit.integrations._graphs``; ``enable(model, cuda_graphs=False)``: never): one per size up
to ``GRAPH_EXACT_TOKENS`` (decode steps), prompts padded to a bucket of sizes beyond (expert id -1
on the padding rows: they make no row).
"""

from __future__ import annotations

import functools
import types
from typing import NamedTuple, Optional

import torch

from moekit.integrations import _graphs
from moekit.integrations._hf_common import (
    _CACHE_ATTR,
    _DET_ATTR,
    _GRAPH_ATTR,
    _ORIG_FWD_ATTR,
    GRAPH_EXACT_TOKENS,
    GRAPH_MAX_TOKENS,
    IMPLEMENTATION,
    _bias,
    _is_silu,
    _needs_autograd,
    _rows,
    _warn_autograd_fallback,
    _weight,
    _where,
    repack_count,
)
from moekit.integrations._llama4 import (
    _install_llama4_dispatch,
    _is_llama4_moe,
    _llama4_moe_forward,
    _llama4_own_forward,  # noqa: F401 (the model's own forward: tests and callers reach it here)
    _llama4_weights,
    _set_llama4_impl,
)

__all__ = [
    "GRAPH_EXACT_TOKENS",
    "GRAPH_MAX_TOKENS",
    "IMPLEMENTATION",
    "SUPPORTED_MODELS",
    "disable",
    "enable",
    "experts_modules",
    "moekit_experts_forward",
    "register",
    "release_cache",
    "repack_count",
]


#: Model families tested end to end (CPU reference tier; CUDA in the gpu tier). Any other
#: ``@use_experts_implementation`` experts class with the standard attributes works too.
SUPPORTED_MODELS = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4 (text)", "inkling (text)")

#: The bf16 decode pipeline's row bound for this integration's calls that run eagerly
#: (``moekit.layers.experts.choose_path``): twice the layers' GPU-measured 2048, as eager calls are
#: paced by the host and that pipeline launches two kernels fewer (H200, Qwen3-30B 2-layer forward of
#: 512 tokens: 8495 against 9362 µs). Graphed calls, paced by the GPU, keep the layers' bound.
EAGER_DECODE_MAX_ROWS = 4096


def _interface():
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # transformers < 5, or not installed
        raise ImportError(
            "moekit.integrations.transformers needs transformers >= 5 (transformers.integrations.moe."
            "ExpertsInterface); install it with `pip install 'moekit[hf]'`"
        ) from e
    return ExpertsInterface


def register() -> None:
    """Register ``moekit_experts_forward`` as ``experts_implementation="moekit"`` (idempotent)."""
    iface = _interface()
    if iface._global_mapping.get(IMPLEMENTATION) is not moekit_experts_forward:
        iface.register(IMPLEMENTATION, moekit_experts_forward)
    _install_llama4_dispatch()


# ----------------------------------------------------------------------------------------------
# Module inspection
# ----------------------------------------------------------------------------------------------


def _uses_interface(module: torch.nn.Module) -> bool:
    """Experts classes decorated with ``@use_experts_implementation`` get these attributes."""
    attrs = ("has_gate", "is_transposed", "_is_expert_parallel", "config")
    return all(hasattr(module, a) for a in attrs)


def _looks_like_experts(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Experts") and any(p.dim() == 3 for p in module.parameters(recurse=False))


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every experts module moekit can run in ``model``:
    ``ExpertsInterface`` experts and Llama 4 text MoE blocks."""
    return [(n, m) for n, m in model.named_modules() if _uses_interface(m) or _is_llama4_moe(m)]


class _Plan(NamedTuple):
    w13: torch.Tensor  # [E * N1, D], N1 = 2F (gated) or F
    b13: Optional[torch.Tensor]  # [E, N1]
    w2: torch.Tensor  # [E * D, F]
    b2: Optional[torch.Tensor]  # [E, D]
    E: int
    D: int
    F: int
    fast_swiglu: bool
    post_norm: bool
    ptrs: tuple  # the weights' storage pointers (what a CUDA graph of this plan reads)


_PLAN_ATTR = "_moekit_plan"
_PLAN_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_PLAN_FLAGS = (
    "has_gate",
    "is_transposed",
    "has_bias",
    "_is_expert_parallel",
    "has_post_expert_norm",
    "is_concatenated",
)


def _plan_key(module: torch.nn.Module) -> tuple:
    """What ``_plan`` depends on: the weights (object, storage, in-place version), the flags and the
    activation; cheaper to build than the plan (every eager call checks it: instance attributes
    are read from the module's ``__dict__``, class ones from its type, no ``nn.Module.__getattr__``)."""
    d = module.__dict__
    params = d.get("_parameters", {})
    key: list = []
    for name in _PLAN_TENSORS:
        t = params.get(name)
        if t is None:
            t = d.get(name)
        key.append(None if t is None else (id(t), t.data_ptr(), t._version))
    cls = type(module)
    for f in _PLAN_FLAGS:
        key.append(d[f] if f in d else getattr(cls, f, None))
    act = d.get("_modules", {}).get("act_fn", d.get("act_fn"))
    key.append(id(act))
    key.append(getattr(cls, "_apply_gate", None))
    return tuple(key)


def _plan(module: torch.nn.Module) -> _Plan:
    """``_make_plan``, cached on the module while ``_plan_key`` holds (not under tracing: dynamo
    cannot trace the key; there the plan is made)."""
    if torch.compiler.is_compiling():
        return _make_plan(module)
    key = _plan_key(module)
    hit = module.__dict__.get(_PLAN_ATTR)
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = _make_plan(module)
    module.__dict__[_PLAN_ATTR] = (key, plan)
    return plan


def _make_plan(module: torch.nn.Module) -> _Plan:
    """Validate an ``ExpertsInterface`` experts module and return its weights in moekit layout."""
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(
            f"moekit's experts implementation does not support expert parallelism, got {_where(module)} with "
            "_is_expert_parallel=True (use a non-distributed load, or experts_implementation='grouped_mm')"
        )
    gated = bool(module.has_gate)
    transposed = bool(module.is_transposed)
    up_name = "gate_up_proj" if gated else "up_proj"
    w13 = _weight(module, up_name, transposed)
    w2 = _weight(module, "down_proj", transposed)
    up = getattr(module, up_name)
    E = up.shape[0]
    N1, D = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    if gated and N1 % 2:
        raise ValueError(f"{_where(module)}.{up_name} must have an even gate|up width, got shape {tuple(up.shape)}")
    F = N1 // 2 if gated else N1
    down = module.down_proj
    want_down = (E, F, D) if transposed else (E, D, F)
    if tuple(down.shape) != want_down:
        raise ValueError(f"{_where(module)}.down_proj must have shape {want_down}, got {tuple(down.shape)}")
    if down.dtype != up.dtype:
        raise TypeError(f"{_where(module)}: {up_name} is {up.dtype} but down_proj is {down.dtype}; they must match")
    if D % 8 or F % 8:
        raise ValueError(
            f"moekit's experts implementation needs the hidden size and the expert intermediate size to be "
            f"multiples of 8, got D={D}, F={F} in {_where(module)}"
        )
    b13 = b2 = None
    if getattr(module, "has_bias", False):
        b13 = _bias(module, f"{up_name}_bias", E, N1)
        b2 = _bias(module, "down_proj_bias", E, D)
    post_norm = bool(getattr(module, "has_post_expert_norm", False))
    if post_norm and not isinstance(getattr(module, "post_expert_norm", None), torch.nn.Module):
        raise TypeError(f"{_where(module)} has has_post_expert_norm=True but no post_expert_norm module")
    fast = False
    if gated and getattr(module, "is_concatenated", True) and _is_silu(getattr(module, "act_fn", None)):
        from transformers.integrations import moe as _hf_moe

        default_gate = getattr(_hf_moe, "_default_apply_gate", None)
        fast = default_gate is not None and getattr(type(module), "_apply_gate", None) is default_gate
    ptrs = tuple(None if t is None else t.data_ptr() for t in (w13, b13, w2, b2))
    return _Plan(w13, b13, w2, b2, E, D, F, fast, post_norm, ptrs)


# ----------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------


def moekit_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``ExpertsInterface`` function: ``[T, D]`` routed-experts output of ``hidden_states``
    ``[T, D]`` for the model's routing ``top_k_index`` / ``top_k_weights`` ``[T, K]``."""
    if _needs_autograd(self, hidden_states, top_k_weights):
        from transformers.integrations.moe import grouped_mm_experts_forward

        _warn_autograd_fallback("transformers' grouped_mm experts")
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    plan = _plan(self)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != plan.D:
        raise ValueError(f"hidden_states must have shape (T, {plan.D}), got {tuple(hidden_states.shape)}")
    T = hidden_states.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"top_k_index and top_k_weights must both have shape ({T}, K), got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}"
        )
    K = top_k_index.shape[1]
    if T == 0 or K == 0:
        return torch.zeros_like(hidden_states)
    deterministic = bool(getattr(self, _DET_ATTR, False))
    inputs = (hidden_states, top_k_index, top_k_weights)
    if _graphs.eligible(inputs, T, getattr(self, _GRAPH_ATTR, GRAPH_MAX_TOKENS)):
        fwd = functools.partial(_experts_forward, self, plan, deterministic, None)
        # Prompts are padded to a bucket of sizes with expert id -1 (no row, no GEMM work).
        # The plan's pointers stand for the module's parameters (``params=False``: no traversal).
        return _graphs.call(
            self, fwd, inputs, extra=(plan.ptrs, deterministic), exact=GRAPH_EXACT_TOKENS,
            pad=(None, -1, 0), params=False,
        )  # fmt: skip
    return _experts_forward(self, plan, deterministic, EAGER_DECODE_MAX_ROWS, *inputs)


def _experts_forward(self: torch.nn.Module, plan: _Plan, deterministic: bool, max_rows: Optional[int],
                     hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                     ) -> torch.Tensor:  # fmt: skip
    """The moekit experts forward on validated inputs (eager, or captured by ``_graphs``);
    ``max_rows``: the decode pipeline's row bound (``choose_path``; ``None``: the layers')."""
    from moekit.layers.experts import choose_path, run_experts, will_store_rows
    from moekit.ops import gather_scale_dense_tokens, grouped_gemm, scatter_add_dense_tokens, shuffle_top_k, silu_mul

    T = hidden_states.shape[0]
    dtype = plan.w13.dtype
    x = _rows(hidden_states.to(dtype))
    E, F = plan.E, plan.F
    K = top_k_index.shape[1]
    post_norm = plan.post_norm
    # The standard SwiGLU experts run moekit's one experts pipeline (the fused decode kernels at
    # small batches); its summed down rows are stored into out as it is (as moe_forward does), any
    # other down projection adds into out zeroed by shuffle_top_k's launch.
    standard = plan.fast_swiglu and plan.b13 is None and plan.b2 is None and not post_norm
    path = choose_path(T * K, E, top_k=K, max_rows=max_rows) if standard else None
    out = torch.empty((T, plan.D), dtype=dtype, device=x.device)
    empty = standard and will_store_rows(out, T * K, E, K, False, deterministic, path, down_k=F)
    counts, expert_ids, token_ids, token_weights, sel_rows = shuffle_top_k(
        top_k_index, top_k_weights, E, zero_buffer=None if empty else out
    )
    m_sizes = counts[:E]
    if standard:
        run_experts(
            x, plan.w13.view(E, 2 * F, plan.D), plan.w2.view(E, plan.D, F), m_sizes, token_ids=token_ids,
            expert_ids=expert_ids, row_weights=token_weights, selection_rows=sel_rows, out=out, out_empty=empty,
            deterministic=deterministic, path=path,
        )  # fmt: skip
        return out.to(hidden_states.dtype)
    xg = gather_scale_dense_tokens(x, token_ids, expert_ids, None)  # rows copied, unscaled
    h = grouped_gemm(xg, plan.w13, m_sizes, bias=plan.b13)
    if plan.fast_swiglu:
        z = silu_mul(h[:, :F], h[:, F:])
    else:
        z = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        z = z.to(dtype)
        if z.stride(-1) != 1:
            z = z.contiguous()

    if not post_norm:
        grouped_gemm(
            z, plan.w2, m_sizes, bias=plan.b2, token_weights=token_weights, _output_tensor=out,
            _scatter_add_indices=token_ids, deterministic=deterministic,
        )  # fmt: skip
    else:
        y = self.post_expert_norm(grouped_gemm(z, plan.w2, m_sizes, bias=plan.b2))
        y = (y * token_weights.unsqueeze(-1)).to(dtype)
        scatter_add_dense_tokens(out, y, token_ids, deterministic=deterministic)
    return out.to(hidden_states.dtype)


# ----------------------------------------------------------------------------------------------
# Enabling on a model
# ----------------------------------------------------------------------------------------------


def _set_impl(model: torch.nn.Module, mods: list[torch.nn.Module], impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    for m in mods:  # standalone experts modules, or sub-models the call above skipped
        if m.config._experts_implementation != impl:
            m.config._experts_implementation = impl


def _foreign_experts(model: torch.nn.Module, found: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """``"name (Class)"`` of the experts-like modules moekit cannot run: neither a supported experts
    module nor a sibling of supported routed experts (a sibling, e.g. Inkling's ``shared_experts``
    next to its routed ``experts``, keeps its own forward: moekit only replaces routed experts)."""
    routed = [m for _, m in found if _uses_interface(m)] + [m.experts for _, m in found if _is_llama4_moe(m)]
    covered = {id(m) for _, m in found} | {id(m) for m in routed}
    parent_of = {id(c): p for p in model.modules() for c in p.children()}
    hosts = {id(parent_of[id(m)]) for m in routed if id(m) in parent_of}
    return [
        f"{n or '<root>'} ({type(m).__name__})"
        for n, m in model.named_modules()
        if _looks_like_experts(m) and id(m) not in covered and id(parent_of.get(id(m))) not in hosts
    ]


def enable(model: torch.nn.Module, *, deterministic: bool = False, cuda_graphs: bool = True) -> torch.nn.Module:
    """Run every MoE experts module of ``model`` with moekit; returns ``model``.

    Registers the implementation, validates each experts module (raising ``TypeError`` /
    ``ValueError`` that names what is unsupported), switches ``ExpertsInterface`` experts to
    ``"moekit"`` and patches Llama 4 text MoE blocks. ``deterministic=True`` uses the
    atomics-free scatter-add (bitwise reproducible). ``cuda_graphs`` (default on): eager calls of
    at most ``GRAPH_MAX_TOKENS`` tokens on CUDA (decode steps and prompts; Llama 4 blocks: up to
    ``GRAPH_EXACT_TOKENS``) replay a CUDA graph of the moekit forward (prompts padded to a bucket of
    sizes), captured the second time an input signature is seen (see ``moekit.integrations._graphs``;
    never while torch.compile traces or a capture is running). Works on a whole model or a single
    experts / MoE module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be a bool, got {type(cuda_graphs).__name__}")
    register()
    found = experts_modules(model)
    foreign = _foreign_experts(model, found)
    if foreign:
        raise TypeError(
            "moekit cannot run these experts modules (they neither use transformers' ExpertsInterface "
            "(@use_experts_implementation) nor are Llama 4 text experts, nor sit next to such experts as "
            f"shared experts): {', '.join(foreign[:4])}" + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        )
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no MoE experts module moekit can run (an ExpertsInterface experts "
            "class or a Llama 4 text MoE block)"
        )
    iface = [m for _, m in found if _uses_interface(m)]
    for name, m in found:
        try:
            _llama4_weights(m) if _is_llama4_moe(m) else _plan(m)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name or '<root>'}: {e}") from e
    for name, m in found:
        graph_tokens = GRAPH_MAX_TOKENS if cuda_graphs else 0
        if (m.__dict__.get(_DET_ATTR), m.__dict__.get(_GRAPH_ATTR)) != (deterministic, graph_tokens):
            _graphs.clear(m)  # new options: the old graphs would only hold memory
        m.__dict__[_DET_ATTR] = deterministic
        m.__dict__[_GRAPH_ATTR] = graph_tokens
        if _is_llama4_moe(m) and _ORIG_FWD_ATTR not in m.__dict__:
            m.__dict__[_ORIG_FWD_ATTR] = m.__dict__.get("forward")
            m.forward = types.MethodType(_llama4_moe_forward, m)
    if iface:
        _set_impl(model, iface, IMPLEMENTATION)
    _set_llama4_impl([m for _, m in found if _is_llama4_moe(m)], IMPLEMENTATION)
    return model


def disable(model: torch.nn.Module, experts_implementation: str = "grouped_mm", *, release: bool = True
            ) -> torch.nn.Module:  # fmt: skip
    """Undo ``enable`` (or ``experts_implementation="moekit"`` at load): switch the experts to
    ``experts_implementation`` (transformers' default ``"grouped_mm"``, or ``"eager"``...; Llama 4
    blocks run their own forward for any value but ``"moekit"``), restore Llama 4 forwards and
    (``release``, default) free the repacked copies and CUDA graphs; ``release=False`` keeps them
    for a later ``enable`` with the same options (e.g. a benchmark switching back and forth)."""
    found = experts_modules(model)
    iface = [m for _, m in found if _uses_interface(m)]
    if iface:
        _set_impl(model, iface, experts_implementation)
    _set_llama4_impl([m for _, m in found if _is_llama4_moe(m)], experts_implementation)
    for _, m in found:
        if _is_llama4_moe(m) and _ORIG_FWD_ATTR in m.__dict__:
            orig = m.__dict__.pop(_ORIG_FWD_ATTR)
            del m.forward
            if orig is not None:
                m.forward = orig
        if release:
            m.__dict__.pop(_DET_ATTR, None)
            m.__dict__.pop(_GRAPH_ATTR, None)
    if release:
        release_cache(model)
    return model


def release_cache(model: torch.nn.Module) -> None:
    """Drop the repacked weight copies and the CUDA graphs held by ``model``'s experts modules
    (rebuilt on demand), and moekit's hold on the graphs' shared pool and static tensors (other
    models' graphs keep theirs; their next captures make new ones), so the memory goes once the
    model's graphs do."""
    for m in model.modules():
        m.__dict__.pop(_CACHE_ATTR, None)
        m.__dict__.pop(_PLAN_ATTR, None)
        _graphs.clear(m)
    _graphs.release_shared()
