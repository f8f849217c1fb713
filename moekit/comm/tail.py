"""The fused MoE-tail collective (vLLM Kimi-K3 ``CollectiveKernel`` API) and standalone
all-reduce + RMSNorm / reduce-scatter collectives built on the same Lamport machinery.

Backends:

- ``"symm_mem"``: one Triton launch per call on symmetric memory through peer pointers (no
  NVLink multicast), see ``moekit/comm/_triton_tail.py``. CUDA-graph capturable, no host sync.
- ``"torch"``: ``torch.distributed`` collectives (all-gather + float32 rank-order sum + RMSNorm,
  all-to-all for the shard), for gloo/CPU or where symmetric memory / P2P is unavailable.
- ``"auto"`` (default): ``"symm_mem"`` when every rank of the group supports it, else ``"torch"``.

Both give the same numbers: contributions travel as bf16, rank sums are float32 in rank order
0..R-1 (bitwise identical routed outputs on every rank), then RMSNorm * gamma.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from moekit._validate import check_int, same_device

__all__ = [
    "AllReduceRMSNorm",
    "CollectiveKernel",
    "ReduceScatterHidden",
    "UnfinalizedMoEOutput",
    "available_backends",
    "validate_shape",
]

MAX_TP = 16
MAX_TOP_K = 64
BACKENDS = ("auto", "symm_mem", "torch")


@dataclass
class UnfinalizedMoEOutput:
    """Unreduced routed expert outputs of this rank: ``gemm2_permuted [rows, L]`` bf16,
    ``expert_weights [M, K]`` (bf16 or float32), ``expanded_idx_to_permuted_idx [M, K]`` int32.
    The latent row of token t is ``sum_k expert_weights[t, k] * gemm2_permuted[idx[t, k]]``
    (float32, slots ascending), skipping ``idx < 0`` (an expert not local to this rank)."""

    gemm2_permuted: torch.Tensor
    expert_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor


def validate_shape(tp_size: int, latent_dim: int, hidden_dim: int) -> int:
    """Check what the kernel needs and return the shard width ``hidden_dim // tp_size``.

    ``1 <= tp_size <= 16``; ``latent_dim`` a positive multiple of 8; ``hidden_dim`` divisible by
    ``tp_size`` with a shard that is a positive multiple of 8 (16-byte fragments). Unlike the
    seed, the latent dim need not be a multiple of the shard and there is no cluster geometry.
    """
    check_int("tp_size", tp_size)
    check_int("latent_dim", latent_dim)
    check_int("hidden_dim", hidden_dim)
    if not 1 <= tp_size <= MAX_TP:
        raise ValueError(f"tp_size must be in [1, {MAX_TP}], got {tp_size}")
    if latent_dim <= 0 or latent_dim % 8:
        raise ValueError(f"latent_dim must be a positive multiple of 8, got {latent_dim}")
    if hidden_dim <= 0 or hidden_dim % tp_size:
        raise ValueError(f"hidden_dim must be a positive multiple of tp_size ({tp_size}), got {hidden_dim}")
    shard = hidden_dim // tp_size
    if shard % 8:
        raise ValueError(
            f"hidden_dim / tp_size (the shard) must be a multiple of 8, got {hidden_dim} / {tp_size} = {shard}"
        )
    return shard


def available_backends() -> list[str]:
    """Backends this process can run (``moekit env``): ``"torch"`` wherever torch.distributed
    exists, ``"symm_mem"`` with CUDA + Triton + symmetric memory + P2P between visible GPUs."""
    out = []
    if dist.is_available():
        out.append("torch")
    try:
        from moekit.comm.symm import symm_mem_supported

        if symm_mem_supported()[0]:
            out.append("symm_mem")
    except ImportError:  # no triton
        pass
    return out


def default_two_shot_min_m(tp_size: int, latent_dim: int) -> int:
    """From which M the routed role goes two-shot: never below 4 ranks (one-shot sends as many
    bytes at TP2 and fewer hops); otherwise once one-shot's egress per call, ``(R-1) * M * L``
    bf16 values, passes about 1 MiB (a heuristic to re-tune on the target machine)."""
    if tp_size < 4:
        return 1 << 30
    return max(1, math.ceil((1 << 20) / ((tp_size - 1) * latent_dim * 2)))


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover
        return False


def _expect(name: str, t: object, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """The seed's kind of check: contiguous, on the collective's device, given dtype and shape."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    if (
        tuple(t.shape) != tuple(shape)
        or t.dtype not in dtypes
        or not same_device(t.device, device)
        or not t.is_contiguous()
    ):
        extra = "" if t.is_contiguous() else ", non-contiguous"
        raise ValueError(
            f"{name} must be contiguous {device.type.upper()} {want} {list(shape)}, "
            f"got {str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}{extra}"
        )


