"""Layer configuration: ``RoutingConfig`` (how router logits become expert choices and weights)
and ``MoEArgs`` (the static description of one MoE layer).

``RoutingConfig`` is the one declaration of the routing options and their defaults:
``MoEArgs`` and ``moekit.testing.ModelShape`` take the defaults of their routing fields from it
(``ROUTING_FIELDS``, ``routing_default``) and build one with ``RoutingConfig.of``.

This module is light on purpose (no ``moekit.ops`` import at import time): ``moekit.testing``
imports it when ``import moekit`` runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

from moekit._validate import check_int
from moekit.reference.routing import SCORE_FUNCS

__all__ = ["PRECISIONS", "EP_COMMS", "ROUTING_FIELDS", "RoutingConfig", "MoEArgs", "routing_default"]

PRECISIONS = ("bf16", "fp8_rowwise")
EP_COMMS = ("static", "dynamic")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------

_CHECK_ROUTING_OPTIONS: Optional[Callable[..., None]] = None


def _check_routing_options() -> Callable[..., None]:
    """``moekit.ops.routing.check_routing_options``, imported on first use (importing
    ``moekit.ops`` here would load every kernel module when ``import moekit`` runs)."""
    global _CHECK_ROUTING_OPTIONS
    if _CHECK_ROUTING_OPTIONS is None:
        from moekit.ops.routing import check_routing_options

        _CHECK_ROUTING_OPTIONS = check_routing_options
    return _CHECK_ROUTING_OPTIONS


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become expert choices and weights (``moekit.reference.routing_weights``'s
    contract). Validated on construction; the fit with the number of experts when used.

    ``apply_router_weight_on_input`` (Llama 4, the MetaShuffling layer's first model) is True by
    default: the expert sees ``x * w``; False multiplies the expert's output by ``w`` instead.
    """

    top_k: int = 1
    score_func: str = "sigmoid"
    renormalize: bool = False
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = True

    def __post_init__(self) -> None:
        _check_routing_options()(
            self.top_k, self.score_func, self.renormalize, self.n_group, self.topk_group, self.routed_scaling_factor
        )
        if not isinstance(self.apply_router_weight_on_input, bool):
            raise TypeError(
                f"apply_router_weight_on_input must be a bool, got {type(self.apply_router_weight_on_input).__name__}"
            )

    def check_experts(self, num_experts: int) -> None:
        _check_routing_options()(
            self.top_k, self.score_func, self.renormalize, self.n_group, self.topk_group,
            self.routed_scaling_factor, num_experts,
        )  # fmt: skip

    @classmethod
    def of(cls, obj: Any, **overrides: Any) -> "RoutingConfig":
        """The ``RoutingConfig`` of any object with the routing fields as attributes (``MoEArgs``,
        ``moekit.testing.ModelShape``); ``overrides`` replace some of them."""
        kw = {n: getattr(obj, n) for n in ROUTING_FIELDS}
        kw.update(overrides)
        return cls(**kw)


ROUTING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RoutingConfig))
_ROUTING_DEFAULTS = {f.name: f.default for f in fields(RoutingConfig)}


def routing_default(name: str) -> Any:
    """The default of ``RoutingConfig``'s field ``name`` (for classes that repeat the field)."""
    return _ROUTING_DEFAULTS[name]


