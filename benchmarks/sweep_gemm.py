#!/usr/bin/env python3
"""Ahead-of-time tuning of the grouped GEMM on the GPU: times the heuristic's configuration and
its alternatives (``candidate_configs`` below: for streaming shapes also the ``persist`` tiles,
the swap-AB tiles on the persistent tile loop) for the shapes given, and
writes the winners as a JSON table (the format ``$MOEKIT_GG_TUNED`` / ``grouped_gemm_tuned.json``
reads).

    python benchmarks/sweep_gemm.py [--shapes deepseek-w2:16384:bf16,...] [--out table.json] [--scatter 8]

``--scatter K``: the rows scatter-added into ``M / K`` token rows, laid out as the layer's down
GEMM below ``DOWN_SUM_MIN_ROWS`` has them (``tune``), whose epilogue wants other tiles than stored
rows (session 35); in the layer's tile order too (the column slabs where ``GG_N_SLAB``'s rule
takes them; ``MOEKIT_KNOBS=GG_N_SLAB=0`` times the plain order). With that layout the sweep ranks
the scatter-add's tiles as the layer does (session 36); random destinations did not.

A shape is ``name:M:dtype`` with ``name`` one of the benchmark's (``bench_grouped_gemm.SHAPES``),
or ``N:K:G:M:dtype``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Optional
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from moekit import settings  # noqa: E402
from moekit._validate import FP8_DTYPE  # noqa: E402
from moekit.ops._common import next_pow2, num_sms  # noqa: E402
from moekit.ops._triton.gg_config import (  # noqa: E402
    GemmConfig,
    config_key,
    expected_groups_hit,
    heuristic_config,
    save_table,
)
from moekit.ops._triton.grouped_gemm import grouped_gemm  # noqa: E402

DEFAULT = (
    "deepseek-w2:16384:bf16,deepseek-w2:16384:fp8,qwen3-w2:16384:fp8,maverick-tp8-w2:16384:fp8,"
    "qwen3-w2:16:fp8,maverick-tp8-w2:16:fp8,qwen3-w2:128:fp8,maverick-tp8-w2:1:fp8,qwen3-w2:1:fp8,"
    "scout-tp8-w13:1:bf16,scout-tp8-w13:1:fp8"
)


def candidate_configs(
    M: int, N: int, K: int, G: int, fp8: bool, elem: int, sms: int, stored: bool = True
) -> list[GemmConfig]:
    """A dozen configurations around the heuristic's choice (same kind first, then the other).
    ``stored``: the heuristic's choice for rows stored (default) or scatter-added, as ``tune``
    times them."""
    h = heuristic_config(M, N, K, G, fp8, elem, sms, stored=stored)
    kpow = max(16, next_pow2(K))
    out = [h]
    if h.persist:  # the same tiles one program per tile (MOEKIT_GG_STREAM_PERSIST=0)
        h = heuristic_config(M, N, K, G, fp8, elem, sms, persist=False, stored=stored)
        out.append(h)
    if h.kind == "gemv":
        for bn in sorted({max(1, h.block_n // 2), h.block_n, min(16, h.block_n * 2)}):
            for bk in sorted({max(16, h.block_k // 2), h.block_k, min(kpow, h.block_k * 2)}):
                stages = 1 + max(2, min(6, (32 * 1024) // (bn * bk * elem)))
                out.append(GemmConfig("gemv", 1, bn, bk, stages, 4, use_tma=False))
        h = replace(
            h, kind="stream", block_m=16, block_n=64, block_k=max(16, min(kpow, 256 // elem)), stages=5, use_tma=True
        )
        out.append(h)
    if h.kind == "stream":
        # The same tiles on the persistent tile loop (``persist``) at the heuristic's K slice and
        # half of it: flattened (the pipeline spans tiles, so it may hold more stages than a tile
        # has K steps) or not.
        for bk in sorted({max(16, h.block_k // 2), h.block_k}):
            steps = max(2, min(4, -(-K // bk)))
            out.append(replace(h, block_k=bk, stages=max(3, steps), persist=True, flatten=True))
            out.append(replace(h, block_k=bk, stages=steps, persist=True, flatten=False))
        for bn in sorted({max(16, h.block_n // 2), h.block_n, min(128, h.block_n * 2)}):
            for bk in sorted({max(16, h.block_k // 2), h.block_k, min(kpow, h.block_k * 2)}):
                stage = (bn + h.block_m) * bk * elem
                stages = max(2, min(6, (128 * 1024) // stage))
                warps = 8 if bn * h.block_m >= 16384 else (2 if bn * h.block_m <= 256 else 4)
                stages = max(2, min(stages, -(-K // bk)))
                for tma in (True, False):
                    out.append(GemmConfig("stream", h.block_m, bn, bk, stages, warps, use_tma=tma))
                out.append(GemmConfig("stream", h.block_m, bn, bk, stages, warps, use_tma=True, x_tma=True))
    bk = 128 if elem == 1 else (64 if elem == 2 else 32)
    for bm, bn, k, stages in (
        (128, 128, bk, 4),
        (128, 128, 2 * bk, 3),
        (128, 256, bk, 3),
        (64, 256, bk, 3),
        (64, 256, bk, 4),
        (64, 128, bk, 4),
        (128, 256, bk, 2),
    ):
        for flatten in (True, False):
            out.append(GemmConfig("tiled", bm, bn, k, stages, 8, flatten=flatten))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def tune(shapes, path: Optional[str] = None, *, top_k: int = 1, device: str = "cuda", log=print,
         scatter: int = 0) -> dict:  # fmt: skip
    """Time ``candidate_configs`` for each ``(M, N, K, G, dtype)`` in ``shapes`` (rows spread by
    a random routing) and return {config_key: best config}; written as JSON to ``path`` when
    given (point $MOEKIT_GG_TUNED at it, or save it as ``moekit/ops/_triton/grouped_gemm_tuned.json``).
    ``scatter``: the rows scatter-added into ``M // scatter`` token rows, laid out as the layer's
    down GEMM below ``DOWN_SUM_MIN_ROWS`` has them (a random top-``scatter`` routing of the tokens,
    rows sorted by expert and by token within an expert, router weights on the rows) instead of
    stored; such a table describes the scatter-add epilogue, not the stored rows the keys also
    name."""
    from moekit.benchmarking import bench_us, rotations
    from moekit.testing import random_m_sizes

    table = {}
    sms = num_sms(torch.device(device))
    for M, N, K, G, dtype in shapes:
        fp8 = dtype == FP8_DTYPE
        x = torch.randn(M, K, device=device).to(dtype)
        w = (torch.randn(G * N, K, device=device) / K**0.5).to(dtype)
        # Several routings, cycled: the weights one call touches must not all sit in the L2.
        touched = expected_groups_hit(M, G) * N * K * x.element_size()
        n_sets = rotations(touched)
        xs = torch.rand(M, device=device) if fp8 else None
        ws = torch.rand(G * N, device=device) if fp8 else None
        if scatter:
            sets = [_scatter_layout(M, G, scatter, i, device) for i in range(n_sets)]
            out = torch.zeros(M // scatter, N, device=device, dtype=torch.bfloat16)
        else:
            sets = [(random_m_sizes(M, G, top_k=1, device=device, seed=i), None, None) for i in range(n_sets)]
            out = None
        best = None
        for cfg in candidate_configs(M, N, K, G, fp8, x.element_size(), sms, stored=not scatter):
            calls = [lambda ms=ms, tok=tok, tw=tw: grouped_gemm(x, w, ms, x_scale=xs, w_scale=ws, token_weights=tw,
                                                                out=out, scatter_indices=tok, config=cfg)
                     for ms, tok, tw in sets]  # fmt: skip
            try:
                t = bench_us(calls, replays=10)
            except Exception as e:  # a config that does not compile or launch is skipped
                log(f"  skip {cfg}: {type(e).__name__}")
                continue
            log(f"  {t:9.2f} us  {cfg}")
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            key = config_key(M, N, K, G, fp8, x.element_size())
            table[key] = asdict(best[1])
            log(f"{key}: {best[0]:.1f} us {best[1]}")
    if path:
        save_table(table, path)
    return table


def _scatter_layout(M: int, G: int, k: int, seed: int, device) -> tuple:
    """``(m_sizes [G] int32, token ids [M] int32, router weights [M] float32)`` of a random top-``k``
    routing of ``M // k`` tokens, rows sorted by expert and by token within an expert (the
    order ``index_shuffling`` gives the layer's rows). ``M`` must be a multiple of ``k``."""
    from moekit.testing import random_routing

    if M % k:
        raise ValueError(f"sweep_gemm --scatter {k}: M ({M}) must be a multiple of it")
    tw, ids = random_routing(M // k, G, k, seed=seed)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    ms = torch.bincount(flat, minlength=G).to(torch.int32)
    tok = (order // k).to(torch.int32)
    return ms.to(device), tok.to(device), tw.reshape(-1)[order].to(device)


def parse(spec: str) -> list:
    import bench_grouped_gemm as bgg

    known = {s[0]: s[1:] for s in bgg.SHAPES}
    out = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) == 3:
            G, N, K = known[parts[0]]
            M, dt = int(parts[1]), parts[2]
        else:
            N, K, G, M, dt = int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4]
        out.append((M, N, K, G, torch.float8_e4m3fn if dt == "fp8" else torch.bfloat16))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh (QUICK=1); no effect")
    ap.add_argument("--out", default=os.path.join(settings.get().bench_dir or ".", "gg_tuned.json"))
    ap.add_argument("--scatter", type=int, default=0,
                    help="top-k: scatter-add the rows into M / top-k token rows (the layer's down GEMM "
                    "below DOWN_SUM_MIN_ROWS) instead of storing them")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_gemm: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    table = {}
    for shape in parse(args.shapes):
        print(f"#### {shape} ({time.time() - t0:.0f} s)", flush=True)
        table.update(tune([shape], log=lambda s: print(s, flush=True), scatter=args.scatter))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    print(f"done in {time.time() - t0:.0f} s; table in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
