"""Random inputs: tie-free routing scores, routings, group sizes, model-shaped expert weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from moekit.layers.config import RoutingConfig, routing_default


def _gen(seed: Optional[int]) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(0 if seed is None else seed)
    return g


def tie_free_scores(
    T: int,
    E: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: Optional[int] = None,
    column_major: bool = False,
) -> torch.Tensor:
    """``[T, E]`` positive scores with no ties inside a row, exact in bf16, fp16 and fp32.

    Each row is a random permutation ``p`` of ``0..E-1`` mapped monotonically to
    ``(128 + p % 128) * 2**(p // 128 - 16)``: 8 significant bits, so every value is exact in
    bf16, and distinct ``p`` give distinct values (E up to 2048). ``column_major`` returns a
    ``[T, E]`` view of an ``[E, T]`` buffer.
    """
    if E > 2048:
        raise ValueError(f"tie_free_scores supports E <= 2048, got {E}")
    g = _gen(seed)
    p = torch.argsort(torch.rand(T, E, generator=g), dim=1)
    vals = (128 + p % 128).double() * torch.pow(2.0, (p // 128).double() - 16)
    vals = vals.to(dtype)
    if column_major:
        vals = vals.T.contiguous().T
    return vals.to(device)


def random_routing(
    T: int, E: int, top_k: int, device: torch.device | str = "cpu", seed: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform random top-k routing: ``(weights_TK float32 in (0, 1], ids_TK int64)`` with
    distinct experts per token."""
    g = _gen(seed)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :top_k]
    w = torch.rand(T, top_k, generator=g) * 0.9 + 0.1
    return w.to(device), ids.to(device)


def random_m_sizes(
    M: int, G: int, top_k: int = 1, device: torch.device | str = "cpu", seed: Optional[int] = None
) -> torch.Tensor:
    """int32 ``[G]`` group sizes summing to ``M``, as a random top-k routing of ``M // top_k``
    tokens spreads them (``M`` must be a multiple of ``top_k``; needs ``top_k <= G``)."""
    if M % top_k:
        raise ValueError(f"M ({M}) must be a multiple of top_k ({top_k})")
    _, ids = random_routing(M // top_k, G, top_k, seed=seed)
    return torch.bincount(ids.reshape(-1), minlength=G).to(torch.int32).to(device)


@dataclass(frozen=True)
class ModelShape:
    """MoE dimensions of a model: D (model dim), F (expert hidden), E experts, top_k, shared
    expert hidden size (0 = none), routing function and where the router weight is applied.

    The routing fields and their defaults are ``moekit.layers.RoutingConfig``'s (the field order
    here is this class's own: ``MODEL_SHAPES`` passes them by position); ``routing_config`` builds
    one."""

    name: str
    D: int
    F: int
    E: int
    top_k: int
    shared_F: int = 0
    score_func: str = routing_default("score_func")
    renormalize: bool = routing_default("renormalize")
    apply_router_weight_on_input: bool = routing_default("apply_router_weight_on_input")
    n_group: Optional[int] = routing_default("n_group")
    topk_group: Optional[int] = routing_default("topk_group")
    routed_scaling_factor: float = routing_default("routed_scaling_factor")

    @property
    def routing_config(self) -> RoutingConfig:
        """This model's routing as a ``RoutingConfig``."""
        return RoutingConfig.of(self)


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("llama4-scout", 5120, 8192, 16, 1, 8192, "sigmoid", False, True),
        ModelShape("llama4-maverick", 5120, 8192, 128, 1, 8192, "sigmoid", False, True),
        ModelShape("deepseek-v3", 7168, 2048, 256, 8, 2048, "sigmoid", True, False, 8, 4, 2.5),
        ModelShape("deepseek-v3-tp8", 7168, 256, 256, 8, 0, "sigmoid", True, False, 8, 4, 2.5),
        ModelShape("qwen3-30b-a3b", 2048, 768, 128, 8, 0, "softmax", True, False),
        ModelShape("gpt-oss-120b", 2880, 2880, 128, 4, 0, "topk_softmax", False, False),
        ModelShape("mixtral-8x7b", 4096, 14336, 8, 2, 0, "softmax", True, False),
        ModelShape("tiny", 64, 32, 6, 2, 32, "softmax", True, False),
    ]
}


# Float32 bytes above which ``random_expert_weights`` draws a stacked GPU weight one expert at a
# time (other values than one draw; no shape under it changes: gpt-oss-120b's w13 is 8.5 GB).
_ONE_DRAW_BYTES = 16 * 2**30


def random_expert_weights(
    shape: ModelShape | str,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: Optional[int] = None,
    num_experts: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Random weights for a named model shape, scaled like a trained layer (unit-variance
    activations in, about unit-variance out).

    Returns ``router_DE [D, E]``, ``w13_e2FD [E, 2F, D]`` (gate rows over up rows), ``w2_eDF
    [E, D, F]``, and when the model has one, ``shared_w13_2FD [2Fs, D]`` and ``shared_w2_DF
    [D, Fs]``; DeepSeek shapes also get ``e_score_correction_bias [E]``. ``num_experts``
    overrides E (e.g. the local experts of one expert-parallel rank).
    """
    s = MODEL_SHAPES[shape] if isinstance(shape, str) else shape
    E = s.E if num_experts is None else num_experts
    on_gpu = torch.device(device).type == "cuda"
    g = _gen(seed)
    if on_gpu:  # full-size models: drawn on the GPU (other values than the CPU's for a seed)
        g = torch.Generator(device=device)
        g.manual_seed(0 if seed is None else seed)

    def rnd(*dims: int, fan_in: int) -> torch.Tensor:
        if on_gpu and len(dims) == 3 and 4 * math.prod(dims) > _ONE_DRAW_BYTES:
            # One expert at a time: a single float32 draw of Llama 4 Maverick's w13 is 43 GB, and
            # its scaled copy as much again (more than an 80 GB card holds).
            out = torch.empty(*dims, dtype=dtype, device=device)
            for e in range(dims[0]):
                out[e] = (torch.randn(*dims[1:], generator=g, device=device) / fan_in**0.5).to(dtype)
            return out
        t = torch.randn(*dims, generator=g, device=device if on_gpu else "cpu")
        return (t / fan_in**0.5).to(dtype).to(device)

    out = {
        "router_DE": rnd(s.D, E, fan_in=s.D),
        "w13_e2FD": rnd(E, 2 * s.F, s.D, fan_in=s.D),
        "w2_eDF": rnd(E, s.D, s.F, fan_in=s.F),
    }
    if s.shared_F:
        out["shared_w13_2FD"] = rnd(2 * s.shared_F, s.D, fan_in=s.D)
        out["shared_w2_DF"] = rnd(s.D, s.shared_F, fan_in=s.shared_F)
    if s.n_group is not None:
        out["e_score_correction_bias"] = (torch.rand(E, generator=g, device=device if on_gpu else "cpu") * 0.1).to(
            device
        )
    return out
