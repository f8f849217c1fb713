#!/usr/bin/env python3
"""The card's ceilings, measured the way ANCHORS.md measured the H200's (the floors of every
benchmark use those: 4.25 TB/s copy, 679 TFLOP/s bf16, 1260 TFLOP/s FP8), so that results from
another card (the device tool's H100s) can be read against that card's own ceilings.

    python benchmarks/card_ceilings.py

Rows (CUDA-graph medians, ``moekit.benchmarking.bench_us``):
- ``copy``: device-to-device copy of 2 GiB (bytes read + written per µs);
- ``read``: a float32 sum over 4 GiB (bytes read; what a weight stream can reach);
- ``bf16_matmul``: ``torch.matmul`` 8192³ bf16;
- ``fp8_matmul`` / ``fp8_matmul_rowwise``: ``torch._scaled_mm`` 8192³ e4m3 (bf16 out), one scale
  per tensor / per row and column.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402


def _stream(name: str, n: int, fn, passes: int) -> dict:
    """Bytes moved per µs by ``fn(src, dst)`` over ``n`` float32 elements (``passes``: times the
    buffer's bytes cross HBM per call)."""
    from moekit.benchmarking import bench_us

    src = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src) if passes == 2 else None
    us = bench_us(lambda: fn(src, dst), replays=20)
    return {"what": name, "us": us, "TB/s": passes * n * 4 / us / 1e6}


def main() -> int:
    if not torch.cuda.is_available():
        print("card_ceilings needs CUDA; nothing to do on this machine")
        return 0
    from moekit.benchmarking import bench_us, markdown_table, save_rows

    dev = torch.device("cuda")
    rows = []

    rows.append(_stream("copy", 2**29, lambda src, dst: dst.copy_(src), 2))  # 2 GiB read + 2 written
    rows.append(_stream("read", 2**30, lambda src, dst: src.sum(), 1))  # 4 GiB read

    n = 8192
    a = torch.randn(n, n, device=dev).bfloat16()
    b = torch.randn(n, n, device=dev).bfloat16()
    us = bench_us(lambda: torch.matmul(a, b), replays=20)
    rows.append({"what": "bf16_matmul", "us": us, "TFLOP/s": 2 * n**3 / us / 1e6})

    fa = a.to(torch.float8_e4m3fn)
    fb = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major right operand
    sa = torch.ones(n, 1, device=dev)
    sb = torch.ones(1, n, device=dev)
    one = torch.ones((), device=dev)
    for name, (s_a, s_b) in (("fp8_matmul", (one, one)), ("fp8_matmul_rowwise", (sa, sb))):
        try:
            us = bench_us(lambda s_a=s_a, s_b=s_b: torch._scaled_mm(fa, fb, scale_a=s_a, scale_b=s_b,
                                                                    out_dtype=torch.bfloat16), replays=20)  # fmt: skip
            rows.append({"what": name, "us": us, "TFLOP/s": 2 * n**3 / us / 1e6})
        except Exception as exc:  # a torch build without this scaled_mm on this card
            rows.append({"what": name, "us": None, "error": f"{type(exc).__name__}: {exc}"[:100]})

    print(torch.cuda.get_device_name(dev))
    print(markdown_table(rows, ["what", "us", "TB/s", "TFLOP/s"]))
    save_rows("card_ceilings", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
