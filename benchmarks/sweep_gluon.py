#!/usr/bin/env python3
"""The Gluon grouped GEMM (``moekit.ops._triton.gg_gluon``, experimental) against the library's
Triton grouped GEMM and cuBLAS on the same rows: what hand-scheduled Hopper tiles give on the
layer's compute-bound GEMMs.

    python benchmarks/sweep_gluon.py [--cases qwen3-w2:8192,...] [--configs 128x256x64b4,128x256x64b3c]

A case is ``name:T[:swiglu][:fp8][:scatter]`` (``scatter``: the rows added into T token rows at
random indices, both kernels' scatter-add; ``swiglu``, a ``-w13`` shape: the gate/up GEMM with its
SwiGLU epilogue, rows read by index, against ``grouped_gemm_swiglu``; else the layer's GEMM at T tokens: ``M = T * top-k`` rows spread over the
experts by a uniform random routing; ``fp8``: row-wise FP8 operands, twice the configs' K tile, cuBLAS
``torch._scaled_mm``); a config is ``BMxBNxBK`` ``b<buffers>`` (``c``: the epilogue's rows
through shared memory; ``d0``: each MMA group waited for before the next is issued, default ``d1``:
one left running; ``w``: the warp-specialized kernel; ``h`` after it: one MMA partition per 64-row
half of the tile). Per case, µs per call (CUDA graphs, medians): ``triton`` (``grouped_gemm``
with the router weights on the rows, its default configuration), one column per Gluon config,
``cublas`` (``torch.mm`` of all M rows against one expert's weights: the dense rate on the same
FLOPs) and TFLOP/s of each; ``rel_err``: the largest Gluon deviation from ``triton``'s output
(max abs over max abs).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

# name: (G experts, N, K, top-k)
SHAPES = {
    "qwen3-w2": (128, 2048, 768, 8),
    "qwen3-w13": (128, 1536, 2048, 8),
    "deepseek-w2": (256, 7168, 256, 8),
    "deepseek-w13": (256, 512, 7168, 8),
    "gptoss-w2": (128, 2880, 2880, 4),
    "gptoss-w13": (128, 5760, 2880, 4),
}
DEFAULT_CASES = (
    "qwen3-w2:8192,qwen3-w13:8192,qwen3-w2:2048,gptoss-w2:8192,deepseek-w2:8192,qwen3-w2:8192:fp8,"
    "gptoss-w2:8192:fp8,deepseek-w2:8192:fp8,qwen3-w13:8192:swiglu,deepseek-w13:8192:swiglu,qwen3-w13:8192:swiglu:fp8"
)
DEFAULT_CONFIGS = "128x256x64b3w,128x256x64b3wh"


def _config(text: str) -> tuple:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)b(\d+)(c?)(?:d(\d))?(w?)(h?)", text.strip())
    if m is None:
        raise SystemExit(
            "--configs: expected entries like 128x256x64b4, 128x256x64b3c, 128x256x64b4d0, 128x256x64b3w or 128x256x64b3wh, "
            f"got {text!r}"
        )
    return (int(m[1]), int(m[2]), int(m[3])), int(m[4]), bool(m[5]), int(m[6] or 1), bool(m[7]), bool(m[8])


def _swiglu_case(case: str, name: str, T: int, fp8: bool, configs: str) -> dict:
    """A ``name:T:swiglu[:fp8]`` case: the gate/up GEMM with its SwiGLU epilogue, rows read by
    index (the layer's fused gate/up stage), ``grouped_gemm_swiglu`` (Triton, its default
    configuration) against ``grouped_gemm_swiglu_gluon`` per config; cuBLAS: ``torch.mm`` of all
    rows against one expert's ``[2F, K]`` weights."""
    from moekit.benchmarking import bench_us
    from moekit.ops import quantize_fp8_row
    from moekit.ops._triton.gg_gluon_swiglu import grouped_gemm_swiglu_gluon
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu
    from moekit.testing.data import random_m_sizes

    G, twoF, K, k = SHAPES[name]
    F = twoF // 2
    M = T * k
    ms = random_m_sizes(M, G, k, device="cuda", seed=0)
    gather = torch.randint(0, T, (M,), device="cuda", dtype=torch.int32)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G * twoF, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    xs = wsc = None
    if fp8:
        x, xs = quantize_fp8_row(x)
        w, wsc = quantize_fp8_row(w)
    flops = 2.0 * M * twoF * K
    row = {"case": case, "M": M, "N": F, "K": K, "G": G}
    want = grouped_gemm_swiglu(x, w, ms, gather, None, xs, wsc)
    us = bench_us(lambda: grouped_gemm_swiglu(x, w, ms, gather, None, xs, wsc), replays=10)
    row["triton"], row["triton_tf"] = round(us, 1), round(flops / us / 1e6)
    worst = 0.0
    for text in configs.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)b(\d+)(p?)", text.strip())
        if m is None:
            raise SystemExit(f"--swiglu-configs: expected entries like 128x128x64b3 or 128x128x64b3p, got {text!r}")
        block, nbuf, pair = (int(m[1]), int(m[2]), int(m[3]) * (2 if fp8 else 1)), int(m[4]), bool(m[5])
        tag = f"sw{text.strip()}"
        try:
            got = grouped_gemm_swiglu_gluon(x, w, ms, gather, x_scale=xs, w_scale=wsc, block=block, num_buf=nbuf,
                                            pair=pair)  # fmt: skip
            torch.cuda.synchronize()
            worst = max(worst, float((got.float() - want.float()).abs().max() / want.float().abs().max()))
            us = bench_us(lambda b=block, n=nbuf, p=pair: grouped_gemm_swiglu_gluon(x, w, ms, gather, x_scale=xs,
                          w_scale=wsc, block=b, num_buf=n, pair=p), replays=10)  # fmt: skip
            row[tag], row[tag + "_tf"] = round(us, 1), round(flops / us / 1e6)
        except Exception as exc:
            row[tag] = f"{type(exc).__name__}: {str(exc)[:80]}"
    xd = x[:M] if M <= T else x.repeat((M + T - 1) // T, 1)[:M]
    wd = w[:twoF]
    if fp8:
        sa = torch.ones(M, 1, device="cuda")
        sb = torch.ones(1, twoF, device="cuda")
        us = bench_us(
            lambda: torch._scaled_mm(xd, wd.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), replays=10
        )
    else:
        us = bench_us(lambda: torch.mm(xd, wd.t()), replays=10)
    row["cublas"], row["cublas_tf"] = round(us, 1), round(flops / us / 1e6)
    row["rel_err"] = round(worst, 5)
    print(row, flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--swiglu-configs", default="128x128x64b3,128x128x64b3p",
                    help="the SwiGLU cases' Gluon tiles, BMxBNxBKb<buffers>[p] (BN output columns; p: one "
                         "N = 2 BN MMA a step)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh; no effect")
    a = ap.parse_args()
    configs = [_config(c) for c in a.configs.split(",") if c]
    if not torch.cuda.is_available():
        print("sweep_gluon needs CUDA; nothing to do on this machine")
        return 0
    from moekit.benchmarking import bench_us, markdown_table, save_rows
    from moekit.ops._triton.gg_gluon import grouped_gemm_gluon
    from moekit.ops import quantize_fp8_row
    from moekit.ops._triton.grouped_gemm import grouped_gemm
    from moekit.testing.data import random_m_sizes

    rows = []
    for case in a.cases.split(","):
        name, T, *rest = case.split(":")
        if "swiglu" in rest:
            rows.append(_swiglu_case(case, name, int(T), "fp8" in rest, a.swiglu_configs))
            torch.cuda.empty_cache()
            continue
        fp8, scatter = "fp8" in rest, "scatter" in rest
        G, N, K, k = SHAPES[name]
        M = int(T) * k
        ms = random_m_sizes(M, G, k, device="cuda", seed=0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(G * N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        rs = torch.rand(M, device="cuda") + 0.5
        sc = {}
        if fp8:  # row-wise FP8 operands, the layer's FP8 path
            x, xs = quantize_fp8_row(x)
            w, wsc = quantize_fp8_row(w)
            sc = {"x_scale": xs, "w_scale": wsc}
        if scatter:  # rows added into T token rows (the layer's down projection): both kernels' scatter-add
            idx = torch.randint(0, int(T), (M,), device="cuda", dtype=torch.int32)
            y = torch.zeros(int(T), N, device="cuda", dtype=torch.bfloat16)
            sc = dict(sc, out=y, scatter_indices=idx)  # (the same arguments in both kernels)
        flops = 2.0 * M * N * K
        row = {"case": case, "M": M, "N": N, "K": K, "G": G}
        if scatter:
            y.zero_()
        res = grouped_gemm(x, w, ms, token_weights=rs, **sc)  # (None with out: the rows added into y)
        want = (y if scatter else res).clone()
        us = bench_us(lambda: grouped_gemm(x, w, ms, token_weights=rs, **sc), replays=10)
        row["triton"], row["triton_tf"] = round(us, 1), round(flops / us / 1e6)
        worst = 0.0
        for block, nbuf, co, dp, ws, hv in configs:
            tag = "x".join(map(str, block)) + f"b{nbuf}" + ("w" if ws else ("c" if co else "") + f"d{dp}") + "h" * hv
            if fp8:  # 128-byte K tiles
                block = (block[0], block[1], 2 * block[2])
            try:
                if scatter:
                    y.zero_()
                got = grouped_gemm_gluon(x, w, ms, rs, block=block, num_buf=nbuf, coalesce=co, depth=dp, ws=ws, halves=hv,
                                         **sc)  # fmt: skip
                torch.cuda.synchronize()
                rel = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                worst = max(worst, rel)
                us = bench_us(lambda b=block, n=nbuf, c=co, d=dp, v=ws, h=hv: grouped_gemm_gluon(x, w, ms, rs, block=b,
                              num_buf=n, coalesce=c, depth=d, ws=v, halves=h, **sc), replays=10)  # fmt: skip
                row[tag], row[tag + "_tf"] = round(us, 1), round(flops / us / 1e6)
            except Exception as exc:  # a config that does not fit (or FP8 off the warp-specialized kernel)
                row[tag] = f"{type(exc).__name__}: {str(exc)[:80]}"
        wd = w[:N]
        if fp8:
            sa, sb = sc["x_scale"][:, None].contiguous(), sc["w_scale"][None, :N].contiguous()
            us = bench_us(
                lambda: torch._scaled_mm(x, wd.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), replays=10
            )
        else:
            us = bench_us(lambda: torch.mm(x, wd.t()), replays=10)
        row["cublas"], row["cublas_tf"] = round(us, 1), round(flops / us / 1e6)
        row["rel_err"] = round(worst, 5)
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    print(markdown_table(rows, list(dict.fromkeys(c for r in rows for c in r))))  # (the SwiGLU cases' columns too)
    save_rows("sweep_gluon", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
