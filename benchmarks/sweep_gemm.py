#!/usr/bin/env python3
"""Ahead-of-time tuning of the grouped GEMM on the GPU: times the heuristic's configuration and
its alternatives (``moekit.ops._triton.grouped_gemm.candidate_configs``) for the shapes given, and
writes the winners as a JSON table (the format ``$MOEKIT_GG_TUNED`` / ``grouped_gemm_tuned.json``
reads).

    python benchmarks/sweep_gemm.py [--shapes deepseek-w2:16384:bf16,...] [--out table.json]

A shape is ``name:M:dtype`` with ``name`` one of the benchmark's (``bench_grouped_gemm.SHAPES``),
or ``N:K:G:M:dtype``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402

DEFAULT = ("deepseek-w2:16384:bf16,deepseek-w2:16384:fp8,qwen3-w2:16384:fp8,maverick-tp8-w2:16384:fp8,"
           "qwen3-w2:16:fp8,maverick-tp8-w2:16:fp8,qwen3-w2:128:fp8,maverick-tp8-w2:1:fp8,qwen3-w2:1:fp8,"
           "scout-tp8-w13:1:bf16,scout-tp8-w13:1:fp8")


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
    ap.add_argument("--out", default=os.path.join(os.environ.get("MOEKIT_BENCH_DIR", "."), "gg_tuned.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_gemm: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    from moekit.ops._triton.grouped_gemm import tune

    t0 = time.time()
    table = {}
    for shape in parse(args.shapes):
        print(f"#### {shape} ({time.time() - t0:.0f} s)", flush=True)
        table.update(tune([shape], log=lambda s: print(s, flush=True)))
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    print(f"done in {time.time() - t0:.0f} s; table in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
