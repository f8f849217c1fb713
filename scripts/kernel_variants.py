#!/usr/bin/env python3
"""Which compiled variants of moekit's Triton kernels a layer's forward runs, eager and under
torch.compile: each variant's specialization (the arguments Triton took as divisible by 16 or as
constants), warps, stages, shared memory and registers, so a kernel that runs slower inside a
compiled graph than eagerly (H100, session 45: the same tiled GEMMs 24-36% slower in
``torch.compile(moe_forward)``) can be traced to how it was compiled.

    python scripts/kernel_variants.py [--model qwen3-30b-a3b] [--tokens 2048] [--dtype bf16]
        [--kernels _swiglu_tiled_kernel,_gg_tiled_kernel] [--dump DIR]

Runs with a fresh ``TRITON_CACHE_DIR`` (every variant compiled in this process), then reads the
cache: one line per variant and kernel; ``--dump`` copies each variant's TTGIR there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def _variants(cache: str, names: set[str]) -> list[dict]:
    out = []
    for meta_path in glob.glob(os.path.join(cache, "**", "*.json"), recursive=True):
        if os.path.basename(meta_path).startswith("__grp__"):
            continue
        try:
            meta = json.load(open(meta_path))
        except (OSError, ValueError):
            continue
        if meta.get("name") not in names:
            continue
        d = os.path.dirname(meta_path)
        ttgir = next(iter(glob.glob(os.path.join(d, "*.ttgir"))), None)
        sig = ""
        if ttgir:
            for line in open(ttgir):
                if "tt.func public" in line:
                    sig = line.strip()
                    break
        out.append(
            {"name": meta["name"], "dir": d, "warps": meta.get("num_warps"), "stages": meta.get("num_stages"),
             "shared": meta.get("shared"), "mtime": os.path.getmtime(meta_path), "sig": sig, "ttgir": ttgir,
             "meta": {k: meta[k] for k in sorted(meta) if k not in ("name", "hash", "target")}}
        )  # fmt: skip
    return sorted(out, key=lambda r: r["mtime"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", default="_swiglu_tiled_kernel,_gg_tiled_kernel")
    ap.add_argument("--dump", default="", help="copy each variant's TTGIR into this directory")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kv_triton_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # before triton reads it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")  # (its kernels' Triton cache too)
    import torch

    if not torch.cuda.is_available():
        print("kernel_variants: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    from moekit import layer_bench
    from moekit.layers.functional import moe_forward, quantize_expert_weights
    from moekit.testing import MODEL_SHAPES, random_expert_weights

    s = MODEL_SHAPES[args.model]
    cfg = layer_bench.routing_config(s)
    w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
    kw = {"e_score_correction_bias": w.get("e_score_correction_bias")}
    w13, w2 = w["w13_e2FD"], w["w2_eDF"]
    if args.dtype == "fp8":
        (w13, kw["w13_scale_e2F"]), (w2, kw["w2_scale_eD"]) = quantize_expert_weights(w13), quantize_expert_weights(w2)
    x = torch.randn(args.tokens, s.D, device="cuda", dtype=torch.bfloat16)
    logits = (x @ w["router_DE"]).float()
    names = set(args.kernels.split(","))
    moe_forward(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    torch.cuda.synchronize()
    eager = {v["dir"] for v in _variants(cache, names)}
    torch.compile(moe_forward, fullgraph=True, dynamic=False)(x, None, w13, w2, cfg, logits_TE=logits, **kw)
    torch.cuda.synchronize()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for v in _variants(cache, names):
        where = "eager" if v["dir"] in eager else "compiled"
        print(f"== {where:8s} {v['name']} warps={v['warps']} stages={v['stages']} shared={v['shared']}")
        print(f"   {v['sig'][:4000]}")
        print(f"   {json.dumps(v['meta'])[:1500]}")
        if args.dump and v["ttgir"]:
            shutil.copy(v["ttgir"], os.path.join(args.dump, f"{where}_{v['name']}_{os.path.basename(v['dir'])}.ttgir"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
