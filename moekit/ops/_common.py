"""Helpers shared by the op wrappers and their Triton launchers."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:  # Triton is optional: without it every op runs its PyTorch reference.
    import triton  # noqa: F401  (only probing that it imports)

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` runs its Triton kernel (CUDA tensors) or its reference."""
    return HAS_TRITON and t.is_cuda


def launch(kernel: Any) -> Any:
    """``kernel`` wrapped for ``torch.library.triton_op`` tracing (``wrap_triton``); launching it
    outside a trace runs it directly, in the interpreter too."""
    from torch.library import wrap_triton

    return wrap_triton(kernel)


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4  # the interpreter: a small "machine" keeps grids (and test time) small


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (cached: no per-call device query)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _num_sms("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return _num_sms(device.type, 0)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
