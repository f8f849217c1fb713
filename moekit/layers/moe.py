"""MoE layers: ``MoEArgs``, ``ScaledParameter``, expert weight holders, ``BaselineMoE`` and
``MetaShufflingMoE`` (DESIGN.md §1.1).

- ``BaselineMoE`` is the plain PyTorch pipeline: router matmul -> ``moekit.reference`` routing
  -> rows sorted by expert -> per-expert GEMMs (``torch._grouped_mm`` on CUDA in bf16) -> SwiGLU
  -> ``index_add_`` combine -> + shared expert. It syncs with the host (per-expert sizes) and is
  the semantics MetaShufflingMoE must reproduce.
- ``MetaShufflingMoE`` runs the sort-based, padding-free, host-sync-free forward of
  ``moekit.layers.functional.moe_forward`` (CUDA-graph capturable, ``torch.compile``-able), with
  the shared expert on a side CUDA stream; with ``ep_size > 1`` the static-shape expert-parallel
  path (all-gather tokens, local experts, reduce-scatter back) or, with ``ep_comm="dynamic"``,
  the all-to-all path (only routed rows travel; one host sync per layer).

Weights follow DESIGN §3: ``router_DE [D, E]``; routed ``w13_e2FD [e, 2F, D]`` (gate rows over up
rows) and ``w2_eDF [e, D, F]``; shared ``w13_2FD [2Fs, D]`` and ``w2_DF [D, Fs]``. FP8 row-wise
weights are ``ScaledParameter`` (e4m3fn data + float32 dequant scale per output row); the scales
are also registered buffers (``w13_scale_e2F``, ``w2_scale_eD``, ...) so they follow ``.to(device)``
and ``state_dict``. The layers are inference-only: parameters are frozen.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from moekit._checks import FP8_DTYPE, check_int, check_tensor, same_device
from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights
from moekit.layers.experts import choose_path, run_experts
from moekit.reference.quantize import DEFAULT_EPS, FUSED_EPS, quantize_rows
from moekit.reference.routing import SCORE_FUNCS, routing_weights

__all__ = [
    "PRECISIONS",
    "EP_COMMS",
    "MoEArgs",
    "ScaledParameter",
    "RoutedExperts",
    "SharedExperts",
    "BaselineMoE",
    "MetaShufflingMoE",
]

PRECISIONS = ("bf16", "fp8_rowwise")
EP_COMMS = ("static", "dynamic")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Arguments
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
    top_k: int = 1
    shared_hidden_dim: int = 0
    score_func: str = "sigmoid"
    renormalize: bool = False
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = True
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
                raise ValueError(
                    f"n_group must divide num_experts ({self.num_experts}), got n_group={self.n_group}"
                )
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
        return RoutingConfig(
            top_k=self.top_k,
            score_func=self.score_func,
            renormalize=self.renormalize,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=float(self.routed_scaling_factor),
            apply_router_weight_on_input=self.apply_router_weight_on_input,
        )

    @classmethod
    def from_model_shape(cls, shape: Any, **overrides: Any) -> "MoEArgs":
        """Build from a ``moekit.testing.ModelShape`` (D, F, E, top_k, shared_F, routing)."""
        kw = dict(
            dim=shape.D,
            hidden_dim=shape.F,
            num_experts=shape.E,
            top_k=shape.top_k,
            shared_hidden_dim=shape.shared_F,
            score_func=shape.score_func,
            renormalize=shape.renormalize,
            n_group=shape.n_group,
            topk_group=shape.topk_group,
            routed_scaling_factor=shape.routed_scaling_factor,
            apply_router_weight_on_input=shape.apply_router_weight_on_input,
            score_correction_bias=shape.n_group is not None,
        )
        known = {f.name for f in fields(cls)}
        for k in overrides:
            if k not in known:
                raise TypeError(f"MoEArgs has no field {k!r}")
        kw.update(overrides)
        return cls(**kw)


# ----------------------------------------------------------------------------------------------
# Scaled parameters and expert weight holders
# ----------------------------------------------------------------------------------------------


class ScaledParameter(torch.nn.Parameter):
    """A frozen ``Parameter`` whose data may be FP8 e4m3fn, carrying its float32 row-wise dequant
    ``scales`` (one per output row: ``w ~= data.float() * scales[..., None]``) or None (unscaled)."""

    def __new__(cls, data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> "ScaledParameter":
        return super().__new__(cls, data, False)

    def __init__(self, data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        self._scale: Optional[torch.Tensor] = scale

    @property
    def weights(self) -> torch.Tensor:
        return self.data

    @property
    def scales(self) -> torch.Tensor:
        if self._scale is None:
            raise ValueError("this ScaledParameter is not scaled (its scales are None)")
        return self._scale

    @scales.setter
    def scales(self, s: Optional[torch.Tensor]) -> None:
        self._scale = s

    @property
    def is_scaled(self) -> bool:
        return self._scale is not None

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (``data * scales[..., None]`` when scaled)."""
        w = self.data.float()
        return w * self._scale.float().unsqueeze(-1) if self._scale is not None else w

    def __deepcopy__(self, memo: dict) -> "ScaledParameter":
        if id(self) in memo:
            return memo[id(self)]
        scale = None if self._scale is None else copy.deepcopy(self._scale, memo)
        out = type(self)(self.data.clone(memory_format=torch.preserve_format), scale)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto: int) -> Any:
        return (_rebuild_scaled_parameter, (self.data, self._scale))

    def __repr__(self) -> str:
        tag = "scaled " if self.is_scaled else ""
        return f"ScaledParameter({tag}{self.dtype}, shape={tuple(self.shape)})"


def _rebuild_scaled_parameter(data: torch.Tensor, scale: Optional[torch.Tensor]) -> ScaledParameter:
    return ScaledParameter(data, scale)


def _seed_for(seed: int, salt: int, index: int) -> int:
    return (seed * 1_000_003 + salt * 10_007 + index) % (2**62)


def _randn(shape: tuple[int, ...], fan_in: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) / math.sqrt(fan_in)


