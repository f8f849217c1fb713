"""The routed experts of a MoE layer, once: rows in, expert outputs out (``run_experts``).

Every caller goes through here: ``moe_forward`` (one GPU), both expert-parallel paths of
``MetaShufflingMoE`` and the transformers integration. Two pipelines, the same function:

- ``decode`` (few rows per expert): ``grouped_gemm_swiglu`` reads each row straight from the
  token matrix by index and applies SiLU * up in its epilogue, then the down GEMM applies the
  router weight and adds into the output (``grouped_gemm_combine``, per token, for top-k >= 6 at
  GEMV sizes; else the scatter-add GEMM): two launches after routing, no gathered copy and no
  ``[N, 2F]`` intermediate. FP8 weights are used weight-only (activations stay 16-bit: the weights
  are the traffic at these sizes, and nothing is quantized on the way).
- ``sorted`` (many rows per expert): where the rows per expert take tensor-core tiles (prefill),
  and for FP8 weights at streaming sizes too, ``grouped_gemm_swiglu`` reads the token rows by
  index and applies SiLU * up in its epilogue (FP8: the T token rows quantized once before it,
  the ``[N, F]`` SwiGLU output after), then the down grouped GEMM with the fused scatter-add;
  elsewhere (or with ``settings.sorted_swiglu`` off): gather (+ FP8 row quantization) -> grouped
  GEMM (gate|up) -> SiLU * up (+ quantization) -> the down GEMM.

``path`` ``"auto"`` (``settings.moe_path``, default) takes ``decode`` where it measured faster
(``choose_path``): bf16 rows few enough (``settings.decode_max_rows``) and spread thin (fewer than
``DECODE_ROWS_PER_EXPERT`` per expert hit), for top-k >= 6 on the streaming kernels too, else on
the GEMV kernels only; FP8 weights on the GEMV kernels only (weight-only FP8 there).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from moekit import settings
from moekit._validate import FP8_DTYPE, check_tensor
from moekit.ops import (
    combine_rows,
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    grouped_gemm,
    grouped_gemm_combine,
    grouped_gemm_fp8_rowwise,
    grouped_gemm_swiglu,
    quantize_fp8_row,
    silu_mul,
    silu_mul_quant,
)
from moekit.ops._common import l2_bytes
from moekit.ops._triton.gg_config import expected_groups_hit, takes_column_slabs, use_gemv

__all__ = [
    "run_experts", "choose_path", "decode_fused", "down_sums_rows", "will_store_rows", "quantizes_token_rows",
    "DECODE_ROWS_PER_EXPERT",
]  # fmt: skip

# Mean rows per hit expert below which the decode pipeline runs (the grouped GEMM's streaming
# kernel range until session 27; its tiled kernel now takes deep, narrow weights from 32 rows:
# knob TILED_MIN_ROWS).
DECODE_ROWS_PER_EXPERT = 48

# Top-k from which the per-token combine beats the scatter-add GEMV at decode (H200, T=1; RESULTS.md
# session 7): k=8 Qwen3-30B 30.0 vs 39.3 µs, DeepSeek-V3 TP8 39.3 vs 52.3 (K atomic adds per output
# element in bf16 against one store); k=4 gpt-oss-120b 70.2 vs 63.7 and k=1 Scout FP8 52.2 vs 45.6,
# where the GEMV's long contiguous K tiles win and its few atomics cost little. The same bound
# decides where the bf16 decode pipeline also runs on its streaming kernels (``choose_path``).
# With session 17's combine tiles (session 18, ``sweep_decode.py``'s ``sorted_combine`` column,
# the knob pinned to 1), the sorted decode pipeline at k=4 (gpt-oss-120b) runs the combine faster
# in FP8 (T=1 40.6 vs 45.0 µs, T=2 64.7 vs 74.2) but slower in bf16 (57.2 vs 56.9, 104.4 vs
# 102.2); moe_decode (``decode_fused``), faster than both, takes those rows anyway.
COMBINE_MIN_TOP_K = 6


def choose_path(rows: int, experts: int, path: Optional[str] = None, fp8: bool = False, top_k: int = 1,
                max_rows: Optional[int] = None) -> str:  # fmt: skip
    """``"decode"`` or ``"sorted"`` for ``rows`` routed rows over ``experts`` local experts
    (``fp8``: FP8 expert weights; ``top_k``: rows per token; ``max_rows``: the bf16 decode
    pipeline's row bound, default ``settings.decode_max_rows``)."""
    s = settings.get()
    path = path or s.moe_path
    if path not in ("auto", "decode", "sorted"):
        raise ValueError(f"path must be 'auto', 'decode' or 'sorted', got {path!r}")
    if path != "auto":
        return path
    hits = max(1.0, expected_groups_hit(rows, max(experts, 1)))
    if fp8:
        # Weight-only FP8 pays on the GEMV kernels (CUDA-core FMAs on the 1-byte weight stream);
        # in the tensor-core tiles the in-register conversion of the weights costs more than the
        # activation quantization saves (H200: Qwen3-30B T=4 80 vs 55 µs; RESULTS.md session 7).
        return "decode" if use_gemv(rows, hits) else "sorted"
    # bf16: the fused pipeline on its streaming kernels beat the sorted one for top-8 models up to
    # 2048 rows (H200, RESULTS.md session 8, after the router's split: Qwen3-30B T=16 187 vs 190
    # µs, T=64 290 vs 296, T=256 306 vs 318; DeepSeek-V3 TP8 T=16 294 vs 296, T=256 692 vs 700,
    # T=64 552 vs 548) and lost for top-1 / top-4 (gpt-oss-120b T=16 601 vs 591, T=64 1317 vs
    # 1283; Scout T=16 593 vs 581), where it keeps to the GEMV kernels. At 4096 rows (Qwen3-30B
    # T=512, session 10) it ran 337.6 µs against 346.3 on uniform random routing but 1581 against
    # 1493 per 2-layer model forward on a model's own (uneven) routing: the GPU bound stays 2048.
    # Eager callers, whose host sets the pace, pass a larger ``max_rows`` (two launches fewer:
    # that forward's host time 8495 against 9362 µs).
    bound = s.decode_max_rows if max_rows is None else max_rows
    if rows <= bound and rows / hits < DECODE_ROWS_PER_EXPERT:
        if top_k >= COMBINE_MIN_TOP_K or use_gemv(rows, hits):
            return "decode"
    return "sorted"


# Routed rows up to which ``settings.decode_fused == "on"`` takes ``moe_decode`` whatever the
# top-k (an experiment switch: ``auto`` keeps to the rows the decode pipeline would give its GEMV
# and per-token combine kernels).
DECODE_FUSED_ON_MAX_ROWS = 64


# Most experts whose scores ``decode_fused`` (auto) has every GEMV program route: the routing's
# rounds of reductions run over all E scores before each program's weight stream starts.
# DeepSeek-V3 TP8 (E=256, grouped) bf16 T=1, fused vs the sorted decode pipeline, same call: 36.0
# -> 34.4 and 35.3 -> 38.0 µs (session 16); 33.7 vs 35.1, 29.7 vs 30.6, 29.8 vs 31.3, 29.9 vs 30.6
# (session 17, runs 1-3, the last two with the new combine tiles).
DECODE_FUSED_MAX_EXPERTS = 256


# Smallest top-k for which ``decode_fused`` (auto) takes moe_decode. H200, session 18 (lazy
# routing, the FP8 GEMV tiles of ``gg_swiglu._fp8_gemv_config``), moe_decode against the sorted
# decode pipeline (its scatter-add GEMV below ``COMBINE_MIN_TOP_K``), same call: gpt-oss-120b
# (top-4) bf16 T=1 55.7 vs 56.9 µs, T=2 97.4 vs 102.2; FP8 T=1 40.9 vs 45.0, T=2 62.5 vs 74.2.
# Top-2 and top-1 kept the sorted pipelines then: Mixtral-8x7B T=1 bf16 181.2 vs 172.5, FP8 113.9
# vs 94.0; Llama 4 Scout FP8 T=1 45.0 vs 41.2. Since session 42 every top-k takes it: H100, same
# call, layer from logits, two lanes each way (µs, sorted -> moe_decode, the combine's tiles of
# then): Scout bf16 T = 1 / 2 / 4 109.0 / 176.0 / 337.3 -> 106.7 / 172.4 / 333.9, FP8 53.5 / 96.1
# / 175.5 -> 53.9 / 91.8 / 171.6; Maverick bf16 94.5 / 175.8 / 337.7 -> 93.3 / 171.7 / 334.5, FP8
# 54.1 / 97.2 / 176.2 -> 54.1 / 91.9 / 171.8; and with the combine's 4 KB tiles for one or two
# choices (``gg_combine.COMBINE_FEW_4KB``; ``sweep_decode.py``, sorted vs moe_decode): Scout bf16
# T = 1 / 2 / 4 94.9 / 160.1 / 306.0 vs 88.1 / 153.7 / 299.9, FP8 54.2 / 89.7 / 160.3 vs 48.2 /
# 82.5 / 156.7; Mixtral-8x7B bf16 239.6 / 425.0 / 657.0 vs 234.3 / 415.5 / 614.3, FP8 127.6 /
# 219.6 / 321.7 vs 122.8 / 212.7 / 315.6-325.6 (two passes).
DECODE_FUSED_MIN_TOP_K = 1

# Most tokens for which ``decode_fused`` (auto) takes moe_decode: one GEMV program per routed row
# and column slice, so rows of one expert read its weights side by side (from L2). H200, session
# 18 run 3, same call, moe_decode vs the path ``auto`` took before (µs): Qwen3-30B bf16 T=2 42.1
# vs 46.7, T=4 71.0 vs 79.5; FP8 28.1 vs 37.8, 45.1 vs 56.9; DeepSeek-V3 TP8 bf16 48.5 vs 57.8,
# 82.3 vs 93.2; FP8 30.3 vs 51.0, 52.5 vs 67.4; gpt-oss-120b bf16 101.0 vs 103.6, 186.9 vs 200.2;
# FP8 63.5 vs 74.9, 112.0 vs 118.0. Not measured past T=4.
DECODE_FUSED_MAX_TOKENS = 4


def decode_fused(rows: int, experts: int, top_k: int, fp8: bool, path: Optional[str] = None,
                 n_group: Optional[int] = None) -> bool:  # fmt: skip
    """Whether ``moe_forward`` runs ``moekit.ops.moe_decode`` (two launches from the logits: the
    token's routing inside the gate/up GEMV, then the per-token combine) for ``rows`` routed rows
    (T x top-k) over ``experts``: ``settings.decode_fused``; ``auto``: at most
    ``DECODE_FUSED_MAX_EXPERTS`` experts, top-k of at least ``DECODE_FUSED_MIN_TOP_K`` and at most
    ``DECODE_FUSED_MAX_TOKENS`` tokens (knobs of the same names), 16-bit or FP8 weights, unless the
    path is pinned to ``sorted``; ``on``: up to ``DECODE_FUSED_ON_MAX_ROWS`` rows where the path
    is ``decode``, any expert count and top-k.

    Measured (H200, fused vs the pipelines ``auto`` took before, same call; the layer benchmark
    through session 17, ``sweep_decode.py`` in session 18):
    bf16 Qwen3-30B (E=128) T=1 30.2 -> 29.3 µs (session 16), 28.6 -> 26.2 (session 17, the new
    combine tiles), 28.4 -> 24.6 (session 18, lazy routing); DeepSeek-V3 TP8 (E=256, grouped)
    faster in four calls of five by 0.7-1.6 µs (``DECODE_FUSED_MAX_EXPERTS``), 30.8 -> 29.3
    (session 18). FP8 was slower until session 18 (Qwen3 22.6 -> 27.3 in session 16, 19.5 ->
    20.7 in session 17: the GEMV's 768 programs of 206 registers ran in 1.45 waves, each wave
    paying its routing); with one wave of 128-register programs and lazy routing: Qwen3 18.8 ->
    17.8, DeepSeek 22.4 -> 19.0, gpt-oss (top-4) 45.0 -> 40.9. T = 2 to 4:
    ``DECODE_FUSED_MAX_TOKENS``."""
    from moekit.ops.decode import moe_decode_supports

    s = settings.get()
    mode = s.decode_fused
    if mode == "off" or rows == 0 or not moe_decode_supports(experts, top_k, n_group):
        return False
    if mode == "on":
        return choose_path(rows, experts, path, fp8=fp8, top_k=top_k) == "decode" and rows <= DECODE_FUSED_ON_MAX_ROWS
    if (path or s.moe_path) == "sorted" or experts > DECODE_FUSED_MAX_EXPERTS:
        return False
    if top_k < s.knob("DECODE_FUSED_MIN_TOP_K", DECODE_FUSED_MIN_TOP_K):
        return False
    return rows <= top_k * s.knob("DECODE_FUSED_MAX_TOKENS", DECODE_FUSED_MAX_TOKENS)


# Routed rows from which the sorted pipeline's down projection stores its rows and sums them per
# token (top-k >= 2) instead of scatter-adding them. H200, session 14, same process, layer from
# router logits, atomic vs sum: at 32768 rows and more the sum won in all 12 cells (T = 8192 and
# 16384 of Qwen3-30B, DeepSeek-V3 TP8, gpt-oss-120b, bf16 and FP8; e.g. DeepSeek bf16 T=8192 2292
# vs 2134 µs, FP8 1892 vs 1788; gpt-oss bf16 T=16384 6642 vs 6632); at 8192-16384 rows it was
# mixed (Qwen3 T=2048 bf16 471 vs 483, FP8 323 vs 340; DeepSeek T=1024 bf16 957 vs 928).
DOWN_SUM_MIN_ROWS = 32768
# The same where the scatter-add's tiles walk the output by column slabs
# (``gg_config.takes_column_slabs``: short K, wide output; DeepSeek-V3 TP8's down GEMM): with
# its atomics hitting L2 the scatter-add stays ahead of the stored rows. Session 36 (H100) put
# the bound at 40961 rows: past it the scatter-add's 128-row tiles read 1.7x the bytes. Since
# session 37 those short-K tiles keep 64 rows (``gg_config.SCATTER_SHORT_K``) and the scatter-add
# leads to T = 16384 (131072 rows). H100, session 38, layer from logits, same call, stored rows
# (two lanes) -> scatter-add (two lanes), µs: bf16 T = 6144 1838.6 / 1842.3 -> 1722.1, T = 8192
# 2229.7 / 2232.2 -> 2104.1 / 2132.8, T = 12288 3032.9 / 3013.6 -> 2895.0 / 2873.9, T = 16384
# 3893.9 / 3872.1 -> 3742.4 / 3801.7; FP8 T = 6144 1363.5 / 1364.3 -> 1321.0, T = 8192 1666.1 /
# 1664.6 -> 1635.7 / 1643.5, T = 12288 and 16384 level (2297-2299 -> 2290-2297, 2952-2956 ->
# 2949-2961).
DOWN_SUM_MIN_ROWS_SLABS = 16 * 8192 + 1


# Knob GLUON_DOWN: the stored down rows through the warp-specialized Gluon kernel (Hopper): 0
# never, 1 always, 2 its halves form, -1 (default) for FP8 rows. H100, session 33 runs 2-3 (layer
# from logits, two lanes each way in one machine, µs, Triton -> Gluon): FP8 Qwen3-30B T = 8192 /
# 16384 899.1 / 1708.7 and 902.1 / 1687.8 -> 883.6 / 1678.5 and 881.8 / 1679.6, DeepSeek-V3 TP8
# 1667.5 / 2994.1 and 1662.9 / 2983.0 -> 1642.7 / 2901.7 and 1642.7 / 2900.6 (the kernel alone:
# Qwen3-30B's FP8 down GEMM at T=8192 269.5 -> 250.3, run 1). 16-bit rows stay on the Triton
# kernel: Qwen3-30B bf16 T=16384 2343.3 / 2382.2 -> 2380.2 / 2421.7 (T=8192 and DeepSeek gained
# 0.5-3.4%). Widths off the kernel's 256-column tiles stay on Triton too (``_GLUON_DOWN_N``).
GLUON_DOWN = -1
# The Triton release whose Gluon API (experimental, changing between releases) the kernel was
# written and validated with: the default takes it there only.
_GLUON_TRITON = "3.6."


@functools.lru_cache(maxsize=None)
def _gluon_triton() -> bool:
    try:
        import triton
        from triton.experimental import gluon  # noqa: F401
    except ImportError:
        return False
    return triton.__version__.startswith(_GLUON_TRITON)


# The default's output widths: whole 256-column tiles of the FP8 kernel (Qwen3-30B's 2048,
# DeepSeek-V3's 7168). gpt-oss-120b's 2880 (eleven tiles and a quarter: the twelfth runs 64 of its
# 256 columns) was slower on it: H100, session 34, layer from logits, FP8, Triton -> Gluon down,
# T = 8192 / 16384 2193.6 / 3853.3 -> 2218.3 / 3927.3 µs (run 1), 2222.3 / 3806.1 -> 2225.0 /
# 3844.2 (run 2).
_GLUON_DOWN_N = 256


def _gluon_mode(fp8: bool, n: int = 0) -> int:
    """Knob ``GLUON_DOWN`` resolved for 16-bit or FP8 rows of ``n`` output columns: 0 off, 1 the
    kernel, 2 its halves form; the default (-1) 1 for FP8 rows where ``_gluon_triton()`` and ``n``
    fills whole ``_GLUON_DOWN_N``-column tiles, else 0."""
    mode = int(settings.get().knob("GLUON_DOWN", GLUON_DOWN))
    if mode < 0:
        return 1 if fp8 and _gluon_triton() and n % _GLUON_DOWN_N == 0 else 0
    return mode


def _gluon_device(t: torch.Tensor) -> bool:
    """Whether the experimental Gluon kernels can run on ``t``'s device now: a CUDA Hopper
    (sm_90) GPU, outside any trace (Gluon kernels are not traceable)."""
    if not t.is_cuda or torch.version.hip is not None:
        return False
    from moekit.ops._common import _capability_major, _tracing

    return (
        not _tracing()
        and _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) == 9
    )


