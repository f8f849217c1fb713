"""``moekit bench``: one MoE layer (routed experts + shared expert), moekit vs a plain PyTorch
pipeline (vs MSLK's pipeline when importable and the model is within its limits), same process.

On CUDA the default is Llama 4 Scout shapes (D=5120, F=8192, E=16, top-1 sigmoid, shared expert);
on a CPU-only machine a tiny config runs the reference path so the command works anywhere.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

import torch

from moekit.benchmarking import bench_us, environment, floor_us, markdown_table, save_rows, try_import_mslk
from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights, route
from moekit.testing import MODEL_SHAPES, ModelShape, random_expert_weights

GPU_TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
GPU_TOKENS_QUICK = [1, 64, 1024]
CPU_TOKENS = [1, 16, 64]


def routing_config(s: ModelShape) -> RoutingConfig:
    return RoutingConfig(
        top_k=s.top_k,
        score_func=s.score_func,
        renormalize=s.renormalize,
        n_group=s.n_group,
        topk_group=s.topk_group,
        routed_scaling_factor=s.routed_scaling_factor,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
    )


def shared_expert(x: torch.Tensor, w: dict) -> Optional[torch.Tensor]:
    if "shared_w13_2FD" not in w:
        return None
    h = x @ w["shared_w13_2FD"].T
    F = h.shape[1] // 2
    return (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w["shared_w2_DF"].T


def torch_pipeline(x: torch.Tensor, w: dict, cfg: RoutingConfig) -> torch.Tensor:
    """What a user writes with stock PyTorch: top-k, stable argsort, bincount, gather,
    ``torch._grouped_mm`` twice, ``index_add_``."""
    T, D = x.shape
    E = w["router_DE"].shape[1]
    F = w["w2_eDF"].shape[2]
    sel, weights = route(x @ w["router_DE"], cfg, w.get("e_score_correction_bias"))
    ids = torch.topk(sel, cfg.top_k, dim=-1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    tok = order // cfg.top_k
    eid = ids[order]
    # bincount would sync with the host (it sizes its output from the data): count with scatter_add_.
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, ids, torch.ones_like(ids))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    wt = weights[tok, eid]
    xs = x[tok]
    if cfg.apply_router_weight_on_input:
        xs = (xs.float() * wt.unsqueeze(1)).to(x.dtype)
    h = torch._grouped_mm(xs, w["w13_e2FD"].transpose(1, 2), offs=offs)
    z = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    y = torch._grouped_mm(z, w["w2_eDF"].transpose(1, 2), offs=offs)
    if not cfg.apply_router_weight_on_input:
        y = (y.float() * wt.unsqueeze(1)).to(x.dtype)
    out = shared_expert(x, w)
    out = torch.zeros_like(x) if out is None else out
    return out.index_add_(0, tok, y)


def moekit_pipeline(x: torch.Tensor, w: dict, cfg: RoutingConfig, fp8: Optional[dict] = None,
                    deterministic: bool = False) -> torch.Tensor:
    shared = shared_expert(x, w)
    if fp8 is None:
        return moe_forward(
            x, w["router_DE"], w["w13_e2FD"], w["w2_eDF"], cfg,
            e_score_correction_bias=w.get("e_score_correction_bias"), shared_out_TD=shared,
            deterministic=deterministic,
        )
    return moe_forward(
        x, w["router_DE"], fp8["w13"], fp8["w2"], cfg,
        e_score_correction_bias=w.get("e_score_correction_bias"), shared_out_TD=shared,
        w13_scale_e2F=fp8["w13_scale"], w2_scale_eD=fp8["w2_scale"], deterministic=deterministic,
    )


def mslk_pipeline(mslk, x: torch.Tensor, w: dict, w13_DE_layout: torch.Tensor, w2_layout: torch.Tensor) -> torch.Tensor:
    """MSLK 1.1.0's own single-GPU MetaShuffling path (top-1 sigmoid, score on the input)."""
    from mslk.gemm.triton.grouped_gemm import grouped_gemm as m_gg  # type: ignore
    from mslk.moe import gather_scale_dense_tokens, silu_mul  # type: ignore

    E = w["router_DE"].shape[1]
    F = w["w2_eDF"].shape[2]
    scores = torch.sigmoid(x @ w["router_DE"])
    counts, eidx, tidx = torch.ops.mslk.index_shuffling(scores)
    xg = gather_scale_dense_tokens(x, tidx.flatten(), eidx.flatten(), scores)
    shared = shared_expert(x, w)
    # MSLK's warp-specialized configs fail in ptxas on this toolchain (insufficient registers).
    h = m_gg(xg, w13_DE_layout, counts[:E], _use_warp_specialization=False)
    z = silu_mul(h[:, :F], h[:, F:])
    return m_gg(
        z, w2_layout, counts[:E], _use_warp_specialization=False, _output_tensor=shared, _scatter_add_indices=tidx
    )


