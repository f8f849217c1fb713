#!/usr/bin/env python3
"""How much of the tensor-core tiles' rows carry real routed rows: for each model and batch size,
the tiled GEMM stages the sorted pipeline runs (``grouped_gemm_swiglu``'s tiled kernel for the fused
gate/up projection where the layer fuses it, else ``grouped_gemm``'s, and the down projection's), the row tile the
launchers' rules pick and the share of its rows that hold routed rows on a uniform top-k routing
(each expert's last row tile is partly empty), beside what 32-, 64- and 128-row tiles would give.
CPU only: the rules and a random routing, no kernel runs.

    python scripts/tile_use.py [--models qwen3-30b-a3b,...] [--tokens 1024,2048,8192] [--seed 0] [--traffic]

``--traffic``: instead, the bytes the down projection's tiles read into the SMs (each weight tile
once per row tile of its expert, each row tile once per column tile; whole tiles, as TMA loads
them) on 64 x 256 and 128 x 256 tiles, FP8 and bf16 (session 47; the 128-row tiles read 0.71x
at 128 rows per expert but did not run faster, session 48).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from moekit.layers.experts import _fused_swiglu  # noqa: E402
from moekit.ops._triton.gg_config import heuristic_config  # noqa: E402
from moekit.ops._triton.gg_swiglu import swiglu_config  # noqa: E402
from moekit.testing.data import MODEL_SHAPES  # noqa: E402

SMS = 132  # H100 / H200
TILE_ROWS = (32, 64, 128)


def expert_rows(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    """Rows per expert of a uniform top-k routing of T tokens (k distinct experts per token)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(T, E, generator=g).topk(k, dim=1).indices.flatten()
    return torch.bincount(picks, minlength=E)


def row_use(rows: torch.Tensor, block_m: int) -> float:
    """Routed rows over the rows of the row tiles that hold them."""
    tiles = (rows + block_m - 1) // block_m
    return float(rows.sum()) / max(1, int(tiles.sum()) * block_m)


def tile_bytes(rows: torch.Tensor, N: int, K: int, block_m: int, block_n: int, elem: int) -> int:
    """Bytes a tiled GEMM's tiles read into the SMs for these rows per expert: every row tile of
    an expert reads the expert's whole ``[N, K]`` weights (its column tiles), every column tile
    reads the ``block_m`` rows of each row tile (TMA boxes: whole tiles, past the expert's rows)."""
    row_tiles = int(((rows + block_m - 1) // block_m).sum())
    col_tiles = -(-N // block_n)
    return row_tiles * (N * K + col_tiles * block_m * K) * elem


def traffic(models: list[str], tokens: list[int], seed: int = 0) -> list[dict]:
    """The down projection's tile reads (MB) on 64 x 256 and 128 x 256 tiles, and their ratio."""
    out = []
    for model in models:
        s = MODEL_SHAPES[model]
        for T in tokens:
            per_expert = expert_rows(T, s.E, s.top_k, seed)
            for elem in (1, 2):
                b64, b128 = (tile_bytes(per_expert, s.D, s.F, bm, 256, elem) for bm in (64, 128))
                out.append({"model": model, "T": T, "dtype": "fp8" if elem == 1 else "bf16",
                            "rows/expert": T * s.top_k / s.E, "MB @64x256": b64 / 1e6,
                            "MB @128x256": b128 / 1e6, "ratio": b128 / b64})  # fmt: skip
    return out


def stages(model: str, T: int, fp8: bool) -> list[tuple[str, int]]:
    """(stage, the rules' row tile) for each tiled stage the sorted pipeline runs at T tokens (its
    gate/up GEMM fused with the SwiGLU where ``experts._fused_swiglu`` says so)."""
    s = MODEL_SHAPES[model]
    M, elem = T * s.top_k, 1 if fp8 else 2
    if _fused_swiglu(M, s.E, s.F, s.D, fp8, elem, torch.device("cpu")):
        w13 = ("w13 (fused SwiGLU)", swiglu_config(M, s.F, s.D, s.E, fp8, elem, SMS))
    else:
        w13 = ("w13 (gathered rows)", heuristic_config(M, 2 * s.F, s.D, s.E, fp8, elem, SMS))
    w2 = ("w2", heuristic_config(M, s.D, s.F, s.E, fp8, elem, SMS))
    return [(name, cfg.block_m) for name, cfg in (w13, w2) if cfg.kind == "tiled"]


def table(models: list[str], tokens: list[int], seed: int = 0) -> list[dict]:
    rows = []
    for model in models:
        s = MODEL_SHAPES[model]
        for T in tokens:
            per_expert = expert_rows(T, s.E, s.top_k, seed)
            for fp8 in (True, False):
                for stage, bm in stages(model, T, fp8):
                    row = {"model": model, "T": T, "dtype": "fp8" if fp8 else "bf16", "stage": stage,
                           "rows/expert": T * s.top_k / s.E, "tile rows": bm, "use": row_use(per_expert, bm)}  # fmt: skip
                    row.update({f"use@{b}": row_use(per_expert, b) for b in TILE_ROWS})
                    rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout")
    ap.add_argument("--tokens", default="1024,2048,8192,16384")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traffic", action="store_true", help="the down projection's tile reads instead")
    args = ap.parse_args()
    models, tokens = args.models.split(","), [int(t) for t in args.tokens.split(",")]
    if args.traffic:
        rows = traffic(models, tokens, args.seed)
        cols = list(rows[0])
        cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    else:
        rows = table(models, tokens, args.seed)
        cols = ["model", "T", "dtype", "stage", "rows/expert", "tile rows", "use"] + [f"use@{b}" for b in TILE_ROWS]
        cells = [[f"{r[c]:.0%}" if c.startswith("use") else (f"{r[c]:.0f}" if c == "rows/expert" else str(r[c]))
                  for c in cols] for r in rows]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for c in cells:
        print("| " + " | ".join(c) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
