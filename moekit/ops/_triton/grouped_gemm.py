"""Triton kernels: grouped GEMM (BF16/FP16/FP32 and FP8 row-wise) with a fused epilogue
(FP8 scales, bias, token weights, scatter-add), and the dense FP8 row-wise GEMM.

Three kernels (the last two share one epilogue):

- ``_gg_gemv_kernel`` (the *GEMV* path, at most ``GEMV_MAX_M`` = 4 rows in all: decode of one
  token, top-1 or a few). One program = one row and a ``BLOCK_N``-row slice (1..16 rows) of its
  expert's weights over the whole K, on CUDA cores: an elementwise float32 accumulator that
  every thread owns (no MMA dependency chain), cp.async-pipelined 16-byte loads, one reduction
  over K at the end. ``BLOCK_N`` is chosen so that there are about two programs per SM (and,
  on short rows, about 16 KB of weights per program): all of them resident at once, each with
  ~32 KB of weights in flight, no split-K reduction and no second launch (the tensor-core tile of 16 rows per MMA would leave one or two chained
  programs per SM streaming at a third of HBM bandwidth).
- ``_gg_stream_kernel`` (the *streaming* path, rows per expert small: decode, and prefill of
  models with many experts). Operands are swapped: the tile is ``[BLOCK_N, BLOCK_M]`` =
  ``w_g[n-slice] @ x_g.T``, so the expert's N dim fills the MMA's wide side and the few rows of
  the group sit in a 16..128-wide side. One program = one (non-empty group, N slice); the grid is
  ``min(G, M) * cdiv(N, BLOCK_N)`` and programs past the number of non-empty groups exit at once,
  so empty groups cost nothing and every SM streams a slice of the weights that are needed.
  The program loops over the group's row tiles (usually one). Slices are 128 or 64 weight rows
  (warpgroup MMA, asynchronous, pipelined) whenever that still gives every SM a slice, with
  pipelines sized so that two programs share an SM (one streams while the other drains).
- ``_gg_tiled_kernel`` (the *tiled* path, many rows per expert: compute-bound prefill): a
  persistent kernel (one program per SM) walking the output tiles of all groups in a grouped
  (L2-friendly) order, with TMA tensor descriptors for x and w on Hopper when the strides allow.
  With ``SWAP_AB`` (a "stream" configuration with ``persist``: the heuristic's streaming tiles
  unless ``MOEKIT_GG_STREAM_PERSIST=0``) it runs the streaming path's swapped tiles on that tile
  loop, ``gg_stream_pps`` programs per SM, so that a short-K tile's weight loads overlap the
  previous tile's work.

All read ``m_sizes`` on the device: every program loads the ``[G]`` sizes, computes the group
offsets with a cumulative sum and clips them to ``M`` (so rows past ``M`` are never touched
when ``sum(m_sizes) > M``, and negative sizes count as 0). No host synchronization anywhere.

Scatter-add: with ``SCATTER`` the rows are atomically added (relaxed ``atomic_add`` in the output
dtype, bf16 for FP8 inputs, as MSLK does) into ``out[idx[row]]``; negative or out-of-range
indices are skipped. ``deterministic=True`` instead stores the rows into a scratch ``[M, N]``
buffer and the deterministic scatter-add's kernels (``gather_scatter``) add them to the output
token by token: each token's rows summed in float32 in ascending row order, then added to the
output once (bitwise reproducible, and bitwise equal to ``scatter_add_dense_tokens(...,
deterministic=True)`` applied to the GEMM's rows).

``use_fast_accum``: FP8 ``tl.dot`` on Hopper accumulates in the tensor core's reduced-precision
accumulator by default (fast accumulation, Triton's sm_90 default); ``use_fast_accum=False``
promotes the accumulator to float32 after every ``BLOCK_K`` slice (the tiled kernel, ``persist``
included; the streaming kernel has short K slices per dot and always uses the default; the GEMV
path always accumulates exact float32 products). Ignored for 16-bit inputs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from moekit import settings
from moekit._validate import FP8_DTYPE
from moekit.ops._common import _capability_major, cdiv, interpreting, l2_bytes, launch, next_pow2, num_sms
from moekit.ops._triton.gg_config import (  # noqa: F401  (re-exported: the launcher's configuration API)
    N_SLAB_COLS,
    GemmConfig,
    config_key,
    expected_groups_hit,
    gemv_config,
    heuristic_config,
    save_table,
    select_config,
    takes_column_slabs,
    use_table,
)
from moekit.ops._triton.gg_kernels import _gg_gemv_kernel, _gg_stream_kernel, _gg_tiled_kernel


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _fake(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and _is_fake(t)  # (a plain tensor is never fake: no import, no call)


def _tma_ok(t: torch.Tensor, block: tuple[int, int]) -> bool:
    """Host TMA descriptor usable for ``t`` (2-D, unit last stride, 16-byte aligned rows/base)?
    Never under tracing (torch.compile): non-dynamo tracing of ``wrap_triton`` does not capture
    descriptors, so traced graphs use the pointer path, or descriptors made in the kernel
    (``device_tma``)."""
    if not settings.get().gg_tma or _fake(t):
        return False
    return _tma_fits(t, block)


def _tma_fits(t: torch.Tensor, block: tuple[int, int]) -> bool:
    """``t`` and a ``block`` tile meet TMA's rules on this device (sm_90+: 2-D, unit last stride,
    16-byte aligned rows and base, a block row of at least 16 bytes and at most 256 rows), whether
    the descriptor is made on the host or in the kernel. The shapes and strides of a traced (fake)
    tensor answer as the real one's will."""
    if not (t.is_cuda or interpreting()):
        return False
    if (
        t.is_cuda
        and _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) < 9
    ):
        return False
    es = t.element_size()
    if t.stride(-1) != 1 or (t.stride(0) * es) % 16 or (t.storage_offset() * es) % 16:
        return False
    if block[1] * es < 16 or block[0] > 256:
        return False
    return t.shape[0] > 0 and t.shape[1] > 0