def _gluon_rows(z, w2, m_sizes, rows_w, zs=None, ws2=None):
    """The down projection's stored rows through the experimental warp-specialized Gluon kernel
    (``moekit.ops._triton.gg_gluon``) where knob ``GLUON_DOWN`` asks for it (default: FP8 rows,
    on the Triton release the kernel was validated with, ``_GLUON_TRITON``) and it runs: a Hopper
    (sm_90) GPU, outside any trace (Gluon kernels are not traceable), rows TMA can read (16-byte
    aligned), float32 router weights, 16-bit or FP8 rows (with fast accumulation: the caller's to
    check). ``None`` elsewhere: the Triton kernel runs. ``GLUON_DOWN=2``: the kernel's ``halves``
    form (one MMA partition per 64-row half of a tile)."""
    w = w2.reshape(-1, w2.shape[-1])
    mode = _gluon_mode(zs is not None, w.shape[0] // max(1, m_sizes.shape[0]))
    if not mode or not _gluon_device(z):
        return None
    if z.dim() != 2 or z.stride(-1) != 1 or (z.stride(0) * z.element_size()) % 16 or not w.is_contiguous():
        return None
    if (w.shape[1] * w.element_size()) % 16 or (rows_w is not None and rows_w.dtype != torch.float32):
        return None
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon

    if zs is None:
        return grouped_gemm_gluon(z, w, m_sizes, rows_w, halves=mode == 2)
    return grouped_gemm_gluon(z, w, m_sizes, rows_w, x_scale=zs.reshape(-1), w_scale=ws2.reshape(-1), halves=mode == 2)


# Knob SWIGLU_QUANT: the FP8 pipeline's fused gate/up GEMM quantizes its SwiGLU rows in the same
# launch (``gg_swiglu.grouped_gemm_swiglu_quant``: each program sweeps whole row tiles, the 16-bit
# rows kept in its own L2-resident scratch until the row's max is known) instead of writing them
# and running ``quantize_fp8_row`` over them: 0 (default) off, 1 on where the tiled kernel runs.
# Slower: H100, session 34 run 1, layer from logits, FP8 T=8192, default -> on (µs, one lane
# each): Qwen3-30B 883.8 -> 1020.1, gpt-oss-120b 2218.3 -> 2208.4. A program owns its row tile
# through every column tile, so 132 different row tiles (35 MB of FP8 rows at Qwen3's K = 2048)
# and their scratch compete for L2 at once where the plain kernel's bands share theirs: the rows
# come again from DRAM for each column tile, more than the quantization pass saved.
SWIGLU_QUANT = 0


def _swiglu_quant(xq, w13, m_sizes, token_ids, in_w, xs, ws13, fast_accum):
    """``(zq, zs)``: ``quantize_fp8_row`` of the fused gate/up GEMM's rows from one launch, where
    knob ``SWIGLU_QUANT`` asks for it and it runs (CUDA, outside any trace, the tiled kernel's
    sizes, float32 ``in_w``); ``None`` elsewhere."""
    if not int(settings.get().knob("SWIGLU_QUANT", SWIGLU_QUANT)) or not xq.is_cuda:
        return None
    from moekit.ops._common import _tracing

    if _tracing() or (in_w is not None and in_w.dtype != torch.float32):
        return None
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu_quant

    return grouped_gemm_swiglu_quant(xq, w13, m_sizes, token_ids, in_w, xs, ws13, fast_accum)


# Knob GLUON_SWIGLU: the sorted pipeline's gate/up GEMM with its SwiGLU epilogue (rows by index or
# in place) through the experimental warp-specialized Gluon kernel on Hopper
# (``moekit.ops._triton.gg_gluon_swiglu``): 0 (default) never; 1 two N = 128 MMAs a step (gate,
# up); 2 one N = 256 MMA a step over gate | up, the accumulator split in registers (``pair``); 3
# the pair form with four operand stages. H100, session 33 run 1, the kernel alone (T=8192, rows
# by index, µs, Triton -> form 1): Qwen3-30B bf16 775.2 -> 923.2, DeepSeek-V3 TP8 bf16 1045.8 ->
# 1630.2, Qwen3-30B FP8 445.2 -> 446.8. Session 34 run 1, the kernel alone (rows by index, µs,
# Triton / form 1 / 2 / 3): Qwen3-30B T=8192 bf16 766.5 / 934.3 / 816.5 / 838.3, FP8 446.5 /
# 449.0 / 436.1 / 424.3; T=2048 bf16 327.2 / 429.2 / 398.8 / 391.9; DeepSeek-V3 TP8 T=8192 bf16
# 1048.7 / 1626.0 / 1410.9 / - (four stages do not fit above 128 groups). The layer from logits
# (Qwen3-30B T=8192, one lane each, form 0 / 2 / 3): bf16 1222.2 / 1283.4 / 1295.7, FP8 883.8 /
# 882.4 / 866.4. Run 2 (FP8, µs, two lanes each in the order off, 3, 3, off): Qwen3-30B T = 8192
# / 16384 888.7 / 1719.1 and 888.2 / 1641.7 -> 861.9 / 1675.3 and 861.9 / 1701.1 (-3.0%, level),
# gpt-oss-120b 2240.3 / 3833.3 and 2222.8 / 3774.0 -> 2248.7 / 3962.7 and 2241.2 / 3796.8 (0.6% /
# 2.0% slower): not the default.
GLUON_SWIGLU = 0


def _gluon_swiglu(x, w13, m_sizes, token_ids, in_w, xs=None, ws13=None):
    """``z`` of the fused (rows by ``token_ids``) or gathered (rows in place) gate/up GEMM through
    ``grouped_gemm_swiglu_gluon`` where knob ``GLUON_SWIGLU`` asks for it and it runs: a Hopper
    GPU outside any trace, the Triton release it was validated with, rows ``cp.async`` can read
    in 16-byte pieces, weights TMA can read, float32 ``in_w`` (FP8: ``xs`` by row of ``x``, the
    weights' ``ws13``). ``None`` elsewhere: the Triton kernel runs."""
    mode = int(settings.get().knob("GLUON_SWIGLU", GLUON_SWIGLU))
    if mode <= 0 or not _gluon_triton() or not _gluon_device(x):
        return None
    if x.dim() != 2 or x.stride(-1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    if (x.shape[1] * x.element_size()) % 16 or not w13.is_contiguous() or w13.data_ptr() % 16:
        return None
    if (in_w is not None and in_w.dtype != torch.float32) or (token_ids is not None and token_ids.dtype != torch.int32):
        return None
    from moekit.ops._triton.gg_gluon_swiglu import grouped_gemm_swiglu_gluon

    # four 48 KB stages, the 32 KB staging buffer and the group table (16 bytes a group) fit one
    # block's 227 KB up to 128 groups
    nbuf = 4 if mode == 3 and m_sizes.shape[0] <= 128 else 3
    return grouped_gemm_swiglu_gluon(x, w13, m_sizes, token_ids, in_w, x_scale=xs, w_scale=ws13, pair=mode >= 2,
                                     num_buf=nbuf)  # fmt: skip


def down_sums_rows(deterministic: bool = False, rows: int = 0, top_k: int = 1, slabs: bool = False) -> bool:
    """Whether the down projection stores its rows and sums them per token (``combine_rows``)
    instead of scatter-adding them with atomics: ``settings.down_sum``; ``auto``: for
    ``deterministic`` (one launch instead of the deterministic scatter-add's inverse-map
    launches, the same bits) and from ``DOWN_SUM_MIN_ROWS`` routed rows of top-k >= 2 (each
    output row takes k atomic adds; the stored rows cost a write and a read of ``[rows, D]``),
    from ``DOWN_SUM_MIN_ROWS_SLABS`` where the scatter-add would walk the output by column slabs
    (``slabs``). Below that the atomics cost nothing visible (H200, RESULTS.md session 8, Qwen3-30B
    and DeepSeek-V3 TP8 at T = 16..256: layer within +-3 µs either way): the down GEMM is bound by
    its weights there, not by the bf16 atomic adds. Knob ``DOWN_SUM_MIN_ROWS`` pins the bound for
    both."""
    mode = settings.get().down_sum
    if mode != "auto":
        return mode == "sum"
    bound = settings.get().knob("DOWN_SUM_MIN_ROWS", DOWN_SUM_MIN_ROWS_SLABS if slabs else DOWN_SUM_MIN_ROWS)
    return bool(deterministic) or (top_k >= 2 and rows >= bound)


def _combine_pays(rows: int, experts: int, top_k: int) -> bool:
    """Rows that rarely share an expert (the grouped GEMM's GEMV range), top-k of at least
    ``COMBINE_MIN_TOP_K`` (knob of the same name)."""
    if top_k < settings.get().knob("COMBINE_MIN_TOP_K", COMBINE_MIN_TOP_K):
        return False
    return use_gemv(rows, max(1.0, expected_groups_hit(rows, max(experts, 1))))


def _down_mode(out, has_selection: bool, rows_dtype, rows: int, experts: int, top_k: int, decode: bool,
               deterministic: bool, down_k: int, x_bytes: int) -> str:  # fmt: skip
    """How the down projection reaches ``out``: ``"combine"`` (decode pipeline, each token's rows
    in one program: ``grouped_gemm_combine``), ``"rows"`` (rows stored, then ``combine_rows``),
    ``"scatter"`` (the GEMM's scatter-add epilogue), or ``"none"`` (no out: rows returned).
    ``down_k``: the down GEMM's K (the experts' intermediate width F), ``x_bytes``: bytes per
    element of its input rows (1: FP8)."""
    if out is None:
        return "none"
    if decode and has_selection and out.is_contiguous() and _combine_pays(rows, experts, top_k):
        return "combine"
    if has_selection and out.dtype == rows_dtype and out.stride(-1) == 1:
        slabs = top_k >= 2 and takes_column_slabs(rows, out.shape[-1], down_k, out.shape[0], x_bytes,
                                                  out.element_size(), l2_bytes(out.device))  # fmt: skip
        if down_sums_rows(deterministic, rows, top_k, slabs):
            return "rows"
    return "scatter"


def will_store_rows(
    out: torch.Tensor, rows: int, experts: int, top_k: int, fp8: bool, deterministic: bool = False,
    path: Optional[str] = None, *, down_k: int,
) -> bool:  # fmt: skip
    """Whether ``run_experts`` (with ``selection_rows``) will store the down projection's summed
    rows into ``out`` rather than add into it: then ``out`` need not be zeroed (pass
    ``out_empty=True``). ``rows``: routed rows (T x top-k), ``experts``: local experts, ``down_k``:
    the experts' intermediate width F (``w2``'s last dimension); 16-bit token rows (FP8 weights:
    bf16 output rows, FP8 down rows)."""
    rows_dtype = torch.bfloat16 if fp8 else out.dtype
    decode = choose_path(rows, experts, path, fp8=fp8, top_k=top_k) == "decode"
    x_bytes = 1 if fp8 else rows_dtype.itemsize
    return _down_mode(out, True, rows_dtype, rows, experts, top_k, decode, deterministic, down_k, x_bytes) == "rows"


# The fused gate/up kernel reads its rows by index (pointer loads, no TMA) and so runs its
# compute-bound tiles up to ~15% slower than the unfused GEMM's (H100, session 13 sweep_swiglu.py:
# Llama 4 Scout T=8192 bf16 2467 vs ~2150 µs of GEMM alone). It pays where the passes it saves
# (the gathered copy, 4D bytes per row, and the [N, 2F] intermediate written and read plus the
# SiLU output, 10F) cost more than that at the machine balance (679 TFLOP/s / 4.25 TB/s ~ 160
# FLOP per byte) against the GEMM's 4DF FLOPs per row: Qwen3-30B 0.40, DeepSeek-V3 TP8 0.68,
# gpt-oss-120b 0.19, Scout 0.098. The layer on the H200 (same run, fused vs unfused, T=2048 /
# 8192): DeepSeek bf16 1025 / 2511 vs 1102 / 2929 µs, FP8 724 / 2162 vs 750 / 2364; Qwen3 bf16
# 497 / 1350 vs 515 / 1409, FP8 343 / 1020 vs 340 / 1031; gpt-oss bf16 1851 / 3908 vs 1790 / 3893,
# FP8 1077 / 2405 vs 1018 / 2348 (fused slower): the bound sits between 0.19 and 0.40.
FUSED_SWIGLU_MIN_SAVING = 0.3
MACHINE_BALANCE = 160.0


def _gate_up_kind(rows: int, experts: int, F: int, D: int, fp8: bool, elem: int, device: torch.device) -> str:
    """The kernel kind ``swiglu_config`` picks for the gate/up GEMM (its tiled kernel where the
    grouped GEMM's rules pick tiles), without its lru_cache: torch.compile traces the callers and
    warns on cached calls."""
    from moekit.ops._common import num_sms
    from moekit.ops._triton.gg_config import heuristic_config

    sms = num_sms(device) if device.type == "cuda" else 132
    return heuristic_config(rows, F, D, max(experts, 1), fp8, elem, sms, persist=False).kind


def _fused_swiglu(rows: int, experts: int, F: int, D: int, fp8: bool, elem: int, device: torch.device) -> bool:
    """Whether the sorted pipeline runs ``grouped_gemm_swiglu`` (rows read by index, SwiGLU in
    the epilogue) for its gate/up GEMM: ``settings.sorted_swiglu``, and either FP8 weights at
    streaming sizes (knob ``FP8_STREAM_SWIGLU``) or rows per expert that take its persistent
    tensor-core tiles with passes saved worth ``FUSED_SWIGLU_MIN_SAVING`` of the GEMM's FLOP
    time."""
    s = settings.get()
    if not s.sorted_swiglu or rows == 0:
        return False
    kind = _gate_up_kind(rows, experts, F, D, fp8, elem, device)
    # FP8 at streaming sizes (knob FP8_STREAM_SWIGLU): the weights are the traffic, and the fused
    # kernel drops the gathered copy and the [N, 2F] intermediate. H200, session 22 run 3, layer
    # from logits, same call, unfused -> fused (µs): Qwen3-30B T=16 / 64 / 256 109.1 / 164.3 /
    # 188.5 -> 105.2 / 159.6 / 182.0, DeepSeek-V3 TP8 163.8 / 304.0 / 404.1 -> 159.7 / 299.5 /
    # 392.3, gpt-oss-120b 332.7 / 711.5 / 812.5 -> 327.9 / 706.3 / 804.6.
    if fp8 and kind == "stream" and s.knob("FP8_STREAM_SWIGLU", True):
        return True
    # The same for 16-bit weights (knob BF16_STREAM_SWIGLU). H100, session 27 run 2, same call,
    # unfused -> fused (µs): DeepSeek-V3 TP8 bf16 T=64 / 256 / 1024 777.0 / 961.1 / 1209.7 ->
    # 765.6 / 943.1 / 1098.9 (T=1024 takes the tiled kernel now: TILED_MIN_ROWS).
    if not fp8 and kind == "stream" and s.knob("BF16_STREAM_SWIGLU", True):
        return True
    if MACHINE_BALANCE * (4 * D + 10 * F) / (4 * D * F) < FUSED_SWIGLU_MIN_SAVING:
        return False
    if kind == "tiled" and s.knob("GATHERED_SWIGLU", GATHERED_SWIGLU) >= 2:
        return False  # the gathered rows through TMA instead (_gathered_swiglu)
    return kind == "tiled"


# Knob GATHERED_SWIGLU: where the sorted pipeline gathers its rows (the unfused gate/up), whether
# the gate/up GEMM is ``grouped_gemm_swiglu`` on the gathered rows (row tiles through TMA, as the
# plain GEMM reads them; SiLU * up in the epilogue: no ``[M, 2F]`` intermediate written and read,
# no ``silu_mul`` launch) instead of the GEMM and ``silu_mul``: 0 never, 1 at the tiled kernel's
# sizes, 2 also instead of the fused kernel's pointer-gathered rows there, -1 (default) the rule
# of ``_gathered_swiglu``.
GATHERED_SWIGLU = -1


def _gathered_swiglu(rows: int, experts: int, F: int, D: int, fp8: bool, elem: int, device: torch.device,
                     top_k: int = 2) -> bool:  # fmt: skip
    """Whether the unfused gate/up GEMM of ``run_experts`` runs ``grouped_gemm_swiglu`` on the
    gathered rows at the tiled kernel's sizes: knob ``GATHERED_SWIGLU``; by default (-1) for
    16-bit weights with top-k >= 2. H100, layer from logits, same call, µs, GEMM + silu_mul ->
    the gathered rows' gate/up tiles (run 4 with the paired tiles, ``gg_swiglu.swiglu_pair``;
    run 3 without): gpt-oss-120b bf16 T = 2048 / 8192 2572.5 / 3831.6 -> 2325.7 / 3665.9 (run
    3: 2546.5 / 3783.0 -> 2351.3 / 3808.4); Mixtral-8x7B bf16 T = 1024 / 2048 / 8192 (run 5,
    two lanes of this path) 1589.5 / 2516.6 / 8778.1 -> 1512.0 / 2525.0 / 8506.8 and 1493.0 /
    2430.0 / 8428.1. Not taken: FP8 (the bf16 output
    quantized in a pass of its own; gpt-oss 1391.9 / 2220.7 -> 1340.5 / 2265.1, Mixtral 1377.5 /
    4980.0 -> 1312.9 / 5090.6 at T = 2048 / 8192), top-1 (Llama 4 Scout bf16 1574.4 / 3474.3 ->
    1583.3 / 3506.3, FP8 849.7 / 1983.0 -> 874.9 / 1951.2) and, mode 2, the fused kernel's rows
    by index (Qwen3-30B bf16 T=8192 1269.5 -> 1425.5, DeepSeek-V3 TP8 2245.3 -> 2882.8: the
    gathered copy costs more than the pointer loads)."""
    s = settings.get()
    mode = s.knob("GATHERED_SWIGLU", GATHERED_SWIGLU)
    if mode < 0:
        mode = 1 if not fp8 and top_k >= 2 else 0
    if rows == 0 or not s.sorted_swiglu or mode < 1:
        return False
    return _gate_up_kind(rows, experts, F, D, fp8, elem, device) == "tiled"


def quantizes_token_rows(x: torch.Tensor, w13_e2FD: torch.Tensor, rows: int, top_k: int,
                         path: Optional[str] = None) -> bool:  # fmt: skip
    """Whether ``run_experts`` on 16-bit token rows ``x [T, D]`` (by ``token_ids``, ``rows`` of
    them) quantizes them whole with ``quantize_fp8_row`` (FP8 weights, the sorted pipeline's
    fused gate/up GEMM): then the caller may hand them over already quantized (``x_fp8``), e.g.
    by the routing launch (``route_and_shuffle``'s ``quantize``; knob ``ROUTE_QUANT``)."""
    if w13_e2FD.dtype != FP8_DTYPE or x.dtype == FP8_DTYPE or x.dim() != 2 or x.stride(-1) != 1 or rows == 0:
        return False
    e, twoF, D = w13_e2FD.shape
    if choose_path(rows, e, path, fp8=True, top_k=top_k) == "decode":
        return False
    return _fused_swiglu(rows, e, twoF // 2, D, True, 1, x.device)


def _no_x_fp8() -> None:
    raise ValueError("x_fp8 is taken only where run_experts quantizes the token rows itself "
                     "(quantizes_token_rows: FP8 weights, 16-bit rows by token_ids, the fused gate/up GEMM)")  # fmt: skip


def run_experts(
    x: torch.Tensor,
    w13_e2FD: torch.Tensor,
    w2_eDF: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    token_ids: Optional[torch.Tensor] = None,
    expert_ids: Optional[torch.Tensor] = None,
    row_weights: Optional[torch.Tensor] = None,
    selection_rows: Optional[torch.Tensor] = None,
    weight_on_input: bool = False,
    x_scale: Optional[torch.Tensor] = None,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_empty: bool = False,
    deterministic: bool = False,
    use_fast_accum: bool = True,
    path: Optional[str] = None,
    x_fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert (``m_sizes [e]`` rows per local expert).

    Rows: with ``token_ids [N]`` (and ``expert_ids [N]``, local ids, ``index_shuffling``'s
    layout; -1 rows skipped) row r is token row ``x[token_ids[r]]`` of ``x [T, D]``; without them
    ``x [N, D]`` holds the sorted rows (optionally FP8 with ``x_scale [N]``, e.g. rows received
    quantized). ``row_weights [N]`` (float32): the router weight of each row, on the expert's
    input (``weight_on_input``) or on its output. ``selection_rows [T * K]`` (``route_and_shuffle``'s
    token-major inverse map), when given with ``out``, lets the decode pipeline combine each
    token's K rows in one program (``grouped_gemm_combine``: no atomics) where they rarely share
    an expert. Weights: ``w13_e2FD [e, 2F, D]`` (gate rows,
    then up rows) and ``w2_eDF [e, D, F]``, bf16, or FP8 e4m3fn with row-wise scales
    ``w13_scale [e, 2F]`` / ``w2_scale [e, D]``.

    With ``out [T, D]`` the rows are scatter-added into ``out`` at ``token_ids`` (bf16 for FP8
    weights; ``deterministic``: the atomics-free, bitwise-reproducible sum) and ``out`` is
    returned; without it the ``[N, D]`` output rows are returned (rows past ``sum(m_sizes)``
    unwritten). ``out_empty``: out holds no values yet (e.g. ``torch.empty``): the summed-rows
    down projection stores into it (no memset, no read of out), the others zero it first
    (``will_store_rows`` says which beforehand). ``x_fp8``: ``quantize_fp8_row(x)`` already
    computed (``(x_fp8 [T, D], x_scale [T])``), where ``quantizes_token_rows`` says this call
    quantizes the token rows (a ``ValueError`` elsewhere).
    """
    check_tensor("w13_e2FD", w13_e2FD, ndim=3)
    e, twoF, D = w13_e2FD.shape
    F = twoF // 2
    check_tensor("w2_eDF", w2_eDF, shape=(e, D, F), dtype=w13_e2FD.dtype)
    fp8_w = w13_e2FD.dtype == FP8_DTYPE
    if fp8_w and (w13_scale is None or w2_scale is None):
        raise ValueError("FP8 expert weights need w13_scale and w2_scale")
    if out is not None and token_ids is None:
        raise ValueError("out (scatter-add into token rows) needs token_ids")
    if token_ids is not None and expert_ids is None:
        raise ValueError("token_ids needs expert_ids (index_shuffling's expert_indices)")
    N = token_ids.shape[0] if token_ids is not None else x.shape[0]
    w13 = w13_e2FD.reshape(-1, D)
    w2 = w2_eDF.reshape(-1, F)
    ws13 = w13_scale.reshape(-1) if fp8_w else None
    ws2 = w2_scale.reshape(-1) if fp8_w else None
    in_w = row_weights if weight_on_input else None
    out_w = None if weight_on_input else row_weights
    down = dict(token_weights=out_w)
    if out is not None:
        down.update(_output_tensor=out, _scatter_add_indices=token_ids, deterministic=deterministic)

    top_k = max(1, N // max(1, x.shape[0])) if token_ids is not None else 1
    rows_dtype = torch.bfloat16 if fp8_w else x.dtype
    decode = choose_path(N, e, path, fp8=fp8_w, top_k=top_k) == "decode"
    # x_fp8: quantizes_token_rows' conditions, from this call's own choices (decode; fused below).
    takes_x_fp8 = token_ids is not None and fp8_w and x.dtype != FP8_DTYPE and x.dim() == 2 and x.stride(-1) == 1
    if x_fp8 is not None and (decode or not takes_x_fp8):
        _no_x_fp8()
    # The down projection into out: scatter-add (atomics), per-token combine (decode), or stored
    # rows + combine_rows (which stores into an empty out; the others add into a zeroed one).
    mode = _down_mode(out, selection_rows is not None, rows_dtype, N, e, top_k, decode, deterministic, w2_eDF.shape[-1],
                      1 if fp8_w else rows_dtype.itemsize)  # fmt: skip
    sum_rows = mode == "rows"
    if out_empty and mode != "rows":
        out.zero_()
    accumulate = not out_empty
    if decode:
        z = grouped_gemm_swiglu(x, w13, m_sizes, gather_indices=token_ids, row_scales=in_w, x_scale=x_scale,
                                w_scale=ws13)  # fmt: skip
        # z is 16-bit: the down GEMM is weight-only FP8 for FP8 weights.
        if mode == "combine":
            return grouped_gemm_combine(z, w2, expert_ids, selection_rows, out, row_weights=out_w, w_scale=ws2)
        if sum_rows:
            rows = grouped_gemm(z, w2, m_sizes, token_weights=out_w, w_scale=ws2)
            return combine_rows(out, rows, selection_rows, accumulate=accumulate)
        return grouped_gemm(z, w2, m_sizes, w_scale=ws2, **down)

    fused = _fused_swiglu(N, e, F, D, fp8_w, 1 if fp8_w else x.element_size(), x.device)
    if x_fp8 is not None:
        if not fused:
            _no_x_fp8()
        if not (isinstance(x_fp8, (tuple, list)) and len(x_fp8) == 2):
            raise TypeError(f"x_fp8 must be a tuple (x_fp8, x_scale), got {type(x_fp8).__name__}")
        check_tensor("x_fp8[0]", x_fp8[0], shape=tuple(x.shape), dtype=FP8_DTYPE, device=x.device)
        check_tensor("x_fp8[1]", x_fp8[1], shape=(x.shape[0],), dtype=torch.float32, device=x.device)
    if not fp8_w:
        if fused:
            z = _gluon_swiglu(x, w13, m_sizes, token_ids, in_w)
            if z is None:
                z = grouped_gemm_swiglu(x, w13, m_sizes, gather_indices=token_ids, row_scales=in_w)
        else:
            # Rows copied (no scores: no ones tensor to fill, one launch fewer).
            xg = gather_scale_dense_tokens(x, token_ids, expert_ids, None) if token_ids is not None else x
            if _gathered_swiglu(N, e, F, D, False, x.element_size(), x.device, top_k):
                z = _gluon_swiglu(xg, w13, m_sizes, None, in_w)
                if z is None:
                    z = grouped_gemm_swiglu(xg, w13, m_sizes, row_scales=in_w)
            else:
                h = grouped_gemm(xg, w13, m_sizes, token_weights=in_w)
                z = silu_mul(h[:, :F], h[:, F:])
        if sum_rows:
            rows = _gluon_rows(z, w2, m_sizes, out_w)
            if rows is None:
                rows = grouped_gemm(z, w2, m_sizes, token_weights=out_w)
            return combine_rows(out, rows, selection_rows, accumulate=accumulate)
        return grouped_gemm(z, w2, m_sizes, **down)
    if x.dtype == FP8_DTYPE:
        if x_scale is None:
            raise ValueError("FP8 rows x need x_scale")
        if token_ids is not None:
            raise ValueError("FP8 rows x are already sorted: pass them without token_ids")
        xq, xs = x, x_scale.reshape(-1)
    elif token_ids is not None and not fused:
        xq, xs = gather_scale_quant_dense_tokens(x, token_ids, expert_ids, None)
    elif x_fp8 is not None:  # the token rows quantized already (by the routing launch)
        xq, xs = x_fp8
    else:  # the token rows quantized once (the fused GEMM reads them by index), or the rows given
        xq, xs = quantize_fp8_row(x)
    zqs = _swiglu_quant(xq, w13, m_sizes, token_ids, in_w, xs, ws13, use_fast_accum) if fused else None
    if zqs is not None:
        zq, zs = zqs
    elif fused:
        z = _gluon_swiglu(xq, w13, m_sizes, token_ids, in_w, xs, ws13) if use_fast_accum else None
        if z is None:
            z = grouped_gemm_swiglu(xq, w13, m_sizes, gather_indices=token_ids, row_scales=in_w, x_scale=xs,
                                    w_scale=ws13, use_fast_accum=use_fast_accum)  # fmt: skip
        zq, zs = quantize_fp8_row(z)
    elif _gathered_swiglu(N, e, F, D, True, 1, x.device, top_k):
        z = _gluon_swiglu(xq, w13, m_sizes, None, in_w, xs, ws13) if use_fast_accum else None
        if z is None:
            z = grouped_gemm_swiglu(xq, w13, m_sizes, row_scales=in_w, x_scale=xs, w_scale=ws13,
                                    use_fast_accum=use_fast_accum)  # fmt: skip
        zq, zs = quantize_fp8_row(z)
    else:
        h = grouped_gemm_fp8_rowwise(xq, w13, m_sizes, xs, ws13, use_fast_accum, token_weights=in_w)
        zq, zs = silu_mul_quant(h[:, :F], h[:, F:])
    if sum_rows:
        rows = _gluon_rows(zq, w2, m_sizes, out_w, zs, ws2) if use_fast_accum else None
        if rows is None:
            rows = grouped_gemm_fp8_rowwise(zq, w2, m_sizes, zs, ws2, use_fast_accum, token_weights=out_w)
        return combine_rows(out, rows, selection_rows, accumulate=accumulate)
    return grouped_gemm_fp8_rowwise(zq, w2, m_sizes, zs, ws2, use_fast_accum, **down)
