#!/usr/bin/env python3
"""Benchmark: index_shuffling (fused top-k + count + sort) — moekit vs MSLK 1.1.0 vs plain PyTorch,
side by side in one process.

    python benchmarks/bench_routing.py [--quick] [--paths]
    python benchmarks/bench_routing.py --op shuffle_top_k [--quick]

Scores are ``[T, E]`` bf16 (tie-free random permutations, exact in bf16). Times are medians of
CUDA-graph replays (``moekit.benchmarking.bench_us``), inputs rotated past the L2 when one set
fits in it. Bytes = scores read + the three int32 outputs written; "% floor" = that traffic at
the measured 4.25 TB/s copy bandwidth over the measured time (for these µs-scale problems read it
as "launch-bound" rather than "bandwidth-bound"). "vs MSLK" / "vs torch" are speedups (their
µs / moekit µs). MSLK (``torch.ops.mslk.index_shuffling``) only takes E in {16, 32, 128, 320} and
top_k in {1, 2, 4}: other cells read "refused" (not called); "error" when a call fails.
torch = ``topk`` + stable ``argsort`` of the expert ids + per-expert counts (``scatter_add_``:
``bincount`` sizes its output on the host and cannot be captured in a CUDA graph).

``--op shuffle_top_k`` times ``moekit.ops.shuffle_top_k`` instead: a routing choice made elsewhere
(``top_k_index`` / ``top_k_weights [T, K]``, what transformers' routers return) turned into the sorted
rows, their weights and the inverse map, the output zeroed on the side (D=2048 bf16, as the
integration asks). torch = what transformers' ``grouped_mm`` experts path runs for the same layout
(``argsort`` of the flat ids, per-expert counts, the gathered weights, the inverse map, the zeroed
output). Every output is checked against ``moekit.reference.shuffle_top_k`` first.

``--paths`` adds a table that times every configuration of moekit's launcher per cell (single
program, 2 or 3 launches, pairwise or gather ranks) to tune the constants at the top of
``moekit/ops/_triton/routing.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from moekit.benchmarking import (  # noqa: E402
    number as _num,
    time_call as _time,
    COPY_TBPS,
    environment,
    floor_us,
    markdown_table,
    rotations,
    save_rows,
    try_import_mslk,
)

MSLK_E = (16, 32, 128, 320)
MSLK_K = (1, 2, 4)
CELLS = [(16, 1), (16, 2), (16, 4), (128, 1), (128, 2), (128, 4), (256, 8), (384, 8)]
# --paths: every launcher configuration (label, overrides of moekit's plan).
PATHS = [
    ("single", {"force": "single"}),
    ("multi 2-launch", {"force": "multi"}),
    ("multi 3-launch", {"force": "multi3"}),
    ("multi 2-launch gather-rank", {"force": "multi", "pairwise": False}),
    ("auto, one key tile", {"chunks": 1}),  # E=384: no 3-chunk keys (and 8 programs per SM)
]


def torch_index_shuffling(scores: torch.Tensor, k: int):
    """The plain PyTorch pipeline a user would write (graph-capturable: no bincount)."""
    T, E = scores.shape
    ids = torch.topk(scores, k, dim=1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=scores.device).scatter_add_(0, ids, torch.ones_like(ids))
    return counts, ids[order], order // k


def _scores(T: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)
    return ((128 + p % 128).float() * torch.pow(2.0, (p // 128).float() - 16)).to(torch.bfloat16)


def bench_cell(T, E, K, has_mslk, rows, path_rows):
    from moekit import reference as ref
    from moekit.ops._triton import routing as tri
    from moekit.ops.routing import index_shuffling

    nbytes = T * E * 2 + (E + 2 + 2 * T * K) * 4
    sets = [_scores(T, E, seed=i) for i in range(rotations(nbytes))]

    # Correctness: exact against the reference; MSLK's counts (its in-expert order is arbitrary).
    got = index_shuffling(sets[0], top_k=K)
    want = ref.index_shuffling(sets[0].cpu(), top_k=K)
    ok = all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    if not ok:
        print(f"  WARNING: moekit disagrees with the reference at T={T} E={E} K={K}")

    ours = _time(lambda s: lambda: index_shuffling(s, top_k=K), sets)
    if not has_mslk:
        peer = None
    elif E not in MSLK_E or K not in MSLK_K:
        peer = "refused"
    else:
        try:
            mc = torch.ops.mslk.index_shuffling(sets[0], top_k=K)[0]
            torch.cuda.synchronize()
            if not torch.equal(mc[: E + 2].to(torch.int32).cpu(), want[0]):
                print(f"  note: MSLK counts differ from the reference at T={T} E={E} K={K}")
        except Exception as e:  # noqa: BLE001
            print(f"  MSLK check call failed: {type(e).__name__}: {str(e)[:160]}")
        peer = _time(lambda s: lambda: torch.ops.mslk.index_shuffling(s, top_k=K), sets)
    t_torch = _time(lambda s: lambda: torch_index_shuffling(s, K), sets)

    p = tri.plan(T, E, K, torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count)
    fl = floor_us(nbytes)
    plan = f"{p.path}/{p.launches}" + (f" x{p.programs}" if p.path == "multi" else "")
    plan += " c3" if p.chunks == 3 else ""
    row = {"T": T, "E": E, "top_k": K, "plan": plan, "exact": ok, "moekit µs": ours}
    if _num(ours):
        row["TB/s"] = nbytes / ours / 1e6
        row["% floor"] = 100.0 * fl / ours
    row["MSLK µs"] = peer
    row["torch µs"] = t_torch
    if _num(ours) and _num(peer):
        row["vs MSLK"] = peer / ours
    if _num(ours) and _num(t_torch):
        row["vs torch"] = t_torch / ours
    rows.append(row)
    print(f"  T={T:6d} E={E:4d} K={K:2d}: moekit {ours} µs ({row['plan']}), MSLK {peer}, torch {t_torch}", flush=True)

    if path_rows is not None:
        prow = {"T": T, "E": E, "top_k": K, "auto": row["plan"], "auto µs": ours}
        for label, kw in PATHS:
            if kw.get("force") == "single" and T * E > 32768:
                prow[label] = "—"
                continue
            prow[label] = _time(lambda s, kw=kw: lambda: tri.index_shuffling(s, top_k=K, **kw), sets)
        path_rows.append(prow)


def torch_shuffle_top_k(ids: torch.Tensor, w: torch.Tensor, E: int, out: torch.Tensor):
    """The rows of a given top-k choice in plain PyTorch (graph-capturable)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    out.zero_()
    return counts, flat[order], order // ids.shape[1], w.reshape(-1)[order].float(), inv