# Knob GG_DEVICE_TMA: where the grouped GEMM's and the SwiGLU GEMM's TMA kernels make their
# descriptors in the kernel (``tl.make_tensor_descriptor``, from the pointers and strides, in
# global scratch memory that Triton's allocator gives each launch) instead of taking host
# ``TensorDescriptor`` arguments. Tracing (torch.compile's graphs) hides the tensors, so without it
# a traced launch takes the pointer loads.
#   0 never; 1 the tiled kernels' traced launches (the default); 2 every TMA launch, eager too
#   (A/B runs, tests); 3 every traced launch, the streaming kernels' too.
# H100, session 45, torch.compile(moe_forward) in one process, 1 against 0 (µs): Qwen3-30B T=2048
# bf16 663 -> 577, FP8 457 -> 375, FP8 T=1024 320 -> 289; DeepSeek-V3 TP8 T=2048 bf16 1310 -> 1180,
# FP8 800 -> 752; gpt-oss-120b level; bf16 T=1024 level. Eagerly the host descriptors stay
# faster (mode 2: 0-7% slower at T = 1024-2048). The streaming kernels keep pointer loads
# under tracing (mode 3 against 1: Qwen3-30B FP8 T=256 2% slower, gpt-oss-120b FP8 T=64 2%).
# Since session 46 knob GG_TRACED_HOST (on) takes those traced tiled launches to run time, where
# they take host descriptors: mode 1 applies to them only with it off (or an explicit config).
GG_DEVICE_TMA = 1

# Knob GG_TRACED_HOST: where a traced launch (torch.compile's graphs) of a tiled kernel would read
# through TMA, the trace instead records an opaque op (``moekit::_grouped_gemm_launch``,
# ``moekit::_grouped_gemm_swiglu_launch``) that runs this launcher at run time on the real tensors:
# host TMA descriptors, eager's kernels. The in-kernel descriptors of GG_DEVICE_TMA need a
# ``fence.proxy.tensormap::generic.acquire`` in the kernel, after which ptxas (Triton 3.6's) keeps
# the scatter-add's relaxed ``atom`` as ATOMG (the old value read back) instead of the
# fire-and-forget REDG it makes everywhere else (sm_90 SASS of Qwen3-30B's down GEMM,
# ``test_kernel_made_descriptors_keep_the_atomics_reading_back_on_sm90``); session 45 had the
# compiled tiled kernels 5-12% behind eager's (H100, Qwen3-30B T=2048 bf16: SwiGLU GEMM 343.7
# against 328.4 µs, down GEMM 207.4 against 184.0). The price: the launcher's Python and one
# dispatch per call at run time (tiled sizes only: hundreds of µs of GPU work each; none inside
# a CUDA graph). 0 off, 1 on (default). H100, session 46, torch.compile(moe_forward), same
# process, 0 -> 1 (µs): Qwen3-30B T = 1024 / 2048 bf16 525 / 588 -> 491 / 565, FP8 297 / 382 ->
# 282 / 369; DeepSeek-V3 TP8 bf16 1116 / 1225 -> 1105 / 1161, FP8 663 / 773 -> 620 / 724;
# gpt-oss-120b FP8 T=2048 1444 -> 1363; gpt-oss bf16, Llama 4 Scout level to 0.7% faster. The
# compiled layer then runs as eager does (Qwen3-30B T=2048 bf16 565 against 561 eager).
GG_TRACED_HOST = 1


