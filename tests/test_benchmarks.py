"""Every script under ``benchmarks/`` imports and, on a machine without CUDA, says so and exits 0
(the device session runs them unattended: a script that fails on import wastes GPU time)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# results_table.py renders RESULTS.md from JSON rows: no GPU involved (tested below).
SCRIPTS = sorted(
    f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and f != "results_table.py"
)


@pytest.mark.reference
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_runs_without_cuda(script):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, os.path.join("benchmarks", script), "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert "CUDA" in r.stdout or "GPU" in r.stdout, r.stdout[-500:]


@pytest.mark.reference
def test_results_md_tables_match_their_json_rows():
    """RESULTS.md's generated tables are what ``results_table.py`` makes of the JSON rows they name."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import results_table
    finally:
        sys.path.pop(0)
    md = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    assert "<!-- table: " in open(md).read()
    assert results_table.update(md, check=True), (
        "RESULTS.md is stale: python benchmarks/results_table.py --update benchmarks/RESULTS.md"
    )


@pytest.mark.reference
def test_results_table_renders_any_benchmarks_rows():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import results_table
    finally:
        sys.path.pop(0)
    data = {"meta": {"gpu": "G", "date": "D"}, "rows": [{"op": "a", "us": 3.14159, "_private": 1},
                                                          {"op": "b", "us": None, "M": 12.5}]}  # fmt: skip
    t = results_table.generic_table(data).splitlines()
    assert t[2] == "| op | us | M |" and t[4] == "| a | 3.14 | — |" and t[5] == "| b | — | 12.5 |"
