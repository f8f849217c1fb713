#!/usr/bin/env python3
"""Issues 14 and 15's acceptance bars, checked cell by cell on layer-benchmark rows, against the
issues' floors (the H200's ceilings, as every benchmark's ``floor_us``) and, given the ceilings of
the card that ran them (``card_ceilings.py``), against that card's own floor: a bar that asks for
less time than the card's floor cannot be met on that card by any implementation. CPU only.

    python benchmarks/acceptance.py --rows benchmarks/results/layer_grid_prefill_h100.json,... \
        [--ceilings benchmarks/results/card_ceilings_h100.json] [--issue 14,15] \
        [--gemm-rows grouped_gemm_grid.json]

Bars (the issues' text):
- issue 14 (T <= 256): T=1 within floor + 6 µs, T >= 4 at least 85% of the floor or within
  floor + 6 µs; at most 0.8x vLLM's ``fused_moe`` and 0.7x MSLK where they ran.
- issue 15 (T >= 256): at least 75% of the floor; at most 0.8x vLLM and 0.9x MSLK.
Per cell: ``met`` or ``missed``, and ``below card floor`` where the bar is under this card's
floor (its bytes at the card's read rate, or its FLOPs at its matmul rate, whichever is larger).
Rows of several files merge per (model, dtype, T), the later file's columns over the earlier's.

``--gemm-rows``: ``bench_grouped_gemm.py``'s rows of the full grid (its three ``--shapes`` parts
joined by ``results_table.py --merge``) for issue 15's grouped-GEMM bar, "never slower than MSLK
or torch._grouped_mm in any cell of the full grid": the cells slower than a peer, and the grid's
cells the rows lack (``gemm_verdict``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

# The issues' bars: (floor share, slack µs, vLLM ratio, MSLK ratio)
BARS = {14: (0.85, 6.0, 0.8, 0.7), 15: (0.75, 0.0, 0.8, 0.9)}
GRIDS = {14: (1, 4, 16, 64, 256), 15: (256, 1024, 2048, 8192, 16384)}


def cell_bytes_flops(model: str, T: int, fp8: bool) -> tuple[float, float]:
    """The floor's bytes (the weights of the experts expected to be hit under uniform routing, 1
    byte each for FP8, plus x and out in bf16) and FLOPs of one layer cell."""
    from moekit.ops._triton.gg_config import expected_groups_hit
    from moekit.testing import MODEL_SHAPES

    s = MODEL_SHAPES[model]
    hits = expected_groups_hit(T * s.top_k, s.E)
    weights = hits * 3 * s.D * s.F * (1 if fp8 else 2)
    return weights + 2 * T * s.D * 2, 2.0 * T * s.top_k * 3 * s.D * s.F


def card_floor_us(row: dict, ceilings: dict) -> float:
    """This card's floor of a row: its bytes at the card's read rate or its FLOPs at its matmul
    rate (FP8: the row-wise scaled matmul), whichever is larger."""
    fp8 = row["dtype"] == "fp8"
    nbytes, flops = cell_bytes_flops(row["model"], int(row["T"]), fp8)
    nbytes = row.get("bytes", nbytes)
    if fp8:
        tflops = ceilings.get("fp8_matmul_rowwise") or ceilings["fp8_matmul"]
    else:
        tflops = ceilings["bf16_matmul"]
    return max(nbytes / (ceilings["read"] * 1e6), flops / (tflops * 1e6))


def load_rows(paths: list[str]) -> list[dict]:
    merged: dict = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                r = dict(r, dtype="fp8" if r["dtype"] in ("fp8", "float8_e4m3fn") else "bf16")
                key = (r["model"], r["dtype"], int(r["T"]))
                merged[key] = {**merged.get(key, {}), **{k: v for k, v in r.items() if v is not None}}
    return list(merged.values())


def load_ceilings(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = {}
    for r in rows:
        v = r.get("TB/s") or r.get("TFLOP/s")
        if v:
            out[r["what"]] = float(v)
    return out


def _verdict(us: float, bar: float, card_floor: Optional[float]) -> str:
    if us <= bar:
        return "met"
    if card_floor is not None and bar < card_floor:
        return "below card floor"
    return "missed"


def check(rows: list[dict], issue: int, ceilings: Optional[dict] = None) -> list[dict]:
    """One result per cell of ``issue``'s grid present in ``rows``: each bar's limit (µs) and
    verdict; ``floor_share`` / ``card_share``: the issue's floor and the card's over moekit's time."""
    share, slack, v_ratio, m_ratio = BARS[issue]
    out = []
    for r in sorted(rows, key=lambda r: (r["model"], r["dtype"], int(r["T"]))):
        T = int(r["T"])
        us = r.get("moekit_us")
        if T not in GRIDS[issue] or not us:
            continue
        floor = float(r["floor_us"])
        card = card_floor_us(r, ceilings) if ceilings else None
        res = {"model": r["model"], "dtype": r["dtype"], "T": T, "moekit_us": us, "floor_us": floor,
               "floor_share": floor / us, "card_floor_us": card, "card_share": None if card is None else card / us}  # fmt: skip
        if issue == 14 and T == 1:
            limit = floor + slack
        else:
            limit = max(floor / share, floor + slack)
        res["floor_bar_us"] = limit
        res["floor_bar"] = _verdict(us, limit, None)
        if card is not None:
            card_limit = card + slack if issue == 14 and T == 1 else max(card / share, card + slack)
            res["card_floor_bar"] = _verdict(us, card_limit, None)
        for peer, ratio in (("vllm", v_ratio), ("mslk", m_ratio)):
            theirs = r.get(f"{peer}_us")
            if theirs:
                res[f"{peer}_us"] = theirs
                res[f"{peer}_bar_us"] = ratio * theirs
                res[f"{peer}_bar"] = _verdict(us, ratio * theirs, card)
        out.append(res)
    return out


