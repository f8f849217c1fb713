"""Development scripts under ``scripts/`` that run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, N: tl.constexpr):
    """doc {doc}"""
    v = tl.load(x_ptr + tl.arange(0, N))
    tl.store(x_ptr + tl.arange(0, N), v {op} 1)
'''


@pytest.mark.reference
def test_jit_ast_diff_tells_moved_kernels_from_changed_ones(tmp_path):
    """A kernel moved to another file with another docstring and spacing is identical; a changed
    operator is not (exit 1, named)."""
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    (a / "one.py").write_text(_KERNEL.format(doc="a", op="+"))
    (b / "two.py").write_text("\n\n" + _KERNEL.format(doc="moved", op="+").replace("v + 1", "v  +  1"))
    (c / "one.py").write_text(_KERNEL.format(doc="a", op="-"))
    script = os.path.join(ROOT, "scripts", "jit_ast_diff.py")
    same = subprocess.run([sys.executable, script, str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "1 @triton.jit functions identical, 0 differ" in same.stdout, same.stdout
    diff = subprocess.run([sys.executable, script, str(a), str(c)], capture_output=True, text=True)
    assert diff.returncode == 1 and "differs: _k" in diff.stdout, diff.stdout


@pytest.mark.reference
def test_tile_use_counts_each_experts_last_tile():
    """``scripts/tile_use.py``: routed rows over the rows of the row tiles holding them (an expert
    of 65 rows takes two 64-row tiles, an empty one none); the table names the stages the layer
    runs (Qwen3-30B at T=2048: the fused SwiGLU gate/up and the down projection)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import tile_use
    finally:
        sys.path.pop(0)
    import torch

    assert tile_use.row_use(torch.tensor([64, 65, 0]), 64) == 129 / 192
    assert tile_use.row_use(torch.tensor([64, 65, 0]), 32) == 129 / 160
    rows = tile_use.table(["qwen3-30b-a3b"], [2048])
    assert [(r["dtype"], r["stage"]) for r in rows] == [
        ("fp8", "w13 (fused SwiGLU)"), ("fp8", "w2"), ("bf16", "w13 (fused SwiGLU)"), ("bf16", "w2")]  # fmt: skip
    assert all(r["use@32"] >= r["use@64"] >= r["use@128"] for r in rows)
    assert all(r["use"] == r[f"use@{r['tile rows']}"] for r in rows)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tile_use.py"), "--models", "gpt-oss-120b",
                          "--tokens", "2048"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "| gpt-oss-120b | 2048 | fp8 | w13 (gathered rows) |" in out.stdout, out.stdout


@pytest.mark.reference
def test_tile_use_traffic_counts_whole_tiles():
    """``scripts/tile_use.py --traffic``: each row tile of an expert reads the expert's whole
    weights, each column tile the row tile's whole ``block_m`` rows; 128-row tiles read less at
    128 rows per expert, more at 32."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import tile_use
    finally:
        sys.path.pop(0)
    import torch

    # experts of 64, 65 and 0 rows, N = 512, K = 8, 1-byte elements: 64-row tiles 3 row tiles,
    # 128-row tiles 2; two column tiles of 256
    assert tile_use.tile_bytes(torch.tensor([64, 65, 0]), 512, 8, 64, 256, 1) == 3 * (512 * 8 + 2 * 64 * 8)
    assert tile_use.tile_bytes(torch.tensor([64, 65, 0]), 512, 8, 128, 256, 2) == 2 * (512 * 8 + 2 * 128 * 8) * 2
    by = {
        (r["model"], r["T"], r["dtype"]): r["ratio"]
        for r in tile_use.traffic(["qwen3-30b-a3b", "deepseek-v3-tp8"], [1024, 2048])
    }
    assert by[("qwen3-30b-a3b", 2048, "fp8")] < 0.8 and by[("deepseek-v3-tp8", 1024, "bf16")] > 1.1, by


@pytest.mark.reference
def test_layer_launches_finds_what_the_layer_runs_on_sm90():
    """``scripts/layer_launches.py``: the layer on meta tensors that read as CUDA ones records the
    launches the GPU would run, each compiled for sm_90: Qwen3-30B at T=1 (FP8) moe_decode's two
    launches (the routing GEMV and the combine), at T=64 (bf16) the sorted pipeline (routing, the
    gate/up GEMM with its SwiGLU, the scatter-added down GEMM); a knob reaches the launchers
    (``DECODE_ROUTE_ROWS``: a row per warp); a case that failed to run is a problem."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import layer_launches
    finally:
        sys.path.pop(0)
    recs = layer_launches.collect([("qwen3-30b-a3b", 1, "fp8"), ("qwen3-30b-a3b", 64, "bf16")])
    assert not [p for r in recs for p in layer_launches.problems(r)], recs
    decode = [r for r in recs if r["case"] == ["qwen3-30b-a3b", 1, "fp8"]]
    assert [r["kernel"] for r in decode] == ["_decode_swiglu_kernel", "_combine_kernel"], decode
    if decode[0]["stack"] is not None:  # (cuobjdump present)
        assert all(r["stack"] == 0 for r in decode), decode
    sorted_ = [r["kernel"] for r in recs if r["case"] == ["qwen3-30b-a3b", 64, "bf16"]]
    assert sorted_[0].startswith("_route") and "_swiglu" in " ".join(sorted_) and len(sorted_) >= 3, sorted_
    rows = layer_launches.collect([("qwen3-30b-a3b", 1, "fp8")], knobs="DECODE_ROUTE_ROWS=1")
    assert rows[0]["constants"]["ROWS"] == "4" and decode[0]["constants"]["ROWS"] == "1", (rows[0], decode[0])
    assert layer_launches.problems({"case": ["m", 1, "fp8"], "case_error": "RuntimeError: item() on meta"})
    line = layer_launches.row(decode[1])
    assert line[:4] == ["qwen3-30b-a3b", "1", "fp8", "_combine_kernel"] and "BLOCK_F=" in line[-1], line
