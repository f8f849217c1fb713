"""Expert weights: ``ScaledParameter`` (a frozen parameter, FP8 e4m3fn data with row-wise
float32 dequant scales, or unscaled 16/32-bit data) and the holders ``RoutedExperts`` /
``SharedExperts`` (DESIGN §3 layouts; seeded init, ``from_weights``, ``from_unfused``).

FP8 scales are also registered buffers (``w13_scale_e2F``, ``w2_scale_eD``, ...) so they follow
``.to(device)`` and ``state_dict``; ``ScaledParameter.scales`` is re-linked to them after each.
Pickles name ``_rebuild_scaled_parameter`` of this module (older ones ``moekit.layers.moe``'s,
which re-exports it).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional

import torch

from moekit._validate import FP8_DTYPE, check_int, check_tensor
from moekit.layers.config import _FLOAT_DTYPES, PRECISIONS
from moekit.layers.functional import quantize_expert_weights

__all__ = ["ScaledParameter", "RoutedExperts", "SharedExperts"]


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

    def _init_weights(self, dim: int, hidden_dim: int, precision: str, dtype: torch.dtype,
                      device: Optional[torch.device | str], seed: int, weights: Optional[tuple],
                      draw: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]) -> None:  # fmt: skip
        """Check the sizes, then set ``weights`` (already prepared) or the seeded float32
        ``draw(device)`` cast / quantized to ``precision``."""
        check_int("dim", dim, lo=1)
        check_int("hidden_dim", hidden_dim, lo=1)
        _check_precision("precision", precision)
        self.dim, self.hidden_dim = dim, hidden_dim
        if weights is None:
            check_int("seed", seed)
            w13, w2 = draw(torch.device("cpu") if device is None else torch.device(device))
            weights = self._prepare(w13, w2, None, None, precision, dtype, self._names())
        self._set_weights(*weights)

    @classmethod
    def _load(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        s13: Optional[torch.Tensor],
        s2: Optional[torch.Tensor],
        precision: Optional[str],
        dtype: Optional[torch.dtype],
        ndim: int,
    ) -> Any:
        """``from_weights``: ``w13 [..., 2F, D]`` and ``w2 [..., D, F]`` with ``ndim`` dims."""
        n13, n2 = cls._W13, cls._W2
        check_tensor(n13, w13, ndim=ndim)
        *lead, twoF, D = w13.shape
        if twoF % 2:
            raise ValueError(f"{n13}.shape[{ndim - 2}] must be 2F (even), got {twoF}")
        check_tensor(n2, w2, shape=(*lead, D, twoF // 2))
        weights = cls._prepare(w13, w2, s13, s2, precision, dtype, cls._names())
        return cls(*lead, D, twoF // 2, precision=precision or "bf16", _weights=weights)

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
        self.num_local_experts = num_local_experts

        def draw(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            e, D, F = num_local_experts, dim, hidden_dim
            w13 = torch.empty(e, 2 * F, D, dtype=torch.float32, device=dev)
            w2 = torch.empty(e, D, F, dtype=torch.float32, device=dev)
            for i in range(e):
                w13[i] = _randn((2 * F, D), D, _seed_for(seed, 1, expert_offset + i), dev)
                w2[i] = _randn((D, F), F, _seed_for(seed, 2, expert_offset + i), dev)
            return w13, w2

        self._init_weights(dim, hidden_dim, precision, dtype, device, seed, _weights, draw)

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
        return cls._load(w13_e2FD, w2_eDF, w13_scale_e2F, w2_scale_eD, precision, dtype, ndim=3)

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

        def draw(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            w13 = _randn((2 * hidden_dim, dim), dim, _seed_for(seed, 3, 0), dev)
            return w13, _randn((dim, hidden_dim), hidden_dim, _seed_for(seed, 4, 0), dev)

        self._init_weights(dim, hidden_dim, precision, dtype, device, seed, _weights, draw)

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
        return cls._load(w13_2FD, w2_DF, w13_scale_2F, w2_scale_D, precision, dtype, ndim=2)

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