def bench_shuffle_top_k_cell(T, E, K, rows, D: int = 2048):
    from moekit import reference as ref
    from moekit.ops.routing import shuffle_top_k

    g = torch.Generator(device="cuda").manual_seed(T * 1000 + E + K)
    nbytes = T * K * (4 + 2) + (E + 2 + 4 * T * K) * 4 + T * D * 2
    sets = []
    for i in range(rotations(nbytes)):
        ids = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K].to(torch.int64)
        w = torch.rand(T, K, device="cuda", generator=g).to(torch.bfloat16)
        sets.append((ids, w, torch.empty(T, D, device="cuda", dtype=torch.bfloat16)))
    ids, w, out = sets[0]
    got = shuffle_top_k(ids, w, E, zero_buffer=out)
    want = ref.shuffle_top_k(ids.cpu(), w.cpu(), E)
    ok = all(torch.equal(a.cpu(), b) for a, b in zip(got, want)) and bool((out == 0).all())
    if not ok:
        print(f"  WARNING: shuffle_top_k disagrees with the reference at T={T} E={E} K={K}")
    ours = _time(lambda s: lambda: shuffle_top_k(s[0], s[1], E, zero_buffer=s[2]), sets)
    t_torch = _time(lambda s: lambda: torch_shuffle_top_k(s[0], s[1], E, s[2]), sets)
    row = {"T": T, "E": E, "top_k": K, "exact": ok, "moekit µs": ours, "floor µs": floor_us(nbytes)}
    if _num(ours):
        row["% floor"] = 100.0 * row["floor µs"] / ours
    row["torch µs"] = t_torch
    if _num(ours) and _num(t_torch):
        row["vs torch"] = t_torch / ours
    rows.append(row)
    print(f"  T={T:6d} E={E:4d} K={K:2d}: moekit {ours} µs, torch {t_torch}", flush=True)


