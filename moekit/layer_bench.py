"""``moekit bench``: one MoE layer (routed experts + shared expert), moekit vs a plain PyTorch
pipeline (vs MSLK's pipeline when importable and the model is within its limits), same process.

On CUDA the default is Llama 4 Scout shapes (D=5120, F=8192, E=16, top-1 sigmoid, shared expert);
on a CPU-only machine a tiny config runs the reference path so the command works anywhere.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch

from moekit.benchmarking import bench_us, environment, floor_us, markdown_table, rotations, save_rows, try_import_mslk
from moekit.layers.functional import RoutingConfig, moe_forward, quantize_expert_weights, route
from moekit.testing import MODEL_SHAPES, ModelShape, random_expert_weights

GPU_TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
GPU_TOKENS_QUICK = [1, 64, 1024]
CPU_TOKENS = [1, 16, 64]


def routing_config(s: ModelShape) -> RoutingConfig:
    return s.routing_config


def shared_expert(x: torch.Tensor, w: dict) -> Optional[torch.Tensor]:
    if "shared_w13_2FD" not in w:
        return None
    h = x @ w["shared_w13_2FD"].T
    F = h.shape[1] // 2
    return (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w["shared_w2_DF"].T


def torch_pipeline(x: torch.Tensor, w: dict, cfg: RoutingConfig) -> torch.Tensor:
    """What a user writes with stock PyTorch: the router GEMM, ``torch_routed`` (top-k, stable
    argsort, counts, gather, ``torch._grouped_mm`` twice, ``index_add_``) and the shared expert."""
    routed = torch_routed(x, x @ w["router_DE"], w, cfg)
    shared = shared_expert(x, w)
    return routed if shared is None else routed.add_(shared)


def moekit_pipeline(
    x: torch.Tensor, w: dict, cfg: RoutingConfig, fp8: Optional[dict] = None, deterministic: bool = False
) -> torch.Tensor:
    shared = shared_expert(x, w)
    if fp8 is None:
        return moe_forward(
            x,
            w["router_DE"],
            w["w13_e2FD"],
            w["w2_eDF"],
            cfg,
            e_score_correction_bias=w.get("e_score_correction_bias"),
            shared_out_TD=shared,
            deterministic=deterministic,
        )
    return moe_forward(
        x,
        w["router_DE"],
        fp8["w13"],
        fp8["w2"],
        cfg,
        e_score_correction_bias=w.get("e_score_correction_bias"),
        shared_out_TD=shared,
        w13_scale_e2F=fp8["w13_scale"],
        w2_scale_eD=fp8["w2_scale"],
        deterministic=deterministic,
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
    return routed_bytes(s, sel, cfg.top_k, fp8, w["w13_e2FD"].element_size(), x) + (
        3 * s.D * s.shared_F * w["router_DE"].element_size() if s.shared_F else 0
    )


def routed_bytes(s: ModelShape, sel: torch.Tensor, top_k: int, fp8: bool, elem: int, x: torch.Tensor) -> float:
    """Weights of the experts hit by the top-k of ``sel`` (1 byte each for FP8), plus x and out."""
    hit = torch.unique(torch.topk(sel, top_k, dim=-1).indices).numel()
    return hit * 3 * s.D * s.F * (1 if fp8 else elem) + 2 * x.numel() * x.element_size()


def _vllm_harness():
    """vLLM 0.33's Triton fused_moe harness (a benchmark peer, never a dependency): found at
    ``$MOEKIT_VLLM_HARNESS``, ``.peers/vllm_fused_moe`` or ``../shared/peers/vllm_fused_moe``."""
    import importlib
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (os.environ.get("MOEKIT_VLLM_HARNESS"), os.path.join(root, ".peers", "vllm_fused_moe"),
              os.path.join(root, "..", "shared", "peers", "vllm_fused_moe")):  # fmt: skip
        if d and os.path.exists(os.path.join(d, "vllm_fused_moe.py")):
            if d not in sys.path:
                sys.path.insert(0, d)
            try:
                return importlib.import_module("vllm_fused_moe")
            except Exception as exc:  # keep the other columns
                print(f"   vLLM harness at {d} does not import: {type(exc).__name__}: {exc}")
                return None
    return None


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Relative error of a pipeline's output; a wrong result stops the benchmark before timing."""
    from moekit.testing import rel_error

    err = rel_error(got.float(), want.float())
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e} against the float32 reference")
    return err


