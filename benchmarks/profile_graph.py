#!/usr/bin/env python3
"""One transformers experts module at decode size, three ways (graph replay with and without PDL
in the graph, eager): host time per call (queued), wall time per call with a sync, and the GPU
span of one call (CUDA events around it), plus the timeline of one synced replay (profiler).

    python benchmarks/profile_graph.py [--arch qwen3-moe] [--tokens 1]
    python benchmarks/profile_graph.py --arch mixtral --prefill 512   # a whole model's forward instead
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
from profile_hf import _time as _host  # noqa: E402  (host time per call, queued or synced)


def _span(fn, n: int) -> float:
    """Median GPU time between an event recorded before ``fn`` and one after (the GPU idle first)."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    out.sort()
    return out[len(out) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-moe", help="comma-separated")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--quick", action="store_true", help="(accepted; the default run is short)")
    ap.add_argument("--prefill", type=int, default=0, help="instead: a whole 2-layer model's forward of N tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_graph: needs a CUDA GPU")
        return 0

    dev = torch.device("cuda")
    for arch in args.arch.split(","):
        if args.prefill:
            _prefill(arch, args.prefill, dev)
        else:
            _profile(arch, [int(t) for t in args.tokens.split(",")], dev)
    return 0


def _prefill(arch: str, tokens: int, dev: torch.device) -> None:
    """A whole 2-layer model's forward over a ``tokens``-token prompt, baseline and moekit
    alternating: host time queued, with a sync, and the GPU's kernel time, with the top kernels."""
    from moekit import hfbench

    print(f"== {arch}: whole-model forward of {tokens} tokens")
    model = hfbench.build_model(arch, size="full", layers=2, vocab=32000, dtype=torch.bfloat16, device=dev,
                                seed=0)  # fmt: skip
    base = hfbench._default_impl(model)
    ids = torch.randint(1, 32000, (1, tokens), device=dev)
    mask = torch.ones_like(ids)

    def fn():
        return model(input_ids=ids, attention_mask=mask, use_cache=False)

    from moekit import settings

    impls = (base, "moekit", "moekit sorted")
    over = {"moekit sorted": {"moe_path": "sorted"}}
    res: dict = {i: [] for i in impls}
    with torch.no_grad():
        for impl in impls:
            hfbench._set_impl(model, impl.split()[0], base)
            with settings.override(**over.get(impl, {})):
                for _ in range(3):
                    fn()
        for _ in range(5):
            for impl in impls:
                hfbench._set_impl(model, impl.split()[0], base)
                with settings.override(**over.get(impl, {})):
                    res[impl].append((_host(fn, 5, sync=False), _host(fn, 5, sync=True)))
        for impl in impls:
            hfbench._set_impl(model, impl.split()[0], base)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with settings.override(**over.get(impl, {})), torch.profiler.profile(activities=acts) as kp:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            busy = sum(ev.time_range.elapsed_us() for ev in kp.events()
                       if ev.device_type == torch.autograd.DeviceType.CUDA) / 3  # fmt: skip
            q = sorted(r[0] for r in res[impl])[2]
            s = sorted(r[1] for r in res[impl])[2]
            print(f"{impl:>10}: queued {q:8.1f} us, with a sync {s:8.1f} us, kernels {busy:8.1f} us (medians of 5)")
            print(kp.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))
        import cProfile
        import io
        import pstats

        hfbench._set_impl(model, "moekit", base)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats("moekit", 30)
        print("-- cProfile of 5 moekit forwards, moekit's functions by cumulative time")
        print(out.getvalue()[-6000:])


def _profile(arch: str, tokens: list, dev: torch.device) -> None:
    from moekit import hfbench, settings
    from moekit.integrations import _graphs
    from moekit.integrations import transformers as mt

    print(f"== {arch}")
    model = hfbench.build_model(arch, size="full", layers=1, vocab=32000, dtype=torch.bfloat16, device=dev,
                                seed=0)  # fmt: skip
    base = hfbench._default_impl(model)
    name, mod = mt.experts_modules(model)[0]
    dims = hfbench.expert_dims(model)
    for T in tokens:
        h = torch.randn(T, dims["D"], device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, dims["E"], device=dev)
        w, idx = torch.topk(torch.softmax(logits, -1), dims["top_k"], dim=-1)
        llama = type(mod).__name__ == "Llama4TextMoe"

        def fn():
            return mod(h) if llama else mod(h, idx, w)

        variants = [("baseline " + base, base, {}, True)]
        if T <= mt.GRAPH_MAX_TOKENS:
            variants += [("moekit graph", "moekit", {}, True), ("moekit graph, no PDL", "moekit", {"pdl": False}, True)]
        variants += [
            ("moekit eager", "moekit", {}, False),
            ("moekit eager, no PDL", "moekit", {"pdl": False}, False),
            ("moekit eager, decode path", "moekit", {"moe_path": "decode"}, False),
            ("moekit eager, sorted path", "moekit", {"moe_path": "sorted"}, False),
        ]
        for label, impl, over, graphs in variants:
            hfbench._set_impl(model, impl, base)
            if impl == "moekit":
                mod.__dict__[mt._GRAPH_ATTR] = mt.GRAPH_MAX_TOKENS if graphs else 0
            _graphs.clear(mod)
            with settings.override(**over), torch.no_grad():
                for _ in range(3):
                    fn()
                q = _host(fn, 30, sync=False)
                s = _host(fn, 30, sync=True)
                g = _span(fn, 15)
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as kp:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                busy = sum(ev.time_range.elapsed_us() for ev in kp.events()
                           if ev.device_type == torch.autograd.DeviceType.CUDA) / 5  # fmt: skip
                print(
                    f"T={T} {label:>26}: queued {q:7.1f} us, with a sync {s:7.1f} us, GPU span {g:7.1f} us, "
                    f"kernels {busy:7.1f} us"
                )
                if label == "moekit graph":
                    e = next(v for k, v in mod.__dict__[_graphs._ATTR].items() if k != "pool" and v.graph is not None)
                    rq = _host(e.graph.replay, 30, sync=False)
                    rs = _host(e.graph.replay, 30, sync=True)
                    rg = _span(e.graph.replay, 15)
                    print(
                        f"T={T} {'bare replay':>26}: queued {rq:7.1f} us, with a sync {rs:7.1f} us, GPU span {rg:7.1f} us"
                    )
                    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=acts) as prof:
                        for _ in range(2):
                            fn()
                            torch.cuda.synchronize()
                    evs = sorted(
                        (ev for ev in prof.events() if ev.time_range.end > 0), key=lambda ev: ev.time_range.start
                    )
                    t0 = evs[0].time_range.start
                    print("   timeline of two synced calls (us from the first event; device rows marked *):")
                    for ev in evs[-60:]:
                        dev_row = "*" if ev.device_type == torch.autograd.DeviceType.CUDA else " "
                        print(
                            f"   {dev_row} {ev.time_range.start - t0:9.1f} {ev.time_range.end - t0:9.1f}  {ev.name[:70]}"
                        )


if __name__ == "__main__":
    sys.exit(main())
