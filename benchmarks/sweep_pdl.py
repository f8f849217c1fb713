#!/usr/bin/env python3
"""Experiment: the one-row grouped GEMM (GEMV kernel) with and without programmatic dependent
launch (``$MOEKIT_PDL``), back to back in a CUDA graph as the benchmarks time it, routings
rotated past the L2. Prints µs for both and checks that the outputs are bitwise equal.

    python benchmarks/sweep_pdl.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

from moekit.benchmarking import bench_us, floor_us, rotations  # noqa: E402

SHAPES = [  # name, G, N, K
    ("scout-tp8-w13", 16, 2048, 5120),
    ("maverick-tp8-w2", 128, 5120, 1024),
    ("deepseek-w2", 256, 7168, 2048),
    ("qwen3-w2", 128, 2048, 768),
]


def main() -> int:
    if not torch.cuda.is_available():
        print("sweep_pdl: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    from moekit.ops._triton import grouped_gemm as GG
    from moekit.testing import random_m_sizes

    fp8 = torch.float8_e4m3fn
    print("| shape | dtype | floor µs | no PDL µs | PDL µs | equal |")
    print("|---|---|---|---|---|---|")
    for name, G, N, K in SHAPES:
        for dtype in (torch.bfloat16, fp8):
            elem = 1 if dtype == fp8 else 2
            x = torch.randn(1, K, device="cuda").to(dtype)
            w = (torch.randn(G * N, K, device="cuda") / K**0.5).to(dtype)
            xs = torch.rand(1, device="cuda") if dtype == fp8 else None
            ws = torch.rand(G * N, device="cuda") if dtype == fp8 else None
            n = rotations(N * K * elem)
            sets = [random_m_sizes(1, G, device="cuda", seed=i) for i in range(n)]
            res = {}
            for pdl in (False, True):
                GG.PDL = pdl
                calls = [lambda ms=ms: GG.grouped_gemm(x, w, ms, x_scale=xs, w_scale=ws) for ms in sets]
                outs = [c() for c in calls]
                torch.cuda.synchronize()
                res[pdl] = (bench_us(calls, replays=30), outs)
            GG.PDL = False
            equal = all(torch.equal(a, b) for a, b in zip(res[False][1], res[True][1]))
            fl = floor_us(N * K * elem + K * elem + 2 * N)
            print(f"| {name} | {'fp8' if dtype == fp8 else 'bf16'} | {fl:.2f} | {res[False][0]:.2f} | "
                  f"{res[True][0]:.2f} | {equal} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