def _expert_f32(w, e: int) -> torch.Tensor:
    """Expert ``e`` of stacked weights in float32; ``w`` a tensor or ``(fp8 weights, row scales)``."""
    if isinstance(w, tuple):
        return w[0][e].float() * w[1][e][:, None]
    return w[e].float()


def _reference_routed(x, w13, w2, ids, weights, on_input):
    """float32 routed-experts output for the given top-k (weights on input or output); ``w13`` /
    ``w2`` stacked weights or ``(fp8 weights, row scales)``, dequantized per expert."""
    T, D = x.shape
    F = (w2[0] if isinstance(w2, tuple) else w2).shape[2]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).long()
    wt = weights.reshape(-1).float()
    tok = torch.arange(T, device=x.device).repeat_interleave(ids.shape[1])
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().flatten()
        xs = x[tok[sel]].float()
        if on_input:
            xs = xs * wt[sel, None]
        h = xs @ _expert_f32(w13, e).T
        y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ _expert_f32(w2, e).T
        if not on_input:
            y = y * wt[sel, None]
        out.index_add_(0, tok[sel], y)
    return out


# Routings rotated at T <= DECODE_SETS_MAX_T whatever the bytes. One routing read the same experts
# every replay, and their time moved with the process: Llama 4 Scout bf16 T=1 on one H100 read
# 85.5-109.0 µs across lanes of the same code (sessions 42-43, one set: 252 MB of one expert),
# while sweep_decode.py, eight routings rotated, read 88.1 and 88.0 in two calls. Each set's
# x and logits are T rows: nothing at these sizes.
DECODE_SETS = 8
DECODE_SETS_MAX_T = 64


_COMPILED: dict = {}


def compiled_forward():
    """``torch.compile(moe_forward, fullgraph=True)`` for the settings in force: the launchers read
    the settings and knobs while Dynamo traces and its guards do not see them, so a change of
    settings resets Dynamo and compiles again (the same settings reuse the compiled graphs)."""
    from moekit import settings

    key = repr(settings.get())
    if key not in _COMPILED:
        torch._dynamo.reset()
        _COMPILED.clear()
        _COMPILED[key] = torch.compile(moe_forward, fullgraph=True, dynamic=False)
    return _COMPILED[key]


def routing_sets(touched: float, T: int) -> int:
    """Routings a row rotates: enough that together they outgrow the L2 (``rotations``, at most 8),
    and ``DECODE_SETS`` at decode sizes even where one set does (each set reads other experts)."""
    return max(rotations(touched, max_sets=8), DECODE_SETS if T <= DECODE_SETS_MAX_T else 1)


