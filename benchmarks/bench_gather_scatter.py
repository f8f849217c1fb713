#!/usr/bin/env python3
"""Benchmark: gather_scale_dense_tokens, gather_scale_quant_dense_tokens, scatter_add_dense_tokens
(default and deterministic) — moekit vs MSLK 1.1.0 vs plain PyTorch, side by side in one process.

    python benchmarks/bench_gather_scatter.py [--quick]

Routing: sigmoid scores ``[T, E]`` bf16 of random logits, rows grouped by expert with
``moekit.reference.index_shuffling`` (int32 indices, as MSLK's layer feeds them). D = 5120, bf16.
Times are medians of CUDA-graph replays (``moekit.benchmarking.bench_us``), inputs rotated past the
L2 when one set fits in it. TB/s counts bytes read + written: gather reads and writes ``a = T*K``
rows (quant writes 1-byte values + a float scale per row); scatter-add reads the ``a`` input rows
and reads and writes the ``T`` output rows. "% floor" is the time at the measured 4.25 TB/s copy
bandwidth over the measured time; "vs MSLK" / "vs torch" are speedups (their µs / moekit µs).
MSLK cells read "refused" when it rejects the shape, "error" when it fails. The deterministic
scatter-add has no MSLK counterpart: its "vs MSLK" compares it with MSLK's atomic kernel. The default
scatter-add uses atomics for top-1 and few rows, the deterministic sum for top-k > 1 (faster there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# MSLK's autotuning results are kept on disk: a second run in the same machine session skips it.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import torch  # noqa: E402

from moekit import reference  # noqa: E402
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
D = 5120


def _mslk_ops() -> dict:
    ops: dict = {}
    if try_import_mslk() is None:
        return ops
    try:
        from mslk.moe import gather_scatter as g  # type: ignore

        for name in ("gather_scale_dense_tokens", "gather_scale_quant_dense_tokens", "scatter_add_dense_tokens"):
            if hasattr(g, name):
                ops[name] = getattr(g, name)
    except Exception as e:  # noqa: BLE001
        print(f"MSLK gather_scatter unavailable: {type(e).__name__}: {e}")
    return ops


def _row(op, T, E, K, nbytes, ours, mslk, torch_us) -> dict:
    return {"op": op, "T": T, "E": E, "K": K, **bandwidth_columns(nbytes, ours, mslk, torch_us)}


def _warn(ok: bool, what: str) -> None:
    if not ok:
        print(f"  WARNING: moekit {what} disagrees with moekit.reference")


def make_set(T: int, E: int, K: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.sigmoid(torch.randn(T, E, device="cuda", generator=g)).to(torch.bfloat16)
    _, eidx, tidx = reference.index_shuffling(scores, top_k=K)
    rows = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return {"x": x, "scores": scores, "eidx": eidx, "tidx": tidx, "rows": rows, "out": out}


# --------------------------------------------------------------------------- plain PyTorch peers


def torch_gather_scale(s):
    t, e = s["tidx"].long(), s["eidx"].long()
    return (s["x"].index_select(0, t).float() * s["scores"][t, e].float().unsqueeze(1)).to(torch.bfloat16)


def torch_gather_scale_quant(s):
    t, e = s["tidx"].long(), s["eidx"].long()
    y = s["x"].index_select(0, t).float() * s["scores"][t, e].float().unsqueeze(1)
    amax = y.abs().amax(dim=1).clamp(min=1e-12)
    inv = 448.0 / amax
    return (y * inv.unsqueeze(1)).clamp(-448.0, 448.0).to(FP8), 1.0 / inv


def torch_scatter_add(s):
    return s["out"].index_add_(0, s["tidx"].long(), s["rows"])


# --------------------------------------------------------------------------- cases


def bench_case(T: int, E: int, K: int, mslk: dict, rows: list, scatter_only: bool = False) -> None:
    from moekit.ops import gather_scatter as ops

    a = T * K
    g_bytes = 2 * a * D * 2 + a * 10
    q_bytes = a * D * 2 + a * D + a * 4 + a * 10
    s_bytes = a * D * 2 + 2 * T * D * 2 + a * 4
    n = rotations(max(g_bytes, s_bytes))
    sets = [make_set(T, E, K, seed) for seed in range(n)]
    s0 = sets[0]

    if not scatter_only:
        got = ops.gather_scale_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
        want = reference.gather_scale_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
        _warn(torch.equal(got, want), "gather_scale_dense_tokens")
        q, sc = ops.gather_scale_quant_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
        rq, rs = reference.gather_scale_quant_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
        _warn(
            torch.allclose(sc, rs, rtol=1e-6, atol=0) and (q.float() - rq.float()).abs().max().item() <= 32.0,
            "gather_scale_quant_dense_tokens",
        )

        def mk_g(fn):
            return lambda s: lambda: fn(s["x"], s["tidx"], s["eidx"], s["scores"])

        ours = _time(mk_g(ops.gather_scale_dense_tokens), sets)
        peer = _time(mk_g(mslk["gather_scale_dense_tokens"]), sets) if "gather_scale_dense_tokens" in mslk else None
        rows.append(
            _row("gather_scale", T, E, K, g_bytes, ours, peer, _time(lambda s: lambda: torch_gather_scale(s), sets))
        )

        ours = _time(mk_g(ops.gather_scale_quant_dense_tokens), sets)
        name = "gather_scale_quant_dense_tokens"
        peer = _time(mk_g(mslk[name]), sets) if name in mslk else None
        tq = _time(lambda s: lambda: torch_gather_scale_quant(s), sets)
        rows.append(_row("gather_scale_quant", T, E, K, q_bytes, ours, peer, tq))

    # scatter-add: check on copies, then time in place (the outputs just keep accumulating).
    o1, o2, o3 = s0["out"].clone(), s0["out"].clone(), s0["out"].clone()
    ops.scatter_add_dense_tokens(o1, s0["rows"], s0["tidx"])
    ops.scatter_add_dense_tokens(o2, s0["rows"], s0["tidx"], deterministic=True)
    reference.scatter_add_dense_tokens(o3, s0["rows"], s0["tidx"])
    _warn((o1.float() - o3.float()).norm().item() <= 1e-2 * o3.float().norm().item(), "scatter_add_dense_tokens")
    _warn(
        (o2.float() - o3.float()).norm().item() <= 1e-2 * o3.float().norm().item(),
        "scatter_add_dense_tokens(deterministic=True)",
    )

    def mk_s(fn, **kw):
        return lambda s: lambda: fn(s["out"], s["rows"], s["tidx"], **kw)

    tsc = _time(lambda s: lambda: torch_scatter_add(s), sets)
    peer = _time(mk_s(mslk["scatter_add_dense_tokens"]), sets) if "scatter_add_dense_tokens" in mslk else None
    ours = _time(mk_s(ops.scatter_add_dense_tokens), sets)
    rows.append(_row("scatter_add (default)", T, E, K, s_bytes, ours, peer, tsc))
    ours = _time(mk_s(ops.scatter_add_dense_tokens, deterministic=True), sets)
    rows.append(_row("scatter_add (deterministic)", T, E, K, s_bytes, ours, peer, tsc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="E in {16, 128}, T in {1, 2048, 16384} (about a minute)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gather_scatter: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    mslk = _mslk_ops()
    print(f"MSLK peers: {sorted(mslk) or 'none (mslk not importable)'}")
    Ts = [1, 2048, 16384] if args.quick else [1, 128, 2048, 4096, 16384]
    Es = [16, 128]
    rows: list[dict] = []
    for E in Es:
        for T in Ts:
            print(f"== E={E} T={T}", flush=True)
            bench_case(T, E, 1, mslk, rows)
            bench_case(T, E, 4, mslk, rows, scatter_only=True)
    print()
    print(f"Gather / scatter, D={D} bf16, one GPU; floor = bytes / {COPY_TBPS} TB/s")
    print(markdown_table(rows))
    path = save_rows("bench_gather_scatter", rows, {**environment(), "quick": args.quick})
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
