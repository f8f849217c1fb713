#!/usr/bin/env python3
"""Host (CPU) cost of launching moekit's ops, layer by layer of the call stack: the public op (its
validation), the registered ``torch.ops.moekit`` op (the dispatcher), the Triton launcher and the
bare kernel launch. Each is called many times without a sync; the time per call is what eager
callers (transformers' ``generate``) pay before the GPU sees any work.

    python benchmarks/profile_launch.py [--T 1,512]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402


def _tiny_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _tiny(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    return _tiny


def per_call(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def profile(name: str, fn, n: int = 100) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"---- cProfile of {name}, {n} calls")
    print("\n".join(line for line in s.getvalue().splitlines()[6:30] if line.strip()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="1,512")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_launch: needs a CUDA GPU")
        return 0
    import moekit.ops as ops
    from moekit.layers.experts import run_experts
    from moekit.ops._triton import activation as tact
    from moekit.ops._triton import grouped_gemm as tgg
    from moekit.ops._triton import routing as troute

    from torch._library.triton import set_wrap_triton_enabled

    def bare(fn):  # the launcher as the op's implementation runs it (wrap_triton off)
        def go():
            with set_wrap_triton_enabled(False):
                return fn()

        return go

    dev = torch.device("cuda")
    E, D, F, k = 128, 2048, 768, 8
    w13 = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) * 0.02
    tiny = _tiny_kernel()
    buf = torch.zeros(64, device=dev)
    print(f"{'T':>5} {'what':<58} {'us per call (queued)':>22}")
    rows = []
    for T in [int(t) for t in args.T.split(",")]:
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        scores = torch.randn(T, E, device=dev)
        counts, eidx, tidx = ops.index_shuffling(scores, top_k=k)
        m = counts[:E]
        rw = torch.rand(T * k, device=dev)
        xg = torch.randn(T * k, D, device=dev, dtype=torch.bfloat16)
        h = torch.randn(T * k, 2 * F, device=dev, dtype=torch.bfloat16)
        out = torch.zeros(T, D, device=dev, dtype=torch.bfloat16)
        w13f = w13.view(-1, D)
        cases = [
            ("torch.empty (reference point)", lambda: torch.empty(T, D, device=dev)),
            ("a bare 3-argument Triton kernel", lambda: tiny[(1,)](buf, 64, BLOCK=64)),
            ("torch.topk + softmax (two torch ops)", lambda: torch.topk(torch.softmax(scores, -1), k, -1)),
            ("index_shuffling: public", lambda: ops.index_shuffling(scores, top_k=k)),
            (
                "index_shuffling: torch.ops.moekit",
                lambda: torch.ops.moekit.index_shuffling(scores, None, None, None, k),
            ),
            ("index_shuffling: Triton launcher", bare(lambda: troute.index_shuffling(scores, None, None, None, k))),
            ("silu_mul: public", lambda: ops.silu_mul(h[:, :F], h[:, F:])),
            ("silu_mul: torch.ops.moekit", lambda: torch.ops.moekit.silu_mul(h[:, :F], h[:, F:], None)),
            ("silu_mul: Triton launcher", bare(lambda: tact.silu_mul(h[:, :F], h[:, F:]))),
            ("grouped_gemm w13: public", lambda: ops.grouped_gemm(xg, w13f, m)),
            ("grouped_gemm w13: torch.ops.moekit", lambda: torch.ops.moekit.grouped_gemm(xg, w13f, m)),
            ("grouped_gemm w13: Triton launcher", bare(lambda: tgg.grouped_gemm(xg, w13f, m))),
            (
                "run_experts (the whole pipeline)",
                lambda: run_experts(x, w13, w2, m, token_ids=tidx, expert_ids=eidx, row_weights=rw, out=out),
            ),  # fmt: skip
        ]
        for name, fn in cases:
            us = per_call(fn)
            rows.append((T, name, us))
            print(f"{T:>5} {name:<58} {us:>22.1f}")
        profile(f"T={T} Triton launcher of grouped_gemm w13", bare(lambda: tgg.grouped_gemm(xg, w13f, m)))
        profile(
            f"T={T} Triton launcher of index_shuffling",
            bare(lambda: troute.index_shuffling(scores, None, None, None, k)),
        )
        profile(f"T={T} run_experts", lambda: run_experts(x, w13, w2, m, token_ids=tidx, expert_ids=eidx,
                                                          row_weights=rw, out=out))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