def _check_precision(name: str, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")


class _Experts(torch.nn.Module):
    """Holds a gate|up weight ``w13`` and a down weight ``w2`` (bf16 or FP8 row-wise)."""

    _W13 = ""
    _W2 = ""
    _S13 = ""
    _S2 = ""

    def _set_weights(
        self, w13: torch.Tensor, w2: torch.Tensor, s13: Optional[torch.Tensor], s2: Optional[torch.Tensor]
    ) -> None:
        setattr(self, self._W13, ScaledParameter(w13, s13))
        setattr(self, self._W2, ScaledParameter(w2, s2))
        if s13 is not None:
            self.register_buffer(self._S13, s13)
            self.register_buffer(self._S2, s2)

    def _relink_scales(self) -> None:
        if self._S13 in self._buffers:
            self._parameters[self._W13].scales = self._buffers[self._S13]
            self._parameters[self._W2].scales = self._buffers[self._S2]

    def _apply(self, fn, recurse=True):  # keep ScaledParameter.scales pointing at the moved buffers
        out = super()._apply(fn, recurse)
        self._relink_scales()
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._relink_scales()

    @classmethod
    def _names(cls) -> tuple[str, str, str, str]:
        return cls._W13, cls._W2, cls._S13, cls._S2

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` in float32, in the subclass's layout."""
        return self.w13.dequantize(), self.w2.dequantize()

    @property
    def w13(self) -> ScaledParameter:
        return self._parameters[self._W13]

    @property
    def w2(self) -> ScaledParameter:
        return self._parameters[self._W2]

    @property
    def w13_scale(self) -> Optional[torch.Tensor]:
        return self._buffers.get(self._S13)

    @property
    def w2_scale(self) -> Optional[torch.Tensor]:
        return self._buffers.get(self._S2)

    @property
    def is_fp8_rowwise(self) -> bool:
        return self.w13.dtype == FP8_DTYPE

    @property
    def precision(self) -> str:
        return "fp8_rowwise" if self.is_fp8_rowwise else "bf16"

    @staticmethod
    def _prepare(
        w13: torch.Tensor,
        w2: torch.Tensor,
        s13: Optional[torch.Tensor],
        s2: Optional[torch.Tensor],
        precision: Optional[str],
        dtype: Optional[torch.dtype],
        names: tuple[str, str, str, str],
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Validate dtypes and quantize / cast to the requested precision."""
        n13, n2, ns13, ns2 = names
        check_tensor(n2, w2, device=w13.device)
        if precision is not None:
            _check_precision("precision", precision)
        fp8_in = w13.dtype == FP8_DTYPE
        if (w2.dtype == FP8_DTYPE) != fp8_in:
            raise TypeError(f"{n13} and {n2} must both be FP8 or both not, got {w13.dtype} and {w2.dtype}")
        if fp8_in:
            if precision == "bf16":
                raise ValueError(f"precision 'bf16' cannot take FP8 weights, got {n13} of dtype {w13.dtype}")
            if s13 is None or s2 is None:
                raise ValueError(f"FP8 weights need {ns13} and {ns2}, got {ns13}={s13 is not None and 'a tensor'}, "
                                 f"{ns2}={s2 is not None and 'a tensor'}")  # fmt: skip
            check_tensor(ns13, s13, dtype=torch.float32, shape=tuple(w13.shape[:-1]), device=w13.device)
            check_tensor(ns2, s2, dtype=torch.float32, shape=tuple(w2.shape[:-1]), device=w13.device)
            return w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous()
        for n, w in ((n13, w13), (n2, w2)):
            if w.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{n} must be bfloat16, float16, float32 or float8_e4m3fn, got {w.dtype}")
        if s13 is not None or s2 is not None:
            raise ValueError(f"{ns13}/{ns2} are only for FP8 weights, got {n13} of dtype {w13.dtype}")
        if precision == "fp8_rowwise":
            q13, s13 = quantize_expert_weights(w13)
            q2, s2 = quantize_expert_weights(w2)
            return q13.contiguous(), q2.contiguous(), s13.contiguous(), s2.contiguous()
        dt = w13.dtype if dtype is None else dtype
        return w13.to(dt).contiguous(), w2.to(dt).contiguous(), None, None


class RoutedExperts(_Experts):
    """The ``num_local_experts`` routed SwiGLU experts of one EP rank (one TP shard of F).

    Parameters: ``w13_e2FD [e, 2F, D]`` (expert g's gate rows ``[:F]`` over its up rows ``[F:]``)
    and ``w2_eDF [e, D, F]``; with FP8 also buffers ``w13_scale_e2F [e, 2F]``, ``w2_scale_eD [e, D]``.
    The seeded init is per global expert (``expert_offset + i``), so an EP rank holds exactly the
    slice of the single-GPU layer's experts.
    """

    _W13, _W2, _S13, _S2 = "w13_e2FD", "w2_eDF", "w13_scale_e2F", "w2_scale_eD"

    def __init__(
        self,
        num_local_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        precision: str = "bf16",
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device | str] = None,
        seed: int = 0,
        expert_offset: int = 0,
        _weights: Optional[tuple] = None,
    ) -> None:
        super().__init__()
        check_int("num_local_experts", num_local_experts, lo=1)
        check_int("dim", dim, lo=1)
        check_int("hidden_dim", hidden_dim, lo=1)
        _check_precision("precision", precision)
        self.num_local_experts, self.dim, self.hidden_dim = num_local_experts, dim, hidden_dim
        if _weights is None:
            check_int("seed", seed)
            dev = torch.device("cpu") if device is None else torch.device(device)
            e, D, F = num_local_experts, dim, hidden_dim
            w13 = torch.empty(e, 2 * F, D, dtype=torch.float32, device=dev)
            w2 = torch.empty(e, D, F, dtype=torch.float32, device=dev)
            for i in range(e):
                w13[i] = _randn((2 * F, D), D, _seed_for(seed, 1, expert_offset + i), dev)
                w2[i] = _randn((D, F), F, _seed_for(seed, 2, expert_offset + i), dev)
            _weights = self._prepare(w13, w2, None, None, precision, dtype, self._names())
        self._set_weights(*_weights)

    @classmethod
    def from_weights(
        cls,
        w13_e2FD: torch.Tensor,
        w2_eDF: torch.Tensor,
        *,
        w13_scale_e2F: Optional[torch.Tensor] = None,
        w2_scale_eD: Optional[torch.Tensor] = None,
        precision: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "RoutedExperts":
        """Load given weights (e.g. from a checkpoint). FP8 weights need their scales; float
        weights are kept in ``dtype`` (default: theirs) or quantized when ``precision='fp8_rowwise'``."""
        check_tensor("w13_e2FD", w13_e2FD, ndim=3)
        e, twoF, D = w13_e2FD.shape
        if twoF % 2:
            raise ValueError(f"w13_e2FD.shape[1] must be 2F (even), got {twoF}")
        check_tensor("w2_eDF", w2_eDF, shape=(e, D, twoF // 2))
        weights = cls._prepare(w13_e2FD, w2_eDF, w13_scale_e2F, w2_scale_eD, precision, dtype, cls._names())
        return cls(e, D, twoF // 2, precision=precision or "bf16", _weights=weights)

    @classmethod
    def from_unfused(
        cls,
        moe_w_in_eDF: torch.Tensor,
        moe_w_swiglu_eDF: torch.Tensor,
        moe_w_out_eFD: torch.Tensor,
        *,
        precision: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "RoutedExperts":
        """Load the MSLK layout: gate ``moe_w_in_eDF``, up ``moe_w_swiglu_eDF`` (``[e, D, F]``, ``x @ w``)
        and down ``moe_w_out_eFD`` (``[e, F, D]``)."""
        check_tensor("moe_w_in_eDF", moe_w_in_eDF, ndim=3)
        check_tensor("moe_w_swiglu_eDF", moe_w_swiglu_eDF, shape=tuple(moe_w_in_eDF.shape))
        e, D, F = moe_w_in_eDF.shape
        check_tensor("moe_w_out_eFD", moe_w_out_eFD, shape=(e, F, D))
        w13 = torch.cat([moe_w_in_eDF, moe_w_swiglu_eDF], dim=-1).transpose(1, 2)
        return cls.from_weights(w13, moe_w_out_eFD.transpose(1, 2), precision=precision, dtype=dtype)


class SharedExperts(_Experts):
    """The shared SwiGLU expert (one TP shard of its hidden dim).

    Parameters: ``w13_2FD [2F, D]`` (gate rows over up rows) and ``w2_DF [D, F]``; with FP8 also
    buffers ``w13_scale_2F [2F]`` and ``w2_scale_D [D]``.
    """

    _W13, _W2, _S13, _S2 = "w13_2FD", "w2_DF", "w13_scale_2F", "w2_scale_D"

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        precision: str = "bf16",
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device | str] = None,
        seed: int = 0,
        _weights: Optional[tuple] = None,
    ) -> None:
        super().__init__()
        check_int("dim", dim, lo=1)
        check_int("hidden_dim", hidden_dim, lo=1)
        _check_precision("precision", precision)
        self.dim, self.hidden_dim = dim, hidden_dim
        if _weights is None:
            check_int("seed", seed)
            dev = torch.device("cpu") if device is None else torch.device(device)
            w13 = _randn((2 * hidden_dim, dim), dim, _seed_for(seed, 3, 0), dev)
            w2 = _randn((dim, hidden_dim), hidden_dim, _seed_for(seed, 4, 0), dev)
            _weights = self._prepare(w13, w2, None, None, precision, dtype, self._names())
        self._set_weights(*_weights)

    @classmethod
    def from_weights(
        cls,
        w13_2FD: torch.Tensor,
        w2_DF: torch.Tensor,
        *,
        w13_scale_2F: Optional[torch.Tensor] = None,
        w2_scale_D: Optional[torch.Tensor] = None,
        precision: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "SharedExperts":
        """Load given weights; see ``RoutedExperts.from_weights``."""
        check_tensor("w13_2FD", w13_2FD, ndim=2)
        twoF, D = w13_2FD.shape
        if twoF % 2:
            raise ValueError(f"w13_2FD.shape[0] must be 2F (even), got {twoF}")
        check_tensor("w2_DF", w2_DF, shape=(D, twoF // 2))
        weights = cls._prepare(w13_2FD, w2_DF, w13_scale_2F, w2_scale_D, precision, dtype, cls._names())
        return cls(D, twoF // 2, precision=precision or "bf16", _weights=weights)

    @classmethod
    def from_unfused(
        cls,
        w_in_shared_FD: torch.Tensor,
        w_swiglu_FD: torch.Tensor,
        w_out_shared_DF: torch.Tensor,
        *,
        precision: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "SharedExperts":
        """Load the MSLK layout: gate ``w_in_shared_FD``, up ``w_swiglu_FD`` (``[F, D]``), down
        ``w_out_shared_DF`` (``[D, F]``)."""
        check_tensor("w_in_shared_FD", w_in_shared_FD, ndim=2)
        check_tensor("w_swiglu_FD", w_swiglu_FD, shape=tuple(w_in_shared_FD.shape))
        F, D = w_in_shared_FD.shape
        check_tensor("w_out_shared_DF", w_out_shared_DF, shape=(D, F))
        w13 = torch.cat([w_in_shared_FD, w_swiglu_FD], dim=0)
        return cls.from_weights(w13, w_out_shared_DF, precision=precision, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Baseline layer (plain PyTorch)
# ----------------------------------------------------------------------------------------------


def _fake_quant_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, eps: float) -> torch.Tensor:
    """FP8 row-wise GEMM in plain PyTorch: quantize the rows of ``x``, then
    ``(xq @ wq.T) * x_scale * w_scale`` in float32, returned in bf16 (like the FP8 kernels)."""
    xq, xs = quantize_rows(x.float(), eps=eps)
    y = (xq.float() @ w.float().T) * xs.unsqueeze(-1) * w_scale.float().unsqueeze(0)
    return y.to(torch.bfloat16)


def _silu_mul_f32(h: torch.Tensor) -> torch.Tensor:
    F = h.shape[-1] // 2
    h = h.float()
    return torch.nn.functional.silu(h[:, :F]) * h[:, F:]


def _check_process_group_type(kind: str, group: Any) -> None:
    """``group`` must be a ``torch.distributed.ProcessGroup`` (``kind``: "ep" or "tp"): anything
    else is a TypeError here, not an AttributeError from inside torch.distributed later."""
    import torch.distributed as dist

    pg_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if pg_type is None or not isinstance(group, pg_type):
        why = "" if pg_type is not None else " (this torch build has no torch.distributed)"
        raise TypeError(f"{kind}_group must be a torch.distributed.ProcessGroup{why}, got {type(group).__name__}")


def _check_process_group(kind: str, group: Any, size: int, rank: int) -> Any:
    """``group`` must have ``size`` ranks with this process at ``rank`` (``kind``: "ep" or "tp")."""
    import torch.distributed as dist

    _check_process_group_type(kind, group)
    got_size, got_rank = dist.get_world_size(group), dist.get_rank(group)
    if got_size != size or got_rank != rank:
        raise ValueError(
            f"{kind}_group must have size {kind}_size={size} with this process at rank {kind}_rank={rank}, "
            f"got size {got_size}, rank {got_rank}"
        )
    return group


class BaselineMoE(torch.nn.Module):
    """The plain PyTorch MoE layer (CPU and GPU): the semantics MetaShufflingMoE reproduces.

    ``forward(x)`` takes ``[T, D]`` or ``[B, S, D]`` in ``args.dtype`` and returns the same
    shape. Module state: ``router_DE [D, E]`` (in ``args.dtype``), optional
    ``e_score_correction_bias_E [E]`` (float32 buffer), ``routed_experts`` and ``shared_experts``
    (None without a shared expert). ``seed`` makes the init deterministic.

    With ``args.ep_size > 1`` pass the expert-parallel ``ep_group`` (its size and this process's
    rank must match ``args.ep_size`` / ``args.ep_rank``), and with ``args.dedup_comm`` the
    tensor-parallel ``tp_group`` (``args.tp_size`` / ``args.tp_rank``).
    """

    def __init__(
        self,
        args: MoEArgs,
        *,
        ep_group: Optional[Any] = None,
        tp_group: Optional[Any] = None,
        device: Optional[torch.device | str] = None,
        seed: int = 0,
        _weights: Optional[dict] = None,
    ) -> None:
        super().__init__()
        if not isinstance(args, MoEArgs):
            raise TypeError(f"args must be a MoEArgs, got {type(args).__name__}")
        self.args = args
        self.ep_group = self._check_group(args, ep_group)
        self.tp_group = self._check_tp_group(args, tp_group)
        self.cfg = args.routing_config
        D, E = args.dim, args.num_experts
        if _weights is None:
            check_int("seed", seed)
            dev = torch.device("cpu") if device is None else torch.device(device)
            router = _randn((D, E), D, _seed_for(seed, 0, 0), dev).to(args.dtype)
            self.router_DE = torch.nn.Parameter(router, requires_grad=False)
            if args.score_correction_bias:
                g = torch.Generator(device=dev)
                g.manual_seed(_seed_for(seed, 5, 0))
                bias = torch.rand(E, generator=g, device=dev) * 0.1
                self.register_buffer("e_score_correction_bias_E", bias)
            else:
                self.e_score_correction_bias_E = None
            self.routed_experts = RoutedExperts(
                args.num_local_experts, D, args.local_hidden_dim, precision=args.precision, dtype=args.dtype,
                device=dev, seed=self._shard_seed(seed), expert_offset=args.expert_start,
            )  # fmt: skip
            self.shared_experts = (
                SharedExperts(
                    D, args.local_shared_hidden_dim, precision=args.resolved_shared_precision, dtype=args.dtype,
                    device=dev, seed=self._shard_seed(seed),
                )  # fmt: skip
                if args.shared_hidden_dim
                else None
            )
        else:
            self.router_DE = torch.nn.Parameter(_weights["router_DE"], requires_grad=False)
            if _weights["bias"] is not None:
                self.register_buffer("e_score_correction_bias_E", _weights["bias"])
            else:
                self.e_score_correction_bias_E = None
            self.routed_experts = _weights["routed"]
            self.shared_experts = _weights["shared"]

    def _shard_seed(self, seed: int) -> int:
        # TP shards draw different weights; EP ranks share the seed (the init is per global expert).
        return seed + 7919 * self.args.tp_rank

    @staticmethod
    def _check_group(args: MoEArgs, ep_group: Optional[Any]) -> Optional[Any]:
        if args.ep_size == 1:
            if ep_group is not None:  # unused, but a wrong kind of argument all the same
                _check_process_group_type("ep", ep_group)
            return ep_group
        if ep_group is None:
            raise ValueError(f"ep_group is required when ep_size > 1, got None (ep_size={args.ep_size})")
        return _check_process_group("ep", ep_group, args.ep_size, args.ep_rank)

    @staticmethod
    def _check_tp_group(args: MoEArgs, tp_group: Optional[Any]) -> Optional[Any]:
        if not args.uses_dedup_comm:
            if tp_group is not None:  # unused, but a wrong kind of argument all the same
                _check_process_group_type("tp", tp_group)
            return tp_group
        if tp_group is None:
            raise ValueError(
                f"tp_group is required with dedup_comm=True, ep_size > 1 and tp_size > 1, got None "
                f"(ep_size={args.ep_size}, tp_size={args.tp_size})"
            )
        return _check_process_group("tp", tp_group, args.tp_size, args.tp_rank)

    @classmethod
    def from_weights(
        cls,
        args: MoEArgs,
        *,
        router_DE: torch.Tensor,
        w13_e2FD: torch.Tensor,
        w2_eDF: torch.Tensor,
        shared_w13_2FD: Optional[torch.Tensor] = None,
        shared_w2_DF: Optional[torch.Tensor] = None,
        e_score_correction_bias: Optional[torch.Tensor] = None,
        w13_scale_e2F: Optional[torch.Tensor] = None,
        w2_scale_eD: Optional[torch.Tensor] = None,
        shared_w13_scale_2F: Optional[torch.Tensor] = None,
        shared_w2_scale_D: Optional[torch.Tensor] = None,
        ep_group: Optional[Any] = None,
        tp_group: Optional[Any] = None,
    ):
        """Build the layer from given tensors (keys of ``moekit.testing.random_expert_weights``).

        Routed weights may hold all E experts (this EP rank's block is sliced out) or exactly the
        ``num_local_experts`` of this rank. Float weights are quantized when the args ask for FP8;
        FP8 weights need their scales. TP sharding is the caller's job (pass this shard's F).
        """
        if not isinstance(args, MoEArgs):
            raise TypeError(f"args must be a MoEArgs, got {type(args).__name__}")
        D, E, e = args.dim, args.num_experts, args.num_local_experts
        check_tensor("router_DE", router_DE, dtype=_FLOAT_DTYPES, shape=(D, E))
        dev = router_DE.device
        check_tensor("w13_e2FD", w13_e2FD, shape=(None, 2 * args.local_hidden_dim, D), device=dev)
        check_tensor("w2_eDF", w2_eDF, shape=(w13_e2FD.shape[0], D, args.local_hidden_dim), device=dev)
        if w13_e2FD.shape[0] not in (e, E):
            raise ValueError(
                f"w13_e2FD.shape[0] must be num_experts ({E}) or num_local_experts ({e}), got {w13_e2FD.shape[0]}"
            )
        if w13_e2FD.shape[0] != e:
            sl = slice(args.expert_start, args.expert_start + e)
            w13_e2FD, w2_eDF = w13_e2FD[sl], w2_eDF[sl]
            w13_scale_e2F = None if w13_scale_e2F is None else w13_scale_e2F[sl]
            w2_scale_eD = None if w2_scale_eD is None else w2_scale_eD[sl]
        routed = RoutedExperts.from_weights(
            w13_e2FD, w2_eDF, w13_scale_e2F=w13_scale_e2F, w2_scale_eD=w2_scale_eD,
            precision=args.precision, dtype=args.dtype,
        )  # fmt: skip
        shared = None
        if args.shared_hidden_dim:
            if shared_w13_2FD is None or shared_w2_DF is None:
                raise ValueError(
                    f"shared_w13_2FD and shared_w2_DF are required when shared_hidden_dim > 0 "
                    f"(got shared_hidden_dim={args.shared_hidden_dim})"
                )
            Fs = args.local_shared_hidden_dim
            check_tensor("shared_w13_2FD", shared_w13_2FD, shape=(2 * Fs, D), device=dev)
            check_tensor("shared_w2_DF", shared_w2_DF, shape=(D, Fs), device=dev)
            shared = SharedExperts.from_weights(
                shared_w13_2FD, shared_w2_DF, w13_scale_2F=shared_w13_scale_2F, w2_scale_D=shared_w2_scale_D,
                precision=args.resolved_shared_precision, dtype=args.dtype,
            )  # fmt: skip
        elif shared_w13_2FD is not None or shared_w2_DF is not None:
            raise ValueError("shared_w13_2FD/shared_w2_DF given but args.shared_hidden_dim is 0")
        bias = None
        if args.score_correction_bias:
            if e_score_correction_bias is None:
                raise ValueError("e_score_correction_bias is required when args.score_correction_bias is True, got None")
            check_tensor("e_score_correction_bias", e_score_correction_bias, shape=(E,), device=dev)
            bias = e_score_correction_bias.float().contiguous()
        elif e_score_correction_bias is not None:
            raise ValueError("e_score_correction_bias given but args.score_correction_bias is False")
        weights = {"router_DE": router_DE.to(args.dtype).contiguous(), "bias": bias, "routed": routed, "shared": shared}
        return cls(args, ep_group=ep_group, tp_group=tp_group, _weights=weights)

    # Helpers shared with MetaShufflingMoE ------------------------------------------------------
    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dtype=self.args.dtype)
        if x.dim() not in (2, 3):
            raise ValueError(f"x must be [T, D] or [B, S, D], got shape {tuple(x.shape)}")
        if x.shape[-1] != self.args.dim:
            raise ValueError(f"x must have the model dim D={self.args.dim} last, got shape {tuple(x.shape)}")
        if not same_device(x.device, self.router_DE.device):
            raise ValueError(f"x must be on the layer's device {self.router_DE.device}, got {x.device}")
        return x.reshape(-1, self.args.dim)

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` float32 router logits."""
        if self.args.router_fp32:
            return x_TD.float() @ self.router_DE.float()
        return (x_TD @ self.router_DE).float()

    def reference_weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights in float32 (FP8 dequantized) under ``moekit.reference.moe_forward``'s
        argument names: the oracle the layer is tested against."""
        w13, w2 = self.routed_experts.dequantized()
        out = {"router_DE": self.router_DE.float(), "w13_e2FD": w13, "w2_eDF": w2}
        if self.shared_experts is not None:
            out["shared_w13_2FD"], out["shared_w2_DF"] = self.shared_experts.dequantized()
        if self.e_score_correction_bias_E is not None:
            out["e_score_correction_bias"] = self.e_score_correction_bias_E
        return out

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_experts is not None

    # Forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = self._flatten(x)
        if self.args.ep_size > 1:
            raise NotImplementedError("BaselineMoE runs on one rank (ep_size=1); use MetaShufflingMoE for EP")
        out = self._routed_baseline(x_TD, self.router_logits(x_TD))
        if self.shared_experts is not None:
            out = out + self._shared_baseline(x_TD).float()
        return out.to(self.args.dtype).reshape(x.shape)

    def _shared_baseline(self, x_TD: torch.Tensor) -> torch.Tensor:
        se = self.shared_experts
        if se.is_fp8_rowwise:
            h = _fake_quant_mm(x_TD, se.w13.data, se.w13_scale, DEFAULT_EPS)
            return _fake_quant_mm(_silu_mul_f32(h), se.w2.data, se.w2_scale, FUSED_EPS)
        h = x_TD @ se.w13.data.T
        z = _silu_mul_f32(h).to(x_TD.dtype)
        return z @ se.w2.data.T

    def _routed_baseline(self, x_TD: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
        """Routed experts' sum in float32 ``[T, D]``."""
        a = self.args
        T, D = x_TD.shape
        K, E = a.top_k, a.num_experts
        out = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
        if T == 0:
            return out
        weights_TK, ids_TK = routing_weights(
            logits_TE, K, a.score_func, a.renormalize, n_group=a.n_group, topk_group=a.topk_group,
            e_score_correction_bias=self.e_score_correction_bias_E, routed_scaling_factor=float(a.routed_scaling_factor),
        )  # fmt: skip
        flat_ids = ids_TK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert, (token, slot) ascending
        tok_N = order // K
        w_N = weights_TK.reshape(-1)[order]
        counts_E = torch.bincount(flat_ids, minlength=E)
        xs = x_TD[tok_N]
        if a.apply_router_weight_on_input:
            xs = xs.float() * w_N.unsqueeze(1)  # FP8 quantizes the scaled float32 rows directly
        re = self.routed_experts
        # MetaShufflingMoE's decode pipeline uses FP8 weights weight-only (16-bit activations).
        weight_only = re.is_fp8_rowwise and choose_path(T * K, E, fp8=True) == "decode"
        if not re.is_fp8_rowwise:
            xs = xs.to(x_TD.dtype)
        if weight_only:
            w13d, w2d = re.dequantized()
            h = self._per_expert(xs.float(), w13d.float(), None, counts_E, 0.0)
            z = _silu_mul_f32(h).to(torch.bfloat16).float()
            y = self._per_expert(z, w2d.float(), None, counts_E, 0.0).to(torch.bfloat16)
        elif re.is_fp8_rowwise:
            h = self._per_expert(xs, re.w13.data, re.w13_scale, counts_E, FUSED_EPS)
            y = self._per_expert(_silu_mul_f32(h), re.w2.data, re.w2_scale, counts_E, FUSED_EPS)
        else:
            h = self._per_expert(xs, re.w13.data, None, counts_E, 0.0)
            y = self._per_expert(_silu_mul_f32(h).to(x_TD.dtype), re.w2.data, None, counts_E, 0.0)
        y = y.float()
        if not a.apply_router_weight_on_input:
            y = y * w_N.unsqueeze(1)
        if a.deterministic:
            # Fixed summation order: back to [T, K, D], sum over the k slots.
            per_slot = torch.empty_like(y)
            per_slot[order] = y
            return per_slot.view(T, K, D).sum(dim=1)
        return out.index_add_(0, tok_N, y)

    @staticmethod
    def _per_expert(
        xs: torch.Tensor, w_eNK: torch.Tensor, w_scale: Optional[torch.Tensor], counts_E: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``y[rows of e] = xs[rows of e] @ w[e].T`` for rows grouped by expert."""
        if w_scale is None and xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            try:
                offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
                return torch._grouped_mm(xs, w_eNK.transpose(-2, -1), offs=offs)
            except (RuntimeError, TypeError, NotImplementedError) as exc:  # older GPU / layout
                from moekit.ops._common import warn_once

                warn_once("baseline-grouped-mm", f"BaselineMoE: torch._grouped_mm failed ({type(exc).__name__}: "
                          f"{str(exc)[:120]}); the baseline runs a Python loop over experts instead")  # fmt: skip
        out_dtype = torch.bfloat16 if w_scale is not None else xs.dtype
        y = torch.empty(xs.shape[0], w_eNK.shape[1], dtype=out_dtype, device=xs.device)
        start = 0
        for e, n in enumerate(counts_E.tolist()):  # host sync: this is the baseline
            if n:
                rows = xs[start : start + n]
                if w_scale is not None:
                    y[start : start + n] = _fake_quant_mm(rows, w_eNK[e], w_scale[e], eps)
                else:
                    y[start : start + n] = rows @ w_eNK[e].T
            start += n
        return y


# ----------------------------------------------------------------------------------------------
# MetaShuffling layer
# ----------------------------------------------------------------------------------------------


class MetaShufflingMoE(BaselineMoE):
    """Sort-based, dropless, padding-free MoE layer with no host synchronization.

    One rank: ``moekit.layers.functional.moe_forward`` (index_shuffling -> gather (+FP8 quant) ->
    grouped GEMM -> SwiGLU (+quant) -> grouped GEMM with the fused scatter-add). On CUDA, with a
    shared expert and ``overlap_shared_expert`` (default True), the shared expert runs on a side
    stream concurrently with the whole routed path and is added at the end; otherwise it runs
    first and the routed rows are scatter-added into its output. CUDA-graph capturable;
    ``torch.compile(fullgraph=True)``-clean (on CUDA the side stream is skipped while compiling).

    ``ep_size > 1``: the static-shape expert-parallel path (``args.ep_comm == "static"``, see
    ``_ep_forward``) or the dynamic all-to-all path (``"dynamic"``, see ``_ep_dynamic_forward``).
    """

    def __init__(self, args: MoEArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        for name, v in (("dim", args.dim), ("hidden_dim // tp_size", args.local_hidden_dim),
                        ("shared_hidden_dim // tp_size", args.local_shared_hidden_dim)):  # fmt: skip
            if v % 8:
                raise ValueError(f"MetaShufflingMoE needs {name} to be a multiple of 8 (grouped GEMM), got {v}")
        self.overlap_shared_expert = True
        self._streams: dict[torch.device, tuple[Any, Any, Any]] = {}

    def __getstate__(self) -> dict:  # CUDA streams/events are per process: not copied or pickled
        state = super().__getstate__()
        state["_streams"] = {}
        return state

    def _side_stream(self, device: torch.device):
        key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
        got = self._streams.get(key)
        if got is None:
            got = (torch.cuda.Stream(device=key), torch.cuda.Event(), torch.cuda.Event())
            self._streams[key] = got
        return got

    def shared_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared expert ``[T, D]`` with moekit ops (dense GEMMs; FP8 row-wise when asked)."""
        from moekit.ops import f8f8bf16_rowwise, quantize_fp8_row, silu_mul, silu_mul_quant

        se = self.shared_experts
        F = se.hidden_dim
        if se.is_fp8_rowwise:
            xq, xs = quantize_fp8_row(x_TD)
            h = f8f8bf16_rowwise(xq, se.w13.data, xs, se.w13_scale, use_fast_accum=self.args.use_fast_accum)
            zq, zs = silu_mul_quant(h[:, :F], h[:, F:])
            return f8f8bf16_rowwise(zq, se.w2.data, zs, se.w2_scale, use_fast_accum=self.args.use_fast_accum)
        h = x_TD @ se.w13.data.T
        z = silu_mul(h[:, :F], h[:, F:])
        return z @ se.w2.data.T

    def _routed(self, x_TD: torch.Tensor, logits_TE: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
        re = self.routed_experts
        return moe_forward(
            x_TD, None, re.w13.data, re.w2.data, self.cfg, e_score_correction_bias=self.e_score_correction_bias_E,
            logits_TE=logits_TE, shared_out_TD=shared, w13_scale_e2F=re.w13_scale, w2_scale_eD=re.w2_scale,
            deterministic=self.args.deterministic, use_fast_accum=self.args.use_fast_accum,
        )  # fmt: skip

    def _route(
        self, logits_TE: torch.Tensor, start: int, end: int, zero_buffer: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, ...]:
        """``route_and_shuffle`` with this layer's routing, experts ``[start, end)`` kept."""
        from moekit.ops import route_and_shuffle

        c = self.cfg
        return route_and_shuffle(
            logits_TE, c.top_k, c.score_func, c.renormalize, n_group=c.n_group, topk_group=c.topk_group,
            e_score_correction_bias=self.e_score_correction_bias_E, routed_scaling_factor=c.routed_scaling_factor,
            expert_index_start=start, expert_index_end=end, zero_buffer=zero_buffer,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = self._flatten(x)
        if self.args.ep_size > 1:
            if self.args.ep_comm == "dynamic":
                return self._ep_dynamic_forward(x_TD).reshape(x.shape)
            return self._ep_forward(x_TD).reshape(x.shape)
        if x_TD.shape[0] == 0:  # static shape: nothing to route
            return torch.zeros_like(x)
        has_shared = self.shared_experts is not None
        overlap = (
            has_shared and x_TD.is_cuda and self.overlap_shared_expert and not torch.compiler.is_compiling()
        )
        if not overlap:
            shared = self.shared_forward(x_TD) if has_shared else None
            return self._routed(x_TD, self.router_logits(x_TD), shared).reshape(x.shape)

        main = torch.cuda.current_stream(x_TD.device)
        side, x_ready, shared_done = self._side_stream(x_TD.device)
        x_ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(x_ready)
            shared = self.shared_forward(x_TD)
            shared_done.record(side)
        x_TD.record_stream(side)  # x_TD is read on the side stream
        out = self._routed(x_TD, self.router_logits(x_TD), None)
        main.wait_event(shared_done)
        shared.record_stream(main)  # allocated on the side stream, consumed on the main one
        return out.add_(shared).reshape(x.shape)

    # Expert parallelism (static shapes) ---------------------------------------------------------
    def _ep_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Static-shape expert parallelism (every rank holds T tokens; no host sync).

        1. all-gather the tokens ``[R*T, D]`` and router logits ``[R*T, E]`` of the EP group;
        2. route all ``R*T`` tokens; ``index_shuffling`` keeps only this rank's experts
           ``[expert_start, expert_start + e)`` (the other rows come last as -1 and are skipped);
        3. gather (+ FP8 quant) -> grouped GEMM -> SwiGLU -> grouped GEMM scatter-added into a
           zero ``[R*T, D]`` partial output;
        4. reduce-scatter (sum over ranks) back to this rank's ``[T, D]``, + the shared expert.

        ``dedup_comm`` (EP x TP): step 1 all-gathers only this TP rank's column slice over the EP
        group, then the slices over the TP group; step 4 reduce-scatters the partial rows over the
        TP group (this rank's columns) before the EP group. 1 / tp_size of the bytes cross EP.

        The dynamic all-to-all path (one host sync per layer) is ``_ep_dynamic_forward``.
        """
        import torch.distributed as dist

        a, re = self.args, self.routed_experts
        R, (T, D), E, e, K = a.ep_size, x_TD.shape, a.num_experts, a.num_local_experts, a.top_k
        e0 = a.expert_start
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        logits_TE = self.router_logits(x_TD).contiguous()
        if a.uses_dedup_comm:
            x_all = self._dedup_gather_rows(x_TD.contiguous(), R * T, all_gather)
        else:
            x_all = torch.empty(R * T, D, dtype=x_TD.dtype, device=x_TD.device)
            all_gather(x_all, x_TD.contiguous(), group=self.ep_group)
        logits_all = torch.empty(R * T, E, dtype=torch.float32, device=x_TD.device)
        all_gather(logits_all, logits_TE, group=self.ep_group)
        shared = self.shared_forward(x_TD) if self.shared_experts is not None else None

        out_dtype = torch.bfloat16 if re.is_fp8_rowwise else x_TD.dtype
        partial = torch.empty(R * T, D, dtype=out_dtype, device=x_TD.device)  # zeroed by the routing launch
        counts, expert_ids, token_ids, row_weights, selection_rows = self._route(
            logits_all, e0, e0 + e, zero_buffer=partial
        )
        # The pipeline the single-GPU layer would take for all R * T tokens (same numerics).
        run_experts(
            x_all, re.w13.data, re.w2.data, counts[e0 : e0 + e], token_ids=token_ids, expert_ids=expert_ids,
            row_weights=row_weights, selection_rows=selection_rows, weight_on_input=a.apply_router_weight_on_input,
            w13_scale=re.w13_scale, w2_scale=re.w2_scale, out=partial, deterministic=a.deterministic,
            use_fast_accum=a.use_fast_accum, path=choose_path(R * T * K, E, fp8=re.is_fp8_rowwise, top_k=K),
        )  # fmt: skip
        if a.uses_dedup_comm:
            # Sum the TP shards' partial rows first (inside the TP group), this rank's column
            # slice only, then over the EP group: 1 / tp_size of the bytes between EP ranks.
            mine = self._dedup_reduce_rows(partial, reduce_scatter)
            out_slice = torch.empty(T, mine.shape[1], dtype=out_dtype, device=x_TD.device)
            reduce_scatter(out_slice, mine, group=self.ep_group)
            out = self._dedup_place(out_slice, D)
        else:
            out = torch.empty(T, D, dtype=out_dtype, device=x_TD.device)
            reduce_scatter(out, partial, group=self.ep_group)
        if shared is not None:
            out = out + shared
        return out.to(a.dtype)

    # Deduplicated communication across the TP group (``args.dedup_comm``) ----------------------
    def _dedup_slice(self, D: int) -> tuple[int, int]:
        """(columns per TP rank, this rank's first column)."""
        Ds = D // self.args.tp_size
        return Ds, self.args.tp_rank * Ds

    def _dedup_gather_rows(self, x_TD: torch.Tensor, rows: int, all_gather) -> torch.Tensor:
        """Static path: ``[T, D]`` (the same on every TP rank) -> the EP group's ``[R*T, D]``. Each
        TP rank all-gathers only its column slice over the EP group, then the TP group all-gathers
        the slices and the columns are put back in order."""
        T, D = x_TD.shape
        Ds, c0 = self._dedup_slice(D)
        part = torch.empty(rows, Ds, dtype=x_TD.dtype, device=x_TD.device)
        all_gather(part, x_TD[:, c0 : c0 + Ds].contiguous(), group=self.ep_group)
        return self._dedup_join_columns(part)

    def _dedup_join_columns(self, part_ND: torch.Tensor) -> torch.Tensor:
        """``[N, D / tp]`` column slices (this TP rank's) -> ``[N, D]`` after an all-gather over the
        TP group (raw bytes: FP8 rows travel on any backend)."""
        import torch.distributed as dist

        N, Ds = part_ND.shape
        tp = self.args.tp_size
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        full = torch.empty(tp * N, Ds, dtype=part_ND.dtype, device=part_ND.device)
        if N:  # every TP rank has the same N (same tokens, same deterministic routing)
            all_gather(full.view(torch.uint8), part_ND.contiguous().view(torch.uint8), group=self.tp_group)
        return full.view(tp, N, Ds).permute(1, 0, 2).reshape(N, tp * Ds)

    def _dedup_reduce_rows(self, partial_ND: torch.Tensor, reduce_scatter) -> torch.Tensor:
        """``[N, D]`` partial rows (this TP rank's hidden-dim shard) -> their sum over the TP group,
        this rank's column slice ``[N, D / tp]``."""
        N, D = partial_ND.shape
        tp = self.args.tp_size
        Ds = D // tp
        mine = torch.empty(N, Ds, dtype=partial_ND.dtype, device=partial_ND.device)
        if N:
            src = partial_ND.view(N, tp, Ds).transpose(0, 1).reshape(tp * N, Ds)  # block j: columns of rank j
            reduce_scatter(mine, src, group=self.tp_group)
        return mine

    def _dedup_place(self, slice_TDs: torch.Tensor, D: int) -> torch.Tensor:
        """This TP rank's column slice in a zero ``[T, D]``: the caller's TP all-reduce adds the
        slices of the other ranks."""
        Ds, c0 = self._dedup_slice(D)
        out = torch.zeros(slice_TDs.shape[0], D, dtype=slice_TDs.dtype, device=slice_TDs.device)
        out[:, c0 : c0 + Ds] = slice_TDs
        return out

    # Expert parallelism (dynamic shapes) --------------------------------------------------------
    def _ep_dynamic_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Dynamic-shape expert parallelism: every rank sends only the rows its tokens routed to
        each other rank (``args.ep_comm == "dynamic"``; T may differ between ranks, even be 0).

        1. route this rank's T tokens over all E experts; ``index_shuffling`` sorts the T*K rows
           by expert, hence by destination rank (rank r holds experts ``[r*e, (r+1)*e)``);
        2. all-to-all of the per-expert counts (``[E]`` -> ``[R, e]`` received), then **one host
           sync** (the documented exception, DESIGN §4) to size the receive buffers;
        3. gather the rows (scaled by the router weight when ``apply_router_weight_on_input``;
           FP8: quantized row-wise here, exactly as on one GPU, so half the bytes travel) and
           all-to-all them, with a float32 side-band per row (FP8 dequant scale, router weight
           when it applies on the output); the shared expert runs while they travel;
        4. ``combine_shuffling`` rank-major -> expert-major, grouped GEMM -> SwiGLU (+ quant) ->
           grouped GEMM (router weight in its epilogue when on the output), ``split_shuffling``
           back to rank-major and all-to-all back;
        5. scatter-add the returned rows into the shared expert's output (or zeros) at their
           tokens (``deterministic``: the atomics-free, bitwise-reproducible sum).

        ``dedup_comm`` (EP x TP): the rows cross the EP group as this TP rank's column slice and
        the TP group all-gathers them (step 3); the returned partial rows are reduce-scattered
        over the TP group first and only this rank's columns cross back (step 4). The TP ranks
        route identically (same tokens, deterministic ops), so no routing broadcast is needed.

        Not CUDA-graph capturable and not ``torch.compile(fullgraph=True)``-clean (the host sync and
        the data-dependent buffer sizes are the point of this path); use ``ep_comm="static"`` there.
        """
        import torch.distributed as dist

        from moekit.ops import (
            combine_shuffling,
            gather_scale_dense_tokens,
            gather_scale_quant_dense_tokens,
            scatter_add_dense_tokens,
            split_shuffling,
        )

        a, re = self.args, self.routed_experts
        R, (T, D), E, e, K = a.ep_size, x_TD.shape, a.num_experts, a.num_local_experts, a.top_k
        dev, group = x_TD.device, self.ep_group
        fp8 = re.is_fp8_rowwise
        out_dtype = torch.bfloat16 if fp8 else x_TD.dtype
        x_TD = x_TD.contiguous()
        N = T * K

        # 1. Local routing: rows sorted by global expert (all E in range: every row is valid).
        if T:
            counts, expert_ids, token_ids, row_weights, _ = self._route(self.router_logits(x_TD), 0, E)
            send_counts_E = counts[:E]
        else:  # a rank without tokens still takes part in every collective
            send_counts_E = torch.zeros(E, dtype=torch.int32, device=dev)
            expert_ids = token_ids = torch.zeros(0, dtype=torch.int32, device=dev)
            row_weights = torch.zeros(0, dtype=torch.float32, device=dev)

        # 2. Counts: send_counts_E[r*e + j] rows go to rank r's local expert j; recv_counts_Re[r, j]
        #    rows come from rank r for this rank's local expert j. Then the one host sync.
        recv_counts_E = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_E, send_counts_E, group=group)
        recv_counts_Re = recv_counts_E.view(R, e)
        per_rank = torch.stack([send_counts_E.view(R, e), recv_counts_Re]).sum(dim=-1)
        send_splits, recv_splits = per_rank.cpu().tolist()  # host sync (the documented exception)
        N_recv = sum(recv_splits)

        # 3. Send rows (FP8: quantized row-wise, half the bytes) with a float32 side band per row
        #    (FP8 dequant scale, router weight: the receiver applies it on the expert's input or
        #    output), all-to-all; the shared expert overlaps the exchange.
        ones = torch.ones((1, 1), dtype=torch.float32, device=dev).expand(T, E)
        meta_N8 = torch.zeros(N, 8, dtype=torch.float32, device=dev)
        meta_N8[:, 1] = row_weights
        if fp8:
            if T:
                send_x, x_scale = gather_scale_quant_dense_tokens(x_TD, token_ids, expert_ids, ones)
                meta_N8[:, 0] = x_scale
            else:
                send_x = torch.empty(0, D, dtype=FP8_DTYPE, device=dev)
        else:
            send_x = gather_scale_dense_tokens(x_TD, token_ids, expert_ids, ones) if T else x_TD[:0]
        dedup = a.uses_dedup_comm
        if dedup:  # only this TP rank's column slice crosses the EP group
            Ds, c0 = self._dedup_slice(D)
            recv_x = torch.empty(N_recv, Ds, dtype=send_x.dtype, device=dev)
            works = [_all_to_all_rows(recv_x, send_x[:, c0 : c0 + Ds], recv_splits, send_splits, group)]
        else:
            recv_x = torch.empty(N_recv, D, dtype=send_x.dtype, device=dev)
            works = [_all_to_all_rows(recv_x, send_x, recv_splits, send_splits, group)]
        recv_meta = torch.empty(N_recv, 8, dtype=torch.float32, device=dev)
        works.append(_all_to_all_rows(recv_meta, meta_N8, recv_splits, send_splits, group))
        shared = self.shared_forward(x_TD) if self.shared_experts is not None and T else None
        for w in works:
            w.wait()
        if dedup:
            recv_x = self._dedup_join_columns(recv_x)

        # 4. Local experts on the received rows, expert-major, then back to rank-major.
        if N_recv:
            xe, counts_out = combine_shuffling(recv_x, recv_counts_Re)
            me = combine_shuffling(recv_meta, recv_counts_Re)[0]
            y = run_experts(
                xe, re.w13.data, re.w2.data, counts_out[:e], row_weights=me[:, 1].contiguous(),
                weight_on_input=a.apply_router_weight_on_input, x_scale=me[:, 0].contiguous() if fp8 else None,
                w13_scale=re.w13_scale, w2_scale=re.w2_scale, use_fast_accum=a.use_fast_accum,
            )  # fmt: skip
            back = split_shuffling(y, recv_counts_Re)
        else:
            back = torch.empty(0, D, dtype=out_dtype, device=dev)
        if dedup:  # sum the TP shards' partial rows inside the TP group; only a slice goes back
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            back = self._dedup_reduce_rows(back, reduce_scatter)
        y_N = torch.empty(N, back.shape[1], dtype=out_dtype, device=dev)
        _all_to_all_rows(y_N, back, send_splits, recv_splits, group).wait()

        # 5. Rows back onto their tokens (same row order as this rank's routing).
        if dedup:
            routed = torch.zeros(T, y_N.shape[1], dtype=out_dtype, device=dev)
            if N:
                scatter_add_dense_tokens(routed, y_N, token_ids, deterministic=a.deterministic)
            out = self._dedup_place(routed, D)
            return (out if shared is None else out + shared).to(a.dtype)
        out = shared if shared is not None else torch.zeros(T, D, dtype=out_dtype, device=dev)
        if N:
            scatter_add_dense_tokens(out, y_N, token_ids, deterministic=a.deterministic)
        return out.to(a.dtype)


def _all_to_all_rows(
    out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> Any:
    """Asynchronous ``all_to_all_single`` of row blocks (``in_splits[r]`` rows of ``inp`` to rank
    r, ``out_splits[r]`` rows from rank r into ``out``), moved as raw bytes so that FP8 and bf16
    travel on any backend. Returns the work handle."""
    import torch.distributed as dist

    return dist.all_to_all_single(
        out.view(torch.uint8), inp.contiguous().view(torch.uint8), out_splits, in_splits, group=group, async_op=True
    )
