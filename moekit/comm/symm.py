"""Symmetric-memory state of the Lamport collectives and their registered op.

``create_symm_state`` allocates the workspace with ``torch.distributed._symmetric_memory``
(``symm_mem.empty`` + ``rendezvous``), takes each peer's base address from
``handle.get_buffer(peer, ...)`` (peer pointers over NVLink P2P: **no multicast object is ever
created or used**), checks the addresses with a probe kernel, fills the sentinels and
synchronizes the group once. ``create_local_state`` builds the same state on any device from
caller-provided peer buffers (tests: simulated peers in the Triton interpreter, or ``tp_size=1``).

The launch is registered as ``torch.ops.moekit.symm_moe_tail_`` (an opaque op that mutates its
output buffers; the workspace and flags stay hidden behind an integer handle, as torch's own
``symm_mem`` ops keep theirs behind a group name), so ``torch.compile(fullgraph=True)`` traces a
call without a graph break and never copies the symmetric workspace.
"""

from __future__ import annotations

import importlib
import itertools
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from moekit import settings

from moekit.comm._triton_tail import (
    SENTINEL16,
    TailLayout,
    TailState,
    choose_blocks,
    initial_flags,
    launch_tail,
    probe_peers,
)

__all__ = ["create_symm_state", "create_local_state", "register_state", "release_state", "symm_mem_supported"]

_STATES: dict[int, TailState] = {}
_NEXT = itertools.count(1)


def register_state(state: TailState) -> int:
    handle = next(_NEXT)
    _STATES[handle] = state
    return handle


def release_state(handle: int) -> None:
    _STATES.pop(handle, None)


def get_state(handle: int) -> TailState:
    try:
        return _STATES[handle]
    except KeyError:
        raise ValueError(f"handle must name a live moekit.comm collective state, got {handle}") from None


@torch.library.custom_op("moekit::symm_moe_tail_", mutates_args=("latent_output", "shared_output"))
def symm_moe_tail_(
    handle: int,
    m: int,
    eps: float,
    two_shot: int,
    latent_source: Optional[torch.Tensor],
    expert_weights: Optional[torch.Tensor],
    expanded_idx_to_permuted_idx: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    gamma: Optional[torch.Tensor],
    shared_source: Optional[torch.Tensor],
    latent_output: Optional[torch.Tensor],
    shared_output: Optional[torch.Tensor],
) -> None:
    """One call of the Lamport MoE-tail collective of state ``handle`` (see ``CollectiveKernel``).
    ``two_shot``: -1 choose by ``m``, 0 one-shot, 1 two-shot. Writes ``latent_output[:m]`` and
    ``shared_output[:m]`` (this rank's shard, unit column stride)."""
    state = get_state(handle)
    if state.workspace.device.type != "cuda":
        from moekit.ops._common import interpreting

        if not interpreting():
            raise RuntimeError(
                "the symmetric-memory collective runs on CUDA tensors (or in the Triton interpreter, "
                "TRITON_INTERPRET=1); use backend='torch' on the CPU"
            )
    launch_tail(
        state,
        m,
        latent_source,
        expert_weights,
        expanded_idx_to_permuted_idx,
        residual,
        gamma,
        shared_source,
        latent_output,
        shared_output,
        eps,
        None if two_shot < 0 else bool(two_shot),
    )


@symm_moe_tail_.register_fake
def _symm_moe_tail_fake(
    handle,
    m,
    eps,
    two_shot,
    latent_source,
    expert_weights,
    expanded_idx_to_permuted_idx,
    residual,
    gamma,
    shared_source,
    latent_output,
    shared_output,
) -> None:
    return None


# ----------------------------------------------------------------------------------------------
# construction
# ----------------------------------------------------------------------------------------------


def _host_error_mirror(R: int) -> Optional[torch.Tensor]:
    """A pinned host tensor the kernel can write (UVA): lets the next call see a timeout without
    a device synchronization. Disabled by ``settings.comm_host_errors`` ($MOEKIT_COMM_HOST_ERRORS=0)."""
    if not settings.get().comm_host_errors:
        return None
    try:
        return torch.zeros(R, dtype=torch.int32, pin_memory=True)
    except Exception:  # pragma: no cover - no pinned memory
        return None