def expected_bytes(s: ModelShape, w: dict, x: torch.Tensor, cfg: RoutingConfig, fp8: bool = False) -> float:
    """Bytes that must move: the weights of the experts actually hit, the shared expert, x and out."""
    sel, _ = route(x @ w["router_DE"], cfg, w.get("e_score_correction_bias"))
    hit = torch.unique(torch.topk(sel, cfg.top_k, dim=-1).indices).numel()
    elt = 1 if fp8 else w["w13_e2FD"].element_size()
    per_expert = 3 * s.D * s.F * elt
    shared = 3 * s.D * s.shared_F * w["router_DE"].element_size() if s.shared_F else 0
    return hit * per_expert + shared + 2 * x.numel() * x.element_size()


def run(model: str, tokens: list[int], fp8: bool, quick: bool) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    s = MODEL_SHAPES[model]
    cfg = routing_config(s)
    dtype = torch.bfloat16 if cuda else torch.float32
    w = random_expert_weights(s, dtype=dtype, device=device, seed=0)
    q = None
    if fp8:
        w13q, w13s = quantize_expert_weights(w["w13_e2FD"])
        w2q, w2s = quantize_expert_weights(w["w2_eDF"])
        q = {"w13": w13q, "w13_scale": w13s, "w2": w2q, "w2_scale": w2s}
    mslk = try_import_mslk() if cuda else None
    mslk_ok = mslk is not None and s.top_k == 1 and s.score_func == "sigmoid" and s.E in (16, 32, 128, 320)
    rows = []
    for T in tokens:
        g = torch.Generator(device="cpu").manual_seed(T)
        xs = [torch.randn(T, s.D, generator=g).to(dtype).to(device) for _ in range(2 if cuda else 1)]
        it = iter(range(10**9))
        pick: Callable[[], torch.Tensor] = lambda: xs[next(it) % len(xs)]  # noqa: E731
        row: dict = {"model": model, "T": T, "dtype": "fp8" if fp8 else str(dtype).replace("torch.", "")}
        nbytes = expected_bytes(s, w, xs[0], cfg, fp8)
        flops = 2 * T * s.top_k * 3 * s.D * s.F + (2 * T * 3 * s.D * s.shared_F)
        row["floor_us"] = floor_us(nbytes, flops, fp8=fp8)
        reps = 5 if quick else 20
        row["moekit_us"] = bench_us(lambda: moekit_pipeline(pick(), w, cfg, q), replays=reps)
        if cuda and s.top_k > 1:  # the atomics-free combine (rows stored, then summed per token)
            row["det_us"] = bench_us(lambda: moekit_pipeline(pick(), w, cfg, q, deterministic=True), replays=reps)
        try:
            row["torch_us"] = bench_us(lambda: torch_pipeline(pick(), w, cfg), replays=reps)
        except Exception as exc:  # torch._grouped_mm needs sm_90+ on CUDA
            row["torch_us"] = None
            row["torch_error"] = type(exc).__name__
        if mslk_ok and not fp8:
            try:
                w13l = w["w13_e2FD"].reshape(-1, s.D)
                w2l = w["w2_eDF"].reshape(-1, s.F)
                row["mslk_us"] = bench_us(lambda: mslk_pipeline(mslk, pick(), w, w13l, w2l), replays=reps)
            except Exception as exc:
                row["mslk_us"] = None
                row["mslk_error"] = f"{type(exc).__name__}: {exc}"[:80]
        row["floor/moekit"] = row["floor_us"] / row["moekit_us"]
        if row.get("torch_us"):
            row["moekit/torch"] = row["moekit_us"] / row["torch_us"]
        if row.get("mslk_us"):
            row["moekit/mslk"] = row["moekit_us"] / row["mslk_us"]
        rows.append(row)
        print(f"  T={T}: moekit {row['moekit_us']:.1f} us (floor {row['floor_us']:.1f})", flush=True)
    return rows


def main(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    model = args.model or ("llama4-scout" if cuda else "tiny")
    if model not in MODEL_SHAPES:
        print(f"unknown model {model!r}; choose from {sorted(MODEL_SHAPES)}")
        return 2
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = (GPU_TOKENS_QUICK if args.quick else GPU_TOKENS) if cuda else CPU_TOKENS
    fp8 = args.dtype == "fp8"
    if fp8 and not cuda:
        print("fp8 needs a CUDA GPU; running bf16 semantics in float32 on the CPU instead")
        fp8 = False
    where = "CUDA" if cuda else "CPU (reference path; times are not representative)"
    print(f"moekit bench: model={model} tokens={tokens} dtype={args.dtype} on {where}")
    rows = run(model, tokens, fp8, args.quick)
    cols = ["model", "T", "dtype", "floor_us", "moekit_us", "torch_us", "mslk_us", "floor/moekit", "moekit/torch", "moekit/mslk"]
    print(markdown_table(rows, [c for c in cols if any(c in r for r in rows)]))
    save_rows(f"layer_{model}_{args.dtype}", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": environment(), "rows": rows}, f, indent=1)
    return 0
