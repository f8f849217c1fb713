#!/usr/bin/env python3
"""Where a MoE layer's time goes: every GPU kernel of the routed experts from router logits (the
pipeline ``bench_layer.py`` times), with its duration, from ``torch.profiler``.

    python benchmarks/profile_layer.py [--models qwen3-30b-a3b,llama4-scout] [--tokens 1,128] [--dtype bf16,fp8]
        [--vllm] [--compile] [--knobs NAME=V,...]

For each (model, T, dtype): the kernels in launch order (name, µs), the count of launches, the
sum of kernel time and the wall time of the same forward replayed in a CUDA graph, so the gap
(launch latency and idle GPU between small kernels) is visible next to the kernels themselves.
A diagnosis aid for decode latency (which kernels to fuse), not a benchmark of record.
``--compile`` profiles the forward through ``torch.compile(fullgraph=True)`` as well (the kernels
a compiled graph adds or changes, beside eager's); ``--knobs`` pins launcher knobs for both.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402


def _print_kernels(kernels: list, top: int) -> None:
    """The kernels in launch order, those under 1% of the total folded into one line each run."""
    total = sum(t for _, t in kernels) or 1.0
    small_n, small_t, shown = 0, 0.0, 0
    for name, t in kernels:
        if t < 0.01 * total or shown >= top:
            small_n, small_t = small_n + 1, small_t + t
            continue
        if small_n:
            print(f"   {small_t:8.2f} µs  ({small_n} small kernels)")
            small_n, small_t = 0, 0.0
        print(f"   {t:8.2f} µs  {name[:110]}")
        shown += 1
    if small_n:
        print(f"   {small_t:8.2f} µs  ({small_n} small kernels)")


def _kernels_and_wall(step) -> tuple[list, float]:
    """``step``'s GPU kernels in launch order (name, µs) from ``torch.profiler`` after three warm-up
    calls (every Triton kernel compiled), and its µs per call replayed in a CUDA graph."""
    from torch.autograd import DeviceType

    from moekit.benchmarking import bench_us

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    gpu = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in gpu], bench_us(step, replays=20)


def _profile_vllm(x, w, s, cfg, fp8: bool) -> None:
    """The same rows through vLLM's fused_moe harness (routing precomputed), kernel by kernel."""
    from moekit import layer_bench
    from moekit.reference.routing import routing_weights

    vllm = layer_bench._vllm_harness()
    if vllm is None or cfg.apply_router_weight_on_input:
        return
    logits = (x @ w["router_DE"]).float()
    wts, ids = routing_weights(logits, cfg.top_k, cfg.score_func, cfg.renormalize, n_group=cfg.n_group,
                               topk_group=cfg.topk_group, e_score_correction_bias=w.get("e_score_correction_bias"),
                               routed_scaling_factor=cfg.routed_scaling_factor)  # fmt: skip
    tw, ti = wts.contiguous(), ids.to(torch.int32).contiguous()
    if fp8:
        v13, v13s = vllm.quantize_weight_per_channel_fp8(w["w13_e2FD"])
        v2, v2s = vllm.quantize_weight_per_channel_fp8(w["w2_eDF"])

        def step():
            return vllm.vllm_moe_fp8(x, v13, v13s, v2, v2s, tw, ti)
    else:

        def step():
            return vllm.vllm_moe(x, w["w13_e2FD"], w["w2_eDF"], tw, ti)

    kernels, wall = _kernels_and_wall(step)
    print(f"   -- vLLM fused_moe: {len(kernels)} kernels, {sum(t for _, t in kernels):.1f} µs of kernel time, "
          f"{wall:.1f} µs per call in a CUDA graph", flush=True)  # fmt: skip
    _print_kernels(kernels, 40)


def profile_one(model: str, T: int, fp8: bool, top: int, vllm: bool = False, compiled: bool = False) -> dict:
    from moekit import layer_bench
    from moekit.layers.functional import quantize_expert_weights
    from moekit.testing import MODEL_SHAPES, random_expert_weights

    s = MODEL_SHAPES[model]
    cfg = layer_bench.routing_config(s)
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
    q = None
    if fp8:
        w13q, w13s = quantize_expert_weights(w["w13_e2FD"])
        w2q, w2s = quantize_expert_weights(w["w2_eDF"])
        q = {"w13": w13q, "w13_scale": w13s, "w2": w2q, "w2_scale": w2s}
    x = torch.randn(T, s.D, device="cuda", dtype=torch.bfloat16)
    logits = (x @ w["router_DE"]).float()
    from moekit.layers.functional import moe_forward

    fwd = layer_bench.compiled_forward() if compiled else moe_forward

    def step() -> torch.Tensor:  # the routed experts from router logits (what bench_layer times)
        if q is None:
            return fwd(
                x,
                None,
                w["w13_e2FD"],
                w["w2_eDF"],
                cfg,
                logits_TE=logits,
                e_score_correction_bias=w.get("e_score_correction_bias"),
            )
        return fwd(
            x,
            None,
            q["w13"],
            q["w2"],
            cfg,
            logits_TE=logits,
            w13_scale_e2F=q["w13_scale"],
            w2_scale_eD=q["w2_scale"],
            e_score_correction_bias=w.get("e_score_correction_bias"),
        )

    kernels, wall = _kernels_and_wall(step)
    total = sum(t for _, t in kernels)
    print(
        f"== {model} T={T} {'fp8' if fp8 else 'bf16'}{' compiled' if compiled else ''}: {len(kernels)} kernels, {total:.1f} µs of kernel time, "
        f"{wall:.1f} µs per forward in a CUDA graph",
        flush=True,
    )
    _print_kernels(kernels, top)
    if vllm:
        _profile_vllm(x, w, s, cfg, q is not None)
    return {
        "model": model,
        "T": T,
        "dtype": "fp8" if fp8 else "bf16",
        "compiled": compiled,
        "kernels": len(kernels),
        "kernel_us": total,
        "graph_us": wall,
        "gap_us": wall - total,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,llama4-scout")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--top", type=int, default=60, help="kernels listed per forward")
    ap.add_argument("--vllm", action="store_true", help="also profile vLLM's fused_moe on the same rows")
    ap.add_argument("--compile", action="store_true", help="also the forward through torch.compile(fullgraph=True)")
    ap.add_argument("--knobs", default="", help="launcher knobs pinned for every forward: NAME=V,...")
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh (QUICK=1); no effect")
    args = ap.parse_args()
    from moekit import settings

    knobs = settings.parse_knobs(args.knobs)  # (MOEKIT_KNOBS' form: integers, or true / false)
    if not torch.cuda.is_available():
        print("profile_layer: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    from moekit.benchmarking import markdown_table, save_rows

    rows = []
    for m in args.models.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            for dt in args.dtype.split(","):
                for comp in (False, True) if args.compile else (False,):
                    try:
                        with settings.override(knobs=knobs):
                            rows.append(profile_one(m, T, dt == "fp8", args.top, args.vllm and not comp, comp))
                    except Exception as exc:  # keep the other rows
                        print(f"   {m} T={T} {dt} failed: {type(exc).__name__}: {exc}")
    print(markdown_table(rows, ["model", "T", "dtype", "compiled", "kernels", "kernel_us", "graph_us", "gap_us"]))
    save_rows("profile_layer", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
