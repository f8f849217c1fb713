#!/usr/bin/env python3
"""RESULTS.md's current tables, generated from the JSON rows the benchmarks write.

    python benchmarks/results_table.py benchmarks/results/layer_h200.json      # print the table
    python benchmarks/results_table.py --update benchmarks/RESULTS.md          # rewrite every
                                                                               # generated block
    python benchmarks/results_table.py --check benchmarks/RESULTS.md           # exit 1 if stale
    python benchmarks/results_table.py --merge OUT.json A.json B.json ...      # one file of the
                                                                               # rows of several runs
    python benchmarks/results_table.py --compare A.json B.json                 # two lanes of one
                                                                               # call, cell by cell

A generated block in a Markdown file sits between ``<!-- table: PATH -->`` and ``<!-- end table
-->`` (PATH relative to the repository root): a JSON file a benchmark wrote (``{"meta": ...,
"rows": [...]}``: ``bench_layer.py``'s rows get the layer layout, any other benchmark's one column
per key). Copy a benchmark's JSON under ``benchmarks/results/`` and run ``--update``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- table: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)

_DT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def _us(v) -> str:
    if v is None:
        return "—"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _ratio(a, b) -> str:
    return "—" if a is None or b is None or not b else f"{a / b:.2f}"


def layer_table(data: dict) -> str:
    """The layer benchmark's rows: one line per (model, dtype, T), moekit against the floor and
    every peer of the same run."""
    meta = data.get("meta", {})
    head = (
        f"{meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, "
        f"MSLK {meta.get('mslk') or '—'}, {meta.get('date', '?')}\n\n"
    )
    cols = ["model", "dtype", "T", "path", "floor µs", "moekit µs", "other pipeline µs", "vLLM µs", "MSLK µs",
            "torch µs", "% of floor", "moekit / vLLM", "moekit / MSLK"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in data["rows"]:
        other = r.get("sorted_us") if r.get("path") in ("decode", "fused") else r.get("decode_us")
        m = r.get("moekit_us")
        pct = "—" if not m else f"{100 * r['floor_us'] / m:.0f}%"
        lines.append("| " + " | ".join([
            r["model"], _DT.get(r["dtype"], r["dtype"]), str(r["T"]), r.get("path", "—"), _us(r.get("floor_us")),
            _us(m), _us(other), _us(r.get("vllm_us")), _us(r.get("mslk_us")), _us(r.get("torch_us")), pct,
            _ratio(m, r.get("vllm_us")), _ratio(m, r.get("mslk_us")),
        ]) + " |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != v:
            return "—"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def generic_table(data: dict) -> str:
    """Any benchmark's rows (``benchmarking.save_rows``): one column per key, in the order the
    keys first appear (keys starting with ``_`` left out)."""
    meta = data.get("meta", {})
    head = f"{meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, {meta.get('date', '?')}\n\n"
    cols: list = []
    for r in data["rows"]:
        cols += [k for k in r if k not in cols and not k.startswith("_")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in data["rows"]]
    return head + "\n".join(lines) + "\n"


def render(path: str) -> str:
    """The table of one JSON file: the layer benchmark's own layout, else one column per key."""
    with open(os.path.join(ROOT, path)) as f:
        data = json.load(f)
    rows = data.get("rows", [])
    if rows and all("moekit_us" in r and "floor_us" in r and "model" in r for r in rows):
        return layer_table(data)
    return generic_table(data)


def update(md_path: str, check: bool = False) -> bool:
    """Rewrite (or, with ``check``, compare) every generated block; True when it was up to date."""
    with open(md_path) as f:
        text = f.read()
    new = BLOCK.sub(lambda m: m.group(1) + render(m.group("path")) + m.group(4), text)
    if new == text:
        return True
    if not check:
        with open(md_path, "w") as f:
            f.write(new)
    return False


