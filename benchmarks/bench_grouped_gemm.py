#!/usr/bin/env python3
"""Benchmark: grouped GEMM (bf16, fp8 row-wise) — moekit vs MSLK 1.1.0 vs torch._grouped_mm /
torch._scaled_grouped_mm, side by side in one process.

    python benchmarks/bench_grouped_gemm.py [--quick] [--dense] [--variants] [--tune PATH] [--no-mslk]
                                            [--budget S] [--mslk-configs N]

Shapes: Llama 4 TP8 shard (G=16 and 128; N, K = 2048, 5120 and 5120, 1024), Llama 4 unsharded
(G=16; 16384, 5120 and 5120, 8192), DeepSeek-V3-like (G=256; 4096, 7168 and 7168, 2048),
Qwen3-30B-A3B (G=128; 1536, 2048 and 2048, 768); M rows spread over the experts by a random
top-k routing (``random_m_sizes``). Each timed input set has its own routing, its own x and, when
the weights are small enough, its own copy of the weights, so nothing is served from L2 that a
real layer would read from HBM.

Columns: "hit" experts with rows; "MB" = bytes that must move (weights of the hit experts + x +
y); "floor µs" = max(MB / 4.25 TB/s, FLOP / 679 (bf16) or 1260 (fp8) TFLOP/s); TB/s and TFLOP/s
of moekit; "% floor" = floor / moekit time; "÷MSLK" and "÷torch" = moekit time / peer time
(targets: <= 1 and <= 0.8). MSLK cells read "refused" when it rejects the shape, "error" when it
fails. ``--dense`` adds the dense FP8 GEMM (``f8f8bf16_rowwise``: Triton vs torch._scaled_mm),
``--variants`` times moekit's kernel variants (TMA off, loop flattening off, the other kernel) on
each cell, ``--tune PATH`` runs the ahead-of-time config search on the benchmark shapes and
writes the table (JSON) to PATH.

MSLK runs its non-warp-specialized kernels (``_use_warp_specialization=False``: its
warp-specialized configs fail in ptxas on H200 with "Insufficient registers"). Its autotuning
compiles every config it keeps for each (G, N, K, M bucket): ``--quick`` keeps only the first
``--mslk-configs`` (default 2) of the configs its own pruning keeps, ranked by ``_mslk_prefer``
(conventional warp count, deepest pipeline that fits), and times each for ~20 ms; the full run
keeps 4 (``--mslk-configs 0``: all of them). Budget: past ``--budget`` seconds (quick: 140,
full: 240, 0: none) the remaining cells are skipped (and listed), and past 85% of it MSLK is no
longer timed (its compilations dominate); every row is printed as soon as it is measured.

``--quick``: one projection per model family (Scout TP8, Maverick TP8, Llama 4, DeepSeek,
Qwen3) at M = 1, 16, 128, 16384, bf16 and fp8 (40 cells), smallest M first. The full grid: every
shape at M = 1, 16 and G x {1, 8, 32, 64, 128, 256, 512, 2048} rows per group up to 65536 rows
(``grid_ms``; set ``--budget 0`` to run all of it). ``--shapes a,b`` keeps those shapes of the
grid (quick or full): the full grid does not fit one 10-minute device call, so it runs as
``GRID_PARTS``' shape lists, one call each, and ``results_table.py --merge`` joins their JSON.

The run ends with issue 15's peer bar for the grouped GEMM alone: the cells where moekit is slower
than MSLK or than torch (``peer_verdict``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from moekit.benchmarking import (  # noqa: E402
    BF16_TFLOPS,
    COPY_TBPS,
    FP8_TFLOPS,
    L2_BYTES,
    bench_us,
    environment,
    floor_us,
    markdown_table,
    rotations,
    save_rows,
    try_import_mslk,
)

FP8 = torch.float8_e4m3fn
REFUSALS = (AssertionError, ValueError, NotImplementedError, TypeError)

# (name, G, N, K)
SHAPES = [
    ("scout-tp8-w13", 16, 2048, 5120),
    ("scout-tp8-w2", 16, 5120, 1024),
    ("maverick-tp8-w13", 128, 2048, 5120),
    ("maverick-tp8-w2", 128, 5120, 1024),
    ("llama4-w13", 16, 16384, 5120),
    ("llama4-w2", 16, 5120, 8192),
    ("deepseek-w13", 256, 4096, 7168),
    ("deepseek-w2", 256, 7168, 2048),
    ("qwen3-w13", 128, 1536, 2048),
    ("qwen3-w2", 128, 2048, 768),
    ("deepseek-tp8-w13", 256, 512, 7168),
    ("deepseek-tp8-w2", 256, 7168, 256),
    ("gpt-oss-w13", 128, 5760, 2880),
    ("gpt-oss-w2", 128, 2880, 2880),
]
# The full grid: decode (M = 1, 16) and M = G x rows per group for every shape, up to 65536 rows
# (issue 15: 32-512 rows per expert is where both peers sit near half the floor).
ROWS_PER_GROUP = [1, 8, 32, 64, 128, 256, 512, 2048]
MAX_M = 65536


def grid_ms(G: int) -> list[int]:
    """Total rows M of the full grid for a shape of G groups."""
    return sorted({1, 16} | {G * r for r in ROWS_PER_GROUP if G * r <= MAX_M})


QUICK_SHAPES = ["scout-tp8-w13", "maverick-tp8-w2", "llama4-w2", "deepseek-w2", "qwen3-w2"]
QUICK_MS = [1, 16, 128, 16384]
TOP_K = {"deepseek": 8, "qwen3": 8, "gpt": 4}

# The full grid in three device calls of similar length (``--shapes``, one list each): the large
# shapes (Llama 4, DeepSeek-V3 unsharded) spread over the parts.
GRID_PARTS = [
    ["scout-tp8-w13", "scout-tp8-w2", "maverick-tp8-w13", "maverick-tp8-w2", "llama4-w13"],
    ["llama4-w2", "deepseek-w13", "deepseek-w2", "qwen3-w13"],
    ["qwen3-w2", "deepseek-tp8-w13", "deepseek-tp8-w2", "gpt-oss-w13", "gpt-oss-w2"],
]


def pick_shapes(text: str) -> list[str]:
    """``--shapes``: comma-separated names of ``SHAPES`` (or ``partN``: ``GRID_PARTS[N - 1]``), in
    the grid's order."""
    names = {s[0] for s in SHAPES}
    want: set = set()
    for t in (t.strip() for t in text.split(",")):
        if not t:
            continue
        if t.startswith("part") and t[4:].isdigit() and 1 <= int(t[4:]) <= len(GRID_PARTS):
            want.update(GRID_PARTS[int(t[4:]) - 1])
        elif t in names:
            want.add(t)
        else:
            raise ValueError(
                f"--shapes: expected names from {sorted(names)} or part1..part{len(GRID_PARTS)}, got {t!r}"
            )
    return [s[0] for s in SHAPES if s[0] in want]


