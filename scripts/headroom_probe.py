#!/usr/bin/env python3
"""One-off probe (session 32): what the vendor library reaches on the layer's GEMMs flattened
to one dense matrix product (every routed row against one expert's weights), bf16 ``torch.mm``
and FP8 row-wise ``torch._scaled_mm``: the headroom a better grouped kernel could have on the
compute-bound prefill cells (H100: our grouped kernels run 500-560 TFLOP/s there).

    python scripts/headroom_probe.py      # (CUDA)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from moekit.benchmarking import bench_us  # noqa: E402

SHAPES = {  # name: (M routed rows, N, K)
    "qwen3 T=8192 gate|up": (65536, 1536, 2048),
    "qwen3 T=8192 down": (65536, 2048, 768),
    "qwen3 T=2048 gate|up": (16384, 1536, 2048),
    "gpt-oss T=8192 gate|up": (32768, 5760, 2880),
    "gpt-oss T=8192 down": (32768, 2880, 2880),
    "deepseek-tp8 T=8192 gate|up": (65536, 512, 7168),
    "deepseek-tp8 T=8192 down": (65536, 7168, 256),
    "square 8192": (8192, 8192, 8192),
}


def main():
    if not torch.cuda.is_available():
        print("headroom_probe needs CUDA; nothing to do on this machine")
        return
    print("| shape | M | N | K | bf16 µs | bf16 TF/s | fp8 µs | fp8 TF/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (M, N, K) in SHAPES.items():
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        us = bench_us(lambda a=a, b=b: torch.mm(a, b.t()), replays=10)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.rand(M, 1, device="cuda") + 0.5
        sb = torch.rand(1, N, device="cuda") + 0.5
        us8 = bench_us(lambda a8=a8, b8=b8, sa=sa, sb=sb: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                       replays=10)  # fmt: skip
        f = 2.0 * M * N * K
        print(
            f"| {name} | {M} | {N} | {K} | {us:.1f} | {f / us / 1e6:.0f} | {us8:.1f} | {f / us8 / 1e6:.0f} |",
            flush=True,
        )
        del a, b, a8, b8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
