"""Facts about this machine for ``moekit env`` and for benchmark logs."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") == "1"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "sms": p.multi_processor_count,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
    info["gpus"] = gpus
    if info["triton"] and gpus:
        ops_backend = "triton (CUDA kernels)"
    elif info["triton"]:
        ops_backend = "reference (PyTorch float32 on CPU); Triton kernels run under TRITON_INTERPRET=1 in tests"
    else:
        ops_backend = "reference (PyTorch float32); triton not installed"
    info["ops_backend"] = ops_backend
    try:
        from moekit.comm import available_backends

        info["comm_backends"] = available_backends()
    except Exception as exc:  # the comm package may be absent or fail to import on odd builds
        info["comm_backends"] = f"unavailable ({type(exc).__name__}: {exc})"
    info["nvls_multicast_disabled"] = {
        k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    }
    try:
        import mslk  # type: ignore

        info["mslk"] = getattr(mslk, "__version__", "present")
    except Exception:
        info["mslk"] = None
    return info


def format_env(info: dict[str, Any]) -> str:
    lines = ["moekit environment"]
    for k in ("python", "platform", "torch", "torch_cuda", "triton", "triton_interpret", "ops_backend"):
        lines.append(f"  {k:<16} {info.get(k)}")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(
                f"  gpu {g['index']:<12} {g['name']} (sm_{g['capability'].replace('.', '')}, "
                f"{g['sms']} SMs, {g['memory_gib']} GiB)"
            )
    else:
        lines.append("  gpus             none (CPU only)")
    cb = info.get("comm_backends")
    if isinstance(cb, dict):
        for name, why in cb.items():
            lines.append(f"  comm backend     {name}: {why}")
    else:
        lines.append(f"  comm backends    {cb}")
    lines.append(f"  multicast env    {info['nvls_multicast_disabled']}")
    lines.append(f"  mslk             {info.get('mslk') or 'not importable (benchmark peer only)'}")
    return "\n".join(lines)