def pick_ms(text: str) -> set[int]:
    """``--ms``: comma-separated positive row counts."""
    out = set()
    for t in (t.strip() for t in text.split(",")):
        if not t:
            continue
        if not t.isdigit() or int(t) < 1:
            raise ValueError(f"--ms: expected positive integers separated by commas, got {t!r}")
        out.add(int(t))
    return out


def peer_verdict(rows: list[dict]) -> list[str]:
    """Issue 15's bar for the grouped GEMM alone, "never slower than MSLK or torch._grouped_mm in
    any cell": a summary line, then one line per cell where moekit is slower than a peer that
    ran (a peer's refusal or error is no cell of the bar)."""
    timed = {"MSLK": 0, "torch": 0}
    lines = []
    slower = 0  # cells, each counted once however many peers it trails
    for r in rows:
        behind = False
        for peer in timed:
            ratio = r.get(f"÷{peer}")
            if ratio is None:
                continue
            timed[peer] += 1
            if ratio > 1.0:
                behind = True
                lines.append(f"  slower than {peer}: {r['shape']} M={r['M']} {r['dtype']} {r['moekit µs']:.1f} µs "
                             f"vs {r[f'{peer} µs']:.1f} ({ratio:.3f}x)")  # fmt: skip
        slower += behind
    head = (f"peer bar (never slower than MSLK or torch): {slower} cell(s) slower, of {timed['MSLK']} "
            f"timed against MSLK and {timed['torch']} against torch")  # fmt: skip
    return [head] + lines