# ----------------------------------------------------------------------------------------------
# Layer arguments
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEArgs:
    """Static description of one MoE layer.

    Sizes: ``dim`` D, ``hidden_dim`` F (routed expert hidden, global), ``num_experts`` E (global),
    ``top_k``, ``shared_hidden_dim`` (shared expert hidden; 0 = no shared expert).

    Routing (mapped onto ``RoutingConfig``, semantics of ``moekit.reference.routing_weights``):
    ``score_func`` ("sigmoid" | "softmax" | "topk_softmax"), ``renormalize``, DeepSeek grouped
    top-k ``n_group``/``topk_group``, ``routed_scaling_factor``, ``apply_router_weight_on_input``
    (Llama 4: the expert sees ``x * w``; else its output is multiplied by ``w``),
    ``score_correction_bias`` (DeepSeek-V3 ``e_score_correction_bias`` buffer, selection only),
    ``router_fp32`` (router logits computed in float32 from the upcast activations and weights).

    Numerics: ``precision`` of the routed experts and ``shared_precision`` of the shared expert
    (None = same as ``precision``), each "bf16" (weights and activations in ``dtype``) or
    "fp8_rowwise" (e4m3fn weights with row-wise scales, activations quantized row-wise on the
    fly, bf16 out; needs ``dtype=torch.bfloat16``). ``dtype`` is the activation / non-FP8 weight
    dtype (bf16, fp16 or fp32; fp32 is handy on the CPU). ``use_fast_accum`` for FP8 GEMMs.
    ``deterministic`` selects the atomics-free scatter-add (bitwise-reproducible outputs).

    Parallelism (defaults: one GPU): ``ep_size``/``ep_rank`` split the experts into contiguous
    blocks of ``num_experts // ep_size``; ``tp_size``/``tp_rank`` shard every expert's hidden dim
    (the layer then returns this shard's partial sum: the caller all-reduces over the TP group).
    ``ep_comm`` picks the expert-parallel communication of ``MetaShufflingMoE`` (ignored when
    ``ep_size == 1``): "static" (default; all-gather tokens, reduce-scatter back; static shapes, no
    host sync, CUDA-graph capturable; every rank must hold the same T) or "dynamic" (all-to-all of
    only the routed rows; one host sync per layer to size the buffers; T may differ per rank).
    ``dedup_comm`` (with ``ep_size > 1`` and ``tp_size > 1``; MSLK's option of the same name): the
    TP ranks of an EP rank hold the same tokens, so instead of each sending whole rows to the other
    EP ranks, each sends only its ``dim // tp_size`` column slice and the TP group all-gathers the
    slices; on the way back the TP group reduce-scatters the partial rows along ``dim`` before the
    EP exchange. The traffic between EP ranks (between nodes, in the usual layout: EP across nodes,
    TP inside one) drops by ``tp_size``. The layer then returns its TP rank's column slice of the
    routed output (zeros elsewhere) plus its shared-expert partial: still a partial sum that the
    caller's TP all-reduce completes. Needs ``tp_group`` (this process's TP group) at construction.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = routing_default("top_k")
    shared_hidden_dim: int = 0
    score_func: str = routing_default("score_func")
    renormalize: bool = routing_default("renormalize")
    n_group: Optional[int] = routing_default("n_group")
    topk_group: Optional[int] = routing_default("topk_group")
    routed_scaling_factor: float = routing_default("routed_scaling_factor")
    apply_router_weight_on_input: bool = routing_default("apply_router_weight_on_input")
    score_correction_bias: bool = False
    router_fp32: bool = True
    precision: str = "bf16"
    shared_precision: Optional[str] = None
    dtype: torch.dtype = torch.bfloat16
    use_fast_accum: bool = True
    deterministic: bool = False
    ep_size: int = 1
    ep_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    ep_comm: str = "static"
    dedup_comm: bool = False

    def __post_init__(self) -> None:
        check_int("dim", self.dim, lo=1)
        check_int("hidden_dim", self.hidden_dim, lo=1)
        check_int("num_experts", self.num_experts, lo=1)
        check_int("top_k", self.top_k, lo=1, hi=self.num_experts)
        check_int("shared_hidden_dim", self.shared_hidden_dim, lo=0)
        for name in ("renormalize", "apply_router_weight_on_input", "score_correction_bias", "router_fp32",
                     "use_fast_accum", "deterministic", "dedup_comm"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        if not isinstance(self.score_func, str) or self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(
                f"n_group and topk_group go together, got n_group={self.n_group}, topk_group={self.topk_group}"
            )
        if self.n_group is not None:
            check_int("n_group", self.n_group, lo=1, hi=self.num_experts)
            check_int("topk_group", self.topk_group, lo=1, hi=self.n_group)
            if self.num_experts % self.n_group:
                raise ValueError(f"n_group must divide num_experts ({self.num_experts}), got n_group={self.n_group}")
            per_group = self.num_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"top_k must be <= topk_group * experts per group ({self.topk_group * per_group}), "
                    f"got top_k={self.top_k}"
                )
        if self.score_func == "topk_softmax" and (self.n_group is not None or self.score_correction_bias):
            raise ValueError(
                "score_func='topk_softmax' takes neither n_group/topk_group nor score_correction_bias, got "
                f"n_group={self.n_group}, score_correction_bias={self.score_correction_bias}"
            )
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(self.routed_scaling_factor, (int, float)):
            raise TypeError(f"routed_scaling_factor must be a float, got {type(self.routed_scaling_factor).__name__}")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")
        for name in ("precision", "shared_precision"):
            v = getattr(self, name)
            if name == "shared_precision" and v is None:
                continue
            if v not in PRECISIONS:
                raise ValueError(f"{name} must be one of {PRECISIONS}, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be bfloat16, float16 or float32, got {self.dtype}")
        if "fp8_rowwise" in (self.precision, self.resolved_shared_precision) and self.dtype != torch.bfloat16:
            raise ValueError(
                f"dtype must be torch.bfloat16 when an expert precision is 'fp8_rowwise' (FP8 GEMMs "
                f"write bf16), got {self.dtype}"
            )
        check_int("ep_size", self.ep_size, lo=1, hi=self.num_experts)
        check_int("ep_rank", self.ep_rank, lo=0, hi=self.ep_size - 1)
        if self.num_experts % self.ep_size:
            raise ValueError(f"ep_size must divide num_experts ({self.num_experts}), got ep_size={self.ep_size}")
        if not isinstance(self.ep_comm, str):
            raise TypeError(f"ep_comm must be a str, one of {EP_COMMS}, got {type(self.ep_comm).__name__}")
        if self.ep_comm not in EP_COMMS:
            raise ValueError(f"ep_comm must be one of {EP_COMMS}, got {self.ep_comm!r}")
        check_int("tp_size", self.tp_size, lo=1)
        check_int("tp_rank", self.tp_rank, lo=0, hi=self.tp_size - 1)
        if self.hidden_dim % self.tp_size:
            raise ValueError(f"tp_size must divide hidden_dim ({self.hidden_dim}), got tp_size={self.tp_size}")
        if self.shared_hidden_dim % self.tp_size:
            raise ValueError(
                f"tp_size must divide shared_hidden_dim ({self.shared_hidden_dim}), got tp_size={self.tp_size}"
            )
        if self.dedup_comm and self.tp_size > 1 and (self.dim % self.tp_size or (self.dim // self.tp_size) % 8):
            raise ValueError(
                f"dedup_comm needs dim // tp_size to be a whole multiple of 8 (column slices of the rows), "
                f"got dim={self.dim}, tp_size={self.tp_size}"
            )

    @property
    def uses_dedup_comm(self) -> bool:
        """``dedup_comm`` takes effect (it needs both expert and tensor parallelism)."""
        return self.dedup_comm and self.ep_size > 1 and self.tp_size > 1

    # Derived sizes ----------------------------------------------------------------------------
    @property
    def resolved_shared_precision(self) -> str:
        return self.precision if self.shared_precision is None else self.shared_precision

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def expert_start(self) -> int:
        """First global expert held by this EP rank."""
        return self.ep_rank * self.num_local_experts

    @property
    def local_hidden_dim(self) -> int:
        return self.hidden_dim // self.tp_size

    @property
    def local_shared_hidden_dim(self) -> int:
        return self.shared_hidden_dim // self.tp_size

    @property
    def routing_config(self) -> RoutingConfig:
        """The routing fields as a ``RoutingConfig``."""
        return RoutingConfig.of(self, routed_scaling_factor=float(self.routed_scaling_factor))

    @classmethod
    def from_model_shape(cls, shape: Any, **overrides: Any) -> "MoEArgs":
        """Build from a ``moekit.testing.ModelShape`` (D, F, E, top_k, shared_F, routing)."""
        kw = {n: getattr(shape, n) for n in ROUTING_FIELDS}
        kw.update(dim=shape.D, hidden_dim=shape.F, num_experts=shape.E, shared_hidden_dim=shape.shared_F,
                  score_correction_bias=shape.n_group is not None)  # fmt: skip
        known = {f.name for f in fields(cls)}
        for k in overrides:
            if k not in known:
                raise TypeError(f"MoEArgs has no field {k!r}")
        kw.update(overrides)
        return cls(**kw)