def markdown(results: list[dict], issue: int) -> str:
    cols = ["model", "dtype", "T", "moekit µs", "floor µs (H200)", "floor bar", "card floor µs", "% of card floor",
            "card floor bar", "vLLM µs", "0.8x vLLM", "MSLK µs", f"{BARS[issue][3]}x MSLK"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def us(v):
        return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")

    for r in results:
        lines.append("| " + " | ".join([
            r["model"], r["dtype"], str(r["T"]), us(r["moekit_us"]), us(r["floor_us"]), r["floor_bar"],
            us(r.get("card_floor_us")), "—" if r.get("card_share") is None else f"{100 * r['card_share']:.0f}%",
            r.get("card_floor_bar", "—"), us(r.get("vllm_us")), r.get("vllm_bar", "—"), us(r.get("mslk_us")),
            r.get("mslk_bar", "—"),
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def summary(results: list[dict]) -> dict:
    """Counts of each verdict per bar."""
    out: dict = {}
    for r in results:
        for bar in ("floor_bar", "card_floor_bar", "vllm_bar", "mslk_bar"):
            if bar in r:
                out.setdefault(bar, {}).setdefault(r[bar], 0)
                out[bar][r[bar]] += 1
    return out


def gemm_verdict(rows: list) -> list:
    """Issue 15's grouped-GEMM bar on ``bench_grouped_gemm.py`` rows: how many of the full grid's
    cells (every shape at ``grid_ms`` rows, bf16 and FP8) the rows time, those they lack, then
    ``peer_verdict``'s lines (the cells slower than MSLK or torch)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import bench_grouped_gemm as bgg

    want = [(name, M, dt) for name, G, _, _ in bgg.SHAPES for M in bgg.grid_ms(G) for dt in ("bf16", "fp8")]
    have = {(r["shape"], r["M"], r["dtype"]) for r in rows if isinstance(r.get("moekit µs"), (int, float))}
    lacking = [c for c in want if c not in have]
    lines = [f"full grid: {len(want) - len(lacking)} of {len(want)} cells timed"]
    by_shape: dict = {}
    for n, m, d in lacking:
        by_shape.setdefault(n, {}).setdefault(m, []).append(d)
    for n, ms in by_shape.items():
        cells = ", ".join(str(m) if len(ds) == 2 else f"{m} {ds[0]}" for m, ds in ms.items())
        lines.append(f"  not timed: {n} M = {cells}")
    return lines + bgg.peer_verdict(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="bench_layer.py JSON files, comma-separated")
    ap.add_argument("--ceilings", default=None, help="card_ceilings.py JSON of the card that ran the rows")
    ap.add_argument("--issue", default="14,15")
    ap.add_argument("--gemm-rows", default=None, help="bench_grouped_gemm.py JSON of the full grid (issue 15)")
    a = ap.parse_args()
    rows = load_rows([p for p in a.rows.split(",") if p])
    ceilings = load_ceilings(a.ceilings)
    for issue in (int(i) for i in a.issue.split(",")):
        res = check(rows, issue, ceilings)
        print(f"## issue {issue}: {len(res)} cells\n")
        print(markdown(res, issue))
        print("\n" + json.dumps(summary(res)) + "\n")
    if a.gemm_rows:
        with open(a.gemm_rows) as f:
            gemm = json.load(f).get("rows", [])
        print("## issue 15: the grouped GEMM alone against MSLK and torch\n")
        print("\n".join(gemm_verdict(gemm)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