def create_local_state(
    layout: TailLayout,
    workspace: torch.Tensor,
    peer_ptrs: list[int],
    *,
    timeout_s: float = 5.0,
    max_programs: int = 1 << 30,
    host_errors: Optional[torch.Tensor] = None,
    max_block_l: Optional[int] = None,
) -> TailState:
    """State over an existing ``int16`` workspace (already sentinel-filled) and the base
    addresses of every rank's workspace (``peer_ptrs[layout.rank]`` must be ``workspace``)."""
    if workspace.dtype != torch.int16 or workspace.numel() < layout.workspace_elems:
        raise ValueError(
            f"workspace must be an int16 tensor of at least {layout.workspace_elems} elements, got "
            f"{workspace.dtype} with {workspace.numel()}"
        )
    if len(peer_ptrs) != layout.tp_size:
        raise ValueError(f"peer_ptrs must hold {layout.tp_size} addresses, got {len(peer_ptrs)}")
    if peer_ptrs[layout.rank] != workspace.data_ptr():
        raise ValueError("peer_ptrs[rank] must be the local workspace's address")
    if any(p == 0 or p % 16 for p in peer_ptrs):
        raise RuntimeError(f"peer workspace addresses must be non-null and 16-byte aligned, got {peer_ptrs}")
    device = workspace.device
    table = list(peer_ptrs) + [host_errors.data_ptr() if host_errors is not None else 0]
    return TailState(
        layout=layout,
        blocks=choose_blocks(layout, max_block_l),
        workspace=workspace,
        peers=torch.tensor(table, dtype=torch.int64, device=device),
        flags=initial_flags(device),
        errors=torch.zeros(layout.tp_size, dtype=torch.int32, device=device),
        host_errors=host_errors,
        timeout_s=float(timeout_s),
        max_programs=max_programs,
    )


def symm_mem_supported() -> tuple[bool, str]:
    """Whether this process can run the symmetric-memory backend (and why not)."""
    from moekit.ops._common import HAS_TRITON, interpreting

    if not HAS_TRITON:
        return False, "triton is not installed"
    if interpreting():
        return False, "TRITON_INTERPRET=1"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not dist.is_available():
        return False, "torch.distributed is unavailable"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as e:  # pragma: no cover
        return False, f"torch.distributed._symmetric_memory unavailable ({e})"
    if torch.cuda.get_device_capability()[0] < 8:
        return False, "needs compute capability 8.0 or newer"
    n = torch.cuda.device_count()
    for i in range(n):
        for j in range(n):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                return False, f"no P2P access between GPU {i} and GPU {j}"
    return True, ""


def create_symm_state(
    layout: TailLayout,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    timeout_s: float,
    max_programs: int = 1 << 30,
) -> TailState:
    """Allocate and rendezvous the symmetric workspace of ``layout`` on ``group`` (collective:
    every rank of the group must call it with the same layout)."""
    import torch.distributed._symmetric_memory as symm_mem

    R, rank = layout.tp_size, layout.rank
    group_name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # a no-op (deprecated) in recent torch, needed by older ones
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    n = layout.workspace_elems
    with torch.cuda.device(device):
        ws = symm_mem.empty(n, dtype=torch.int16, device=device)
        handle = symm_mem.rendezvous(ws, group_name)
        own = handle.get_buffer(rank, (n,), torch.int16).data_ptr()
        delta = ws.data_ptr() - own  # the tensor's offset inside its symmetric allocation
        ptrs = [handle.get_buffer(p, (n,), torch.int16).data_ptr() + delta for p in range(R)]
        # every rank must see the same offset, or the peer addresses are wrong
        deltas = [None] * R
        dist.all_gather_object(deltas, delta, group=group)
        if any(d != delta for d in deltas):
            raise RuntimeError(f"symmetric workspace offsets differ across ranks: {deltas}")
        host_err = _host_error_mirror(R)
        state = create_local_state(
            layout, ws, ptrs, timeout_s=timeout_s, max_programs=max_programs, host_errors=host_err
        )
        # probe: every rank writes its own marker, each reads all peers through the pointers
        ws[0] = rank + 1
        ws[n - 1] = -(rank + 1)
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        got = probe_peers(state.peers, R, n - 1).cpu().view(R, 2)
        want = torch.tensor([[p + 1, -(p + 1)] for p in range(R)], dtype=torch.int32)
        ok = torch.tensor([1 if torch.equal(got, want) else 0], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank raises, or none
        if not bool(ok.item()):
            raise RuntimeError(
                f"peer workspace probe failed (rank {rank} read {got.tolist()}, expected {want.tolist()}): "
                "the symmetric-memory peer addresses are not usable"
            )
        ws.fill_(SENTINEL16)
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
    state.symm_handle = handle  # keep the rendezvous alive with the state
    return state
