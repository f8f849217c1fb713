#!/usr/bin/env python3
"""``route_and_shuffle``'s split path (router logits -> sorted rows, more than 8 tokens) under
alternative launch shapes: a tuning aid for the constants at the top of
``moekit/ops/_triton/route.py``.

    python benchmarks/sweep_route.py [--models qwen3-30b-a3b,deepseek-v3-tp8] [--tokens 256,8192]

Per (model, T), µs per call (CUDA graphs, medians, logits rotated past L2):
- ``auto``: the launcher's own ``split_plan``;
- ``composite``: dense scores with torch ops, then ``index_shuffling`` (what batches past the
  kernels take);
- one column per ``tile/warps/blocks``: ``ROUTE_SPLIT_TILE`` elements per sub-tile, at most
  ``ROUTE_SPLIT_WARPS`` warps, ``SPLIT_MAX_BLOCKS`` blocks (pinned knobs).
Every configuration's outputs are checked bitwise against ``auto``'s first.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

TILES = (512, 1024, 2048)
WARPS = (1, 2, 4, 8)
BLOCKS = (256, 1024)


def _call(s, logits):
    from moekit.ops import route_and_shuffle

    return route_and_shuffle(
        logits, s.top_k, s.score_func, s.renormalize, n_group=s.n_group, topk_group=s.topk_group,
        routed_scaling_factor=s.routed_scaling_factor,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout")
    ap.add_argument("--tokens", default="64,256,1024,2048,8192,16384")
    ap.add_argument("--quick", action="store_true", help="fewer alternatives (tiles 1024/2048, warps 1/2/8)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_route needs CUDA; nothing to do on this machine")
        return 0
    from moekit import settings
    from moekit.benchmarking import bench_us, markdown_table, save_rows
    from moekit.ops._triton import route as R
    from moekit.testing import MODEL_SHAPES

    tiles, warps = ((1024, 2048), (1, 2, 8)) if a.quick else (TILES, WARPS)
    rows = []
    for m in a.models.split(","):
        s = MODEL_SHAPES[m]
        for T in (int(t) for t in a.tokens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(T)
            sets = [torch.randn(T, s.E, generator=g, device="cuda") for _ in range(4)]
            p = R.split_plan(T, s.E, s.top_k)
            row = {"model": m, "T": T, "plan": f"bt{p.bt} tpb{p.tpb} n{p.n} w{p.warps} {'f' if p.fused_scan else 's'}"}
            want = _call(s, sets[0])
            row["auto"] = bench_us([lambda x=x: _call(s, x) for x in sets], replays=10)
            real = R.kernel_supports
            R.kernel_supports = lambda *args: False
            try:
                row["composite"] = bench_us([lambda x=x: _call(s, x) for x in sets], replays=10)
            finally:
                R.kernel_supports = real
            for tile in tiles:
                for w in warps:
                    if w * 256 > tile:
                        continue
                    for nb in BLOCKS:
                        knobs = {"ROUTE_SPLIT_TILE": tile, "ROUTE_SPLIT_WARPS": w, "SPLIT_MAX_BLOCKS": nb}
                        with settings.override(knobs=knobs):
                            got = _call(s, sets[0])
                            same = all(torch.equal(u, v) for u, v in zip(got, want))
                            key = f"{tile}/{w}/{nb}"
                            row[key] = bench_us([lambda x=x: _call(s, x) for x in sets], replays=10) if same else "DIFF"
            print(row, flush=True)
            rows.append(row)
    print(markdown_table(rows))
    save_rows("sweep_route", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
