#!/usr/bin/env python3
"""The sorted pipeline's gate/up stage at prefill sizes, fused or not, and the fused kernel's tile
alternatives: a tuning aid for ``grouped_gemm_swiglu``'s persistent tiled kernel.

    python benchmarks/sweep_swiglu.py [--models qwen3-30b-a3b,deepseek-v3-tp8] [--tokens 2048,8192]
        [--dtype bf16,fp8]

Per (model, T, dtype), µs per call (CUDA graphs, medians, inputs rotated past L2):
- ``unfused``: gather (+ FP8 row quantization) -> grouped GEMM gate|up -> ``silu_mul`` (+ quant);
- ``auto``: ``grouped_gemm_swiglu`` reading the token rows by index with its chosen tile (FP8: the
  token rows quantized first, the SwiGLU output after, as ``run_experts`` does);
- ``gathered``: gather (+ FP8 quantization) -> ``grouped_gemm_swiglu`` on the gathered rows (row
  tiles through TMA; FP8: the SwiGLU output quantized after), ``run_experts``' path where
  ``experts._gathered_swiglu`` takes it;
- one column per alternative tile ``BMxBN sS`` of the fused kernel (``fused``: its tile loop fused
  into the K loop; ``pair`` / ``two``: knob ``SWIGLU_PAIR`` pinned on / off, the gate and up rows in
  one load and MMA or two; ``--tiles`` / ``--pairs`` pick the alternatives), and where ``auto`` streams, per streaming alternative
  ``stream BMxBNxBK sS``;
- ``kernel_us`` / ``tma_kernel_us`` / ``gemm_us``: the kernels alone (FP8 rows quantized
  beforehand, no output quantization): ``grouped_gemm_swiglu`` reading the token rows by index,
  the same on the rows gathered beforehand (row tiles through TMA), and the plain grouped GEMM
  ``[M, 2F]`` on the gathered rows (no SiLU); ``*_tflops`` their rate. What the rows by pointer
  cost against TMA rows, and the fused epilogue against the plain GEMM, on the same shape;
- ``worst_rel``: the alternatives' largest deviation from ``auto``'s output (max abs over max abs,
  the routed rows of the first input set): a tile that computes something else shows here.
Routing: uniform random top-k (the benchmark's models' shapes).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

# Streaming alternatives where ``auto`` streams (few rows per expert; DeepSeek-V3 TP8 at T=1024 has
# 32): (columns, K slice for bf16 (FP8: twice), stages), rows as ``auto``. ``auto``'s two weight
# tiles per stage leave it 2 stages at 128 columns.
STREAM = [(128, 64, 2), (128, 32, 4), (64, 64, 4), (64, 64, 6), (64, 128, 3), (32, 64, 6), (32, 128, 4)]
# (rows, columns, stages, fused tile + K loop)
TILES = [(64, 128, 4, False), (128, 64, 4, False), (128, 128, 3, False), (64, 64, 4, False), (128, 128, 2, False),
         (128, 128, 3, True), (128, 128, 2, True), (64, 128, 4, True)]  # fmt: skip


def _parse_tile(text: str) -> tuple:
    """``BMxBN[xBK]sS[f]`` -> (rows, columns, K tile or 0 for the dtype's, stages, fused loop)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?s(\d+)(f?)", text.strip())
    if m is None:
        raise SystemExit(f"--tiles: expected entries like 128x128s3f or 128x128x256s2, got {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0), int(m[4]), bool(m[5])


def _case(model: str, T: int, fp8: bool, seed: int = 0) -> dict:
    from moekit.layers.functional import quantize_expert_weights
    from moekit.ops import route_and_shuffle
    from moekit.testing import MODEL_SHAPES

    s = MODEL_SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(s.E, 2 * s.F, s.D, generator=g, device="cuda") / s.D**0.5).bfloat16()
    ws = None
    if fp8:
        w13, ws = quantize_expert_weights(w13)
    sets = []
    for i in range(2):
        x = torch.randn(T, s.D, generator=g, device="cuda").bfloat16()
        logits = torch.randn(T, s.E, generator=g, device="cuda")
        counts, eidx, tidx, rw, _ = route_and_shuffle(logits, s.top_k, "softmax", True)
        sets.append(dict(x=x, ms=counts[: s.E], eidx=eidx, tidx=tidx))
    return dict(s=s, w13=w13.reshape(-1, s.D), ws=None if ws is None else ws.reshape(-1), sets=sets, fp8=fp8)


def _unfused(c: dict, st: dict):
    from moekit.ops import (
        gather_scale_dense_tokens,
        gather_scale_quant_dense_tokens,
        grouped_gemm,
        grouped_gemm_fp8_rowwise,
        silu_mul,
        silu_mul_quant,
    )

    F = c["s"].F
    ones = torch.ones((1, 1), dtype=torch.float32, device="cuda").expand(st["x"].shape[0], c["s"].E)
    if c["fp8"]:
        xq, xs = gather_scale_quant_dense_tokens(st["x"], st["tidx"], st["eidx"], ones)
        h = grouped_gemm_fp8_rowwise(xq, c["w13"], st["ms"], xs, c["ws"])
        return silu_mul_quant(h[:, :F], h[:, F:])
    xg = gather_scale_dense_tokens(st["x"], st["tidx"], st["eidx"], ones)
    h = grouped_gemm(xg, c["w13"], st["ms"])
    return silu_mul(h[:, :F], h[:, F:])


def _gathered(c: dict, st: dict):
    from moekit.ops import gather_scale_dense_tokens, gather_scale_quant_dense_tokens, quantize_fp8_row
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu

    ones = torch.ones((1, 1), dtype=torch.float32, device="cuda").expand(st["x"].shape[0], c["s"].E)
    if c["fp8"]:
        xq, xs = gather_scale_quant_dense_tokens(st["x"], st["tidx"], st["eidx"], ones)
        return quantize_fp8_row(grouped_gemm_swiglu(xq, c["w13"], st["ms"], None, None, xs, c["ws"]))
    xg = gather_scale_dense_tokens(st["x"], st["tidx"], st["eidx"], ones)
    return grouped_gemm_swiglu(xg, c["w13"], st["ms"], None, None, None, None)


def _fused(c: dict, st: dict, config=None):
    from moekit.ops import quantize_fp8_row
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu

    if c["fp8"]:
        xq, xs = quantize_fp8_row(st["x"])
        z = grouped_gemm_swiglu(xq, c["w13"], st["ms"], st["tidx"], None, xs, c["ws"], config=config)
        return quantize_fp8_row(z)
    return grouped_gemm_swiglu(st["x"], c["w13"], st["ms"], st["tidx"], None, None, None, config=config)


def _kernels(c: dict) -> dict:
    """The three kernels alone on each input set's rows (inputs prepared outside the timing)."""
    from moekit.ops import gather_scale_dense_tokens, grouped_gemm, grouped_gemm_fp8_rowwise, quantize_fp8_row
    from moekit.ops._triton.gg_swiglu import grouped_gemm_swiglu

    s, out = c["s"], {}
    preps = []
    for st in c["sets"]:
        ones = torch.ones((1, 1), dtype=torch.float32, device="cuda").expand(st["x"].shape[0], s.E)
        xg = gather_scale_dense_tokens(st["x"], st["tidx"], st["eidx"], ones)
        if c["fp8"]:
            xq, xs = quantize_fp8_row(st["x"])
            xgq, xgs = quantize_fp8_row(xg)
            preps.append(dict(st=st, x=xq, xs=xs, xg=xgq, xgs=xgs))
        else:
            preps.append(dict(st=st, x=st["x"], xs=None, xg=xg, xgs=None))
    ws = c["ws"]

    def by_index(p):
        return grouped_gemm_swiglu(p["x"], c["w13"], p["st"]["ms"], p["st"]["tidx"], None, p["xs"], ws)

    def tma_rows(p):
        return grouped_gemm_swiglu(p["xg"], c["w13"], p["st"]["ms"], None, None, p["xgs"], ws)

    def gemm(p):
        if c["fp8"]:
            return grouped_gemm_fp8_rowwise(p["xg"], c["w13"], p["st"]["ms"], p["xgs"], ws)
        return grouped_gemm(p["xg"], c["w13"], p["st"]["ms"])

    from moekit.benchmarking import bench_us

    flops = 2.0 * int(c["sets"][0]["tidx"].shape[0]) * 2 * s.F * s.D
    for name, fn in (("kernel", by_index), ("tma_kernel", tma_rows), ("gemm", gemm)):
        us = bench_us([lambda p=p: fn(p) for p in preps], replays=10)
        out[f"{name}_us"] = us
        out[f"{name}_tflops"] = round(flops / us / 1e6, 1) if isinstance(us, float) and us > 0 else None
    return out


def _z(out) -> torch.Tensor:
    """The SwiGLU output as float32 (FP8: dequantized)."""
    if isinstance(out, tuple):
        q, scale = out
        return q.float() * scale.float().reshape(-1, 1)
    return out.float()


def _valid(st: dict) -> torch.Tensor:
    """Rows that hold a routed token (the tail past the routed rows is left unwritten)."""
    return torch.arange(st["tidx"].shape[0], device=st["tidx"].device) < st["ms"].sum()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh; no effect")
    ap.add_argument(
        "--no-alts", action="store_true", help="skip the tile alternatives (the stage and kernel columns only)"
    )
    ap.add_argument(
        "--tiles",
        default="",
        help="tiled alternatives instead of the built-in list: BMxBN[xBK]sS[f] entries, comma-separated "
        "(BK defaults to 128 for FP8, 64 for bf16; f: tile loop fused into the K loop), e.g. 128x128s3f,128x128x256s2",
    )
    ap.add_argument("--pairs", default="two,pair", help="SWIGLU_PAIR per tiled alternative: two, pair or both")
    a = ap.parse_args()
    tiles = [_parse_tile(t) for t in a.tiles.split(",") if t] or [(bm, bn, 0, st, fl) for bm, bn, st, fl in TILES]
    pairs = [{"two": False, "pair": True}[p] for p in a.pairs.split(",") if p]
    if not torch.cuda.is_available():
        print("sweep_swiglu needs CUDA; nothing to do on this machine")
        return 0
    from moekit import settings
    from moekit.benchmarking import bench_us, markdown_table, save_rows
    from moekit.ops._common import num_sms
    from moekit.ops._triton.gg_config import GemmConfig
    from moekit.ops._triton.gg_swiglu import swiglu_config

    rows = []
    for dt in a.dtype.split(","):
        for m in a.models.split(","):
            for T in (int(t) for t in a.tokens.split(",")):
                fp8 = dt == "fp8"
                c = _case(m, T, fp8)
                s = c["s"]
                M = T * s.top_k
                cfg = swiglu_config(
                    M, s.F, s.D, s.E, fp8, 1 if fp8 else 2, num_sms(torch.device("cuda")), 1 if fp8 else 2
                )
                row = {
                    "model": m,
                    "T": T,
                    "dtype": dt,
                    "auto": f"{cfg.kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.stages}",
                }
                row["unfused_us"] = bench_us([lambda st=st: _unfused(c, st) for st in c["sets"]], replays=10)
                row["fused_us"] = bench_us([lambda st=st: _fused(c, st) for st in c["sets"]], replays=10)
                row["gathered_us"] = bench_us([lambda st=st: _gathered(c, st) for st in c["sets"]], replays=10)
                row.update(_kernels(c))
                alts = [
                    (f"{bm}x{bn}{f'x{bk}' if bk else ''} s{stages}{' fused' if flatten else ''} "
                     f"{'pair' if pair else 'two'}",
                     GemmConfig("tiled", bm, bn, bk or (128 if fp8 else 64), stages, 8 if bm * bn >= 128 * 64 else 4,
                                flatten=flatten),
                     {"SWIGLU_PAIR": pair})
                    for bm, bn, bk, stages, flatten in ([] if a.no_alts else tiles) for pair in pairs
                ]  # fmt: skip
                if cfg.kind == "stream" and not a.no_alts:
                    for bn, sk, stages in STREAM:
                        k = sk * (2 if fp8 else 1)
                        warps = 8 if bn * cfg.block_m >= 128 * 128 else 4
                        alts.append((f"stream {cfg.block_m}x{bn}x{k} s{stages}",
                                     GemmConfig("stream", cfg.block_m, bn, k, stages, warps), {}))  # fmt: skip
                st0 = c["sets"][0]
                want = _z(_fused(c, st0))
                ok = _valid(st0)
                row["worst_rel"] = 0.0  # the alternatives' largest deviation from auto's z (valid rows)
                for name, alt, knobs in alts:
                    try:
                        with settings.override(knobs=knobs):
                            got = _z(_fused(c, st0, alt))
                            err = ((got[ok] - want[ok]).abs().max() / want[ok].abs().max().clamp_min(1e-30)).item()
                            row["worst_rel"] = max(row["worst_rel"], err)
                            row[name] = bench_us([lambda st=st: _fused(c, st, alt) for st in c["sets"]], replays=10)
                    except Exception as exc:  # a tile that does not fit: keep the others
                        row[name] = f"{type(exc).__name__}"
                del want, ok, st0, alts
                c.clear()
                gc.collect()
                torch.cuda.empty_cache()
                # What the case left allocated: 5-35 GiB before session 31's fix of direct launcher
                # calls (torch's kernel side table kept every TMA descriptor and its rows), 0 since.
                row["gib_after"] = round(torch.cuda.memory_allocated() / 2**30, 2)
                print(row, flush=True)
                rows.append(row)
    print(markdown_table(rows))
    save_rows("sweep_swiglu", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
