#!/usr/bin/env python3
"""Benchmark: combine_shuffling / split_shuffling — moekit vs MSLK 1.1.0 vs plain PyTorch, side by
side in one process.

    python benchmarks/bench_shuffling.py [--quick]

Two layouts of the received buffer (D = 5120 bf16):

- dense (the dynamic EP path): ``token_counts [EP, EG]`` of this rank's EG local experts, T rows
  received in all, every one of them moved.
- padded (the static all-gather path): ``token_counts [EP, E]`` of all E = EG * EP experts, rank
  blocks of T rows each (the buffer holds EP * T rows), local experts ``[EG, 2 EG)``; about T rows
  belong to them and are moved.

TB/s counts the moved rows read + written (``2 * rows * D * 2`` bytes; split without
``init_with_zeros``, MSLK's default). Times are medians of CUDA-graph replays
(``moekit.benchmarking.bench_us``), inputs rotated past the L2 when one set fits in it. The torch
peer builds the row map with static-shape torch ops (``moekit.reference.shuffling``) and gathers
or scatters the rows. "vs MSLK" / "vs torch" are speedups (their µs / moekit µs); MSLK cells read
"refused" when it rejects the case, "error" when it fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# MSLK's autotuning results are kept on disk: a second run in the same machine session skips it.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
# MSLK's shuffling kernel trips a Triton deprecation warning on every compilation.
warnings.filterwarnings("ignore", message="Logical operators 'and' and 'or' are deprecated")

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
from moekit.reference.shuffling import shuffle_row_map  # noqa: E402

D = 5120
EG = 16  # local experts per rank


def _mslk_ops() -> dict:
    ops: dict = {}
    if try_import_mslk() is None:
        return ops
    try:
        from mslk.moe import shuffling as s  # type: ignore

        for name in ("combine_shuffling", "split_shuffling"):
            if hasattr(s, name):
                ops[name] = getattr(s, name)
    except Exception as e:  # noqa: BLE001
        print(f"MSLK shuffling unavailable: {type(e).__name__}: {e}")
    return ops


def _row(op, layout, EP, T, moved, ours, mslk, torch_us) -> dict:
    nbytes = 2 * moved * D * 2
    head = {"op": op, "layout": layout, "EP": EP, "T": T, "rows moved": moved}
    return {**head, **bandwidth_columns(nbytes, ours, mslk, torch_us)}


def _counts(rows_per_rank: int, EP: int, E: int, g: torch.Generator) -> torch.Tensor:
    """[EP, E] int32: each rank spreads rows_per_rank rows over E experts uniformly at random."""
    ids = torch.randint(0, E, (EP, rows_per_rank), generator=g)
    c = torch.zeros(EP, E, dtype=torch.int64).scatter_add_(1, ids, torch.ones_like(ids))
    return c.to(torch.int32)


def make_set(layout: str, EP: int, T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if layout == "dense":
        counts = _counts(T // EP, EP, EG, g)
        n_rows, start, end = T, None, None
    else:
        counts = _counts(T, EP, EG * EP, g)
        n_rows, start, end = EP * T, EG, 2 * EG
    tokens = torch.randn(n_rows, D, device="cuda", dtype=torch.bfloat16)
    counts = counts.cuda()
    _, _, co = shuffle_row_map(counts, n_rows, start, end, layout == "padded")
    moved = int(co[-1])
    combined = torch.randn(n_rows, D, device="cuda", dtype=torch.bfloat16)
    return {
        "tokens": tokens,
        "counts": counts,
        "start": start,
        "end": end,
        "padded": layout == "padded",
        "moved": moved,
        "combined": combined,
    }


def torch_combine(s):
    src, valid, counts_out = shuffle_row_map(s["counts"], s["tokens"].shape[0], s["start"], s["end"], s["padded"])
    return s["tokens"].index_select(0, src), counts_out


def torch_split(s):
    x = s["combined"]
    src, valid, _ = shuffle_row_map(s["counts"], x.shape[0], s["start"], s["end"], s["padded"])
    out = torch.empty_like(x)
    dst = torch.where(valid, src, x.shape[0] - 1)  # invalid rows rewrite the last row (harmless here)
    out.index_copy_(0, dst, x)
    return out


def bench_case(layout: str, EP: int, T: int, mslk: dict, rows: list) -> None:
    from moekit.ops.shuffling import combine_shuffling, split_shuffling

    probe = make_set(layout, EP, T, 0)
    n = rotations(2 * probe["moved"] * D * 2)
    sets = [probe] + [make_set(layout, EP, T, seed) for seed in range(1, n)]
    s0 = sets[0]
    moved = s0["moved"]

    o, c = combine_shuffling(s0["tokens"], s0["counts"], s0["start"], s0["end"], s0["padded"])
    ro, rc = reference.combine_shuffling(s0["tokens"], s0["counts"], s0["start"], s0["end"], s0["padded"])
    if not (torch.equal(c, rc.to(c.device)) and torch.equal(o[:moved], ro[:moved])):
        print("  WARNING: moekit combine_shuffling disagrees with moekit.reference")
    # Split as timed (no zero fill): compare the rank-major rows the local experts cover.
    back = split_shuffling(o, s0["counts"], s0["start"], s0["end"], s0["padded"], False)
    src, valid, _ = shuffle_row_map(s0["counts"], o.shape[0], s0["start"], s0["end"], s0["padded"])
    covered = src[valid]
    if not torch.equal(back[covered], s0["tokens"][covered]):
        print("  WARNING: moekit split_shuffling disagrees with moekit.reference")

    def mk_c(fn):
        return lambda s: lambda: fn(s["tokens"], s["counts"], s["start"], s["end"], s["padded"])

    def mk_s(fn):
        return lambda s: lambda: fn(s["combined"], s["counts"], s["start"], s["end"], s["padded"], False)

    ours = _time(mk_c(combine_shuffling), sets)
    peer = _time(mk_c(mslk["combine_shuffling"]), sets) if "combine_shuffling" in mslk else None
    rows.append(_row("combine", layout, EP, T, moved, ours, peer, _time(lambda s: lambda: torch_combine(s), sets)))
    ours = _time(mk_s(split_shuffling), sets)
    peer = _time(mk_s(mslk["split_shuffling"]), sets) if "split_shuffling" in mslk else None
    rows.append(_row("split", layout, EP, T, moved, ours, peer, _time(lambda s: lambda: torch_split(s), sets)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="EP in {2, 8}, T in {4096, 16384}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_shuffling: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    mslk = _mslk_ops()
    print(f"MSLK peers: {sorted(mslk) or 'none (mslk not importable)'}")
    EPs = [2, 8]
    Ts = [4096, 16384] if args.quick else [1024, 4096, 16384]
    rows: list[dict] = []
    for layout in ("dense", "padded"):
        for EP in EPs:
            for T in Ts:
                print(f"== {layout} EP={EP} T={T}", flush=True)
                bench_case(layout, EP, T, mslk, rows)
    print()
    print(f"EP shuffling, D={D} bf16, {EG} local experts, one GPU; floor = moved bytes / {COPY_TBPS} TB/s")
    print(markdown_table(rows))
    path = save_rows("bench_shuffling", rows, {**environment(), "quick": args.quick})
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s" + (f"; saved to {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