def merge(paths: list) -> dict:
    """One ``{"meta", "rows"}`` of several runs of a benchmark (a grid split over device calls,
    e.g. ``bench_grouped_gemm.py --shapes part1..part3``): the rows in the order given, the first
    file's meta with each part's date and shapes under ``parts``. The runs must come from one
    kind of GPU: rows of different cards are not one table (``ValueError``)."""
    if not paths:
        raise ValueError("--merge: expected an output path and at least one JSON file to merge")
    datas = []
    for p in paths:
        with open(p) as f:
            datas.append(json.load(f))
    gpus = {d.get("meta", {}).get("gpu") for d in datas}
    if len(gpus) > 1:
        raise ValueError(
            f"--merge: the files come from different GPUs ({sorted(map(str, gpus))}); one table needs one card"
        )
    meta = dict(datas[0].get("meta", {}))
    meta["parts"] = [{"file": os.path.basename(p), "date": d.get("meta", {}).get("date"),
                      "shapes": d.get("meta", {}).get("shapes"), "rows": len(d.get("rows", []))}
                     for p, d in zip(paths, datas)]  # fmt: skip
    return {"meta": meta, "rows": [r for d in datas for r in d.get("rows", [])]}


# Columns that name a cell (the rest are measurements): rows of two runs with the same values here
# are the same cell.
_CELL_KEYS = ("op", "shape", "model", "G", "N", "K", "M", "T", "dtype", "kind")


def compare(a: dict, b: dict, col: str = "moekit µs") -> str:
    """A Markdown table of the cells two runs share (an A/B: two lanes of one device call, e.g.
    knobs off and on): ``col`` in each, B over A, and the ``config`` column where the two differ,
    then a line counting the cells B is ahead, level (within 1%) or behind. Cells where either run
    has no number in ``col`` are left out; ``ValueError`` when the runs share no cell."""
    keys = [k for k in _CELL_KEYS if any(k in r for r in a.get("rows", []))]

    def cell(r):
        return tuple(str(r.get(k)) for k in keys)

    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    right = {cell(r): r for r in b.get("rows", []) if num(r.get(col))}
    pairs = [(r, right[cell(r)]) for r in a.get("rows", []) if num(r.get(col)) and cell(r) in right]
    if not pairs:
        raise ValueError(f"--compare: the two files share no cell with a number in {col!r} (cells by {keys})")
    lines = ["| " + " | ".join(keys) + f" | A {col} | B {col} | B / A | config A -> B |",
             "|" + "---|" * (len(keys) + 4)]  # fmt: skip
    ahead = level = behind = 0
    for ra, rb in pairs:
        q = rb[col] / ra[col]
        ahead, level, behind = ahead + (q < 0.99), level + (0.99 <= q <= 1.01), behind + (q > 1.01)
        ca, cb = ra.get("config"), rb.get("config")
        cfg = "" if ca == cb else f"{ca} -> {cb}"
        head = " | ".join(_cell(ra.get(k)) for k in keys)
        lines.append(f"| {head} | {_us(ra[col])} | {_us(rb[col])} | {q:.3f} | {cfg} |")
    lines.append(f"\n{len(pairs)} cells: B ahead in {ahead}, level (within 1%) in {level}, behind in {behind}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", help="a benchmark's JSON file: print its table")
    ap.add_argument("--update", metavar="MD", help="rewrite the generated blocks of a Markdown file")
    ap.add_argument("--check", metavar="MD", help="exit 1 when a generated block is stale")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "JSON"),
                    help="write OUT: the rows of the JSON files after it, in order (one card)")  # fmt: skip
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="the cells two JSON files share, moekit µs of each and B / A (an A/B of one call)")  # fmt: skip
    args = ap.parse_args()
    if args.compare:
        try:
            datas = []
            for p in args.compare:
                with open(p) as f:
                    datas.append(json.load(f))
            print(compare(*datas), end="")
        except ValueError as e:
            ap.error(str(e))
        return 0
    if args.merge:
        try:
            data = merge(args.merge[1:])
        except ValueError as e:
            ap.error(str(e))
        with open(args.merge[0], "w") as f:
            json.dump(data, f, indent=1)
        print(f"{args.merge[0]}: {len(data['rows'])} rows from {len(args.merge) - 1} file(s)")
        return 0
    if args.check:
        ok = update(args.check, check=True)
        print("up to date" if ok else f"{args.check}: stale generated tables (run --update)")
        return 0 if ok else 1
    if args.update:
        update(args.update)
        return 0
    if not args.json:
        ap.error("give a JSON file, --update or --check")
    print(render(os.path.relpath(os.path.abspath(args.json), ROOT)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
