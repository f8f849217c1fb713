"""Launch configurations of the grouped GEMM: shape buckets and size rules (no autotuning at call
time), or an ahead-of-time tuned table (``settings.gg_tuned`` / ``$MOEKIT_GG_TUNED``, written by
``benchmarks/sweep_gemm.py``)."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from moekit import settings
from moekit.ops._common import cdiv, next_pow2


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. ``kind``: "gemv" (CUDA cores, per row and N slice; ``block_m``
    is ignored), "stream" (swap-AB, per group and N slice) or "tiled" (persistent). ``use_tma``:
    ask for TMA descriptors (used only when the strides allow; never by "gemv"); ``x_tma``: the
    streaming kernel reads x through one as well (whole row tiles). ``persist`` ("stream" only):
    the swap-AB tiles on the persistent tiled kernel's tile loop (``flatten``: one software
    pipeline across tiles, so a tile's weight loads start during the previous tile's MMAs and
    epilogue; short K has 2-4 steps per tile), ``gg_stream_pps`` programs per SM; the heuristic's
    choice for short K (``heuristic_config``)."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    use_tma: bool = True
    flatten: bool = True
    x_tma: bool = False
    persist: bool = False


def expected_groups_hit(M: int, G: int) -> float:
    """Expected number of non-empty groups when M rows land uniformly on G groups."""
    if M <= 0:
        return 0.0
    return G * (1.0 - (1.0 - 1.0 / G) ** M) if G > 1 else 1.0


def _m_bucket(M: int) -> int:
    return next_pow2(max(M, 1))


# Ahead-of-time tuned table: {"<key>": {GemmConfig fields}}, read from ``settings.gg_tuned``
# ($MOEKIT_GG_TUNED), else from grouped_gemm_tuned.json next to this file when present (written by
# ``benchmarks/sweep_gemm.py``).
_DEFAULT_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grouped_gemm_tuned.json")
_TUNED: Optional[dict] = None


def _tuned_table() -> dict:
    global _TUNED
    if _TUNED is None:
        path = settings.get().gg_tuned or _DEFAULT_TABLE
        _TUNED = {}
        if os.path.exists(path):
            with open(path) as f:
                _TUNED = json.load(f)
    return _TUNED


def save_table(table: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)


_TABLE_GENERATION = [0]


def use_table(table: Optional[dict]) -> None:
    """Install a tuned table for this process (None: re-read ``settings.gg_tuned`` / the default)."""
    global _TUNED
    _TUNED = table
    _TABLE_GENERATION[0] += 1
    select_config.cache_clear()


def table_generation() -> int:
    """How many times ``use_table`` has run in this process (a part of torch.compile's cache tag:
    ``moekit.ops._common.compile_cache_tag``)."""
    return _TABLE_GENERATION[0]


def config_key(M: int, N: int, K: int, G: int, fp8: bool, elem: int) -> str:
    return f"m{_m_bucket(M)}_n{N}_k{K}_g{G}_{'fp8' if fp8 else f'b{elem}'}"


@functools.lru_cache(maxsize=4096)
def select_config(M: int, N: int, K: int, G: int, fp8: bool, elem: int, sms: int, w_only: bool = False,
                  stored: bool = False) -> GemmConfig:  # fmt: skip
    """The launch configuration for a shape: a tuned entry when $MOEKIT_GG_TUNED names a table
    holding this shape bucket, else the heuristic below. Cheap (cached per shape). ``w_only``:
    FP8 weights with 16-bit rows (``elem`` is the rows'), never on the persistent stream loop.
    ``stored``: the GEMM stores its rows (no scatter-add epilogue; ``heuristic_config``)."""
    tuned = _tuned_table().get(config_key(M, N, K, G, fp8, elem))
    if tuned and not (w_only and tuned.get("persist")):
        return GemmConfig(**tuned)
    return heuristic_config(M, N, K, G, fp8, elem, sms, persist=False if w_only else None, stored=stored, w_only=w_only)


def use_gemv(M: int, hits: float) -> bool:
    """The GEMV kernel: at most ``settings.gg_gemv_max_m`` rows (0: never), or at most
    ``settings.gg_gemv_spread_max_m`` rows that rarely share an expert (``hits``: expected groups
    hit; top-k decode, where one token's k rows go to k experts and a tensor-core tile would hold
    one real row of 16)."""
    s = settings.get()
    if s.gg_gemv_max_m <= 0:
        return False
    return M <= s.gg_gemv_max_m or (M <= s.gg_gemv_spread_max_m and M <= 1.1 * hits)


# Shared memory one streaming program may use: two programs per SM (228 KB per SM, 1 KB each
# reserved), so that one streams while the other fills or drains its pipeline.
_STREAM_SMEM = 110 * 1024


def widest_slice(rows: int, N: int, sms: int, most: int = 16) -> int:
    """Columns per GEMV-like program: the widest of 16, 8, 4, 2 (at most ``most``) whose grid
    (``rows x cdiv(N, columns)``) still gives about two programs per SM (1.8), else 1."""
    for bn in (16, 8, 4, 2):
        if bn <= most and rows * cdiv(N, bn) >= (9 * sms) // 5:
            return bn
    return 1


def gemv_config(M: int, N: int, K: int, elem: int, sms: int) -> GemmConfig:
    """GEMV kernel: weight slices of ``block_n`` rows, K tiles of about 8 KB of weights (at most
    512 FP8 values; a power of two dividing K when one of at least 128 elements does: no K masks),
    about 32 KB of them in flight. ``block_n``: the widest (up to 16) that still gives about two programs per SM; on
    short rows (K under 4 KB of weights) no wider than 16 KB of weights per program. Measured on
    the H200 (one row, routings rotated past the L2): Scout TP8 w13 bf16 8 rows 5.5 µs vs 6.2 at
    4; Maverick TP8 w2 16 KB programs (bf16 8 rows 5.9 vs 6.4 at 16; FP8 16 rows 4.1 vs 4.6 at
    8); DeepSeek w2 FP8 8 rows 7.8 vs 8.8 at 16; Llama 4 w2 FP8 (K = 8192) 16 rows 13.8 vs 14.7."""
    row_bytes = K * elem
    block_n = widest_slice(M, N, sms, 16 if row_bytes >= 4096 else 16384 // max(row_bytes, 1))
    # K tiles of ~8 KB of weights, at most 512 wide for FP8 (run 6: DeepSeek w2 8 x 512 7.8 µs vs
    # 8 x 1024 8.9; Maverick / Qwen3 / Llama 4 at or within 5% of their best with 512).
    target = max(64, 8192 // (block_n * elem))
    if elem == 1:
        target = min(target, 512)
    div = K & -K  # the largest power of two dividing K
    block_k = min(target, div) if div >= 128 else min(target, max(16, next_pow2(K)))
    # Pipeline depth: about 32 KB of weights in flight per program (num_stages - 1 tiles).
    stages = 1 + max(2, min(6, (32 * 1024) // (block_n * block_k * elem)))
    return GemmConfig("gemv", 1, block_n, block_k, stages, 4, use_tma=False)


# K up to which the tiled kernel takes 32-47 rows per group too (``heuristic_config``).
TILED_SHORT_K = 256

# Knob FP8_TALL_TILES (``heuristic_config``): FP8 grouped GEMMs that store their rows (no scatter-add
# epilogue) take 128 x 128 x 256 tiles, three stages, from 48 to under 96 rows per group, where
# one 128-row tile holds most groups whole: each group's weights stream through one tile per
# column slice instead of through one or two 64-row tiles, in half as many K steps. H100,
# session 35 run 3 (``sweep_gemm.py``, the GEMM alone, rows stored, µs, 64 x 256 x 128 s4 ->
# 128 x 128 x 256 s3): 64 rows per group, gpt-oss-120b gate|up (M=8192, N=5760, K=2880) 852.1 ->
# 795.9, DeepSeek-V3 TP8 down (M=16384, N=7168, K=256) 298.7 -> 254.0, gpt-oss-120b down (N=2880,
# K=2880) 408.5 -> 411.4. With a scatter-add epilogue the same tiles were slower (the layer's
# down GEMMs below 32768 rows: Qwen3-30B FP8 T=2048 356.6 -> 386.3 µs with a tuned table
# holding them). The layer from logits (runs 4-5, FP8, off -> on, two lanes in opposite
# orders, µs): gpt-oss-120b T=2048 1458.9 / 1459.8 -> 1358.4 / 1356.8 (its gate|up), Llama 4
# Scout T=1024 796.6 / 796.5 -> 779.3 / 778.6, Mixtral-8x7B T=256 572.3 / 572.3 -> 562.7 /
# 563.6, Llama 4 Maverick T=8192 6279.3 / 6268.2 -> 6102.7 / 6103.0; the cells it does not
# touch level. 0: off.
FP8_TALL_TILES = 1

# Knob FP8_TALL_SHORT_K: the FP8 tall tiles above also from 96 to under 192 rows per group where K
# is at most this (0: off). The likely reason (not profiled): short K leaves each tile few K steps
# (K = 1024: eight 128-wide steps on 64 x 256 x 128, four 256-wide ones on 128 x 128 x 256), so the
# per-tile costs weigh, and a group of ~128 rows takes 1-2 tall row tiles instead of 2-3 short ones,
# each streaming the group's weights again. H100, session 40 (``sweep_gemm.py``, the GEMM alone,
# rows stored, FP8, 128 rows per group, µs, 64 x 256 x 128 s4 -> 128 x 128 x 256 s3): Qwen3-30B
# down (G=128, N=2048, K=768) 118.5 -> 105.8, Llama 4 Scout TP8 down (G=16, N=5120, K=1024) 51.6 ->
# 44.5, Maverick TP8 down (G=128, N=5120, K=1024) 335.5 -> 305.6; at K=2048 level (Qwen3 gate|up
# 184.4 -> 183.6), and longer K lost (gpt-oss-120b down, K=2880, 483.1 -> 510.7; Scout TP8 gate|up,
# K=5120, 82.5 -> 90.9).
# 16-bit rows took no such bound (the same sweeps, 128 x 128 x 128 s3: Scout TP8 down 80.8 -> 77.0
# but Maverick TP8 down 542.0 -> 563.4).
FP8_TALL_SHORT_K = 1024

# Knob BF16_TALL_TILES: the same for 16-bit GEMMs that store their rows, 128 x 128 x 128 tiles,
# three stages, from the tiled kernel's smallest groups to under 96 rows per group. H100, session
# 39 (``sweep_gemm.py``, the GEMM alone, rows stored, bf16, µs, the rule's tile -> 128 x 128 x
# 128 s3): Llama 4 Scout TP8 gate|up (G=16, N=2048, K=5120) M=1024 (64 rows per group) 140.7 ->
# 122.7, gpt-oss-120b gate|up (G=128, N=5760, K=2880) M=8192 (64) 1727.4 -> 1573.5, DeepSeek-V3
# TP8 gate|up (G=256, N=512, K=7168) M=8192 (32) 714.9 -> 672.6 (each the best of the sweep's 14
# tiles; bench_grouped_gemm.py, same machine: 138.6 -> 123.0 against MSLK's 128.7, 1765.1 ->
# 1551.9 against 1592.3). Why: at 32-95 rows per group these GEMMs are bytes-bound (64 rows make
# 64 FLOP per weight byte, the card's ridge is ~160), and with 64-row tiles about half the groups
# (random routing around a mean of 64) spill a few rows into a second row tile that streams the
# group's whole weight slab again, from DRAM where the slabs outgrow L2; a 128-row tile holds such
# groups whole. In all seven session-39 sweeps that timed both (32-128 rows per group) 128 x 128
# x 128 s3 was at or ahead of 64 x 256 x 64 s4. 0: off.
BF16_TALL_TILES = 1

# Knob NARROW_TILES_WAVES: 256-column tiled tiles narrow to 128 columns only where the wide ones
# would make fewer than this many waves (tiles per SM). It was 4 (never measured); H100, session
# 39, the GEMM alone, Llama 4 Scout TP8 gate|up (G=16, N=2048, K=5120), M=2048 (128 rows per
# group: 384 wide tiles, 2.9 waves), 64 x 128 -> 64 x 256 tiles, µs: bf16 179.5 -> 149.7, FP8
# 97.1 -> 81.6 (MSLK 148.1 / 82.9, bench_grouped_gemm.py 178.7 / 97.2 -> 150.2 / 82.2); M=1024
# bf16 140.7 -> 136.6.
NARROW_TILES_WAVES = 1

# Knob STREAM_DEEP_K: 16-bit streaming GEMMs that store their rows, on 64 x 128 tiles (17-32 rows
# per group) with K >= 1024, take 128-wide K steps in two stages instead of 64-wide ones in four
# (the same 96 KB of operands in flight, two programs per SM). H100, session 39 (``sweep_gemm.py``,
# the GEMM alone, rows stored, bf16, 32 rows per group, µs): Llama 4 Scout TP8 gate|up (M=512)
# 124.7 -> 117.9 and down (K=1024) 66.4 -> 64.0, Llama 4 Maverick TP8 gate|up (M=4096) 963.1 ->
# 911.0, Llama 4 down (K=8192, M=512) 482.0 -> 459.4 (bench_grouped_gemm.py, same machine: 124.5
# -> 118.1 against MSLK's 118.6, 959.4 -> 908.8 against 919.2). Not the scatter-added or the
# fused gate/up GEMMs (not measured). 0: off.
STREAM_DEEP_K = 1

# Knob STREAM_DEEP_K32: STREAM_DEEP_K's step for the 32 x 128 streaming tiles (8-16 rows per group,
# 16-bit rows stored) with K >= 256: 128-wide K steps in (at most) three stages, 120 KB in flight
# and one program per SM, instead of 64-wide ones in five (100 KB, two per SM), on the plain tile
# loop (not the persistent one short K would take). H100, session 41 (``sweep_gemm.py``, the GEMM
# alone, rows stored, bf16, 8 rows per group, µs): Llama 4 Scout TP8 gate|up (M=128) 118.2 ->
# 115.1, DeepSeek-V3 TP8 down (K=256, M=2048; persistent 32 x 128 x 64 s4 before) 343.3 -> 329.1,
# Qwen3-30B gate|up (M=1024) 276.6 -> 270.1, Llama 4 Maverick TP8 down (K=1024) 455.7 -> 447.6,
# gpt-oss-120b down (K=2880) 734.7 -> 732.9 (its best: 32 x 64 x 128 s5, 714.1). A/B, session 42
# (H100, ``bench_grouped_gemm.py``, knob 0 then 1 in one call, 8 rows per group): the 14 cells whose
# tile changed 0.956-1.004x, median 0.988 (DeepSeek-V3 TP8 down 344.0 -> 328.8, Llama 4 down 454.9
# -> 442.7, Scout TP8 gate|up 118.4 -> 114.7; gpt-oss-120b down 730.6 -> 733.2). 0: off.
STREAM_DEEP_K32 = 1

# K up to which a scatter-added tiled GEMM keeps 64-row tiles at any rows per group (knob
# SCATTER_SHORT_K, 0: off; 128-row tiles from 192 rows per group otherwise). DeepSeek-V3 TP8's bf16
# down GEMM scatter-added at T=6144 (192 rows per expert, K=256) compiled its 128 x 256 tiles to
# 255 registers and ran 1073.6 µs, reading 2221 MB and writing 286 MB, where T=5120's 64-row tiles
# (142 registers) ran 630.8 µs (1340 / 115 MB; ncu, H100, session 37; neither spills on sm_90: the
# bytes, not the registers). Layer from logits, H200, same call, 128-row -> 64-row scatter-add
# tiles (µs): Qwen3-30B (K=768) T=3072 bf16 621.2 -> 554.2, FP8 446.1 -> 415.1; DeepSeek-V3 TP8 (K=256, its down rows scatter-added) T=6144 / 8192
# bf16 1743.8 / 2239.2 -> 1558.6 / 1907.0, FP8 1404.9 / 1758.1 -> 1211.1 / 1524.5; but long K
# lost: Mixtral-8x7B (K=14336) T=3072 / 8192 bf16 +7.9 / +10.5%, FP8 +2.1 / +10.4%, Llama 4 Scout
# (K=8192) T=3072 / 8192 FP8 +4.4 / +6.0%, bf16 T=8192 +7.0%.
SCATTER_SHORT_K = 1024


def heuristic_config(
    M: int,
    N: int,
    K: int,
    G: int,
    fp8: bool,
    elem: int,
    sms: int,
    persist: Optional[bool] = None,
    stored: bool = False,
    w_only: bool = False,
) -> GemmConfig:
    """The launch configuration by size rules. ``persist``: whether short-K streaming tiles may run
    on the persistent tile loop (default ``settings.gg_stream_persist``); False for kernels
    without that loop. ``stored``: the grouped GEMM stores its rows (no scatter-add epilogue):
    FP8 tiles from 48 to under 96 rows per group are then 128 x 128 x 256 (knob
    ``FP8_TALL_TILES``; to under 192 where K <= ``FP8_TALL_SHORT_K``), 16-bit tiled tiles below 96
    rows per group 128 x 128 x 128 (``BF16_TALL_TILES``) and 16-bit streaming 64 x 128 tiles with
    K >= 1024 take 128-wide K steps (``STREAM_DEEP_K``), the 32 x 128 ones with K >= 256 too
    (``STREAM_DEEP_K32``); a scatter-add with K <= ``SCATTER_SHORT_K`` keeps 64-row tiles past 192
    rows per group. ``w_only``: FP8 weights with 16-bit rows (``elem`` is the rows'), which keep
    the 16-bit rules' older tiles."""
    # Problems of at most ``settings.gg_gemv_max_m`` rows in all run the GEMV kernel (0: never).
    hits = max(1.0, min(expected_groups_hit(M, G), float(min(G, M))))
    # The GEMV kernel also when the rows rarely share an expert (top-k decode: one token's k rows
    # go to k different experts), where a tensor-core tile would hold one real row of 16.
    if use_gemv(M, hits):
        return gemv_config(M, N, K, elem, sms)
    rows_per_group = M / hits
    kpow = next_pow2(K)
    # 48+ rows per group (32+ for deep, narrow weights) take the tiled kernel (64 x 256 tiles),
    # unless it would leave SMs idle (few groups: e.g. one group of 64 rows is 2 x cdiv(N, 256)
    # tiles) where the streaming kernel still spreads the weights over every SM.
    tiled_tiles = (M / 64 + hits) * cdiv(N, 256)
    # Deep, narrow weights (K >= 4N: DeepSeek-V3 TP8's gate/up, N = F = 256, K = 7168) from 32 rows
    # per group (knob TILED_MIN_ROWS pins one bound for every shape). H100, session 27 runs 2-3,
    # layer from logits at T=1024 (32 rows per expert), same call: DeepSeek bf16 1203.2 -> 1058.8
    # µs, FP8 637.7 -> 615.8 with every shape from 32; but Qwen3-30B FP8 T=512 252.8 -> 268.4 and
    # gpt-oss-120b T=1024 FP8 1190.6 -> 1239.8, bf16 2223.6 -> 2279.7, whose K is at most 4N.
    # And where K is at most TILED_SHORT_K (knob, 0: off): short-K tiles, whose per-tile costs the
    # wider tiled tiles halve (DeepSeek-V3 TP8's down GEMM, K = 256). H100, layer from logits, same
    # call: session 27 run 4 FP8 T=1024 626.8 -> 616.4 µs (every shape from 32); session 28 run 1
    # (this bound alone, µs): FP8 T = 768 / 1024 609.4 / 644.8 -> 606.9 / 635.7, bf16 1077.3 /
    # 1112.2 -> 1077.1 / 1107.4.
    s = settings.get()
    # 16-bit rows and weights, rows stored: STREAM_DEEP_K's and BF16_TALL_TILES' GEMMs
    stored_16 = stored and not fp8 and not w_only and elem == 2
    short_k = s.knob("TILED_SHORT_K", TILED_SHORT_K)
    tiled_min = s.knob("TILED_MIN_ROWS", 32 if K >= 4 * N or K <= short_k else 48)
    if rows_per_group < tiled_min or (rows_per_group <= max(64, tiled_min) and tiled_tiles < sms):
        # Streaming: the weights of the hit experts are the traffic. Rows tile: room for about
        # twice the mean group size, so a group rarely needs a second pass over its weights.
        block_m = min(128, max(16, next_pow2(int(math.ceil(2 * rows_per_group - 1e-3)))))
        # N slice: 128 or 64 rows (warpgroup MMA tiles, asynchronous and pipelined) when that
        # still gives every SM a slice: the slices then run in one wave (two programs per SM)
        # or in many, and the weights stream at the HBM rate. Narrower (synchronous MMA)
        # slices only when even 64-row slices leave SMs idle.
        block_n = 0
        for bn in (128, 64):
            if bn <= max(16, next_pow2(N)) and hits * cdiv(N, bn) >= sms:
                block_n = bn
                break
        if block_n == 0:
            block_n = 32 if N > 16 and hits * cdiv(N, 32) >= sms else 16
        # 16x16 tiles: 4 warps would duplicate the MMA work (warps beyond the tile replicate).
        warps = 8 if block_n * block_m >= 128 * 128 else (2 if block_n * block_m <= 256 else 4)
        # K slice: about 16 KB of weights per pipeline stage (32 KB for FP8 with 16-row x tiles:
        # 128 x 256 slices, 3 stages, measured 5-10% faster than 128 x 128 x 6 on Maverick / Qwen3
        # shapes at M = 16 and 128), x slice at most 16 KB (8 KB for the 2-warp 16x16 tiles, whose pointer loads
        # would otherwise run out of registers).
        cap = 32 if elem == 4 else (512 if warps == 2 else 1024) // elem
        w_stage = 32768 if elem == 1 and block_m <= 16 else 16384
        block_k = min(w_stage // (block_n * elem), 16384 // (block_m * elem), cap, max(kpow, 16))
        block_k = max(16, block_k)
        # Short K (DeepSeek TP8's down projection, K = 256): at least two K steps, so that a
        # program's second weight load overlaps its first MMA (one 256-wide step: 155.6 µs vs 122.3
        # for two 128-wide ones, FP8 N=7168 K=256 G=256 M=512, session 9 run 1).
        while block_k > 64 and cdiv(K, block_k) < 2:
            block_k //= 2
        stage_bytes = (block_n + block_m) * block_k * elem
        if block_n >= 64 and warps == 4:  # two programs per SM (registers allow it too)
            stages = max(2, min(6, _STREAM_SMEM // stage_bytes))
        else:
            stages = max(2, min(8 if warps == 2 else 6, (128 * 1024) // stage_bytes))
        # No more stages than K steps: a stage past them is shared memory no load ever fills, and
        # it costs programs per SM (5 stages for 2 K steps: 187.2 µs, 2 stages: 147.0, FP8
        # N=7168 K=256 G=256 M=2048, session 9 run 1).
        stages = max(2, min(stages, cdiv(K, block_k)))
        if (stored_16 and (block_m, block_n, block_k, warps) == (64, 128, 64, 4) and K >= 1024
                and s.knob("STREAM_DEEP_K", STREAM_DEEP_K)):  # fmt: skip
            block_k, stages = 128, 2  # the same 96 KB in flight, half the K steps (STREAM_DEEP_K)
        if (stored_16 and (block_m, block_n, block_k, warps) == (32, 128, 64, 4) and K >= 256
                and s.knob("STREAM_DEEP_K32", STREAM_DEEP_K32)):  # fmt: skip
            return GemmConfig("stream", 32, 128, 128, min(3, cdiv(K, 128)), 4)  # STREAM_DEEP_K32
        # Short K (at most 4 K steps per tile): the same tiles on the persistent, flattened tile
        # loop, whose pipeline spans tiles (at least 3 stages), so the next tile's weights load
        # while this one's MMAs and epilogue run. Session 21 (H200), GEMM alone: DeepSeek TP8 w2
        # (K=256) M=128 FP8 49.5 us vs 56.2, bf16 91.8 vs 101.9, M=1024 bf16 228.5 vs 254.6;
        # Qwen3 w2 (K=768) M=128 FP8 35.2 vs 38.9. Layers: DeepSeek 4-12% faster at T=16-1024,
        # Qwen3 FP8 3-5% at T=16-256; long K (gpt-oss K=2880, Scout) 1-3% slower, so not there.
        allowed = s.gg_stream_persist if persist is None else persist
        if allowed and cdiv(K, block_k) <= 4:
            return GemmConfig("stream", block_m, block_n, block_k, max(3, stages), warps, persist=True)
        return GemmConfig("stream", block_m, block_n, block_k, stages, warps)
    # Tiled persistent: compute-bound (or nearly) tiles. Groups of under ~200 rows waste less of
    # their last row tile with 64-row tiles; 64 x 256 with four stages was the measured best from
    # 64 to 128 rows per group (DeepSeek w2 FP8 at M = 16384: 999 µs vs 1113 for 128 x 256 and
    # 1211 for the streaming kernel; Llama 4 w13 / w2 at M = 1024: 652 / 341 µs vs 683 / 373).
    fp8_tall_rows = 96 if K > s.knob("FP8_TALL_SHORT_K", FP8_TALL_SHORT_K) else 192  # FP8_TALL_SHORT_K
    fp8_tall = stored and fp8 and 48 <= rows_per_group < fp8_tall_rows and K >= 256
    if fp8_tall and s.knob("FP8_TALL_TILES", FP8_TALL_TILES):
        # (the fused tile loop: three 64 KB stages and the 32 KB epilogue tile take 224 KB, over
        # the 220 KB bound below but inside a block's 227 KB; it compiles and runs on sm_90, and
        # ran 104.8 µs against 147.5 unfused on Qwen3-30B's down GEMM at M = 16384, run 2)
        return GemmConfig("tiled", 128, 128, 256, 3, 8, flatten=s.gg_flatten)
    if stored_16 and rows_per_group < 96 and K >= 256 and s.knob("BF16_TALL_TILES", BF16_TALL_TILES):
        # The same for 16-bit rows: 128 x 128 x 128, three 64 KB stages (the same bytes per stage).
        return GemmConfig("tiled", 128, 128, 128, 3, 8, flatten=s.gg_flatten)
    # 128-row tiles from 192 rows per group, but never for a short-K scatter-add (SCATTER_SHORT_K).
    short_scatter = not stored and K <= s.knob("SCATTER_SHORT_K", SCATTER_SHORT_K)
    block_m = 64 if rows_per_group < 192 or short_scatter else 128
    block_k = 128 if elem == 1 else (64 if elem == 2 else 32)
    block_n = 256 if N >= 256 else max(16, next_pow2(N))
    est_tiles = (M / block_m + hits) * cdiv(N, block_n)
    if block_n == 256 and est_tiles < s.knob("NARROW_TILES_WAVES", NARROW_TILES_WAVES) * sms:
        block_n = 128
    stage_bytes = (block_m + block_n) * block_k * elem
    stages = max(2, min(4, (176 * 1024) // stage_bytes))
    # Tiled kernel: let Triton fuse the persistent tile loop with the K loop (one software pipeline
    # across tiles, as Triton's persistent Hopper matmul does); ``settings.gg_flatten`` turns it off.
    # The fused loop keeps a second epilogue buffer: with float32 tiles the stages plus that
    # buffer pass the 227 KB a block may use. (FP8 128x256 tiles spilled in it until the tile
    # table took two reductions per tile: now 255 registers, no stack, sm_90.)
    out_elem = 4 if elem == 4 else 2
    flatten = settings.get().gg_flatten and stages * stage_bytes + block_m * block_n * out_elem <= 220 * 1024
    return GemmConfig("tiled", block_m, block_n, block_k, stages, 8, flatten=flatten)


@settings.on_change
def _settings_changed() -> None:
    global _TUNED
    _TUNED = None
    select_config.cache_clear()


# Column slabs of the scatter-add's tile order (``n_slab_tiles``): the slab width the rule takes,
# and the output size past which the rule considers them (a quarter of L2: below it the whole
# destination stays in L2 without them).
N_SLAB_COLS = 512
N_SLAB_MIN_OUT_L2_FRACTION = 0.25


def column_slabs_pay(M: int, N: int, K: int, out_rows: int, x_bytes: int, out_bytes: int, l2: int) -> bool:
    """The column-slab rule of ``n_slab_tiles`` for a scatter-add of ``M`` rows of ``x``
    (``x_bytes`` per element, ``K`` wide) into ``out_rows`` rows of ``N`` columns: (1) the
    destination rows take at least two rows each (top-k >= 2), (2) the output is larger than
    ``N_SLAB_MIN_OUT_L2_FRACTION`` of ``l2`` bytes, (3) a row of x is at most an eighth of an
    output row in bytes (short K, wide output: the rows every slab reads again cost less than the
    misses the slabs save), and the output is wider than one slab."""
    reuse = M >= 2 * out_rows
    big = out_rows * N * out_bytes > N_SLAB_MIN_OUT_L2_FRACTION * l2
    short_k = 8 * K * x_bytes <= N * out_bytes
    return reuse and big and short_k and N > N_SLAB_COLS


def takes_column_slabs(M: int, N: int, K: int, out_rows: int, x_bytes: int, out_bytes: int, l2: int) -> bool:
    """Whether a tiled scatter-add of this size walks the output by column slabs (knob
    ``GG_N_SLAB``: pinned width, off, or the rule ``column_slabs_pay``)."""
    cols = settings.get().knob("GG_N_SLAB", -1)
    return cols > 0 or (cols < 0 and column_slabs_pay(M, N, K, out_rows, x_bytes, out_bytes, l2))