def traced_host(t: torch.Tensor, config: Optional[GemmConfig]) -> bool:
    """Whether a traced launch of a tiled TMA kernel with operand ``t`` goes through the opaque
    run-time launch (knob ``GG_TRACED_HOST``): a fake ``t`` (under tracing), TMA on, no explicit
    ``config`` (the run-time launch chooses its own, from the same shapes and settings)."""
    s = settings.get()
    return config is None and bool(s.knob("GG_TRACED_HOST", GG_TRACED_HOST)) and s.gg_tma and _fake(t)


def device_tma(t: torch.Tensor, tiled: bool = True) -> bool:
    """Whether a launch whose operand ``t`` would go through TMA makes its descriptors in the
    kernel (knob ``GG_DEVICE_TMA``; ``tiled``: the launch is of a tiled kernel, not a streaming
    one): the launchers then pass the tensors themselves (``DEV_TMA``) and check them with
    ``_tma_fits``."""
    mode = int(settings.get().knob("GG_DEVICE_TMA", GG_DEVICE_TMA))
    if mode <= 0 or not settings.get().gg_tma:
        return False
    if mode == 2:
        return True
    return (tiled or mode == 3) and _fake(t)


def ensure_allocator() -> None:
    """Give Triton an allocator for the kernels' global scratch (the in-kernel descriptors) where
    none is set in this context: torch's caching allocator on the current device (so CUDA-graph
    captures take it from the graph's pool). Inductor sets its own before it launches a compiled
    graph's kernels; one set by the user is kept."""
    import triton
    from triton.runtime import _allocation

    if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
        return

    def alloc(size: int, alignment: int, stream) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: Optional[torch.Tensor],
    *,
    x_scale: Optional[torch.Tensor] = None,
    w_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    scatter_indices: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    fast_accum: bool = True,
    config: Optional[GemmConfig] = None,
) -> Optional[torch.Tensor]:
    """Launch the grouped GEMM on validated inputs.

    ``m_sizes`` None means one group of all M rows (dense GEMM; ``w`` is then ``[N, K]``).
    FP8 when ``x`` is e4m3fn (``x_scale`` [M], ``w_scale`` [G*N] float32 dequant scales).
    Without ``out``: returns ``y [M, N]`` (bf16 for FP8, else ``x.dtype``), rows past
    ``sum(m_sizes)`` left unwritten. With ``out`` [T, N] and ``scatter_indices`` [M]: adds the
    rows into ``out`` (atomics, or stored rows and the deterministic scatter-add) and returns None.
    """
    M, K = x.shape
    G = 1 if m_sizes is None else m_sizes.shape[0]
    N = w.shape[0] // G
    fp8 = x.dtype == FP8_DTYPE  # (a 16-bit x with FP8 w and w_scale: weight-only FP8)
    y_dtype = torch.bfloat16 if fp8 else x.dtype
    if out is not None and deterministic:
        rows = torch.empty((M, N), dtype=out.dtype, device=x.device)
        _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, None, None, fast_accum,
                config, M, N, K, G, fp8, out.dtype, rows_out=rows)  # fmt: skip
        _deterministic_scatter(out, rows, m_sizes, scatter_indices, M)
        return None
    return _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, out, scatter_indices, fast_accum,
                   config, M, N, K, G, fp8, y_dtype)  # fmt: skip