def _rank2(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 2:
        raise ValueError(f"{name} must be rank-2, got shape {list(t.shape)}")
    return t


class _Collective:
    """Backend selection, state and error reporting shared by the collectives."""

    _state_handle: Optional[int] = None
    _state = None
    _failed: Optional[str] = None

    def _init_common(self, group, backend: str, timeout_s: float) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before creating a moekit.comm collective")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.timeout_s = float(timeout_s)
        self._requested_backend = backend
        pg_backend = str(dist.get_backend(self.group)).lower()
        on_cuda = torch.cuda.is_available() and "nccl" in pg_backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")

    def _check_group(self, rank: int, tp_size: int) -> None:
        size = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        if size != tp_size:
            raise ValueError(f"tp_size must equal the group size ({size}), got {tp_size}")
        if me != rank:
            raise ValueError(f"rank must be this process's rank in the group ({me}), got {rank}")

    def _choose_backend(self) -> str:
        """Agree on the backend across the group (collective)."""
        want = self._requested_backend
        if want == "torch":
            return "torch"
        ok, why = False, "the process group does not run on CUDA (NCCL)"
        if self.device.type == "cuda":
            from moekit.comm.symm import symm_mem_supported

            ok, why = symm_mem_supported()
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        every = bool(flag.item())
        if want == "symm_mem" and not every:
            raise RuntimeError(
                f"backend='symm_mem' is unavailable on this group ({why or 'not supported on another rank'}); "
                "use backend='torch' or 'auto'"
            )
        return "symm_mem" if every else "torch"

    def _init_symm(self, layout, max_programs: int) -> None:
        from moekit.comm.symm import create_symm_state, register_state, release_state

        self._state = create_symm_state(
            layout, self.group, self.device, timeout_s=self.timeout_s, max_programs=max_programs
        )
        self._state_handle = register_state(self._state)
        self._finalizer = weakref.finalize(self, release_state, self._state_handle)

    # errors -------------------------------------------------------------------------------
    def _missing_message(self, missing: list[int]) -> str:
        return (
            f"moekit.comm {type(self).__name__}: rank {self.rank} timed out after {self.timeout_s:g} s waiting "
            f"for data from rank(s) {missing} of its group (a rank skipped a call, used a different M, or died); "
            "this instance is no longer usable, create a new one"
        )

    def _raise_if_failed(self) -> None:
        """Non-blocking: the host-mapped error mirror (written by a kernel that timed out)."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
        st = self._state
        if st is None or st.host_errors is None or _compiling():
            return
        if st.host_errors.numpy().any():  # a plain host read of pinned memory, no CUDA call
            missing = st.host_errors.nonzero().flatten().tolist()
            self._failed = self._missing_message(missing)
            raise RuntimeError(self._failed)

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the missing source ranks if any call so far timed out.
        Synchronizes the device (not for the hot path); the next call also raises, without a
        sync, once the failed kernel has finished."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
        st = self._state
        if st is None:
            return
        errs = st.errors.cpu()
        if st.host_errors is not None:
            errs = errs | st.host_errors
        if bool(errs.any()):
            self._failed = self._missing_message(errs.nonzero().flatten().tolist())
            raise RuntimeError(self._failed)

    def close(self) -> None:
        """Release the symmetric workspace (collective: every rank should close)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        self._state = None


class CollectiveKernel(_Collective):
    """Fused MoE tail on a TP group, one launch per call (vLLM Kimi-K3 ``CollectiveKernel`` API).

    ``__call__(latent_source | UnfinalizedMoEOutput, shared_source, gamma)`` returns
    ``(latent_output[:m], shared_shard[:m])``:

    - routed role: ``latent = rms_norm(sum over ranks of latent_source) * gamma`` (bf16
      ``[m, L]``), identical on every rank. ``fp32_internal=False`` (the seed's upstream mode)
      rounds the rank sum to bf16 and squares in bf16; ``True`` stays in float32. With
      ``top_k > 0`` pass an ``UnfinalizedMoEOutput``: each rank's row is the top-k finalize of
      its unreduced expert outputs, rounded to bf16 before it is published.
    - shared role: ``shared_shard = (sum over ranks of shared_source)[:, rank*S:(rank+1)*S]``,
      ``S = hidden_dim / tp_size`` (a view of the ``[max_m, hidden_dim]`` ``shared_output``).

    Outputs are persistent buffers, valid until the next call. A disabled role's input may be
    ``None`` and its output is ``None``. ``max_token_ctas`` bounds the launch to that many
    tokens in flight (programs = tokens x chunks per token, never more than the SM count).
    ``timeout_s`` bounds every wait; after a timeout ``check()`` (or the next call) raises.
    ``two_shot_min_m``: from which M the routed role uses the two-shot path (default:
    ``default_two_shot_min_m``; pass a value above ``max_m`` to disable it).
    """

    def __init__(
        self,
        *,
        group: Optional[dist.ProcessGroup],
        rank: int,
        tp_size: int,
        latent_dim: int,
        hidden_dim: int,
        max_m: int,
        max_token_ctas: int,
        rms_eps: float,
        fp32_internal: bool,
        top_k: int = 0,
        include_routed: bool = True,
        include_reduce_scatter: bool = True,
        backend: str = "auto",
        timeout_s: float = 5.0,
        two_shot_min_m: Optional[int] = None,
    ) -> None:
        self.shard_dim = validate_shape(tp_size, latent_dim, hidden_dim)
        check_int("rank", rank)
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank must be in [0,{tp_size}), got {rank}")
        if not include_routed and not include_reduce_scatter:
            raise ValueError("at least one collective role must be enabled")
        check_int("max_m", max_m, lo=1)
        check_int("max_token_ctas", max_token_ctas, lo=1)
        check_int("top_k", top_k, lo=0, hi=MAX_TOP_K)
        _check_eps("rms_eps", rms_eps)
        if not isinstance(fp32_internal, bool):
            raise TypeError(f"fp32_internal must be a bool, got {type(fp32_internal).__name__}")
        if two_shot_min_m is not None:
            check_int("two_shot_min_m", two_shot_min_m, lo=1)
        self._init_common(group, backend, timeout_s)
        self._check_group(rank, tp_size)
        self.rank, self.tp_size = rank, tp_size
        self.latent_dim, self.hidden_dim = latent_dim, hidden_dim
        self.max_m, self.max_token_ctas = max_m, max_token_ctas
        self.rms_eps = float(rms_eps)
        self.fp32_internal = fp32_internal
        self.top_k = top_k
        self.include_routed = include_routed
        self.include_reduce_scatter = include_reduce_scatter
        self.two_shot_min_m = default_two_shot_min_m(tp_size, latent_dim) if two_shot_min_m is None else two_shot_min_m
        self.backend = self._choose_backend()
        dev = self.device
        self._latent_output = torch.empty((max_m, latent_dim), dtype=torch.bfloat16, device=dev)
        self._shared_output = torch.empty((max_m, hidden_dim), dtype=torch.bfloat16, device=dev)
        lo = rank * self.shard_dim
        self._shared_shard = self._shared_output[:, lo : lo + self.shard_dim]
        if self.backend == "symm_mem":
            from moekit.comm._triton_tail import TailLayout, choose_blocks

            layout = TailLayout(
                rank=rank,
                tp_size=tp_size,
                latent_dim=latent_dim if include_routed else 0,
                hidden_dim=hidden_dim if include_reduce_scatter else 0,
                max_m=max_m,
                top_k=top_k,
                routed=include_routed,
                shared=include_reduce_scatter,
                fp32_internal=fp32_internal,
                two_shot_min_m=self.two_shot_min_m,
            )
            blk = choose_blocks(layout)
            per_token = max(
                (math.ceil(latent_dim / blk.block_p) if include_routed else 0)
                + (math.ceil(self.shard_dim / blk.block_s) if include_reduce_scatter else 0),
                1,
            )
            self._init_symm(layout, max_programs=max_token_ctas * per_token)

    @property
    def latent_output(self) -> torch.Tensor:
        """``[max_m, latent_dim]`` bf16: the routed output of the last call (rows ``[:m]``)."""
        return self._latent_output

    @property
    def shared_output(self) -> torch.Tensor:
        """``[max_m, hidden_dim]`` bf16; this rank's shard columns hold the last call's result."""
        return self._shared_output

    @property
    def shared_shard(self) -> torch.Tensor:
        return self._shared_shard

    def _validate(self, latent_source, shared_source, gamma):
        dev = self.device
        L, H = self.latent_dim, self.hidden_dim
        bf16 = (torch.bfloat16,)
        gemm2 = wts = idx = None
        m = None
        if self.include_routed:
            if isinstance(latent_source, UnfinalizedMoEOutput):
                if self.top_k <= 0:
                    raise ValueError("collective was not configured for top-k finalize")
                gemm2 = _rank2("gemm2_permuted", latent_source.gemm2_permuted)
                wts = _rank2("expert_weights", latent_source.expert_weights)
                idx = _rank2("expanded_idx_to_permuted_idx", latent_source.expanded_idx_to_permuted_idx)
                m = idx.shape[0]
                _expect("gemm2_permuted", gemm2, (gemm2.shape[0], L), bf16, dev)
                _expect("expert_weights", wts, (m, self.top_k), (torch.bfloat16, torch.float32), dev)
                _expect("expanded_idx_to_permuted_idx", idx, (m, self.top_k), (torch.int32, torch.int64), dev)
            else:
                if self.top_k > 0:
                    raise ValueError("top-k collective requires an unfinalized output")
                gemm2 = _rank2("latent_source", latent_source)
                m = gemm2.shape[0]
                _expect("latent_source", gemm2, (m, L), bf16, dev)
            _expect("gamma", gamma, (L,), bf16, dev)
        if self.include_reduce_scatter:
            _rank2("shared_source", shared_source)
            if m is None:
                m = shared_source.shape[0]
            _expect("shared_source", shared_source, (m, H), bf16, dev)
        if not 1 <= m <= self.max_m:
            raise ValueError(f"runtime M={m} must be in [1, {self.max_m}]")
        return m, gemm2, wts, idx

    def __call__(
        self,
        latent_source: Union[torch.Tensor, UnfinalizedMoEOutput, None],
        shared_source: Optional[torch.Tensor],
        gamma: Optional[torch.Tensor],
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        self._raise_if_failed()
        m, src, wts, idx = self._validate(latent_source, shared_source, gamma)
        routed, shared = self.include_routed, self.include_reduce_scatter
        if self.backend == "symm_mem":
            torch.ops.moekit.symm_moe_tail_(
                self._state_handle,
                m,
                self.rms_eps,
                -1,
                src,
                wts,
                idx,
                None,
                gamma if routed else None,
                shared_source if shared else None,
                self._latent_output if routed else None,
                self._shared_shard if shared else None,
            )
        else:
            from moekit.comm import fallback as fb

            if routed:
                x = fb.finalize_bf16(src, wts, idx) if idx is not None else src
                fb.routed_all_reduce_rms_norm(
                    x,
                    gamma,
                    self._latent_output,
                    group=self.group,
                    world_size=self.tp_size,
                    eps=self.rms_eps,
                    fp32_internal=self.fp32_internal,
                )
            if shared:
                fb.shared_reduce_scatter(shared_source, self._shared_shard, group=self.group, world_size=self.tp_size)
        return (
            self._latent_output[:m] if routed else None,
            self._shared_shard[:m] if shared else None,
        )


def _check_eps(name: str, eps: object) -> float:
    """The RMSNorm eps, checked as ``moekit.ops.rms_norm`` checks it: a number (TypeError
    otherwise), finite and non-negative (ValueError: NaN or a negative eps would turn every
    output into NaN, an infinite one every output into 0)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name} must be a non-negative float and finite, got {eps!r}")
    return float(eps)


class AllReduceRMSNorm(_Collective):
    """``all_reduce_rms_norm(x, gamma, eps=None, residual=None)``: ``rms_norm(sum over ranks
    of x (+ residual)) * gamma`` for ``x [m, hidden]`` bf16, any hidden that is a multiple of 8.
    The result (bf16 ``[m, hidden]``) is identical on every rank and lives in a persistent buffer
    valid until the next call. ``fp32_internal`` as in ``CollectiveKernel`` (default: float32)."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        max_m: int,
        hidden: int,
        *,
        eps: float = 1e-6,
        fp32_internal: bool = True,
        backend: str = "auto",
        timeout_s: float = 5.0,
        two_shot_min_m: Optional[int] = None,
    ) -> None:
        check_int("max_m", max_m, lo=1)
        check_int("hidden", hidden, lo=1)
        if hidden % 8:
            raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
        _check_eps("eps", eps)
        if not isinstance(fp32_internal, bool):
            raise TypeError(f"fp32_internal must be a bool, got {type(fp32_internal).__name__}")
        if two_shot_min_m is not None:
            check_int("two_shot_min_m", two_shot_min_m, lo=1)
        self._init_common(group, backend, timeout_s)
        self.rank, self.tp_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.tp_size > MAX_TP:
            raise ValueError(f"the group size must be <= {MAX_TP}, got {self.tp_size}")
        self.max_m, self.hidden, self.eps, self.fp32_internal = max_m, hidden, float(eps), fp32_internal
        self.two_shot_min_m = default_two_shot_min_m(self.tp_size, hidden) if two_shot_min_m is None else two_shot_min_m
        self.backend = self._choose_backend()
        self._out = torch.empty((max_m, hidden), dtype=torch.bfloat16, device=self.device)
        if self.backend == "symm_mem":
            from moekit.comm._triton_tail import TailLayout

            layout = TailLayout(
                rank=self.rank,
                tp_size=self.tp_size,
                latent_dim=hidden,
                hidden_dim=0,
                max_m=max_m,
                top_k=0,
                routed=True,
                shared=False,
                fp32_internal=fp32_internal,
                two_shot_min_m=self.two_shot_min_m,
                gather_f32=True,
            )
            self._init_symm(layout, max_programs=1 << 30)

    @property
    def output(self) -> torch.Tensor:
        return self._out

    def __call__(
        self, x: torch.Tensor, gamma: torch.Tensor, eps: Optional[float] = None, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        self._raise_if_failed()
        _rank2("x", x)
        m = x.shape[0]
        bf16 = (torch.bfloat16,)
        _expect("x", x, (m, self.hidden), bf16, self.device)
        _expect("gamma", gamma, (self.hidden,), bf16, self.device)
        if residual is not None:
            _expect("residual", residual, (m, self.hidden), bf16, self.device)
        if not 1 <= m <= self.max_m:
            raise ValueError(f"runtime M={m} must be in [1, {self.max_m}]")
        e = self.eps if eps is None else _check_eps("eps", eps)
        if self.backend == "symm_mem":
            torch.ops.moekit.symm_moe_tail_(
                self._state_handle, m, e, -1, x, None, None, residual, gamma, None, self._out, None
            )
        else:
            from moekit.comm import fallback as fb

            fb.routed_all_reduce_rms_norm(
                x,
                gamma,
                self._out,
                group=self.group,
                world_size=self.tp_size,
                eps=e,
                fp32_internal=self.fp32_internal,
                residual=residual,
            )
        return self._out[:m]

    all_reduce_rms_norm = __call__


class ReduceScatterHidden(_Collective):
    """``reduce_scatter_hidden(x)``: ``(sum over ranks of x)[:, rank*S:(rank+1)*S]`` for
    ``x [m, hidden]`` bf16, ``S = hidden / R`` a multiple of 8; bf16 ``[m, S]`` in a persistent
    buffer valid until the next call (float32 rank-order sums)."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        max_m: int,
        hidden: int,
        *,
        backend: str = "auto",
        timeout_s: float = 5.0,
    ) -> None:
        check_int("max_m", max_m, lo=1)
        check_int("hidden", hidden, lo=1)
        self._init_common(group, backend, timeout_s)
        self.rank, self.tp_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.tp_size > MAX_TP:
            raise ValueError(f"the group size must be <= {MAX_TP}, got {self.tp_size}")
        if hidden % self.tp_size or (hidden // self.tp_size) % 8:
            raise ValueError(f"hidden must be a multiple of 8 * group size ({8 * self.tp_size}), got {hidden}")
        self.max_m, self.hidden, self.shard_dim = max_m, hidden, hidden // self.tp_size
        self.backend = self._choose_backend()
        self._out = torch.empty((max_m, self.shard_dim), dtype=torch.bfloat16, device=self.device)
        if self.backend == "symm_mem":
            from moekit.comm._triton_tail import TailLayout

            layout = TailLayout(
                rank=self.rank,
                tp_size=self.tp_size,
                latent_dim=0,
                hidden_dim=hidden,
                max_m=max_m,
                top_k=0,
                routed=False,
                shared=True,
                fp32_internal=False,
                two_shot_min_m=1 << 30,
            )
            self._init_symm(layout, max_programs=1 << 30)

    @property
    def output(self) -> torch.Tensor:
        return self._out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._raise_if_failed()
        _rank2("x", x)
        m = x.shape[0]
        _expect("x", x, (m, self.hidden), (torch.bfloat16,), self.device)
        if not 1 <= m <= self.max_m:
            raise ValueError(f"runtime M={m} must be in [1, {self.max_m}]")
        if self.backend == "symm_mem":
            torch.ops.moekit.symm_moe_tail_(
                self._state_handle, m, 0.0, -1, None, None, None, None, None, x, None, self._out
            )
        else:
            from moekit.comm import fallback as fb

            fb.shared_reduce_scatter(x, self._out, group=self.group, world_size=self.tp_size)
        return self._out[:m]

    reduce_scatter_hidden = __call__