def run(model: str, tokens: list[int], fp8: bool, quick: bool, lean: bool = False,
        alt_knobs: Optional[dict] = None, compiled: bool = False) -> list[dict]:  # fmt: skip
    """One row per T: the routed experts of one layer, **from router logits to output**, for
    moekit (``moe_forward(logits_TE=...)``, the automatic pipeline, and the sorted one pinned),
    vLLM 0.33's Triton fused_moe with the routing precomputed (its ``us_moe_only``), MSLK's
    pipeline (top-1 sigmoid) and plain torch; each checked against a float32 reference before it
    is timed. Inputs rotate over several routings so the experts' weights are not served from L2
    (and at decode sizes over eight: ``routing_sets``).
    ``lean``: moekit's automatic pipeline and vLLM only (same-call A/B lanes of a setting).
    ``alt_knobs``: also moekit with these knobs pinned (``settings.override(knobs=...)``), in the
    same process on the same inputs, timed default / knobs / knobs / default (``moekit_us``,
    ``alt_us``, ``alt_us_2``, ``moekit_us_2``): ``alt/moekit`` is the ratio of the two means.
    ``compiled``: moekit's forward through ``torch.compile(fullgraph=True)`` (``compiled_forward``).
    Session 43's lanes in separate processes drew a fast or a slow mode per process (H100:
    Mixtral-8x7B bf16 T=1 234 or 275 µs on one path); session 44 found the slow readings were a
    cell's first ones, before ``bench_us`` warmed up for 50 ms (``MOEKIT_BENCH_WARMUP_MS``)."""
    from moekit import settings
    from moekit.reference.routing import routing_weights

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    s = MODEL_SHAPES[model]
    cfg = routing_config(s)
    dtype = torch.bfloat16 if cuda else torch.float32
    w = random_expert_weights(s, dtype=dtype, device=device, seed=0)
    bias = w.get("e_score_correction_bias")
    q = None
    if fp8:
        w13q, w13s = quantize_expert_weights(w["w13_e2FD"])
        w2q, w2s = quantize_expert_weights(w["w2_eDF"])
        q = {"w13": w13q, "w13_scale": w13s, "w2": w2q, "w2_scale": w2s}
    w13 = q["w13"] if fp8 else w["w13_e2FD"]
    w2 = q["w2"] if fp8 else w["w2_eDF"]
    # The reference's weights: FP8 dequantized one expert at a time (``_reference_routed``), not
    # whole (a float32 copy of Llama 4 Maverick's w13 is 43 GB).
    deq13 = (q["w13"], q["w13_scale"]) if fp8 else w["w13_e2FD"]
    deq2 = (q["w2"], q["w2_scale"]) if fp8 else w["w2_eDF"]
    mslk = try_import_mslk() if cuda else None
    mslk_ok = mslk is not None and s.top_k == 1 and s.score_func == "sigmoid" and s.E in (16, 32, 128, 320) and not fp8
    vllm = _vllm_harness() if cuda else None
    on_input = cfg.apply_router_weight_on_input
    tol = 8e-2 if fp8 else 2e-2
    reps = 5 if quick else 20
    rows = []
    vq: list = []
    for T in tokens:
        g = torch.Generator(device="cpu").manual_seed(T)
        x0 = torch.randn(T, s.D, generator=g).to(dtype).to(device)
        l0 = (x0 @ w["router_DE"]).float()
        touched = routed_bytes(s, route(l0, cfg, bias)[0], cfg.top_k, fp8, dtype.itemsize, x0)
        n_sets = routing_sets(touched, T) if cuda else 1
        sets = []
        for i in range(n_sets):
            x = x0 if i == 0 else torch.randn(T, s.D, generator=g).to(dtype).to(device)
            logits = (x @ w["router_DE"]).float()
            wts, ids = routing_weights(logits, cfg.top_k, cfg.score_func, cfg.renormalize, n_group=cfg.n_group,
                                       topk_group=cfg.topk_group, e_score_correction_bias=bias,
                                       routed_scaling_factor=cfg.routed_scaling_factor)  # fmt: skip
            sets.append(dict(x=x, logits=logits, tw=wts.contiguous(), ti=ids.to(torch.int32).contiguous()))
        row: dict = {"model": model, "T": T, "dtype": "fp8" if fp8 else str(dtype).replace("torch.", "")}
        nbytes = sum(routed_bytes(s, route(st["logits"], cfg, bias)[0], cfg.top_k, fp8, dtype.itemsize, st["x"])
                     for st in sets) / n_sets  # fmt: skip
        row["flops"] = 2 * T * s.top_k * 3 * s.D * s.F
        row["bytes"] = nbytes  # what the floor counts (weights of the experts hit, x and out)
        row["floor_us"] = floor_us(nbytes, row["flops"], fp8=fp8)
        ref0 = _reference_routed(sets[0]["x"], deq13, deq2, sets[0]["ti"], sets[0]["tw"], on_input)

        def ours(st, path=None, det=False):
            fwd = compiled_forward() if compiled else moe_forward
            return fwd(
                st["x"], None, w13, w2, cfg, e_score_correction_bias=bias, logits_TE=st["logits"],
                w13_scale_e2F=q["w13_scale"] if fp8 else None, w2_scale_eD=q["w2_scale"] if fp8 else None,
                deterministic=det, path=path,
            )  # fmt: skip

        from moekit.layers.experts import choose_path, decode_fused

        def path_now() -> str:  # the pipeline moe_forward takes under the current settings
            if (torch.bfloat16 if fp8 else dtype) == dtype and decode_fused(T * s.top_k, s.E, s.top_k, fp8,
                                                                            n_group=cfg.n_group):  # fmt: skip
                return "fused"  # moe_decode: two launches from the logits
            return choose_path(T * s.top_k, s.E, fp8=fp8, top_k=s.top_k)

        row["path"] = path_now()
        row["moekit_err"] = _check("moekit", ours(sets[0]), ref0, tol)
        row["moekit_us"] = bench_us([lambda st=st: ours(st) for st in sets], replays=reps)
        if alt_knobs:
            with settings.override(knobs=alt_knobs):
                row["alt_path"] = path_now()
                row["alt_err"] = _check("moekit alt", ours(sets[0]), ref0, tol)
                row["alt_us"] = bench_us([lambda st=st: ours(st) for st in sets], replays=reps)
                row["alt_us_2"] = bench_us([lambda st=st: ours(st) for st in sets], replays=reps)
            row["moekit_us_2"] = bench_us([lambda st=st: ours(st) for st in sets], replays=reps)
            row["alt/moekit"] = (row["alt_us"] + row["alt_us_2"]) / (row["moekit_us"] + row["moekit_us_2"])
        if cuda and T <= 2048 and not lean:  # the other pipeline on the same rows
            alt = "sorted" if row["path"] in ("decode", "fused") else "decode"
            with settings.override(moe_path=alt):
                _check(f"moekit {alt}", ours(sets[0]), ref0, tol)
                row[f"{alt}_us"] = bench_us([lambda st=st: ours(st) for st in sets], replays=reps)
        if cuda and s.top_k > 1 and not (quick or lean):
            row["det_us"] = bench_us([lambda st=st: ours(st, det=True) for st in sets], replays=reps)
        if vllm is not None and not on_input:
            try:
                if fp8:
                    if not vq:  # vLLM's own per-channel FP8 weights, once per model (not per T)
                        vq.extend(vllm.quantize_weight_per_channel_fp8(w["w13_e2FD"]))
                        vq.extend(vllm.quantize_weight_per_channel_fp8(w["w2_eDF"]))
                    v13, v13s, v2, v2s = vq

                    def theirs(st):
                        return vllm.vllm_moe_fp8(st["x"], v13, v13s, v2, v2s, st["tw"], st["ti"])
                else:

                    def theirs(st):
                        return vllm.vllm_moe(st["x"], w["w13_e2FD"], w["w2_eDF"], st["tw"], st["ti"])

                row["vllm_err"] = _check("vllm", theirs(sets[0]), ref0, tol)
                row["vllm_us"] = bench_us([lambda st=st: theirs(st) for st in sets], replays=reps)
            except Exception as exc:
                row["vllm_us"] = None
                row["vllm_error"] = f"{type(exc).__name__}: {exc}"[:120]
                print(f"   vLLM T={T}: {row['vllm_error']}")
        if not lean and (not quick or T <= 64):
            try:
                row["torch_us"] = bench_us([lambda st=st: torch_routed(st["x"], st["logits"], w, cfg)
                                            for st in sets], replays=reps)  # fmt: skip
            except Exception as exc:  # torch._grouped_mm needs sm_90+ on CUDA
                row["torch_us"] = None
                row["torch_error"] = type(exc).__name__
        if mslk_ok and not lean:
            try:
                w13l = w["w13_e2FD"].reshape(-1, s.D)
                w2l = w["w2_eDF"].reshape(-1, s.F)
                # MSLK routes on bf16 sigmoid scores: where two experts' scores round to one bf16
                # value its choice may differ from the float32 routing's (a few tokens from T=16 on
                # failed the 2% check against ref0). Its experts are checked with its own choice.
                m_ti, m_tw = mslk_routing(sets[0]["logits"])
                ref_m = _reference_routed(sets[0]["x"], deq13, deq2, m_ti, m_tw, on_input)
                row["mslk_err"] = _check("mslk", mslk_routed(sets[0]["x"], sets[0]["logits"], w, w13l, w2l), ref_m, tol)
                row["mslk_routing_differs"] = int((m_ti != sets[0]["ti"]).sum())
                row["mslk_us"] = bench_us([lambda st=st: mslk_routed(st["x"], st["logits"], w, w13l, w2l)
                                           for st in sets], replays=reps)  # fmt: skip
            except Exception as exc:
                row["mslk_us"] = None
                row["mslk_error"] = f"{type(exc).__name__}: {exc}"[:80]
        row["floor/moekit"] = row["floor_us"] / row["moekit_us"]
        for peer in ("vllm", "torch", "mslk", "sorted", "decode"):
            if row.get(f"{peer}_us"):
                row[f"moekit/{peer}"] = row["moekit_us"] / row[f"{peer}_us"]
        rows.append(row)
        extra = f", vLLM {row['vllm_us']:.1f}" if row.get("vllm_us") else ""
        print(f"  T={T}: moekit {row['moekit_us']:.1f} us ({row['path']}; floor {row['floor_us']:.1f}{extra})",
              flush=True)  # fmt: skip
    return rows