def _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, out, scatter_indices, fast_accum,
            config, M, N, K, G, fp8, y_dtype, rows_out=None):  # fmt: skip
    # Configs are chosen per concrete shape: symbolic sizes (torch.compile dynamic shapes) are
    # specialized here.
    M, N, K, G = int(M), int(N), int(K), int(G)
    scatter = out is not None
    if scatter:
        y = out
    elif rows_out is not None:
        y = rows_out
    else:
        y = torch.empty((M, N), dtype=y_dtype, device=x.device)
    if M == 0 or N == 0:
        return None if scatter else y
    if G * N >= 2**31 or M >= 2**31:
        raise ValueError(f"grouped_gemm supports G * N and M below 2**31, got G*N={G * N}, M={M}")
    x = _unit_last(x)
    w = _unit_last(w)
    sms = num_sms(x.device)
    w_only = not fp8 and w.dtype == FP8_DTYPE
    # Weight-only FP8 (bf16 rows) stays off the persistent stream loop: its swap-AB tiles there
    # ran slower than one program per tile (session 21, DeepSeek TP8 decode path T=16: 292 us vs 261).
    cfg = config or select_config(M, N, K, G, fp8, x.element_size(), sms, w_only, stored=not scatter)
    if w_only and cfg.kind == "gemv" and config is None:
        cfg = gemv_config(M, N, K, 1, sms)  # K tiles sized by the 1-byte weights it streams
    if fp8 and not fast_accum and cfg.kind == "tiled" and cfg.block_n > 128:
        cfg = replace(cfg, block_n=128)  # the promoted accumulator needs registers: 128x256 spills
    if fp8 and scatter and cfg.kind == "tiled" and cfg.flatten and cfg.block_m * cfg.block_n >= 128 * 256:
        cfg = replace(cfg, flatten=False)  # the fused loop's scatter-add epilogue spills FP8 128x256 tiles
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    out_rows = out.shape[0] if scatter else M
    # Placeholder for the pointer arguments a launch does not use: never the output. Under
    # torch.compile, inductor's mutation analysis counts every pointer passed to a @triton.jit
    # helper (the epilogue) as written; an output passed twice then gets two functionalized
    # copies, and the untouched one is written back over the result.
    ph = torch.empty((1,), dtype=torch.int32, device=x.device)
    optional = [t if t is not None else ph for t in (m_sizes, x_scale, w_scale, bias, token_weights, scatter_indices)]
    if cfg.kind == "gemv":
        launch(_gg_gemv_kernel)[(M * cdiv(N, bn),)](
            x, w, y, *optional, M, N, K, G, out_rows, x.stride(0), w.stride(0), y.stride(0),
            HAS_MSIZES=m_sizes is not None, FP8=fp8, HAS_BIAS=bias is not None,
            HAS_TW=token_weights is not None, SCATTER=scatter, W_ONLY=w_only, G_BLOCK=max(16, next_pow2(G)),
            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, STAGES=cfg.stages,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        return None if scatter else y
    x_block, w_block = [bm, bk], [bn, bk]
    stream = cfg.kind == "stream"
    if (not stream and cfg.use_tma and traced_host(x, config) and _tma_fits(w, tuple(w_block))
            and _tma_fits(x, tuple(x_block))):  # fmt: skip
        # the trace records the run-time launch (knob GG_TRACED_HOST): host descriptors there
        torch.ops.moekit._grouped_gemm_launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, y,
                                              scatter_indices, bool(fast_accum))  # fmt: skip
        return None if scatter else y
    dev = device_tma(w, tiled=not stream)  # descriptors made in the kernel (DEV_TMA), from the tensors passed
    ok = _tma_fits if dev else _tma_ok
    # The streaming kernel reads x through masked pointers (only the group's rows move).
    use_tma = cfg.use_tma and ok(w, tuple(w_block)) and (stream or ok(x, tuple(x_block)))
    x_tma = stream and use_tma and cfg.x_tma and ok(x, tuple(x_block))
    dev = dev and use_tma
    if dev:
        ensure_allocator()
    x_arg = _descriptor(x, x_block) if use_tma and (not stream or x_tma) and not dev else x
    w_arg = _descriptor(w, w_block) if use_tma and not dev else w
    common = dict(
        HAS_MSIZES=m_sizes is not None,
        FP8=fp8,
        HAS_BIAS=bias is not None,
        HAS_TW=token_weights is not None,
        SCATTER=scatter,
        W_ONLY=w_only,
        USE_TMA=use_tma,
        DEV_TMA=dev,
        G_BLOCK=max(16, next_pow2(G)),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=cfg.stages,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    args = (
        x_arg,
        w_arg,
        y,
        *optional,
        M,
        N,
        K,
        G,
        out_rows,
        x.stride(0),
        w.stride(0),
        y.stride(0),
    )
    upper = (cdiv(M, bm) + min(G, M)) * cdiv(N, bn)  # the persistent tile loop's most tiles
    if stream and cfg.persist:
        # The swap-AB tiles on the persistent tile loop (``GemmConfig.persist``): the streaming
        # kernel's programs per SM, no more than fit side by side (a program that starts only
        # when another ends would run its share of the tiles after the rest: tiles are dealt
        # statically), at most one per tile.
        smem = (bm + bn) * bk * x.element_size() * cfg.stages + (bm * bn * 2 if cfg.flatten else 0)
        by_regs = settings.get().knob("GG_PERSIST_REGS", False)
        key = (
            (cfg, fp8, w_only, use_tma, x_tma, token_weights is not None, scatter, bias is not None)
            if by_regs
            else None
        )
        pps = persist_programs_per_sm(smem, cfg.warps, _PERSIST_REGS.get(key))
        grid = (max(1, min(upper, pps * sms)),)
        compiled = launch(_gg_tiled_kernel)[grid](
            *args, FAST_ACCUM=bool(fast_accum) or not fp8, FLATTEN=cfg.flatten, GROUP_M=cfg.group_m, SWAP_AB=True,
            X_TMA=x_tma, EARLY_EPI=early_epilogue(cfg, fp8, True, K), N_SLAB=0, **common,
        )  # fmt: skip
        regs = getattr(compiled, "n_regs", None) if by_regs else None  # None in the interpreter or a trace
        if isinstance(regs, int) and regs > 0:
            _PERSIST_REGS[key] = regs
    elif stream:
        # One program per (possibly non-empty group, N slice), capped (``settings.gg_stream_pps``
        # programs per SM): programs past the non-empty groups exit at once, and a capped grid
        # loops over the items.
        grid = (max(1, min(min(G, M) * cdiv(N, bn), settings.get().gg_stream_pps * sms)),)
        launch(_gg_stream_kernel)[grid](*args, X_TMA=x_tma, EARLY_EPI=early_epilogue(cfg, fp8, True, K), **common)
    else:
        grid = (max(1, min(sms, upper)),)
        launch(_gg_tiled_kernel)[grid](
            *args,
            FAST_ACCUM=bool(fast_accum) or not fp8,
            FLATTEN=cfg.flatten,
            GROUP_M=cfg.group_m,
            SWAP_AB=False,
            X_TMA=use_tma,  # every argument given: inductor's kernel analysis fills in no defaults
            EARLY_EPI=early_epilogue(cfg, fp8, False, K),
            N_SLAB=n_slab_tiles(
                cfg, scatter, M, N, K, out_rows, x.element_size(), y.element_size(), l2_bytes(x.device)
            ),
            **common,
        )
    return None if scatter else y


@torch.library.custom_op("moekit::_grouped_gemm_launch", mutates_args=("y",))
def _grouped_gemm_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: Optional[torch.Tensor],
    x_scale: Optional[torch.Tensor],
    w_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    token_weights: Optional[torch.Tensor],
    y: torch.Tensor,
    scatter_indices: Optional[torch.Tensor],
    fast_accum: bool,
) -> None:
    """``_launch`` at run time (knob ``GG_TRACED_HOST``): the rows stored into ``y`` ``[M, N]``,
    or, with ``scatter_indices``, added into ``y[idx[row]]``."""
    M, K = x.shape
    G = 1 if m_sizes is None else m_sizes.shape[0]
    scatter = scatter_indices is not None
    _launch(x, w, m_sizes, x_scale, w_scale, bias, token_weights, y if scatter else None, scatter_indices,
            fast_accum, None, M, w.shape[0] // G, K, G, x.dtype == FP8_DTYPE, y.dtype,
            rows_out=None if scatter else y)  # fmt: skip