def summary(rows) -> list[str]:
    out = []
    by = {(r["T"], r["E"], r["top_k"]): r for r in rows}
    for r in rows:
        if r["T"] == 1 and _num(r["moekit µs"]):
            flag = "OK" if r["moekit µs"] < 8.0 else "MISS"
            out.append(f"T=1 E={r['E']} k={r['top_k']}: {r['moekit µs']:.2f} µs (target < 8 µs: {flag})")
    for r in rows:
        if _num(r.get("vs MSLK")) and r["vs MSLK"] < 1.0:
            out.append(f"slower than MSLK at T={r['T']} E={r['E']} k={r['top_k']}: x{r['vs MSLK']:.2f}")
    for T in sorted({r["T"] for r in rows}):
        base = by.get((T, 128, 4))
        for E in (256, 384):
            r = by.get((T, E, 8))
            if base and r and _num(base["moekit µs"]) and _num(r["moekit µs"]):
                q = r["moekit µs"] / base["moekit µs"]
                verdict = "OK" if q <= 2 else "MISS"
                out.append(f"T={T}: E={E}/k=8 takes {q:.2f}x the E=128/k=4 time (target <= 2x: {verdict})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cells (about a minute with compilation)")
    ap.add_argument("--paths", action="store_true", help="also time every moekit path per cell (tuning)")
    ap.add_argument("--op", choices=("index_shuffling", "shuffle_top_k"), default="index_shuffling")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_routing: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    if args.op == "shuffle_top_k":
        rows = []
        cells = [(128, 8), (8, 2), (256, 8), (128, 4)] if not args.quick else [(128, 8), (8, 2)]
        for E, K in cells:
            for T in (1, 16, 128, 512, 2048, 16384):
                bench_shuffle_top_k_cell(T, E, K, rows)
        print(f"\nshuffle_top_k (+ zeroing a [T, 2048] bf16 output), one GPU; floor = bytes / {COPY_TBPS} TB/s")
        print(markdown_table(rows))
        path = save_rows("bench_shuffle_top_k", rows, {**environment(), "quick": args.quick})
        print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
        return 0
    has_mslk = try_import_mslk() is not None and hasattr(torch.ops.mslk, "index_shuffling")
    print(f"MSLK index_shuffling: {'available' if has_mslk else 'not importable'}")
    Ts = [1, 128, 2048, 16384]
    cells = [(16, 1), (16, 4), (128, 1), (128, 4), (256, 8), (384, 8)] if args.quick else CELLS
    rows: list[dict] = []
    path_rows: list[dict] | None = [] if args.paths else None
    for E, K in cells:
        for T in Ts:
            bench_cell(T, E, K, has_mslk, rows, path_rows)
    print()
    print(f"index_shuffling, bf16 scores, one GPU; floor = bytes / {COPY_TBPS} TB/s")
    print(markdown_table(rows))
    print()
    for line in summary(rows):
        print(line)
    if path_rows:
        print("\nmoekit paths (µs): auto plan vs each forced configuration")
        print(markdown_table(path_rows))
    meta = {**environment(), "quick": args.quick}
    path = save_rows("bench_routing", rows + [{"paths": r} for r in (path_rows or [])], meta)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
