"""``moekit bench --plot out.png``: the layer benchmark's measured times against the roofline
floor, per token count T, one panel per model (and precision), log-log.

Reads the rows ``moekit bench --json`` and ``benchmarks/bench_layer.py`` write (``{"meta": ...,
"rows": [...]}`` or a bare list of rows): ``model``, ``T``, ``floor_us``, ``moekit_us`` and the
peers' ``*_us`` columns where present. matplotlib is optional: ``pip install 'moekit[plot]'``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

#: (row key, legend label, line style) in drawing order; the floor is drawn separately.
SERIES = (
    ("moekit_us", "moekit", dict(marker="o", linewidth=2.2, color="tab:blue")),
    ("decode_us", "moekit, decode pipeline pinned", dict(marker=".", linestyle=":", color="tab:cyan")),
    ("sorted_us", "moekit, sorted pipeline pinned", dict(marker=".", linestyle=":", color="tab:purple")),
    ("det_us", "moekit, deterministic", dict(marker=".", linestyle=":", color="tab:gray")),
    ("vllm_us", "vLLM fused_moe", dict(marker="s", color="tab:orange")),
    ("mslk_us", "MSLK", dict(marker="^", color="tab:green")),
    ("torch_us", "torch (_grouped_mm)", dict(marker="v", color="tab:red")),
)
FLOOR = ("floor_us", "roofline floor", dict(linestyle="--", color="black", linewidth=1.5))


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 else None


def load_rows(paths: Iterable[str]) -> list[dict]:
    """The rows of one or more JSON files (``{"rows": [...]}`` or a list of rows)."""
    rows: list[dict] = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        got = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(got, list) or not all(isinstance(r, dict) for r in got):
            raise ValueError(f"{path}: expected {{'rows': [...]}} or a list of row objects")
        rows += got
    return rows


def group(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Layer rows (with ``T``, ``floor_us`` and ``moekit_us``) per panel ("model, dtype"),
    sorted by T; the last row wins where a T repeats."""
    panels: dict[str, dict[int, dict]] = {}
    for r in rows:
        if not all(k in r for k in ("T", "floor_us", "moekit_us")):
            continue
        key = str(r.get("model", "?")) + (f", {r['dtype']}" if r.get("dtype") else "")
        panels.setdefault(key, {})[int(r["T"])] = r
    return {k: [v[t] for t in sorted(v)] for k, v in panels.items()}


def _figure_cls():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("moekit bench --plot needs matplotlib: pip install 'moekit[plot]'") from e
    return Figure


def plot(rows: Sequence[dict], out: str, title: str | None = None) -> str:
    """Write the figure of ``rows`` to ``out`` (format from its extension); returns ``out``."""
    panels = group(rows)
    if not panels:
        raise ValueError("no layer benchmark rows (with T, floor_us and moekit_us) to plot")
    Figure = _figure_cls()
    n = len(panels)
    cols = min(n, 2)
    nrows = math.ceil(n / cols)
    fig = Figure(figsize=(6.4 * cols, 4.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax, (name, prs) in zip(axes.flat, panels.items()):
        for key, label, style in (FLOOR, *SERIES):
            pts = [(r["T"], _number(r.get(key))) for r in prs]
            pts = [(t, v) for t, v in pts if v is not None]
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("µs per layer call")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=120)
    return out