@_grouped_gemm_launch.register_fake
def _(x, w, m_sizes, x_scale, w_scale, bias, token_weights, y, scatter_indices, fast_accum) -> None:
    return None


def n_slab_tiles(cfg: GemmConfig, scatter: bool, M: int, N: int, K: int, out_rows: int, x_bytes: int,
                 out_bytes: int, l2: int) -> int:  # fmt: skip
    """N tiles per column slab of the tiled kernel's tile order (its ``N_SLAB``; 0: none): a
    scatter-add's tiles walk the output one slab of columns at a time, every expert's tiles of a
    slab before the next slab's, so that the ``[out_rows, slab]`` destination its atomics add into
    stays in L2 while the top-k rows of each token arrive from their experts (in the expert-major
    order each token's k additions are far apart, and with the weights streaming through L2 in
    between, each misses). The price: every slab reads the rows of x again.

    Knob ``GG_N_SLAB``: a slab width in columns, 0 off, -1 (default) slabs of ``N_SLAB_COLS``
    columns where ``column_slabs_pay``. Measured (H100, session 36, layer from logits, µs, plain ->
    512-column slabs, two lanes each way): DeepSeek-V3 TP8 (K = 256, N = 7168) FP8 T = 1024 / 2048
    / 3072 636.1 -> 618.4, 758.1 -> 728.5, 905.1 -> 871.2, bf16 1105.5 -> 1098.6, 1200.8 ->
    1160.9, 1337.7 -> 1276.5; gpt-oss-120b (K = N = 2880) 3-4% slower with 1024-column slabs (FP8
    T = 2048 1356.6 -> 1400.2), Qwen3-30B (K = 768, N = 2048, an 8 MB output at T = 2048) level:
    neither passes the rule. With slabs (and, since session 37, 64-row tiles at short K) DeepSeek's
    scatter-add beats the stored rows up to T = 16384 (``experts.DOWN_SUM_MIN_ROWS_SLABS``)."""
    if not scatter or not takes_column_slabs(M, N, K, out_rows, x_bytes, out_bytes, l2):
        return 0
    cols = settings.get().knob("GG_N_SLAB", -1)
    slab = max(1, (cols if cols > 0 else N_SLAB_COLS) // cfg.block_n)
    return 0 if slab >= cdiv(N, cfg.block_n) else slab


# Largest tiled-kernel output tile (BLOCK_M x BLOCK_N) whose epilogue operands knob
# ``GG_EARLY_EPI`` may load before the K loop: the 128 x 256 prefill tiles would hold them across
# it at 255 registers (FP8) and spill.
EARLY_EPI_MAX_TILE = 64 * 256
# Longest K of a tiled tile that loads its epilogue operands early (knob ``EARLY_EPI_MAX_K``): the
# latency they hide is paid once per tile, so it counts where the K loop is short (measured: the
# down GEMMs of Qwen3-30B, K = 768, and DeepSeek-V3 TP8, K = 256). Long K measured in session 26
# (H100, same call, layer from logits, µs, bound 1024 twice -> 8192): gpt-oss-120b FP8 (K = 2880)
# T = 1024 1250.3 / 1248.2 -> 1247.8, T = 2048 1463.2 / 1459.1 -> 1460.3 (level); Llama 4 Scout FP8
# (K = 5120 / 8192) T = 1024 796.9 / 800.7 -> 822.3, T = 2048 879.1 / 882.4 -> 918.0 (3-4% slower).
EARLY_EPI_MAX_K = 1024


def early_epilogue(cfg: GemmConfig, fp8: bool, swap_ab: bool, K: int) -> int:
    """Where a tile's epilogue operands load (the kernels' ``EARLY_EPI``): 0 after its K loop, 1
    the x / w scales, bias and token weights before it, 2 the scatter-add's destination rows too
    (knob ``GG_EARLY_DST``, off: measured mixed; never for FP8 tiled tiles, which hold their
    operands at 255 registers already and spilled with the rows). The loads sat exposed once per
    tile after the last MMA.

    - Swap-AB tiles (the streaming kernel's, alone or on the persistent loop) with FP8 rows: early
      (H200, session 23: DeepSeek-V3 TP8 FP8 T=256 down GEMM 157 -> 132 us); 16-bit ones never
      (bf16 DeepSeek-V3 TP8 T=1024 lost 2.5%, the weight-only FP8 decode down GEMM 7-11%).
    - Tiled tiles of at most ``EARLY_EPI_MAX_TILE`` with K at most ``EARLY_EPI_MAX_K`` by knob
      ``GG_EARLY_EPI``: 1 (default) FP8 tiles, 2 every dtype's, 0 none. Session 25, same call,
      layer from logits (H100, the tool's card; µs, loads after -> before): Qwen3-30B FP8 T=1024
      293.5 / 292.7 -> 284.3 (its 64x256 down GEMM), T=2048 371.6 / 369.8 -> 366.8, DeepSeek-V3
      TP8 FP8 T=2048 768.2 / 765.6 -> 739.9; bf16 slower (Qwen3 T=1024 469.5 -> 479.0, DeepSeek
      T=2048 1156 -> 1285). Longer K (knob ``EARLY_EPI_MAX_K``) measured level for gpt-oss-120b
      and 3-4% slower for Llama 4 Scout (session 26; see ``EARLY_EPI_MAX_K``).
    - With the destination rows too (``GG_EARLY_DST``, same call): DeepSeek FP8 T=1024 637.8 ->
      627.8 but T=256 491.7 -> 527.2."""
    s = settings.get()
    level = 2 if s.knob("GG_EARLY_DST", False) else 1
    if swap_ab:
        return level if fp8 else 0
    mode = s.knob("GG_EARLY_EPI", 1)
    max_k = s.knob("EARLY_EPI_MAX_K", EARLY_EPI_MAX_K)
    if mode < (1 if fp8 else 2) or cfg.block_m * cfg.block_n > EARLY_EPI_MAX_TILE or K > max_k:
        return 0
    return 1 if fp8 else level


# Registers per thread of the compiled persistent swap-AB tiles, by specialization (the launch
# returns its compiled kernel): what the register file holds bounds the programs per SM.
_PERSIST_REGS: dict = {}
_SM_REGS = 65536  # 32-bit registers per SM (sm_80 / sm_90)


def persist_programs_per_sm(smem: int, warps: int, regs: Optional[int]) -> int:
    """Programs per SM of the persistent swap-AB tile loop: ``settings.gg_stream_pps``, no more than
    the shared memory holds (``smem`` bytes each), and, with knob ``GG_PERSIST_REGS`` (off until
    measured) and the compiled kernel's ``regs`` per thread known (from its first launch), no more
    than the register file holds (256-register warp granules). Session 23's FP8 epilogue operands,
    loaded before the K loop, took the FP8 32x128 tile from 148 to 198 registers (sm_90 compile of
    the pointer-load variant): three programs of 4 warps then no longer fit one SM, and the third
    would run its statically dealt tiles after the other two."""
    pps = max(1, min(settings.get().gg_stream_pps, (227 * 1024) // max(smem, 1)))
    if regs and settings.get().knob("GG_PERSIST_REGS", False):
        per_warp = -(-regs * 32 // 256) * 256
        pps = max(1, min(pps, _SM_REGS // (per_warp * warps)))
    return pps


def _deterministic_scatter(out, rows, m_sizes, indices, M):
    """``out[idx[r]] += rows[r]`` for the computed rows (``r < sum(m_sizes)``): the deterministic
    scatter-add's kernels (each token's rows summed in float32 in ascending row order, then added
    to ``out`` once), so the result is bitwise that of ``scatter_add_dense_tokens(...,
    deterministic=True)`` on the GEMM's rows. The row count stays on the device."""
    from moekit.ops._triton.gather_scatter import scatter_add_dense_tokens_deterministic

    valid = None
    if m_sizes is not None:  # summed in int64 and clipped to M before the narrowing
        valid = m_sizes.clamp(min=0).sum().clamp(max=M).to(torch.int32).reshape(1)
    # Those kernels address rows as ``row * (stride // 8) * 8`` (the public scatter-add requires
    # a row stride that is a multiple of 8); the GEMM accepts any row stride of its output, so an
    # odd one goes through a contiguous copy.
    if out.shape[0] > 1 and out.stride(0) % 8:
        tmp = out.contiguous()
        scatter_add_dense_tokens_deterministic(tmp, rows, indices, valid)
        out.copy_(tmp)
        return
    scatter_add_dense_tokens_deterministic(out, rows, indices, valid)


def f8f8bf16_rowwise(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """Dense FP8 row-wise GEMM as one group of the grouped kernel."""
    out = grouped_gemm(
        XQ, WQ, None, x_scale=x_scale.reshape(-1), w_scale=w_scale.reshape(-1), bias=bias,
        fast_accum=use_fast_accum, config=config,
    )  # fmt: skip
    assert out is not None
    return out
