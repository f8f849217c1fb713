"""moekit: fast Mixture-of-Experts inference kernels and layers for PyTorch.

- ``moekit.ops``: registered ops (``torch.ops.moekit.*``) with MSLK-compatible signatures;
  Triton kernels on CUDA, float32 references on the CPU.
- ``moekit.reference``: the float32 oracles that define every op's semantics.
- ``moekit.comm``: the fused MoE-tail collective and expert-parallel exchange.
- ``moekit.testing``: tolerances, tie-free routing scores, poisoning helpers.
"""

__version__ = "0.1.0"

from moekit import reference, testing  # noqa: E402,F401

__all__ = ["__version__", "reference", "testing"]
