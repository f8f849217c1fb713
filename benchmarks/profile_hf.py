#!/usr/bin/env python3
"""Where a transformers model's time goes, default experts vs moekit: one experts module called
eagerly (GPU time per call with a sync, and CPU launch time per call without one), then one prefill
and one decode step of the whole model under ``torch.profiler`` (the top CPU ops and every host
sync).

    python benchmarks/profile_hf.py [--arch qwen3-moe] [--tokens 1,512] [--layers 2]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense",
               "cudaMemcpy", "cudaEventSynchronize")  # fmt: skip


def _time(fn, n: int, sync: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _generate_ms(model, ids, n: int) -> list:
    """ms of each decode step of one greedy ``generate`` (a streamer notes the time of each token)."""
    times = []

    class _S:
        def put(self, value):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       streamer=_S())  # fmt: skip
    return [round((b - a) * 1e3, 2) for a, b in zip(times[1:], times[2:])]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-moe")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="also the GPU kernels of 10 experts calls (profiler)")
    ap.add_argument("--no-model", action="store_true", help="skip the whole-model profile")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_hf: needs a CUDA GPU")
        return 0
    from moekit import hfbench
    from moekit.integrations import transformers as mt

    dev = torch.device("cuda")
    model = hfbench.build_model(args.arch, size="full", layers=args.layers, vocab=32000, dtype=torch.bfloat16,
                                device=dev, seed=0)  # fmt: skip
    base = hfbench._default_impl(model)
    name, mod = mt.experts_modules(model)[0]
    dims = hfbench.expert_dims(model)
    print(f"{args.arch}: {dims}; experts module {name} ({type(mod).__name__}); baseline {base}")
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, dims["D"], device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, dims["E"], device=dev)
        w, idx = torch.topk(torch.softmax(logits, -1), dims["top_k"], dim=-1)
        for impl in (base, "moekit"):
            hfbench._set_impl(model, impl, base)
            with torch.no_grad():
                fn = (lambda: mod(h, idx, w)) if not type(mod).__name__ == "Llama4TextMoe" else (lambda: mod(h))
                fn()
                gpu = _time(fn, 20, sync=True)
                cpu = _time(fn, 20, sync=False)
                print(f"T={T} {impl:>10}: {gpu:8.1f} us per call with a sync, {cpu:8.1f} us per call queued")
                if args.kernels:
                    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    with torch.profiler.profile(activities=acts) as prof:
                        for _ in range(10):
                            fn()
                        torch.cuda.synchronize()
                    print(f"-- T={T} {impl}: kernels of 10 calls")
                    print(
                        prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
                    )
                if impl == "moekit" and T > 32:
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(20):
                        fn()
                    pr.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
                    print("\n".join(s.getvalue().splitlines()[:45]))
    if args.no_model:
        return 0
    # The whole model: a prefill and one decode step under the profiler.
    ids = torch.randint(1, 32000, (1, 512), device=dev)
    for impl in (base, "moekit"):
        hfbench._set_impl(model, impl, base)
        with torch.no_grad():
            for _ in range(2):
                out = model(input_ids=ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            cache = out.past_key_values
            for _ in range(3):  # decode steps: eager, capture (moekit's graphs), replay
                model(input_ids=nxt, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(input_ids=nxt, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
            print(f"== whole model, {impl}: one decode step (synced) {(time.perf_counter() - t0) / 10 * 1e3:.3f} ms")
            from moekit.integrations import _graphs

            for n, m in mt.experts_modules(model):
                ents = [(k[0], v.seen, v.failed, v.graph is not None)
                        for k, v in m.__dict__.get(_graphs._ATTR, {}).items() if k != "pool"]  # fmt: skip
                print(f"   graphs of {n}: {ents}")
            ms = _generate_ms(model, ids, 16)
            print(f"== whole model, {impl}: generate 16 new tokens, ms per decode step: {ms}")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:  # fmt: skip
                for _ in range(3):
                    model(input_ids=nxt, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
        ev = prof.key_averages()
        print(f"== whole model, {impl}: three decode steps")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
        for e in ev:
            if any(s in e.key for s in SYNC_EVENTS):
                print(f"sync-like: {e.key} x{e.count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
