#!/usr/bin/env python3
"""Benchmark: silu_mul, silu_mul_quant, quantize_fp8_row (and rms_norm) — moekit vs MSLK 1.1.0 vs
plain PyTorch, side by side in one process.

    python benchmarks/bench_activation.py [--quick]

Inputs: ``x0``/``x1`` are the two column halves of one ``[T, 2F]`` bf16 tensor (the layout the
MoE layer hands over from its gate|up GEMM); ``quantize_fp8_row`` on ``[T, 5120]`` bf16; ``rms_norm``
on ``[T, H]`` bf16 with a bf16 residual. Times are medians of CUDA-graph replays
(``moekit.benchmarking.bench_us``), with inputs rotated past the L2 when one set fits in it.
TB/s counts the bytes that must move (read + written); "% floor" is the time at the measured
4.25 TB/s copy bandwidth over the measured time. "vs MSLK" and "vs torch" are speedups
(their µs / moekit µs). MSLK cells read "refused" when it rejects the shape, "error" when it fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as Fn  # noqa: E402

from moekit import reference  # noqa: E402
from moekit.ops._triton import activation as tri_act  # noqa: E402
from moekit.ops._triton import quantize as tri_q  # noqa: E402
from moekit.benchmarking import (  # noqa: E402
    bandwidth_columns,
    time_call as _time,
    COPY_TBPS,
    environment,
    markdown_table,
    rotations,
    save_rows,
    try_import_mslk,
)

FP8 = torch.float8_e4m3fn


def _mslk_ops() -> dict:
    ops: dict = {}
    if try_import_mslk() is None:
        return ops
    try:
        from mslk.moe.activation import silu_mul, silu_mul_quant  # type: ignore

        ops["silu_mul"], ops["silu_mul_quant"] = silu_mul, silu_mul_quant
    except Exception as e:  # noqa: BLE001
        print(f"MSLK activation ops unavailable: {type(e).__name__}: {e}")
    try:
        from mslk.quantize.triton.fp8_quantize import triton_quantize_fp8_row  # type: ignore

        ops["quantize_fp8_row"] = triton_quantize_fp8_row
    except Exception as e:  # noqa: BLE001
        print(f"MSLK triton_quantize_fp8_row unavailable: {type(e).__name__}: {e}")
    return ops


# --------------------------------------------------------------------------- plain PyTorch peers


def torch_silu_mul(x0, x1):
    return Fn.silu(x0) * x1


def torch_quant_rows(y, eps, scale_ub=None):
    amax = y.abs().amax(dim=-1).float().clamp(min=eps)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub)
    inv = 448.0 / amax
    q = (y.float() * inv.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8)
    return q, 1.0 / inv


def torch_silu_mul_quant(x0, x1):
    y = Fn.silu(x0.float()) * x1.float()
    return torch_quant_rows(y, 1e-12)


def torch_rms_norm(x, g, eps, r):
    v = x.float() + r.float()
    return Fn.rms_norm(v, (v.shape[-1],), g.float(), eps).to(x.dtype)


# --------------------------------------------------------------------------- cases


def _row(op, T, C, nbytes, ours, mslk, torch_us) -> dict:
    return {"op": op, "T": T, "F/K/H": C, **bandwidth_columns(nbytes, ours, mslk, torch_us)}


def _plans(label: str, **plans) -> None:
    """Print the launch plan moekit picks for a shape (tiles, stages, warps, persistent grid)."""
    for name, p in plans.items():
        print(f"  plan {name} {label}: " + ", ".join(f"{k}={v}" for k, v in p._asdict().items()))


def _check(ok: bool, what: str) -> None:
    if not ok:
        print(f"  WARNING: moekit {what} disagrees with moekit.reference / the PyTorch pipeline")


def bench_silu(T, F, mslk, rows):
    from moekit.ops.activation import silu_mul, silu_mul_quant

    in_bytes = T * 2 * F * 2
    n = rotations(in_bytes + T * F * 2)
    sets = [torch.randn(T, 2 * F, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    halves = lambda h: (h[:, :F], h[:, F:])  # noqa: E731

    x0, x1 = halves(sets[0])
    _check(torch.allclose(silu_mul(x0, x1).float(), torch_silu_mul(x0, x1).float(), rtol=2e-2, atol=1e-2), "silu_mul")
    q, s = silu_mul_quant(x0, x1)
    rq, rs = reference.silu_mul_quant(x0, x1)
    _check(torch.allclose(s, rs, rtol=1e-5) and (q.float() - rq.float()).abs().max().item() <= 32.0, "silu_mul_quant")

    def mk(fn):
        return lambda h: lambda: fn(*halves(h))

    _plans(
        f"T={T} F={F}",
        silu=tri_act.tile_config(T, F, 2, x0.device),
        quant=tri_act.silu_mul_quant_config(T, F, 2, x0.device),
    )
    nbytes = in_bytes + T * F * 2
    ours = _time(mk(silu_mul), sets)
    peer = _time(mk(mslk["silu_mul"]), sets) if "silu_mul" in mslk else None
    rows.append(_row("silu_mul", T, F, nbytes, ours, peer, _time(mk(torch_silu_mul), sets)))
    nbytes = in_bytes + T * F + 4 * T
    ours = _time(mk(silu_mul_quant), sets)
    peer = _time(mk(mslk["silu_mul_quant"]), sets) if "silu_mul_quant" in mslk else None
    rows.append(_row("silu_mul_quant", T, F, nbytes, ours, peer, _time(mk(torch_silu_mul_quant), sets)))


def bench_quant(T, K, mslk, rows):
    from moekit.ops.quantize import quantize_fp8_row

    in_bytes = T * K * 2
    sets = [torch.randn(T, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotations(in_bytes + T * K))]
    q, s = quantize_fp8_row(sets[0])
    rq, rs = reference.quantize_fp8_row(sets[0])
    _check(torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "quantize_fp8_row")

    def mk(fn):
        return lambda a: lambda: fn(a)

    _plans(f"T={T} K={K}", quantize=tri_q.quantize_config(T, K, 2, sets[0].device))
    ours = _time(mk(quantize_fp8_row), sets)
    peer = _time(mk(mslk["quantize_fp8_row"]), sets) if "quantize_fp8_row" in mslk else None
    tq = _time(mk(lambda a: torch_quant_rows(a, 1.0 / 512.0)), sets)
    rows.append(_row("quantize_fp8_row", T, K, in_bytes + T * K + 4 * T, ours, peer, tq))


def bench_norm(T, H, rows):
    from moekit.ops.norm import rms_norm

    per_set = 3 * T * H * 2
    n = rotations(per_set)
    sets = [
        (torch.randn(T, H, device="cuda", dtype=torch.bfloat16), torch.randn(T, H, device="cuda", dtype=torch.bfloat16))
        for _ in range(n)
    ]
    g = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    x, r = sets[0]
    _check(
        torch.allclose(rms_norm(x, g, 1e-6, r).float(), torch_rms_norm(x, g, 1e-6, r).float(), rtol=2e-2, atol=2e-2),
        "rms_norm",
    )

    def mk(fn):
        return lambda s: lambda: fn(s[0], g, 1e-6, s[1])

    ours = _time(mk(rms_norm), sets)
    rows.append(_row("rms_norm (+residual)", T, H, per_set + 2 * H, ours, None, _time(mk(torch_rms_norm), sets)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes (about a minute with compilation)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_activation: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    mslk = _mslk_ops()
    print(f"MSLK peers: {sorted(mslk) or 'none (mslk not importable)'}")
    if args.quick:
        Ts, Fs, norm_shapes = [1, 2048, 16384], [2048, 8192], [(1, 7168), (2048, 7168), (16384, 7168)]
    else:
        Ts, Fs = [1, 128, 2048, 4096, 16384], [1024, 2048, 8192]
        norm_shapes = [(T, H) for T in [1, 128, 2048, 16384] for H in [5120, 7168]]
    rows: list[dict] = []
    for F in Fs:
        for T in Ts:
            bench_silu(T, F, mslk, rows)
    for T in Ts:
        bench_quant(T, 5120, mslk, rows)
    for T, H in norm_shapes:
        bench_norm(T, H, rows)
    print()
    print(f"Activation / quantization ops, bf16, one GPU; floor = bytes / {COPY_TBPS} TB/s")
    print(markdown_table(rows))
    path = save_rows("bench_activation", rows, {**environment(), "quick": args.quick})
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
