"""Collectives for tensor-parallel MoE: the fused MoE-tail collective (``CollectiveKernel``,
vLLM Kimi-K3 API) and standalone ``AllReduceRMSNorm`` / ``ReduceScatterHidden``, on symmetric
memory through peer pointers (one Triton launch per call) or on torch.distributed collectives.

NVLink multicast is never used (it can take a shared host's GPUs out of service): importing
this package sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` unless already set. Import it before initializing torch.distributed
(and set them in every process you spawn).
"""

import os

for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)

from moekit.comm.tail import (  # noqa: E402
    AllReduceRMSNorm,
    CollectiveKernel,
    ReduceScatterHidden,
    UnfinalizedMoEOutput,
    available_backends,
    default_two_shot_min_m,
    validate_shape,
)
from moekit.ops._common import HAS_TRITON  # noqa: E402

if HAS_TRITON:  # registers torch.ops.moekit.symm_moe_tail_
    from moekit.comm import symm as _symm  # noqa: E402,F401

__all__ = [
    "AllReduceRMSNorm",
    "CollectiveKernel",
    "ReduceScatterHidden",
    "UnfinalizedMoEOutput",
    "available_backends",
    "default_two_shot_min_m",
    "validate_shape",
]
