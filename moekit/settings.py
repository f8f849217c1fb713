"""Every run-time setting of moekit in one place: environment variables, read once, and a way to
pin a choice for a block of code (tests, benchmarks) without touching module globals.

    from moekit import settings
    settings.get().pdl                       # the current value
    with settings.override(moe_path="decode"):
        ...                                  # code here sees the pinned value

Environment variables (all optional; README.md lists them too):

| variable | setting | default | meaning |
|---|---|---|---|
| ``MOEKIT_PDL`` | ``pdl`` | 1 | programmatic dependent launch on Hopper+, in CUDA-graph captures (0: off) |
| ``MOEKIT_EAGER_DIRECT`` | ``eager_direct`` | 1 | eager calls on plain tensors run an op's implementation directly, skipping the dispatcher (0: always through ``torch.ops.moekit``) |
| ``MOEKIT_PDL_SKIP`` | ``pdl_skip`` | the grouped GEMMs' persistent tiled and streaming kernels | kernels launched without PDL (comma-separated names) |
| ``MOEKIT_PDL_MODE`` | ``pdl_mode`` | per kernel | force every PDL kernel's trigger: 1 early, 2 late (experiments) |
| ``MOEKIT_MOE_PATH`` | ``moe_path`` | auto | the experts pipeline: ``auto``, ``decode`` (fused small-batch kernels), ``sorted`` (index-shuffled grouped GEMMs) |
| ``MOEKIT_DECODE_MAX_ROWS`` | ``decode_max_rows`` | 2048 | ``auto`` takes the decode path up to this many routed rows (tokens x top-k; see ``moekit.layers.experts.choose_path``) |
| ``MOEKIT_DECODE_FUSED`` | ``decode_fused`` | auto | ``moe_forward``'s two-launch decode (``moekit.ops.moe_decode``: routing inside the gate/up GEMV, no sorted layout): ``auto``: any top-k, at most 256 experts, at most 4 tokens, 16-bit or FP8 weights; ``on``: wherever the decode pipeline runs up to 64 rows, any top-k (experiments); ``off`` |
| ``MOEKIT_ROUTE_FUSED_MAX_T`` | ``route_fused_max_t`` | 8 | ``route_and_shuffle`` routes up to this many tokens in one program (one launch); more take a program per block of tokens and a placing launch |
| ``MOEKIT_SORTED_SWIGLU`` | ``sorted_swiglu`` | 1 | the sorted pipeline's gate/up GEMM reads token rows by index with the SiLU * up in its epilogue (``grouped_gemm_swiglu``'s tiled kernel) where its rows per expert take tensor-core tiles (0: gather, GEMM, ``silu_mul``) |
| ``MOEKIT_DOWN_SUM`` | ``down_sum`` | auto | the sorted pipeline's down projection: ``atomic`` (scatter-add epilogue), ``sum`` (rows stored, then each token's rows summed: no atomics), ``auto`` (``sum`` for ``deterministic=True`` and from ``moekit.layers.experts.DOWN_SUM_MIN_ROWS`` routed rows of top-k >= 2, ``DOWN_SUM_MIN_ROWS_SLABS`` where the scatter-add takes column slabs) |
| ``MOEKIT_GG_TUNED`` | ``gg_tuned`` | none | JSON table of grouped-GEMM configurations (``benchmarks/tune_gemm.py`` writes it) |
| ``MOEKIT_GG_GEMV_MAX_M`` | ``gg_gemv_max_m`` | 4 | grouped GEMMs of at most this many rows run the GEMV kernel (0: never) |
| ``MOEKIT_GG_GEMV_SPREAD_MAX_M`` | ``gg_gemv_spread_max_m`` | 8 | ... and up to this many rows when they rarely share an expert (top-k decode) |
| ``MOEKIT_GG_TMA`` | ``gg_tma`` | 1 | TMA descriptors in the grouped GEMM where the strides allow |
| ``MOEKIT_GG_FLATTEN`` | ``gg_flatten`` | 1 | the tiled GEMM's fused (flattened) tile + K loop |
| ``MOEKIT_GG_STREAM_PPS`` | ``gg_stream_pps`` | 4 | streaming GEMM grid cap, programs per SM |
| ``MOEKIT_GG_STREAM_PERSIST`` | ``gg_stream_persist`` | 1 | short-K streaming GEMM tiles (at most 4 K steps, not weight-only FP8) on the persistent tile loop (``GemmConfig.persist``; 0: one program per tile) |
| ``MOEKIT_F8_DENSE`` | ``f8_dense`` | auto | dense FP8 GEMM backend: ``auto``, ``triton``, ``scaled_mm`` |
| ``MOEKIT_COMM_HOST_ERRORS`` | ``comm_host_errors`` | 1 | the collective mirrors timeouts to pinned host memory |
| ``MOEKIT_BENCH_DIR`` | ``bench_dir`` | ``$OUT`` | where benchmarks write their JSON rows |
| ``MOEKIT_BENCH_WARMUP_MS`` | ``bench_warmup_ms`` | 50 | GPU milliseconds ``benchmarking.bench_us`` replays a case before timing it |
| ``MOEKIT_KNOBS`` | ``knobs`` | none | experiments: pin kernel-choice knobs (below), ``NAME=value,NAME=value`` (integers, or ``true`` / ``false``) |

A malformed value raises ``ValueError`` naming the variable when the settings are first read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Settings", "get", "override", "on_change", "reload"]

MOE_PATHS = ("auto", "decode", "sorted")
DECODE_FUSED = ("auto", "on", "off")
DOWN_SUMS = ("auto", "atomic", "sum")
F8_DENSE = ("auto", "triton", "scaled_mm")
_DEFAULT_PDL_SKIP = frozenset({"_gg_tiled_kernel", "_gg_stream_kernel", "_swiglu_tiled_kernel"})


@dataclass(frozen=True)
class Settings:
    pdl: bool = True
    eager_direct: bool = True
    pdl_skip: frozenset = _DEFAULT_PDL_SKIP
    pdl_mode: Optional[int] = None
    moe_path: str = "auto"
    decode_max_rows: int = 2048
    decode_fused: str = "auto"
    route_fused_max_t: int = 8
    sorted_swiglu: bool = True
    down_sum: str = "auto"
    gg_tuned: Optional[str] = None
    gg_gemv_max_m: int = 4
    gg_gemv_spread_max_m: int = 8
    gg_tma: bool = True
    gg_flatten: bool = True
    gg_stream_pps: int = 4
    gg_stream_persist: bool = True
    f8_dense: str = "auto"
    comm_host_errors: bool = True
    bench_dir: Optional[str] = None
    bench_warmup_ms: int = 50
    # Kernel-choice knobs that tests pin to reach every path (and device A/B runs through
    # ``MOEKIT_KNOBS``). Each
    # overrides the module constant of the same name (a leading underscore dropped), the default
    # when unpinned; modules are under moekit.ops._triton (DOWN_SUM_MIN_ROWS and COMBINE_MIN_TOP_K:
    # moekit.layers.experts):
    #   PIPE_MIN_BYTES_SILU               activation (silu_mul_quant persistent kernel)  256 MiB
    #   PIPE_MIN_BYTES                    quantize (quantize_fp8_row persistent kernel)   64 MiB
    #   SCAN_CB                           routing (histogram scan tile, programs)           1024
    #   MAX_KERNEL_E                      routing (read by moekit.ops.routing)              4096
    #   FUSED_SCAN_MAX                    routing + route (count rows scanned in place)    16384
    #   SPLIT_MAX_BLOCKS                  route (route_and_shuffle blocks of one sub-tile)  1024
    #   ROUTE_SPLIT_TILE                  route (split path sub-tile, tokens x experts)     2048
    #   ROUTE_SPLIT_WARPS                 route (split path routing program warps)             8
    #   ZERO_RIDE_MAX                     route (zero_buffer zeroed in the launch, elements)  1M
    #   DOWN_SUM_MIN_ROWS                 experts (down rows summed, not scatter-added; pins
    #                                     both bounds)         32768, 131073 with column slabs
    #   COMBINE_MIN_TOP_K                 experts (decode: per-token combine from this top-k)    6
    #   DECODE_FUSED_MIN_TOP_K            experts (decode_fused auto: moe_decode from this top-k) 1
    #   DECODE_FUSED_MAX_TOKENS           experts (decode_fused auto: moe_decode up to these tokens) 4
    #   SWIGLU_GEMV_FP8_WAVE              gg_swiglu (FP8 gate/up GEMV tiles sized for one wave) True
    #   FP8_STREAM_SWIGLU                 experts (FP8 sorted pipeline at streaming sizes through
    #                                     grouped_gemm_swiglu: token rows quantized once)      True
    #   GG_PERSIST_REGS                   grouped_gemm (persistent swap-AB grid bounded by the
    #                                     compiled kernel's registers, not only its shared memory) False
    #   ROUTE_QUANT                       experts (FP8 token rows quantized by the routing launch,
    #                                     read by moekit.layers.functional)                     True
    #   GG_EARLY_EPI                      grouped_gemm (tiled tiles' epilogue operands loaded before
    #                                     the K loop: 0 none, 1 FP8 tiles, 2 every dtype)          1
    #   GG_EARLY_DST                      grouped_gemm (the scatter-add's destination rows loaded
    #                                     before the K loop too, where the operands are)        False
    #   EARLY_EPI_MAX_K                   grouped_gemm (longest K of a tiled tile loading early)  1024
    #   SWIGLU_SMALL_TILES                gg_swiglu (64-row paired tiled tiles below 192
    #                                     rows/expert; default: rows by index, K < 4F)          rule
    #   BF16_STREAM_SWIGLU                experts + gg_swiglu (16-bit sorted pipeline's gate/up
    #                                     GEMM fused at streaming sizes, as FP8_STREAM_SWIGLU)   True
    #   TILED_MIN_ROWS                    grouped_gemm (tiled kernel from, rows per expert; default
    #                                     32 where K >= 4N, else 48)                            rule
    #   TILED_SHORT_K                     grouped_gemm (also from 32 rows where K <= this)     256
    #   GG_N_SLAB                         grouped_gemm (scatter-add tiles by column slabs of this
    #                                     width, every expert's tiles of a slab in turn; 0 off;
    #                                     -1 the rule: short K, wide output, top-k >= 2)     -1
    #   GATHERED_SWIGLU                   experts (gathered rows' gate/up through grouped_gemm_swiglu:
    #                                     0 never, 1 at tiled sizes, 2 also for the fused kernel's,
    #                                     -1 the rule: 16-bit weights, top-k >= 2)             -1
    #   SWIGLU_PAIR                       gg_swiglu (tiled tiles: gate and up rows in one
    #                                     [G, 2, F, K] descriptor load, one MMA; default from
    #                                     128 rows per expert)                                  rule
    #   SWIGLU_FLATTEN                    gg_swiglu (tiled tiles: the tile loop fused into the K
    #                                     loop; default the 64-row tiles only; FP8 128-row never) rule
    #   TOPK_ROWS_BLOCKS                  route (shuffle_top_k's split path: blocks aimed at,
    #                                     a power of two sub-tiles each)                       256
    #   SWIGLU_TILED_STAGES               gg_swiglu (stages of the 128-row tiled tiles)          3
    #   SWIGLU_SMALL_MAX_ROWS             gg_swiglu (64-row tiles below this many rows/expert)   192
    #   GLUON_DOWN                        experts (the stored down rows through the experimental
    #                                     warp-specialized Gluon kernel on Hopper; 2: its
    #                                     one-partition-per-half form)              FP8 rows (-1)
    #   GLUON_SWIGLU                      experts (the gate/up GEMM + SwiGLU through the
    #                                     experimental Gluon kernel on Hopper; 2: one N=256
    #                                     MMA a step, 3: that with four stages)                 0
    #   SWIGLU_QUANT                      experts (the FP8 gate/up GEMM quantizes its SwiGLU rows
    #                                     in the same launch: grouped_gemm_swiglu_quant)        0
    #   FP8_TALL_TILES                    gg_config (FP8 GEMMs storing their rows: 128 x 128 x
    #                                     256 tiles from 48 to 95 rows/group)                   1
    #   FP8_TALL_SHORT_K                  gg_config (those FP8 tiles to 191 rows/group where K
    #                                     is at most this; 0 off)                            1024
    #   BF16_TALL_TILES                   gg_config (16-bit GEMMs storing their rows: 128 x 128
    #                                     x 128 tiles below 96 rows/group)                      1
    #   NARROW_TILES_WAVES                gg_config (256-column tiled tiles narrow to 128 below
    #                                     this many waves of them)                              1
    #   STREAM_DEEP_K                     gg_config (16-bit streaming GEMMs storing their rows,
    #                                     64 x 128 tiles, K >= 1024: 128-wide K, 2 stages)      1
    #   STREAM_DEEP_K32                   gg_config (the same for their 32 x 128 tiles, K >=
    #                                     256: 128-wide K, up to 3 stages)                      1
    #   COMBINE_FEW_4KB                   gg_combine (per-token combine of top-1 / top-2: 4 KB
    #                                     weight tiles per choice, 512-wide F, 3 stages)     True
    #   SWIGLU_PTR_PAIR                   gg_swiglu (the paired gate|up tile also through
    #                                     pointers, where no TMA descriptor is taken)        True
    #   SWIGLU_PAIR_MIX                   gg_swiglu (the paired tile's gate and up rows mixed
    #                                     in blocks of BN/2: the split stays in registers)  False
    #   SWIGLU_SMALL_STAGES               gg_swiglu (pipeline stages of the 64-row tiles; above 4
    #                                     only where the launch mixes the pair order)          4
    #   DECODE_ROUTE_ROWS                 decode (moe_decode's first launch routes the token on
    #                                     one copy of its logits row per warp)               False
    #   GG_DEVICE_TMA                     grouped_gemm + gg_swiglu (TMA descriptors made in the
    #                                     kernel: 0 never, 1 the tiled kernels under tracing
    #                                     (torch.compile), 2 every TMA launch, 3 every
    #                                     launch under tracing)                                 1
    #   GG_TRACED_HOST                    grouped_gemm + gg_swiglu (traced tiled TMA launches
    #                                     recorded as opaque ops that launch at run time with
    #                                     host descriptors)                                     1
    #   SCATTER_SHORT_K                   gg_config (scatter-added tiled GEMMs with K up to this
    #                                     keep 64-row tiles at any rows/group; 0 off)        1024
    #   GATHER_WHOLE_ROW_MIN_ROWS_PER_SM  gs_gather (whole-row gather from, rows/SM)           8
    #   GATHER_WHOLE_ROW_MAX_ROWS_PER_SM  gs_gather (whole-row gather below, rows/SM)         64
    #   GATHER_STREAM_PROGRAMS_PER_SM     gs_gather (whole-row gather grid, programs/SM)       8
    #   ONE_PASS_MAX_D                    gs_gather (+ gs_scatter's locked path), columns   8192
    #   LOCKED_MIN_ROWS                   gs_scatter (locked scatter-add from, rows)        1024
    #   SCAN_MAX_ROWS                     gs_scatter_det (+ gs_scatter's choice), rows      1024
    #   UNROLL_MAX                        shuffling (rows held whole, main chunks)             4
    #   PIPELINE                          shuffling (next unit loaded before stores)        True
    knobs: dict = field(default_factory=dict)

    def knob(self, name: str, default: Any) -> Any:
        """A pinned tuning knob (``override(knobs={name: value})``), else ``default``."""
        return self.knobs.get(name, default)


#: Every knob name ``override(knobs=...)`` accepts (the list in ``Settings``' comment).
KNOBS = (
    "PIPE_MIN_BYTES_SILU", "PIPE_MIN_BYTES", "SCAN_CB", "MAX_KERNEL_E", "SPLIT_MAX_BLOCKS",
    "FUSED_SCAN_MAX", "ROUTE_SPLIT_TILE", "ROUTE_SPLIT_WARPS", "ZERO_RIDE_MAX", "DOWN_SUM_MIN_ROWS",
    "GATHER_WHOLE_ROW_MIN_ROWS_PER_SM", "GATHER_WHOLE_ROW_MAX_ROWS_PER_SM", "GATHER_STREAM_PROGRAMS_PER_SM",
    "ONE_PASS_MAX_D", "LOCKED_MIN_ROWS", "SCAN_MAX_ROWS", "UNROLL_MAX", "PIPELINE",
    "COMBINE_MIN_TOP_K", "DECODE_FUSED_MIN_TOP_K", "DECODE_FUSED_MAX_TOKENS",
    "SWIGLU_GEMV_FP8_WAVE", "FP8_STREAM_SWIGLU", "GG_PERSIST_REGS", "ROUTE_QUANT", "GG_EARLY_EPI",
    "GG_EARLY_DST", "EARLY_EPI_MAX_K", "SWIGLU_SMALL_TILES", "BF16_STREAM_SWIGLU", "TILED_MIN_ROWS",
    "TILED_SHORT_K", "GG_N_SLAB", "GATHERED_SWIGLU",
    "SWIGLU_PAIR", "SWIGLU_FLATTEN", "TOPK_ROWS_BLOCKS", "SWIGLU_TILED_STAGES", "SWIGLU_SMALL_MAX_ROWS",
    "GLUON_DOWN", "GLUON_SWIGLU", "SWIGLU_QUANT", "FP8_TALL_TILES", "SCATTER_SHORT_K",
    "BF16_TALL_TILES", "NARROW_TILES_WAVES", "STREAM_DEEP_K", "FP8_TALL_SHORT_K",
    "STREAM_DEEP_K32", "COMBINE_FEW_4KB", "SWIGLU_PTR_PAIR", "GG_DEVICE_TMA",
    "GG_TRACED_HOST", "SWIGLU_PAIR_MIX", "SWIGLU_SMALL_STAGES", "DECODE_ROUTE_ROWS",
)  # fmt: skip


def _flag(env: dict, name: str, default: bool) -> bool:
    v = env.get(name)
    if v is None or v == "":
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be '0' or '1', got {v!r}")
    return v == "1"


def _int(env: dict, name: str, default: int, lo: int = 0) -> int:
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}") from None
    if n < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return n


def _choice(env: dict, name: str, default: str, choices: tuple) -> str:
    v = env.get(name) or default
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")
    return v


def _knobs(env: dict) -> dict:
    """``MOEKIT_KNOBS``: ``NAME=value`` pairs, comma-separated; integers, or true / false."""
    return parse_knobs(env.get("MOEKIT_KNOBS") or "")


def parse_knobs(v: str) -> dict:
    """``"NAME=value,NAME=value"`` (``MOEKIT_KNOBS``' form; integers, or true / false) as the dict
    ``override(knobs=...)`` takes. ValueError names the knobs on an unknown name or value."""
    out: dict = {}
    for item in (i.strip() for i in v.split(",")):
        if not item:
            continue
        name, eq, raw = item.partition("=")
        name, raw = name.strip(), raw.strip().lower()
        if not eq or name not in KNOBS:
            raise ValueError(f"MOEKIT_KNOBS takes NAME=value pairs with NAME one of {list(KNOBS)}, got {item!r}")
        if raw in ("true", "false"):
            out[name] = raw == "true"
            continue
        try:
            out[name] = int(raw)
        except ValueError:
            raise ValueError(f"MOEKIT_KNOBS: {name} takes an integer or true / false, got {raw!r}") from None
    return out


def from_environ(env: Optional[dict] = None) -> Settings:
    """Settings read from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    mode = env.get("MOEKIT_PDL_MODE", "")
    if mode not in ("", "1", "2"):
        raise ValueError(f"MOEKIT_PDL_MODE must be unset, '1' or '2', got {mode!r}")
    skip = _DEFAULT_PDL_SKIP
    if "MOEKIT_PDL_SKIP" in env:
        skip = frozenset(k for k in env["MOEKIT_PDL_SKIP"].split(",") if k)
    return Settings(
        pdl=_flag(env, "MOEKIT_PDL", True),
        eager_direct=_flag(env, "MOEKIT_EAGER_DIRECT", True),
        pdl_skip=skip,
        pdl_mode=int(mode) if mode else None,
        moe_path=_choice(env, "MOEKIT_MOE_PATH", "auto", MOE_PATHS),
        decode_max_rows=_int(env, "MOEKIT_DECODE_MAX_ROWS", 2048),
        decode_fused=_choice(env, "MOEKIT_DECODE_FUSED", "auto", DECODE_FUSED),
        route_fused_max_t=_int(env, "MOEKIT_ROUTE_FUSED_MAX_T", 8),
        sorted_swiglu=_flag(env, "MOEKIT_SORTED_SWIGLU", True),
        down_sum=_choice(env, "MOEKIT_DOWN_SUM", "auto", DOWN_SUMS),
        gg_tuned=env.get("MOEKIT_GG_TUNED") or None,
        gg_gemv_max_m=_int(env, "MOEKIT_GG_GEMV_MAX_M", 4),
        gg_gemv_spread_max_m=_int(env, "MOEKIT_GG_GEMV_SPREAD_MAX_M", 8),
        gg_tma=_flag(env, "MOEKIT_GG_TMA", True),
        gg_flatten=_flag(env, "MOEKIT_GG_FLATTEN", True),
        gg_stream_pps=_int(env, "MOEKIT_GG_STREAM_PPS", 4, lo=1),
        gg_stream_persist=_flag(env, "MOEKIT_GG_STREAM_PERSIST", True),
        f8_dense=_choice(env, "MOEKIT_F8_DENSE", "auto", F8_DENSE),
        comm_host_errors=_flag(env, "MOEKIT_COMM_HOST_ERRORS", True),
        bench_dir=env.get("MOEKIT_BENCH_DIR") or env.get("OUT") or None,
        bench_warmup_ms=_int(env, "MOEKIT_BENCH_WARMUP_MS", 50),
        knobs=_knobs(env),
    )


_current: Optional[Settings] = None
_listeners: list[Callable[[], None]] = []


def get() -> Settings:
    """The settings in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_environ()
    return _current


def _set(s: Settings) -> None:
    global _current
    _current = s
    for fn in _listeners:
        fn()


def reload() -> Settings:
    """Re-read the environment (e.g. after changing ``os.environ``)."""
    _set(from_environ())
    return get()


def on_change(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` (e.g. a cache's ``cache_clear``) to run whenever the settings change."""
    _listeners.append(fn)
    return fn


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Pin settings for the ``with`` block (``knobs={...}`` merges into the pinned knobs)."""
    names = {f.name for f in dataclasses.fields(Settings)}
    for k in changes:
        if k not in names:
            raise TypeError(f"override: unknown setting {k!r}; settings are {sorted(names)}")
    if "moe_path" in changes and changes["moe_path"] not in MOE_PATHS:
        raise ValueError(f"moe_path must be one of {MOE_PATHS}, got {changes['moe_path']!r}")
    if "decode_fused" in changes and changes["decode_fused"] not in DECODE_FUSED:
        raise ValueError(f"decode_fused must be one of {DECODE_FUSED}, got {changes['decode_fused']!r}")
    if "down_sum" in changes and changes["down_sum"] not in DOWN_SUMS:
        raise ValueError(f"down_sum must be one of {DOWN_SUMS}, got {changes['down_sum']!r}")
    before = get()
    if "knobs" in changes:
        unknown = sorted(set(changes["knobs"]) - set(KNOBS))
        if unknown:
            raise TypeError(f"override: unknown knob(s) {unknown}; knobs are {list(KNOBS)}")
        changes["knobs"] = {**before.knobs, **changes["knobs"]}
    _set(dataclasses.replace(before, **changes))
    try:
        yield get()
    finally:
        _set(before)


def _register_with_torch_compile() -> None:
    """Settings are read while torch.compile traces moekit's Python (path and configuration
    choices). Registered as a pytree constant, a compiled region that read them is guarded on
    their value (``==``): a changed setting recompiles it, and torch 2.11's Dynamo, which can
    take the frozen ``_current`` for a constant, builds that guard instead of failing with
    "Unexpected type Settings" (H200, session 18: ``test_gpu_decode_compiles_fullgraph``)."""
    try:
        import torch.utils._pytree as pytree
    except ImportError:  # settings alone, without torch
        return
    register = getattr(pytree, "register_constant", None)
    if register is not None and not pytree.is_constant_class(Settings):
        register(Settings)


_register_with_torch_compile()
