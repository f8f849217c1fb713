"""``MoEBase``: what every MoE layer module holds and checks (DESIGN §1.1): the ``MoEArgs``, the
router ``router_DE [D, E]`` (in ``args.dtype``), the optional DeepSeek-V3 selection bias
``e_score_correction_bias_E [E]`` (float32 buffer), the routed and shared expert weights, the
expert- and tensor-parallel process groups (validated against the args), ``from_weights`` and the
router logits. ``BaselineMoE`` (the PyTorch oracle, ``moekit.layers.baseline``) and
``MetaShufflingMoE`` (``moekit.layers.moe``) each add their forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from moekit._validate import check_int, check_tensor, same_device
from moekit.layers.config import _FLOAT_DTYPES, MoEArgs
from moekit.layers.weights import RoutedExperts, SharedExperts, _randn, _seed_for

__all__ = ["MoEBase"]


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


class MoEBase(torch.nn.Module):
    """The state and checks shared by the MoE layer modules (no forward of its own).

    Module state: ``router_DE [D, E]`` (in ``args.dtype``), optional
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
                    D,
                    args.local_shared_hidden_dim,
                    precision=args.resolved_shared_precision,
                    dtype=args.dtype,
                    device=dev,
                    seed=self._shard_seed(seed),
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
                raise ValueError(
                    "e_score_correction_bias is required when args.score_correction_bias is True, got None"
                )
            check_tensor("e_score_correction_bias", e_score_correction_bias, shape=(E,), device=dev)
            bias = e_score_correction_bias.float().contiguous()
        elif e_score_correction_bias is not None:
            raise ValueError("e_score_correction_bias given but args.score_correction_bias is False")
        weights = {"router_DE": router_DE.to(args.dtype).contiguous(), "bias": bias, "routed": routed, "shared": shared}
        return cls(args, ep_group=ep_group, tp_group=tp_group, _weights=weights)

    # Helpers ------------------------------------------------------------------------------------
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
