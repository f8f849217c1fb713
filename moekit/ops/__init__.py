"""Public MoE ops (MSLK-compatible names and signatures), each a registered ``torch.ops.moekit.*``
op: Triton kernels on CUDA tensors, float32 references on CPU tensors."""

from moekit.ops.activation import silu_mul, silu_mul_quant
from moekit.ops.decode import moe_decode
from moekit.ops.gather_scatter import (
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    scatter_add_dense_tokens,
    scatter_add_dense_tokens_deterministic,
    scatter_add_padded_tokens,
)
from moekit.ops.grouped_gemm import (
    f8f8bf16_rowwise,
    grouped_gemm,
    combine_rows,
    grouped_gemm_combine,
    grouped_gemm_fp8_rowwise,
    grouped_gemm_swiglu,
)
from moekit.ops.norm import rms_norm
from moekit.ops.quantize import quantize_fp8_row, triton_quantize_fp8_row
from moekit.ops.routing import index_shuffling, route_and_shuffle, shuffle_top_k
from moekit.ops.shuffling import combine_shuffling, split_shuffling

__all__ = [
    "combine_shuffling",
    "f8f8bf16_rowwise",
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "grouped_gemm",
    "combine_rows",
    "grouped_gemm_combine",
    "grouped_gemm_fp8_rowwise",
    "grouped_gemm_swiglu",
    "index_shuffling",
    "moe_decode",
    "quantize_fp8_row",
    "rms_norm",
    "route_and_shuffle",
    "scatter_add_dense_tokens",
    "scatter_add_dense_tokens_deterministic",
    "scatter_add_padded_tokens",
    "shuffle_top_k",
    "silu_mul",
    "silu_mul_quant",
    "split_shuffling",
    "triton_quantize_fp8_row",
]
