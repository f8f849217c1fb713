"""Host side of the fused MoE-tail collective (``moekit.comm._triton_tail``): the protocol's
constants, the static layout of one instance's workspace, its block sizes and device state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moekit.ops._common import next_pow2

NUM_BUFFERS = 3
SENTINEL16 = -32768  # 0x8000: bf16 -0.0
SENTINEL32 = -2147450880  # 0x80008000: two bf16 sentinels read as one 32-bit word
# flags tensor (int32)
F_CURRENT, F_DIRTY, F_DIRTY_M, F_DIRTY_USED, F_ARRIVED, F_CALLS = 0, 1, 2, 3, 4, 5
NUM_FLAGS = 8


@dataclass(frozen=True)
class TailLayout:
    """Static geometry of one collective instance (identical on every rank).

    Workspace (``int16``): ``[NUM_BUFFERS, max_m, foot]``; per token: the shared region
    ``[R, S]`` first (slot of source s at ``s*S``), then the routed region at ``rt0``: one-shot
    ``[R, L]``; two-shot ``[R, L/R]`` reduce-scatter slots followed by the gathered row (bf16, or
    float32 words with ``gather_f32``, which defaults to ``fp32_internal``; the standalone
    all-reduce + norm sets it so that a residual is added to the unrounded sum).
    """

    rank: int
    tp_size: int
    latent_dim: int  # L (0 when the routed role is off)
    hidden_dim: int  # H (0 when the shared role is off)
    max_m: int
    top_k: int
    routed: bool
    shared: bool
    fp32_internal: bool
    two_shot_min_m: int  # > max_m: never
    gather_f32: Optional[bool] = None  # two-shot all-gather in float32 (default: fp32_internal)

    @property
    def gathers_f32(self) -> bool:
        return self.fp32_internal if self.gather_f32 is None else self.gather_f32

    @property
    def shard_dim(self) -> int:
        return self.hidden_dim // self.tp_size if self.shared else 0

    @property
    def two_shot_possible(self) -> bool:
        R, L = self.tp_size, self.latent_dim
        return self.routed and R >= 2 and L % (8 * R) == 0 and self.two_shot_min_m <= self.max_m

    @property
    def gather_elems(self) -> int:  # int16 units per gathered element in the two-shot path
        return 2 if self.gathers_f32 else 1

    @property
    def rt0(self) -> int:
        return self.tp_size * self.shard_dim

    def used(self, two_shot: bool) -> int:
        if not self.routed:
            return self.rt0
        L = self.latent_dim
        return self.rt0 + ((1 + self.gather_elems) * L if two_shot else self.tp_size * L)

    @property
    def foot(self) -> int:
        f = self.used(False)
        if self.two_shot_possible:
            f = max(f, self.used(True))
        return f

    @property
    def buffer_elems(self) -> int:
        return self.max_m * self.foot

    @property
    def workspace_elems(self) -> int:
        return NUM_BUFFERS * self.buffer_elems

    def use_two_shot(self, m: int) -> bool:
        return self.two_shot_possible and m >= self.two_shot_min_m


@dataclass(frozen=True)
class TailBlocks:
    block_l: int
    block_p: int
    block_s: int
    block_c: int
    num_warps: int
    kg: int


def choose_blocks(layout: TailLayout, max_block_l: Optional[int] = None) -> TailBlocks:
    """Block sizes from the static shapes (a cheap bucket function: one config per instance)."""
    L, S = layout.latent_dim, layout.shard_dim
    cap = 8192 if max_block_l is None else max_block_l
    if layout.routed:
        block_l = next_pow2(L) if next_pow2(L) <= cap else min(4096, cap)
    else:
        block_l = 16
    block_l = max(block_l, 16)
    num_warps = 4 if block_l <= 2048 else (8 if block_l <= 4096 else 16)
    vec = num_warps * 32 * 8  # one 16-byte vector per thread
    if layout.routed:
        span = L // layout.tp_size if layout.two_shot_possible else L
        block_p = max(16, min(vec, next_pow2(span), block_l))
        if layout.two_shot_possible:
            block_p = max(16, min(block_p, next_pow2(L // layout.tp_size)))
    else:
        block_p = 16
    block_s = max(16, min(vec, next_pow2(S))) if layout.shared else 16
    block_c = 2 * vec
    k = layout.top_k
    kg = max((d for d in range(1, 9) if k and k % d == 0), default=1)
    return TailBlocks(block_l, block_p, block_s, block_c, num_warps, kg)


@dataclass
class TailState:
    """Device state of one instance: the local workspace (``int16``; ``ws32`` is its int32
    view), peer base addresses ``peers`` (int64 ``[R + 1]``, entry R = host-mapped error mirror
    or 0), ``flags`` (int32 ``[8]``), ``errors`` (int32 ``[R]``, 1 = that source rank was
    missing at a timeout)."""

    layout: TailLayout
    blocks: TailBlocks
    workspace: torch.Tensor
    peers: torch.Tensor
    flags: torch.Tensor
    errors: torch.Tensor
    host_errors: Optional[torch.Tensor]
    timeout_s: float
    max_programs: int
    prev_m: int = 0

    @property
    def ws32(self) -> torch.Tensor:
        return self.workspace.view(torch.int32)


def initial_flags(device: torch.device) -> torch.Tensor:
    f = torch.zeros(NUM_FLAGS, dtype=torch.int32, device=device)
    f[F_DIRTY] = NUM_BUFFERS - 1
    return f


def max_spins_for(timeout_s: float) -> int:
    """Iteration cap of the interpreter's waits (no clock there): about 1 ms per spin."""
    return max(2, int(timeout_s * 1000))
