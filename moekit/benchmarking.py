"""The shared benchmark timer and roofline helpers (used by ``benchmarks/`` and ``moekit bench``).

Times are medians of CUDA-graph replays: one graph holds ``calls`` launches cycling through the
given callables (pass several input sets to rotate them past the 60 MB L2), and the per-call
time is the replay time over ``calls``. On the CPU it falls back to wall-clock medians.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from moekit import settings

# Measured ceilings of one H200 (shared/ANCHORS.md).
COPY_TBPS = 4.25
BF16_TFLOPS = 679.0
FP8_TFLOPS = 1260.0
L2_BYTES = 60 * 2**20


def floor_us(bytes_moved: float = 0.0, flops: float = 0.0, fp8: bool = False) -> float:
    """Roofline floor in µs: max(bytes / copy bandwidth, flops / matmul peak)."""
    t_mem = bytes_moved / (COPY_TBPS * 1e12)
    t_flop = flops / ((FP8_TFLOPS if fp8 else BF16_TFLOPS) * 1e12)
    return max(t_mem, t_flop) * 1e6


def rotations(bytes_per_set: float, max_sets: int = 16) -> int:
    """How many input sets to rotate so that together they exceed 3x the L2 (1 if one set does)."""
    if bytes_per_set <= 0:
        return max_sets
    need = int(3 * L2_BYTES // max(bytes_per_set, 1)) + 1
    return max(1, min(max_sets, need))


def warm_up(run: Callable[[], Any], timed_ms: Callable[[Callable[[], Any]], float], warmup_ms: float,
            max_runs: int = 1000) -> int:  # fmt: skip
    """Call ``run`` through ``timed_ms`` (which runs it and returns its milliseconds) until the
    runs add up to ``warmup_ms``; at least once, at most ``max_runs`` times. Returns the count."""
    if warmup_ms < 0:
        raise ValueError(f"warm_up: warmup_ms must be >= 0, got {warmup_ms}")
    spent, runs = 0.0, 0
    while runs < max_runs and (runs == 0 or spent < warmup_ms):
        spent += max(0.0, float(timed_ms(run)))
        runs += 1
    return runs


def bench_us(
    fns: Callable[[], Any] | Sequence[Callable[[], Any]],
    *,
    calls: Optional[int] = None,
    replays: int = 20,
    warmup: int = 3,
    use_graph: bool = True,
    warmup_ms: Optional[float] = None,
) -> float:
    """Median µs per call of ``fns`` (one callable or several cycled in order).

    Before the timed replays the graph (or the eager calls) replays until the GPU has run it for
    ``warmup_ms`` (``warm_up``; default ``settings.bench_warmup_ms``, ``MOEKIT_BENCH_WARMUP_MS``).
    Without it, a cell timed first after its layer was built (seconds of host work) could read up
    to 17% slow through all of its timed replays (session 44, H100, ``bench_layer.py --quick
    --alt-knobs``: the same cell default / knobs / knobs / default in one process, Llama 4 Scout
    bf16 T=1 100.4 then 85.5 µs, Mixtral-8x7B bf16 T=1 259.4 then 227.8, Scout FP8 T=1 54.4 then
    47.4; never at the second T of a model)."""
    fns = [fns] if callable(fns) else list(fns)
    if not torch.cuda.is_available():
        for f in fns:
            f()
        samples = []
        for _ in range(max(3, replays // 4)):
            t0 = time.perf_counter()
            for f in fns:
                f()
            samples.append((time.perf_counter() - t0) / len(fns) * 1e6)
        return statistics.median(samples)
    n = calls if calls is not None else max(len(fns), 10)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if use_graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fns[i % len(fns)]()
        run = g.replay
    else:

        def run():
            for i in range(n):
                fns[i % len(fns)]()

    def timed_ms(f: Callable[[], Any]) -> float:
        start.record()
        f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    warm_up(run, timed_ms, settings.get().bench_warmup_ms if warmup_ms is None else warmup_ms)
    samples = []
    for _ in range(replays):
        samples.append(timed_ms(run) * 1e3 / n)
    if use_graph:
        g.reset()  # its memory pool now, not when a reference cycle is collected (sweeps ran out of memory)
    return statistics.median(samples)


def try_import_mslk() -> Optional[Any]:
    """The ``mslk`` package when importable (a benchmark peer, never a dependency)."""
    try:
        import mslk  # type: ignore

        return mslk
    except Exception:
        return None


def markdown_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> str:
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return "—" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def save_rows(name: str, rows: Sequence[dict], meta: Optional[dict] = None) -> Optional[str]:
    """Write rows as JSON to ``settings.bench_dir`` ($MOEKIT_BENCH_DIR, else $OUT) when set."""
    out_dir = settings.get().bench_dir
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta or environment(), "rows": list(rows)}, f, indent=1)
    return path


def environment() -> dict:
    """Versions and device facts for a results log."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpus=torch.cuda.device_count())
    mslk = try_import_mslk()
    info["mslk"] = getattr(mslk, "__version__", "present") if mslk else None
    info["date"] = time.strftime("%Y-%m-%d")
    return info


# What a peer raises when it does not support a case (MSLK asserts on E, top-k, D): such a cell
# reads "refused"; anything else reads "error".
REFUSALS = (AssertionError, ValueError, NotImplementedError, TypeError)


def time_call(make_call: Callable[[Any], Callable[[], Any]], sets: Sequence[Any]) -> "float | str":
    """µs per call of ``make_call(s)()`` rotated over the input sets ``sets``, or ``"refused"`` /
    ``"error"``. The first call (compilation, autotuning, argument checks) runs outside the graph,
    so a peer that rejects the case is reported, not timed."""
    fns = [make_call(s) for s in sets]
    try:
        fns[0]()
        torch.cuda.synchronize()
    except REFUSALS as e:
        print(f"  refused: {type(e).__name__}: {str(e)[:160]}")
        return "refused"
    except Exception as e:  # noqa: BLE001 - a peer's failure must not end the run
        print(f"  error: {type(e).__name__}: {str(e)[:200]}")
        return "error"
    try:
        return bench_us(fns)
    except Exception as e:  # noqa: BLE001
        print(f"  error while timing: {type(e).__name__}: {str(e)[:200]}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the context may be unusable after a launch failure
            pass
        return "error"


def number(v: Any) -> Optional[float]:
    """``v`` when it is a time, None for a status string ("refused", "error")."""
    return v if isinstance(v, float) else None


def bandwidth_columns(nbytes: float, ours: Any, mslk: Any, torch_us: Any) -> dict:
    """The columns every memory-bound benchmark row shares, in table order: MB, floor, moekit's
    time, TB/s and % of the floor, MSLK's time and TB/s, torch's time, and the speed-up of moekit
    over each peer (``peer µs / moekit µs``). Times may be status strings ("refused", "error")."""
    fl = floor_us(nbytes)
    row: dict = {"MB": nbytes / 1e6, "floor µs": fl, "moekit µs": ours}
    if number(ours):
        row["moekit TB/s"] = nbytes / ours / 1e6
        row["% floor"] = 100.0 * fl / ours
    row["MSLK µs"] = mslk
    if number(mslk):
        row["MSLK TB/s"] = nbytes / mslk / 1e6
    row["torch µs"] = torch_us
    if number(ours) and number(mslk):
        row["vs MSLK"] = mslk / ours
    if number(ours) and number(torch_us):
        row["vs torch"] = torch_us / ours
    return row