def _top_k(name: str, M: int, G: int) -> int:
    k = TOP_K.get(name.split("-")[0], 1)
    while k > 1 and (M % k or k > G):
        k //= 2
    return k


def _mslk_prefer(cfg, elem: int) -> tuple:
    """Rank of an MSLK autotuning config when only a few are kept: the conventional warp count
    for the tile (4 for 64-row tiles, 8 for 128), pipelines of at most 200 KB, the widest N
    tile, then the deepest pipeline (shared memory of all stages)."""
    kw = cfg.kwargs
    bm, bn, bk = kw.get("BLOCK_SIZE_M", 64), kw.get("BLOCK_SIZE_N", 64), kw.get("BLOCK_SIZE_K", 64)
    smem = (bm + bn) * bk * cfg.num_stages * elem
    return (cfg.num_warps == (8 if bm >= 128 else 4), smem <= 200 * 1024, bn, smem)


def _restrict_mslk_autotune(max_configs: int, fast_timing: bool) -> None:
    """Keep at most ``max_configs`` of the configs MSLK's own pruning keeps (0: all), and time
    each for ~20 ms instead of ~125 ms when ``fast_timing``."""
    try:
        import mslk.gemm.triton.grouped_gemm as mg  # type: ignore
        from triton.runtime.autotuner import Autotuner
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        print(f"  (MSLK autotuning left as is: {type(e).__name__}: {e})")
        return
    found = []
    for name, elem in (("_mslk_grouped_gemm", 2), ("_mslk_grouped_gemm_fp8_rowwise", 1)):
        tuner = getattr(mg, name, None)
        if not isinstance(tuner, Autotuner):
            continue
        found.append(name)
        if fast_timing:
            tuner.do_bench = lambda fn, quantiles: do_bench(fn, warmup=5, rep=20, quantiles=quantiles)
        base = tuner.early_config_prune
        if max_configs > 0 and base is not None:

            def prune(configs, named_args, _base=base, _elem=elem, **kw):
                kept = _base(configs, named_args, **kw)
                ranked = sorted(kept, key=lambda c: _mslk_prefer(c, _elem), reverse=True)
                return ranked[:max_configs] or kept

            tuner.early_config_prune = prune
    if max_configs > 0 or fast_timing:
        print(f"  MSLK autotuners restricted: {found or 'none found (full autotuning)'}")


def _mslk_ops(max_configs: int = 0, fast_timing: bool = False) -> dict:
    ops: dict = {}
    if try_import_mslk() is None:
        return ops
    try:
        from mslk.gemm.triton.grouped_gemm import grouped_gemm, grouped_gemm_fp8_rowwise  # type: ignore

        ops["bf16"], ops["fp8"] = grouped_gemm, grouped_gemm_fp8_rowwise
    except Exception as e:  # noqa: BLE001
        print(f"MSLK grouped_gemm unavailable: {type(e).__name__}: {e}")
        return ops
    _restrict_mslk_autotune(max_configs, fast_timing)
    return ops


