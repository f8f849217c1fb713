"""Shared pieces of the transformers integration (``moekit.integrations.transformers`` and its
Llama 4 blocks, ``_llama4``): the option attributes it keeps on modules, the expert weights in
moekit's layout (views, or cached repacked copies), and the inference-only guard."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

IMPLEMENTATION = "moekit"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_ATTR = "_moekit_weight_cache"
_DET_ATTR = "_moekit_deterministic"
_GRAPH_ATTR = "_moekit_graph_tokens"
#: Eager experts calls of at most this many tokens replay CUDA graphs (``enable(model,
#: cuda_graphs=False)``: never); above ``GRAPH_EXACT_TOKENS`` padded to a bucket of sizes
#: (``moekit.integrations._graphs.bucket``), up to it one graph per size. Llama 4 blocks (whose
#: router runs inside the graph) take graphs up to ``GRAPH_EXACT_TOKENS`` only.
GRAPH_MAX_TOKENS = 2048
GRAPH_EXACT_TOKENS = 32
_ORIG_FWD_ATTR = "_moekit_original_forward"
_DISPATCH_ATTR = "_moekit_dispatch_original"
_repacks = [0]


def repack_count() -> int:
    """How many expert weights were repacked (copied into moekit's layout) in this process."""
    return _repacks[0]


def _where(module: torch.nn.Module) -> str:
    return type(module).__name__


def _weight(module: torch.nn.Module, attr: str, transposed: bool) -> torch.Tensor:
    """``getattr(module, attr)`` ``[E, N, K]`` (``[E, K, N]`` when transposed) as a 2-D
    ``[E * N, K]`` moekit weight: a view when the layout allows, else a cached repacked copy."""
    p = getattr(module, attr)
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{_where(module)}.{attr} must be a tensor of stacked expert weights, got {type(p).__name__}")
    if p.dim() != 3:
        raise ValueError(f"{_where(module)}.{attr} must be 3-D [experts, out, in], got shape {tuple(p.shape)}")
    if p.dtype not in _FLOATS:
        raise TypeError(
            f"moekit's experts implementation supports bfloat16 / float16 / float32 expert weights, got "
            f"{_where(module)}.{attr} of dtype {p.dtype} (quantized experts are not supported)"
        )
    t = p.detach()
    if not transposed and t.is_contiguous():
        return t.view(-1, t.shape[-1])
    cache = module.__dict__.setdefault(_CACHE_ATTR, {})
    hit = cache.get(attr)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the storage-pointer check: trust a copy made eagerly (``enable``
        # makes them), else repack inside the graph (a copy per call: call ``enable`` first).
        if hit is not None:
            return hit[1]
        src = t.transpose(1, 2) if transposed else t
        return src.contiguous().view(-1, src.shape[-1])
    key = (t.data_ptr(), p._version, tuple(t.shape), t.stride(), t.dtype, t.device)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        src = t.transpose(1, 2) if transposed else t
        packed = src.contiguous().view(-1, src.shape[-1])
    _repacks[0] += 1
    cache[attr] = (key, packed)
    return packed


def _bias(module: torch.nn.Module, attr: str, E: int, N: int) -> Optional[torch.Tensor]:
    b = getattr(module, attr, None)
    if b is None:
        return None
    if tuple(b.shape) != (E, N):
        raise ValueError(f"{_where(module)}.{attr} must have shape ({E}, {N}), got {tuple(b.shape)}")
    return b.detach()


def _is_silu(act: Any) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    return type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers")


def _needs_autograd(module: torch.nn.Module, *tensors: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return True
    return any(p.requires_grad for p in module.parameters())


def _warn_autograd_fallback(what: str) -> None:
    warnings.warn(
        f"moekit experts are inference-only: grad mode is on and the input or the expert weights require "
        f"grad, so this call runs {what}. Run under torch.no_grad() / torch.inference_mode() (generate "
        "does) to use moekit.",
        UserWarning,
        stacklevel=3,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Token rows as the gather op wants them (unit last stride, row stride a multiple of 8)."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8):
        return x.contiguous()
    return x