def torch_routed(x: torch.Tensor, logits: torch.Tensor, w: dict, cfg: RoutingConfig) -> torch.Tensor:
    """The routed experts with stock PyTorch from router logits."""
    E = w["router_DE"].shape[1]
    F = w["w2_eDF"].shape[2]
    sel, weights = route(logits, cfg, w.get("e_score_correction_bias"))
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
    return torch.zeros_like(x).index_add_(0, tok, y)


def mslk_routing(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-1 choice MSLK's ``index_shuffling`` makes on bf16 sigmoid scores, as ``[T, 1]``
    expert ids and float32 weights (the score of the chosen expert)."""
    scores = torch.sigmoid(logits.to(torch.bfloat16))
    _, eidx, tidx = torch.ops.mslk.index_shuffling(scores)
    T = logits.shape[0]
    ids = torch.empty(T, dtype=torch.int64, device=logits.device)
    ids[tidx.flatten()[:T].long()] = eidx.flatten()[:T].long()
    return ids[:, None].to(torch.int32), scores.gather(1, ids[:, None]).float()


def mslk_routed(x: torch.Tensor, logits: torch.Tensor, w: dict, w13l: torch.Tensor, w2l: torch.Tensor):
    """MSLK 1.1.0's routed experts from router logits (top-1 sigmoid, score on the input)."""
    from mslk.gemm.triton.grouped_gemm import grouped_gemm as m_gg  # type: ignore
    from mslk.moe import gather_scale_dense_tokens, silu_mul  # type: ignore

    E = w["router_DE"].shape[1]
    F = w["w2_eDF"].shape[2]
    scores = torch.sigmoid(logits.to(x.dtype))
    counts, eidx, tidx = torch.ops.mslk.index_shuffling(scores)
    xg = gather_scale_dense_tokens(x, tidx.flatten(), eidx.flatten(), scores)
    h = m_gg(xg, w13l, counts[:E], _use_warp_specialization=False)
    z = silu_mul(h[:, :F], h[:, F:])
    out = torch.zeros_like(x)
    return m_gg(z, w2l, counts[:E], _use_warp_specialization=False, _output_tensor=out, _scatter_add_indices=tidx)


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
    cols = ["model", "T", "dtype", "path", "floor_us", "moekit_us", "decode_us", "sorted_us", "vllm_us", "torch_us", "mslk_us",
            "floor/moekit", "moekit/vllm", "moekit/torch", "moekit/mslk"]  # fmt: skip
    print(markdown_table(rows, [c for c in cols if any(c in r for r in rows)]))
    save_rows(f"layer_{model}_{args.dtype}", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": environment(), "rows": rows}, f, indent=1)
    return 0
