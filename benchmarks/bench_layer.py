"""Whole MoE layer: moekit vs plain PyTorch vs MSLK (top-1 sigmoid shapes), one process.

    python benchmarks/bench_layer.py [--quick] [--models llama4-scout,deepseek-v3] [--dtype bf16|fp8]
"""

from __future__ import annotations

import argparse
import sys

import torch

from moekit import _bench
from moekit.benchmarking import markdown_table, save_rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="llama4-scout,llama4-maverick,deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--dtype", default="bf16,fp8")
    p.add_argument("--tokens", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer needs CUDA; nothing to do on this machine")
        return 0
    models = a.models.split(",")
    if a.quick:
        models = models[:1] + (["deepseek-v3"] if "deepseek-v3" in models[1:] else [])
    tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else (_bench.GPU_TOKENS_QUICK if a.quick else _bench.GPU_TOKENS)
    rows = []
    for m in models:
        for dt in a.dtype.split(","):
            print(f"== {m} {dt}", flush=True)
            try:
                rows += _bench.run(m, tokens, dt == "fp8", a.quick)
            except Exception as exc:  # keep the other models' rows
                print(f"   {m} {dt} failed: {type(exc).__name__}: {exc}")
    cols = ["model", "T", "dtype", "floor_us", "moekit_us", "det_us", "torch_us", "mslk_us", "floor/moekit", "moekit/torch", "moekit/mslk"]
    print(markdown_table(rows, cols))
    save_rows("bench_layer", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