def _time(fns, replays: int = 20) -> float | str:
    """µs per call, or "refused"/"error". The first call (compilation, autotuning, shape
    checks) runs outside the graph."""
    try:
        fns[0]()
        torch.cuda.synchronize()
    except REFUSALS as e:
        print(f"    refused: {type(e).__name__}: {str(e)[:160]}")
        return "refused"
    except Exception as e:  # noqa: BLE001
        print(f"    error: {type(e).__name__}: {str(e)[:200]}")
        return "error"
    try:
        return bench_us(fns, replays=replays)
    except Exception as e:  # noqa: BLE001
        print(f"    error while timing: {type(e).__name__}: {str(e)[:200]}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return "error"


def _num(v):
    return v if isinstance(v, float) else None


def _weights(rows: int, K: int, fp8: bool):
    """Random weights (bf16, or fp8 with row-wise dequant scales), built in chunks so that the
    float32 temporaries stay small even for 15 GB of DeepSeek experts."""
    if not fp8:
        w = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        return w.mul_(K**-0.5), None
    wq = torch.empty(rows, K, device="cuda", dtype=FP8)
    sc = torch.empty(rows, device="cuda", dtype=torch.float32)
    step = max(1, (1 << 28) // K)
    for r0 in range(0, rows, step):
        w = torch.randn(min(step, rows - r0), K, device="cuda") * K**-0.5
        s = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
        wq[r0 : r0 + w.shape[0]] = (w / s[:, None]).to(FP8)
        sc[r0 : r0 + w.shape[0]] = s
    return wq, sc


class Case:
    """Input sets for one (shape, M, dtype): per set its own routing, x, scales and weight copy."""

    def __init__(self, G, N, K, M, dtype, top_k, max_sets=64):
        from moekit.testing import random_m_sizes

        fp8 = dtype == FP8
        es = 1 if fp8 else 2
        w_bytes = G * N * K * es
        first = random_m_sizes(M, G, top_k=top_k, seed=100)
        touched = int((first > 0).sum()) * N * K * es + M * K * es + M * N * 2
        # Enough sets (each with its own routing, hence its own experts) that one pass over them
        # moves 3x the L2; weight copies when all the experts together would fit in it.
        n_sets = rotations(touched, max_sets=max_sets)
        n_w = max(1, min(n_sets, math.ceil(3 * L2_BYTES / max(w_bytes, 1)))) if w_bytes < 3 * L2_BYTES else 1
        self.sizes = [first] + [random_m_sizes(M, G, top_k=top_k, seed=101 + i) for i in range(n_sets - 1)]
        self.hit = sum(int((s > 0).sum()) for s in self.sizes) / n_sets
        self.bytes = self.hit * N * K * es + M * K * es + M * N * 2
        self.flops = 2.0 * M * N * K
        self.fp8 = fp8
        ws = [_weights(G * N, K, fp8) for _ in range(n_w)]
        self.sets = []
        for i, s in enumerate(self.sizes):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xs = None
            if fp8:
                xs = x.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
                x = (x.float() / xs[:, None]).to(FP8)
            w, wsc = ws[i % n_w]
            ms = s.to(device="cuda", dtype=torch.int32)
            offs = torch.cumsum(ms, 0).to(torch.int32)
            self.sets.append(dict(x=x, w=w, xs=xs, ws=wsc, ms=ms, offs=offs))
        self.G, self.N, self.K, self.M = G, N, K, M


def _moekit_fns(case: Case, config=None):
    from moekit.ops._triton import grouped_gemm as tri
    from moekit.ops.grouped_gemm import grouped_gemm, grouped_gemm_fp8_rowwise

    out = []
    for s in case.sets:
        if config is not None:
            out.append(
                lambda s=s: tri.grouped_gemm(s["x"], s["w"], s["ms"], x_scale=s["xs"], w_scale=s["ws"], config=config)
            )
        elif case.fp8:
            out.append(lambda s=s: grouped_gemm_fp8_rowwise(s["x"], s["w"], s["ms"], s["xs"], s["ws"]))
        else:
            out.append(lambda s=s: grouped_gemm(s["x"], s["w"], s["ms"]))
    return out


def _mslk_fns(case: Case, mslk: dict):
    fn = mslk.get("fp8" if case.fp8 else "bf16")
    if fn is None:
        return None
    if case.fp8:
        return [lambda s=s: fn(s["x"], s["w"], s["ms"], s["xs"], s["ws"], _use_warp_specialization=False)
                for s in case.sets]  # fmt: skip
    return [lambda s=s: fn(s["x"], s["w"], s["ms"], _use_warp_specialization=False) for s in case.sets]


def _torch_fns(case: Case):
    G, N, K = case.G, case.N, case.K
    out = []
    for s in case.sets:
        wt = s["w"].view(G, N, K).transpose(-2, -1)  # [G, K, N], column-major per expert
        if case.fp8:
            if not hasattr(torch, "_scaled_grouped_mm"):
                return None
            wsc = s["ws"].view(G, N)
            out.append(lambda s=s, wt=wt, wsc=wsc: torch._scaled_grouped_mm(
                s["x"], wt, s["xs"], wsc, offs=s["offs"], out_dtype=torch.bfloat16, use_fast_accum=True))  # fmt: skip
        else:
            if not hasattr(torch, "_grouped_mm"):
                return None
            out.append(lambda s=s, wt=wt: torch._grouped_mm(s["x"], wt, offs=s["offs"]))
    return out


def _check(case: Case) -> None:
    """moekit vs a float32 per-group product on the first set (a warning, never fatal)."""
    from moekit.ops.grouped_gemm import grouped_gemm, grouped_gemm_fp8_rowwise

    s = case.sets[0]
    if case.M == 0:
        return
    y = (
        grouped_gemm_fp8_rowwise(s["x"], s["w"], s["ms"], s["xs"], s["ws"])
        if case.fp8
        else grouped_gemm(s["x"], s["w"], s["ms"])
    )
    sizes = s["ms"].tolist()
    start, num, den = 0, 0.0, 0.0
    N = case.N
    for g, n in enumerate(sizes):
        if n and start < case.M:
            e = min(start + n, case.M)
            a = s["x"][start:e].float() @ s["w"][g * N : (g + 1) * N].float().T
            if case.fp8:
                a = a * s["xs"][start:e, None] * s["ws"][g * N : (g + 1) * N][None, :]
            num += float(torch.linalg.vector_norm(y[start:e].float() - a) ** 2)
            den += float(torch.linalg.vector_norm(a) ** 2)
        start += n
    err = math.sqrt(num / max(den, 1e-30))
    if not err < (6e-2 if case.fp8 else 1e-2):
        print(f"  WARNING: moekit relative error {err:.2e} on this case")


def _variants(case: Case, cfg):
    """Alternative kernels for --variants: TMA off, flattening off, the other kernel kind."""
    from moekit.ops._triton import grouped_gemm as tri

    if cfg.kind == "gemv":  # the streaming (tensor-core) kernel at its small-M tile
        return {"stream": tri.GemmConfig("stream", 16, 64, 256 if case.fp8 else 128, 5, 4)}
    out = {"no-tma": replace(cfg, use_tma=False)}
    if cfg.kind == "tiled":
        out["flatten" if not cfg.flatten else "no-flatten"] = replace(cfg, flatten=not cfg.flatten)
        out["stream"] = tri.GemmConfig("stream", 128, 128, 128 if case.fp8 else 64, 4, 8)
    else:
        out["tiled"] = tri.GemmConfig("tiled", 128, 128, 128 if case.fp8 else 64, 4, 8)
    return out


def timed_config(M: int, N: int, K: int, G: int, fp8: bool, sms: int):
    """The config ``_moekit_fns``' calls take: their rows are stored (no scatter-add), which picks the
    stored-row rules' tiles (FP8_TALL_TILES, BF16_TALL_TILES, STREAM_DEEP_K). Before session 40 the
    label asked without ``stored`` and named the scatter-add's tile for those cells."""
    from moekit.ops._triton import grouped_gemm as tri

    return tri.select_config(M, N, K, G, fp8, 1 if fp8 else 2, sms, stored=True)


def config_label(cfg) -> str:
    return f"{cfg.kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.stages}"


def bench_case(name, G, N, K, M, dtype, mslk, rows, variants=False, replays=20, skip_mslk=False):
    fp8 = dtype == FP8
    case = Case(G, N, K, M, dtype, _top_k(name, M, G))
    _check(case)
    fl = floor_us(case.bytes, case.flops, fp8)
    ours = _time(_moekit_fns(case), replays)
    m_fns = _mslk_fns(case, mslk)
    peer = ("skipped" if skip_mslk else _time(m_fns, replays)) if m_fns else None
    t_fns = _torch_fns(case)
    tt = _time(t_fns, replays) if t_fns else None
    cfg = timed_config(M, N, K, G, fp8, torch.cuda.get_device_properties(0).multi_processor_count)
    row = {
        "shape": name, "G": G, "N": N, "K": K, "M": M, "dtype": "fp8" if fp8 else "bf16", "hit": case.hit,
        "MB": case.bytes / 1e6, "floor µs": fl, "moekit µs": ours, "MSLK µs": peer, "torch µs": tt,
    }  # fmt: skip
    if _num(ours):
        row["TB/s"] = case.bytes / ours / 1e6
        row["TFLOP/s"] = case.flops / ours / 1e6
        row["% floor"] = 100.0 * fl / ours
        if _num(peer):
            row["÷MSLK"] = ours / peer
        if _num(tt):
            row["÷torch"] = ours / tt
    row["config"] = config_label(cfg)
    if variants:
        for vname, vcfg in _variants(case, cfg).items():
            v = _time(_moekit_fns(case, vcfg), replays)
            row[f"µs {vname}"] = v
    rows.append(row)
    print("  " + _row_line(row), flush=True)
    del case
    torch.cuda.empty_cache()


def _row_line(row: dict) -> str:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, float) else ("—" if v is None else str(v))

    return (
        f"{row['shape']} M={row['M']} {row['dtype']}: moekit {f(row['moekit µs'])} µs | MSLK {f(row['MSLK µs'])}"
        f" | torch {f(row['torch µs'])} | floor {f(row['floor µs'])} | {f(row.get('% floor'), '{:.0f}')}% floor"
        f" | ÷MSLK {f(row.get('÷MSLK'), '{:.2f}')} | ÷torch {f(row.get('÷torch'), '{:.2f}')} | {row['config']}"
    )


def bench_dense(rows, quick):
    """f8f8bf16_rowwise (shared expert shapes): the Triton kernel vs torch._scaled_mm."""
    from moekit.ops._triton import grouped_gemm as tri

    shapes = [(16384, 5120), (5120, 8192)]
    Ms = [1, 64, 2048] if quick else [1, 16, 64, 128, 1024, 2048, 16384]
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ws = w.abs().amax(1).float() / 448.0
        wq = (w.float() / ws[:, None]).to(FP8)
        del w
        for M in Ms:
            n = rotations(N * K + M * K)
            xs_list = []
            for _ in range(n):
                x = torch.randn(M, K, device="cuda")
                s = x.abs().amax(1) / 448.0
                xs_list.append(((x / s[:, None]).to(FP8), s))
            tri_us = _time([lambda a=a: tri.f8f8bf16_rowwise(a[0], wq, a[1], ws) for a in xs_list])
            sm_us = _time([lambda a=a: torch._scaled_mm(a[0], wq.t(), a[1][:, None], ws[None, :],
                                                        out_dtype=torch.bfloat16, use_fast_accum=True)
                           for a in xs_list])  # fmt: skip
            nbytes, flops = N * K + M * K + 2 * M * N, 2.0 * M * N * K
            rows.append({
                "op": "f8f8bf16_rowwise", "M": M, "N": N, "K": K, "floor µs": floor_us(nbytes, flops, True),
                "triton µs": tri_us, "_scaled_mm µs": sm_us,
                "triton ÷ scaled_mm": tri_us / sm_us if _num(tri_us) and _num(sm_us) else None,
            })  # fmt: skip
        wq = None  # the next shape's weights replace these


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one shape per model family at M = 1, 16, 128, 16384 (about 2 min with compilation)",
    )
    ap.add_argument("--dense", action="store_true", help="also the dense FP8 GEMM (Triton vs torch._scaled_mm)")
    ap.add_argument("--variants", action="store_true", help="also time moekit's alternative kernel variants")
    ap.add_argument("--tune", metavar="PATH", help="tune configs on the benchmark shapes, write the JSON table")
    ap.add_argument("--no-mslk", action="store_true", help="skip the MSLK peer")
    ap.add_argument("--dtype", choices=["bf16", "fp8", "both"], default="both")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds; later cells are skipped (quick: 140, full: 240; 0: no limit)")  # fmt: skip
    ap.add_argument("--mslk-configs", type=int, default=None,
                    help="MSLK autotuning configs kept per shape (quick: 2, full: 4; 0: all)")  # fmt: skip
    ap.add_argument("--shapes", default="",
                    help="comma-separated shape names (or part1..part3: the full grid's device calls) to keep")  # fmt: skip
    ap.add_argument(
        "--ms", default="", help="comma-separated total rows M to keep (e.g. 1024,2048: an A/B of a few cells)"
    )
    args = ap.parse_args()
    try:
        keep = pick_shapes(args.shapes) if args.shapes else None
        keep_ms = pick_ms(args.ms) if args.ms else None
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("bench_grouped_gemm: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    budget = args.budget if args.budget is not None else (140.0 if args.quick else 240.0)
    budget = budget if budget > 0 else float("inf")
    n_mslk = args.mslk_configs if args.mslk_configs is not None else (2 if args.quick else 4)
    mslk = {} if args.no_mslk else _mslk_ops(n_mslk, fast_timing=args.quick)
    print(f"MSLK peers: {sorted(mslk) or 'none'} (non-warp-specialized; autotuning configs kept: "
          f"{n_mslk or 'all'}); budget {budget:.0f} s")  # fmt: skip
    dtypes = {"bf16": [torch.bfloat16], "fp8": [FP8], "both": [torch.bfloat16, FP8]}[args.dtype]
    plan = []
    if args.quick:
        by_name = {s[0]: s for s in SHAPES}
        plan = [(by_name[n], m) for m in QUICK_MS for n in QUICK_SHAPES]
    else:
        plan = [(s, m) for s in SHAPES for m in grid_ms(s[1])]
    if keep is not None:
        plan = [(s, m) for s, m in plan if s[0] in keep]
    if keep_ms is not None:
        plan = [(s, m) for s, m in plan if m in keep_ms]
    if args.tune:
        from sweep_gemm import tune

        shapes = [(m, s[2], s[3], s[1], dt) for s, m in plan for dt in dtypes]
        tune(shapes, args.tune)
        print(f"tuned table written to {args.tune} ({time.time() - t0:.0f} s)")
        return 0
    rows: list[dict] = []
    skipped = []
    for (name, G, N, K), M in plan:
        for dt in dtypes:
            spent = time.time() - t0
            if spent > budget:
                skipped.append(f"{name} M={M} {'fp8' if dt == FP8 else 'bf16'}")
                continue
            bench_case(name, G, N, K, M, dt, mslk, rows, variants=args.variants,
                       replays=10 if M >= 16384 else 20, skip_mslk=spent > 0.85 * budget)  # fmt: skip
    if skipped:
        print(f"skipped past the {budget:.0f} s budget: {', '.join(skipped)}")
    print()
    print(f"Grouped GEMM, one GPU; floor = max(bytes / {COPY_TBPS} TB/s, FLOP / {BF16_TFLOPS} (bf16) or "
          f"{FP8_TFLOPS} (fp8) TFLOP/s); ÷peer = moekit µs / peer µs")  # fmt: skip
    print(markdown_table(rows))
    print("\n".join(peer_verdict(rows)))
    dense: list[dict] = []
    if args.dense:
        bench_dense(dense, args.quick)
        print()
        print(markdown_table(dense))
    meta = {**environment(), "quick": args.quick, "shapes": keep}
    path = save_rows("bench_grouped_gemm", rows + dense, meta)
    print(f"\n{len(rows) + len(dense)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
