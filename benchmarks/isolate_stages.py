#!/usr/bin/env python3
"""Each stage of one MoE layer forward timed two ways: alone (the same call with the very inputs
the layer gave it, replayed in a CUDA graph) and in place (the layer's time minus the layer's time
with that one stage replaced by its recorded result). A stage whose in-place cost exceeds its time
alone loses time to its surroundings (the previous kernel's tail, the L2 it inherits, launch
order); one whose time alone exceeds the same GEMM on a random routing (``random m_sizes``
column, grouped GEMMs only) loses it to the rows it is given. Grouped GEMMs are also timed with
rows out instead of their token weights and scatter-add (``plain``), and with ``sweep_gemm``'s
operand values (``rand_w``: randn / sqrt(K) weights; ``rand_xw``: randn rows too).

    python benchmarks/isolate_stages.py [--models qwen3-30b-a3b,deepseek-v3-tp8] [--tokens 256] [--dtype fp8]

The layer is ``moe_forward`` from router logits, as ``bench_layer.py`` times it (inputs rotated
over a few routings). A diagnosis aid, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # the moekit on PYTHONPATH when there is one (an earlier tree of scripts/ab_trees.sh), else this one
    import moekit  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

# The stage functions as moe_forward and run_experts call them (module, name).
STAGES = [
    ("moekit.ops", "route_and_shuffle"),  # moe_forward imports it at call time
    ("moekit.layers.experts", "grouped_gemm"),
    ("moekit.layers.experts", "grouped_gemm_fp8_rowwise"),
    ("moekit.layers.experts", "grouped_gemm_swiglu"),
    ("moekit.layers.experts", "grouped_gemm_combine"),
    ("moekit.layers.experts", "gather_scale_dense_tokens"),
    ("moekit.layers.experts", "gather_scale_quant_dense_tokens"),
    ("moekit.layers.experts", "quantize_fp8_row"),
    ("moekit.layers.experts", "silu_mul"),
    ("moekit.layers.experts", "silu_mul_quant"),
    ("moekit.layers.experts", "combine_rows"),
]


class Recorder:
    """Wraps the stage functions: ``mode`` "record" keeps every call's arguments and result per
    rotation; "skip" returns the recorded result of call ``skip`` instead of running it."""

    def __init__(self) -> None:
        import importlib

        self.mods = [(importlib.import_module(m), n) for m, n in STAGES]
        self.orig = {(m.__name__, n): getattr(m, n) for m, n in self.mods}
        self.mode, self.rot, self.idx, self.skip = "off", 0, 0, -1
        self.calls: dict[int, list] = {}
        for m, n in self.mods:
            setattr(m, n, self._wrap(m.__name__, n))

    def _wrap(self, mod: str, name: str):
        fn = self.orig[(mod, name)]

        def wrapped(*args, **kwargs):
            i, self.idx = self.idx, self.idx + 1
            if self.mode == "record":
                res = fn(*args, **kwargs)
                self.calls.setdefault(self.rot, []).append((name, fn, args, kwargs, res))
                return res
            if self.mode == "skip" and i == self.skip:
                return self.calls[self.rot][i][4]
            return fn(*args, **kwargs)

        return wrapped

    def restore(self) -> None:
        for m, n in self.mods:
            setattr(m, n, self.orig[(m.__name__, n)])


def _random_like(t: torch.Tensor, weights: bool) -> torch.Tensor:
    """``t``'s shape and dtype filled as ``sweep_gemm`` fills its operands: randn rows, randn /
    sqrt(K) weights (FP8 then holds small values, not the full-range row-scaled ones)."""
    r = torch.randn(t.shape, device=t.device)
    if weights:
        r = r / t.shape[-1] ** 0.5
    return r.to(t.dtype)


def one_case(model: str, T: int, fp8: bool, rots: int, device: str = "cuda") -> list[dict]:
    from moekit import layer_bench
    from moekit.benchmarking import bench_us
    from moekit.layers.functional import moe_forward, quantize_expert_weights
    from moekit.testing import MODEL_SHAPES, random_expert_weights, random_m_sizes

    s = MODEL_SHAPES[model]
    cfg = layer_bench.routing_config(s)
    w = random_expert_weights(s, dtype=torch.bfloat16, device=device, seed=0)
    if fp8:
        w13, w13s = quantize_expert_weights(w["w13_e2FD"])
        w2, w2s = quantize_expert_weights(w["w2_eDF"])
    else:
        w13, w13s, w2, w2s = w["w13_e2FD"], None, w["w2_eDF"], None
    xs = [torch.randn(T, s.D, device=device, dtype=torch.bfloat16) for _ in range(rots)]
    logits = [(x @ w["router_DE"]).float() for x in xs]
    bias = w.get("e_score_correction_bias")
    rec = Recorder()

    def step(r: int):
        def f():
            rec.rot, rec.idx = r, 0
            return moe_forward(xs[r], None, w13, w2, cfg, logits_TE=logits[r], w13_scale_e2F=w13s,
                               w2_scale_eD=w2s, e_score_correction_bias=bias)  # fmt: skip

        return f

    steps = [step(r) for r in range(rots)]
    try:
        for f in steps:  # compile every kernel
            f()
        rec.mode = "record"
        for f in steps:
            f()
        if device == "cuda":
            torch.cuda.synchronize()
        rec.mode = "off"
        n = len(rec.calls[0])
        if any(len(rec.calls[r]) != n or [c[0] for c in rec.calls[r]] != [c[0] for c in rec.calls[0]]
               for r in range(rots)):  # fmt: skip
            raise RuntimeError("the rotations took different stage sequences")
        layer = bench_us(steps)
        rows = []
        for i in range(n):
            name = rec.calls[0][i][0]

            def alone(r, i=i):
                _, fn, args, kwargs, _ = rec.calls[r][i]
                return lambda: fn(*args, **kwargs)

            t_alone = bench_us([alone(r) for r in range(rots)])
            rec.mode, rec.skip = "skip", i
            t_without = bench_us(steps)
            rec.mode, rec.skip = "off", -1
            t_rand = None
            _, fn, args, kwargs, _ = rec.calls[0][i]
            if name.startswith("grouped_gemm") and name != "grouped_gemm_combine" and len(args) >= 3:
                ms = args[2]
                M = int(ms.sum().item())
                rand = [random_m_sizes(M, ms.shape[0], device=device, seed=r) for r in range(rots)]

                def rnd(r, i=i):
                    _, fn, args, kwargs, _ = rec.calls[r][i]
                    a = list(args)
                    a[2] = rand[r]
                    return lambda: fn(*a, **kwargs)

                t_rand = bench_us([rnd(r) for r in range(rots)])
            t_plain = t_rw = t_rxw = None
            if name.startswith("grouped_gemm") and name != "grouped_gemm_combine":
                epi = ("token_weights", "_output_tensor", "_scatter_add_indices", "deterministic")
                if name != "grouped_gemm_swiglu" and any(kwargs.get(k) is not None for k in epi[:3]):

                    def plain(r, i=i):  # rows out: no token weights, no scatter-add
                        _, fn, args, kwargs, _ = rec.calls[r][i]
                        kw = {k: v for k, v in kwargs.items() if k not in epi}
                        return lambda: fn(*args, **kw)

                    t_plain = bench_us([plain(r) for r in range(rots)])
                xr, wr = _random_like(args[0], False), _random_like(args[1], True)

                def rand_data(r, i=i, both=False):  # sweep_gemm's data: randn rows, randn / sqrt(K) weights
                    _, fn, args, kwargs, _ = rec.calls[r][i]
                    a = list(args)
                    a[1] = wr
                    if both:
                        a[0] = xr
                    return lambda: fn(*a, **kwargs)

                t_rw = bench_us([rand_data(r) for r in range(rots)])
                t_rxw = bench_us([rand_data(r, both=True) for r in range(rots)])
                del xr, wr
            occ = torch.stack([rec.calls[r][i][2][2] for r in range(rots)]) if t_rand is not None else None
            rows.append({
                "model": model, "T": T, "dtype": "fp8" if fp8 else "bf16", "stage": i, "op": name,
                "alone_us": t_alone, "in_place_us": layer - t_without, "random_m_sizes_us": t_rand,
                "plain_us": t_plain, "rand_w_us": t_rw, "rand_xw_us": t_rxw,
                "max_rows": int(occ.max().item()) if occ is not None else None, "layer_us": layer,
            })  # fmt: skip
        return rows
    finally:
        rec.restore()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8")
    p.add_argument("--tokens", default="256")
    p.add_argument("--dtype", default="fp8")
    p.add_argument("--rotations", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="accepted for device_session.sh (QUICK=1); no effect")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("isolate_stages needs CUDA; nothing to do on this machine")
        return 0
    from moekit.benchmarking import markdown_table, save_rows

    rows = []
    for dt in a.dtype.split(","):
        for m in a.models.split(","):
            for T in [int(t) for t in a.tokens.split(",")]:
                r = one_case(m, T, dt == "fp8", a.rotations)
                print(f"== {m} T={T} {dt}: layer {r[0]['layer_us']:.1f} us, stages alone "
                      f"{sum(x['alone_us'] for x in r):.1f}", flush=True)  # fmt: skip
                print(
                    markdown_table(
                        r,
                        [
                            "stage",
                            "op",
                            "alone_us",
                            "in_place_us",
                            "random_m_sizes_us",
                            "plain_us",
                            "rand_w_us",
                            "rand_xw_us",
                            "max_rows",
                        ],
                    )
                )
                rows += r
    save_rows("isolate_stages", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
