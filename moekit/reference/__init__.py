"""Pure-PyTorch float32 oracles for every moekit op (CPU and CUDA, deterministic).

Imports only torch. Each function's docstring is its exact contract; the kernels in
``moekit.ops`` are tested against these.
"""

from moekit.reference.activation import silu_mul, silu_mul_quant
from moekit.reference.gather_scatter import (
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    scatter_add_dense_tokens,
    scatter_add_dense_tokens_deterministic,
    scatter_add_padded_tokens,
)
from moekit.reference.grouped_gemm import (
    f8f8bf16_rowwise,
    grouped_gemm,
    combine_rows,
    grouped_gemm_combine,
    grouped_gemm_fp8_rowwise,
    grouped_gemm_swiglu,
)
from moekit.reference.moe import moe_decode, moe_forward, swiglu_expert
from moekit.reference.norm import (
    all_reduce_rms_norm,
    moe_tail,
    rank_sum,
    reduce_scatter_hidden,
    rms_norm,
    topk_finalize,
)
from moekit.reference.quantize import DEFAULT_EPS, FUSED_EPS, dequantize_fp8_row, quantize_fp8_row
from moekit.reference.routing import (
    dense_scores,
    index_shuffling,
    route_and_shuffle,
    routing_weights,
    shuffle_top_k,
    topk,
)
from moekit.reference.shuffling import combine_shuffling, split_shuffling

__all__ = [
    "DEFAULT_EPS",
    "FUSED_EPS",
    "all_reduce_rms_norm",
    "combine_shuffling",
    "dense_scores",
    "dequantize_fp8_row",
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
    "moe_forward",
    "moe_tail",
    "quantize_fp8_row",
    "rank_sum",
    "reduce_scatter_hidden",
    "rms_norm",
    "route_and_shuffle",
    "routing_weights",
    "scatter_add_dense_tokens",
    "scatter_add_dense_tokens_deterministic",
    "scatter_add_padded_tokens",
    "shuffle_top_k",
    "silu_mul",
    "silu_mul_quant",
    "split_shuffling",
    "swiglu_expert",
    "topk",
    "topk_finalize",
]
