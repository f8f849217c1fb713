"""``moekit check``: run every public op (``moekit.ops.__all__``) on this machine's device and
compare it with its float32 reference (``moekit.reference``) on the CPU, on small random inputs.
Prints one line per op (OK / FAIL and its largest relative error); exits 1 if any fails."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

import torch

from moekit import reference as ref
from moekit.testing import assert_close, random_m_sizes, tie_free_scores

# (public op name in moekit.ops, check): each check runs the op on the given device against its
# reference, raises AssertionError past the tolerance, and returns the largest relative error.
CHECKS: list[tuple[str, Callable[[torch.device], float]]] = []

FP8 = torch.float8_e4m3fn
# Dequantized FP8 values against the reference's dequantized values: two round-to-nearest-even
# quantizers differ (by one e4m3 step) only on the few values next to a rounding midpoint.
FP8_DEQUANT_TOL = 1e-2
# The FP8 GEMMs on the same quantized inputs: float32 (or Hopper fast) accumulation, bf16 output.
FP8_GEMM_TOL = 2e-2


def check(name: str):
    """Register the check of public op ``name``."""

    def deco(fn: Callable[[torch.device], float]) -> Callable[[torch.device], float]:
        CHECKS.append((name, fn))
        return fn

    return deco


def covered_ops() -> set[str]:
    """The public ops ``moekit check`` covers (one check each)."""
    return {name for name, _ in CHECKS}


def _dt(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _routed(T: int, E: int, k: int, seed: int):
    """Tie-free scores ``[T, E]`` and the reference's ``(counts, expert_indices, token_indices)``."""
    s = tie_free_scores(T, E, seed=seed)
    return (s, *ref.index_shuffling(s, top_k=k))


def _close(got: torch.Tensor, want: torch.Tensor, msg: str, *, dtype=None, tol=None) -> float:
    return assert_close(got.cpu(), want.cpu(), dtype=dtype, tol=tol, msg=msg)


def _fp8_close(q, scale, rq, rscale, msg: str) -> float:
    """FP8 values with their row scales against the reference's, dequantized, and the scales."""
    err = _close(scale.float(), rscale.float(), f"{msg} scales", tol=1e-5)
    deq = q.float().cpu() * scale.float().cpu().unsqueeze(-1)
    rdeq = rq.float() * rscale.float().unsqueeze(-1)
    return max(err, _close(deq, rdeq, f"{msg} dequantized values", tol=FP8_DEQUANT_TOL))


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


@check("index_shuffling")
def _index_shuffling(device: torch.device) -> float:
    from moekit.ops import index_shuffling

    for T, E, k in [(1, 16, 1), (37, 6, 2), (64, 257, 8)]:
        s = tie_free_scores(T, E, seed=T + E)
        got = index_shuffling(s.to(device), top_k=k)
        want = ref.index_shuffling(s, top_k=k)
        V = int(want[0][E + 1])
        _close(got[0], want[0], f"token_counts T={T} E={E} k={k}")
        _close(got[1][:V], want[1][:V], f"expert_indices T={T} E={E} k={k}")
        _close(got[2][:V], want[2][:V], f"token_indices T={T} E={E} k={k}")
    return 0.0


@check("route_and_shuffle")
def _route_and_shuffle(device: torch.device) -> float:
    from moekit.ops import route_and_shuffle

    err = 0.0
    # (T, E, top_k, score_func, n_group, topk_group); T = 300 takes the multi-launch path on CUDA.
    for T, E, k, sf, ng, tg in [(1, 128, 8, "softmax", None, None), (5, 256, 8, "sigmoid", 8, 4),
                                (300, 16, 2, "softmax", None, None)]:  # fmt: skip
        p = torch.argsort(torch.rand(T, E, generator=torch.Generator().manual_seed(T)), dim=1).float()
        logits = (p - E / 2) / 16  # tie-free
        got = route_and_shuffle(logits.to(device), k, sf, True, n_group=ng, topk_group=tg)
        want = ref.route_and_shuffle(logits, k, sf, True, n_group=ng, topk_group=tg)
        names = ("token_counts", "expert_indices", "token_indices", "row_weights", "selection_rows")
        for g, w, n in zip(got, want, names):
            err = max(err, _close(g, w, f"{n} T={T} E={E} k={k}", tol=1e-6))
    return err


@check("shuffle_top_k")
def _shuffle_top_k(device: torch.device) -> float:
    from moekit.ops import shuffle_top_k

    # (T, E, top_k); repeated experts in a token and out-of-range ids; T = 300 takes two launches.
    for T, E, k in [(1, 128, 8), (37, 256, 8), (300, 16, 2)]:
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(-1, E + 1, (T, k), generator=g)
        w = torch.rand(T, k, generator=g)
        got = shuffle_top_k(ids.to(device), w.to(device), E)
        want = ref.shuffle_top_k(ids, w, E)
        names = ("token_counts", "expert_indices", "token_indices", "row_weights", "selection_rows")
        for gt, wt, n in zip(got, want, names):
            if not torch.equal(gt.cpu(), wt):
                raise AssertionError(f"{n} T={T} E={E} k={k}: {(gt.cpu() != wt).sum().item()} elements differ")
    return 0.0


# ---------------------------------------------------------------------------------------------
# Gather / scatter
# ---------------------------------------------------------------------------------------------


@check("gather_scale_dense_tokens")
def _gather(device: torch.device) -> float:
    from moekit.ops import gather_scale_dense_tokens

    dt = _dt(device)
    s, _, eidx, tidx = _routed(33, 16, 2, seed=1)
    x = torch.randn(33, 256).to(dt)
    got = gather_scale_dense_tokens(x.to(device), tidx.to(device), eidx.to(device), s.to(device))
    return _close(got.float(), ref.gather_scale_dense_tokens(x, tidx, eidx, s).float(), "rows", dtype=dt)


@check("gather_scale_quant_dense_tokens")
def _gather_quant(device: torch.device) -> float:
    from moekit.ops import gather_scale_quant_dense_tokens

    s, _, eidx, tidx = _routed(21, 8, 2, seed=2)
    x = torch.randn(21, 128)
    q, qs = gather_scale_quant_dense_tokens(x.to(device), tidx.to(device), eidx.to(device), s.to(device))
    rq, rs = ref.gather_scale_quant_dense_tokens(x, tidx, eidx, s)
    return _fp8_close(q, qs, rq, rs, "gathered fp8 rows")


def _scatter_inputs(dt: torch.dtype):
    _, _, _, tidx = _routed(33, 16, 2, seed=3)
    return torch.randn(33, 256).to(dt), torch.randn(66, 256).to(dt), tidx


@check("scatter_add_dense_tokens")
def _scatter(device: torch.device) -> float:
    from moekit.ops import scatter_add_dense_tokens

    dt = _dt(device)
    out, rows, tidx = _scatter_inputs(dt)
    got = scatter_add_dense_tokens(out.to(device).clone(), rows.to(device), tidx.to(device))
    want = out.clone()
    ref.scatter_add_dense_tokens(want, rows, tidx)
    return _close(got.float(), want.float(), "out_tokens", dtype=dt)


@check("scatter_add_dense_tokens_deterministic")
def _scatter_det(device: torch.device) -> float:
    from moekit.ops import scatter_add_dense_tokens_deterministic

    dt = _dt(device)
    out, rows, tidx = _scatter_inputs(dt)
    got = scatter_add_dense_tokens_deterministic(out.to(device).clone(), rows.to(device), tidx.to(device))
    want = out.clone()
    ref.scatter_add_dense_tokens_deterministic(want, rows, tidx)
    return _close(got.float(), want.float(), "out_tokens", dtype=dt)


@check("scatter_add_padded_tokens")
def _scatter_padded(device: torch.device) -> float:
    from moekit.ops import scatter_add_padded_tokens

    EP, E, T, D, k = 2, 8, 6, 64, 2
    _, counts, _, tidx = _routed(T, E, k, seed=4)
    rows, out = torch.randn(EP, T * k, D), torch.randn(T, D)
    got = scatter_add_padded_tokens(rows.to(device), counts[:E].to(device), tidx.to(device), out.to(device).clone())
    want = out.clone()
    ref.scatter_add_padded_tokens(rows, counts[:E], tidx, want)
    return _close(got, want, "out_tokens", tol=1e-5)


# ---------------------------------------------------------------------------------------------
# Shuffling (expert-parallel layouts)
# ---------------------------------------------------------------------------------------------

_SHUFFLE_COUNTS = [[2, 1, 3], [0, 4, 1]]  # [EP = 2, E = 3]


@check("combine_shuffling")
def _combine_shuffling(device: torch.device) -> float:
    from moekit.ops import combine_shuffling

    c = torch.tensor(_SHUFFLE_COUNTS, dtype=torch.int32)
    x = torch.randn(11, 64)
    got, gc = combine_shuffling(x.to(device), c.to(device))
    want, wc = ref.combine_shuffling(x, c)
    n = int(wc[-1])
    _close(gc, wc, "token_counts")
    return _close(got[:n], want[:n], "rows", tol=0.0)


@check("split_shuffling")
def _split_shuffling(device: torch.device) -> float:
    from moekit.ops import split_shuffling

    c = torch.tensor(_SHUFFLE_COUNTS, dtype=torch.int32)
    x = torch.randn(11, 64)
    got = split_shuffling(x.to(device), c.to(device), init_with_zeros=True)
    return _close(got, ref.split_shuffling(x, c, init_with_zeros=True), "rows", tol=0.0)


# ---------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------


@check("grouped_gemm")
def _grouped_gemm(device: torch.device) -> float:
    from moekit.ops import grouped_gemm

    G, N, K, M = 4, 64, 128, 48
    dt = _dt(device)
    x = torch.randn(M, K).to(dt)
    w = (torch.randn(G * N, K) / K**0.5).to(dt)
    tw = torch.rand(M).to(dt)
    m = random_m_sizes(M, G, seed=3)
    got = grouped_gemm(x.to(device), w.to(device), m.to(device), token_weights=tw.to(device))
    return _close(got.float(), ref.grouped_gemm(x, w, m, token_weights=tw).float(), "y", dtype=dt)


def _fp8_operands(M: int, G: int, N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xq, xs = ref.quantize_fp8_row(torch.randn(M, K, generator=g))
    wq, ws = ref.quantize_fp8_row(torch.randn(G * N, K, generator=g) / K**0.5)
    return xq, xs, wq, ws


@check("grouped_gemm_fp8_rowwise")
def _grouped_gemm_fp8(device: torch.device) -> float:
    from moekit.ops import grouped_gemm_fp8_rowwise

    G, N, K, M = 4, 64, 128, 40
    xq, xs, wq, ws = _fp8_operands(M, G, N, K, seed=5)
    m = random_m_sizes(M, G, seed=5)
    got = grouped_gemm_fp8_rowwise(*(t.to(device) for t in (xq, wq, m, xs, ws)))
    return _close(got.float(), ref.grouped_gemm_fp8_rowwise(xq, wq, m, xs, ws).float(), "y", tol=FP8_GEMM_TOL)


@check("f8f8bf16_rowwise")
def _f8f8bf16(device: torch.device) -> float:
    from moekit.ops import f8f8bf16_rowwise

    xq, xs, wq, ws = _fp8_operands(24, 1, 64, 128, seed=6)
    bias = torch.randn(64).bfloat16()
    got = f8f8bf16_rowwise(*(t.to(device) for t in (xq, wq, xs, ws, bias)))
    return _close(got.float(), ref.f8f8bf16_rowwise(xq, wq, xs, ws, bias).float(), "y", tol=FP8_GEMM_TOL)


def _decode_inputs(dt: torch.dtype):
    T, E, k, D, F = 3, 16, 4, 64, 32
    p = torch.argsort(torch.rand(T, E, generator=torch.Generator().manual_seed(7)), dim=1).float()
    counts, eidx, tidx, rw, srow = ref.route_and_shuffle(p, k, "softmax", True)
    x = torch.randn(T, D).to(dt)
    w13 = (torch.randn(E * 2 * F, D) / D**0.5).to(dt)
    w2 = (torch.randn(E * D, F) / F**0.5).to(dt)
    return x, w13, w2, counts[:E], eidx, tidx, rw, srow


@check("grouped_gemm_swiglu")
def _grouped_gemm_swiglu(device: torch.device) -> float:
    from moekit.ops import grouped_gemm_swiglu

    dt = _dt(device)
    x, w13, _, m, _, tidx, rw, _ = _decode_inputs(dt)
    got = grouped_gemm_swiglu(x.to(device), w13.to(device), m.to(device), gather_indices=tidx.to(device),
                              row_scales=rw.to(device))  # fmt: skip
    want = ref.grouped_gemm_swiglu(x, w13, m, gather_indices=tidx, row_scales=rw)
    return _close(got.float(), want.float(), "z", dtype=dt)


@check("grouped_gemm_combine")
def _grouped_gemm_combine(device: torch.device) -> float:
    from moekit.ops import grouped_gemm_combine

    dt = _dt(device)
    x, w13, w2, m, eidx, tidx, rw, srow = _decode_inputs(dt)
    z = ref.grouped_gemm_swiglu(x, w13, m, gather_indices=tidx).to(dt)
    out = torch.randn(x.shape).to(dt)  # [T, D]
    got = grouped_gemm_combine(z.to(device), w2.to(device), eidx.to(device), srow.to(device), out.to(device).clone(),
                               row_weights=rw.to(device))  # fmt: skip
    want = ref.grouped_gemm_combine(z, w2, eidx, srow, out.clone(), row_weights=rw)
    return _close(got.float(), want.float(), "out", dtype=dt)


@check("moe_decode")
def _moe_decode(device: torch.device) -> float:
    from moekit.ops import moe_decode

    dt = _dt(device)
    T, E, k, D, F = 3, 16, 4, 64, 32
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, D, generator=g).to(dt)
    logits = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()  # tie-free scores
    w13 = (torch.randn(E, 2 * F, D, generator=g) / D**0.5).to(dt)
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).to(dt)
    out = torch.randn(T, D, generator=g).to(dt)
    got = moe_decode(x.to(device), logits.to(device), w13.to(device), w2.to(device), out.to(device).clone(), k,
                     "softmax", True)  # fmt: skip
    want = ref.moe_decode(x, logits, w13, w2, out.clone(), top_k=k, score_func="softmax", renormalize=True)
    return _close(got.float(), want.float(), "out", dtype=dt)


@check("combine_rows")
def _combine_rows(device: torch.device) -> float:
    from moekit.ops import combine_rows

    dt = _dt(device)
    x, w13, w2, m, eidx, tidx, rw, srow = _decode_inputs(dt)
    rows = torch.randn(srow.shape[0], x.shape[1]).to(dt)
    out = torch.randn(x.shape).to(dt)
    got = combine_rows(out.to(device).clone(), rows.to(device), srow.to(device))
    want = ref.combine_rows(out.clone(), rows, srow)
    return _close(got.float(), want.float(), "out", dtype=dt)


# ---------------------------------------------------------------------------------------------
# Quantization, activation, norm
# ---------------------------------------------------------------------------------------------


@check("quantize_fp8_row")
def _quantize(device: torch.device) -> float:
    from moekit.ops import quantize_fp8_row

    x = torch.randn(2, 20, 128)
    q, s = quantize_fp8_row(x.to(device))
    rq, rs = ref.quantize_fp8_row(x)
    return _fp8_close(q, s, rq, rs, "quantize_fp8_row")


@check("triton_quantize_fp8_row")
def _triton_quantize(device: torch.device) -> float:
    # quantize_fp8_row's kernel with MSLK's signature and the align_rows_to zero padding.
    from moekit.ops import triton_quantize_fp8_row

    x = torch.randn(20, 120)
    q, s = triton_quantize_fp8_row(x.to(device), align_rows_to=16)
    rq, rs = ref.quantize_fp8_row(x)
    rq = torch.nn.functional.pad(rq.float(), (0, 8)).to(FP8)
    return _fp8_close(q, s, rq, rs, "triton_quantize_fp8_row(align_rows_to=16)")


@check("silu_mul")
def _silu_mul(device: torch.device) -> float:
    from moekit.ops import silu_mul

    dt = _dt(device)
    h = torch.randn(17, 96).to(dt)
    hd = h.to(device)
    return _close(silu_mul(hd[:, :48], hd[:, 48:]).float(), ref.silu_mul(h[:, :48], h[:, 48:]).float(), "y", dtype=dt)


@check("silu_mul_quant")
def _silu_mul_quant(device: torch.device) -> float:
    from moekit.ops import silu_mul_quant

    h = torch.randn(9, 96)
    hd = h.to(device)
    q, qs = silu_mul_quant(hd[:, :48], hd[:, 48:])
    rq, rs = ref.silu_mul_quant(h[:, :48], h[:, 48:])
    return _fp8_close(q, qs, rq, rs, "silu_mul_quant")


@check("rms_norm")
def _rms_norm(device: torch.device) -> float:
    from moekit.ops import rms_norm

    dt = _dt(device)
    x, g, r = torch.randn(7, 40).to(dt), torch.randn(40).to(dt), torch.randn(7, 40).to(dt)
    got = rms_norm(x.to(device), g.to(device), residual=r.to(device))
    return _close(got.float(), ref.rms_norm(x, g, residual=r).float(), "y", dtype=dt)


# ---------------------------------------------------------------------------------------------


def run(device: torch.device) -> list[tuple[str, bool, str]]:
    """Run every check on ``device``: ``(op, passed, detail)`` per op, printing one line each."""
    results = []
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            err = fn(device)
            ok, detail = True, f"OK    rel err {err:.1e}"
        except Exception as exc:  # report every op, then fail at the end
            traceback.print_exc()
            ok, detail = False, f"FAIL  {type(exc).__name__}: {exc}"
        print(f"  {name:<40} {detail}  ({(time.perf_counter() - t0) * 1e3:.0f} ms)", flush=True)
        results.append((name, ok, detail))
    return results


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"moekit check on {device}: {len(CHECKS)} ops against moekit.reference")
    results = run(device)
    failed = [name for name, ok, _ in results if not ok]
    print("all checks passed" if not failed else f"{len(failed)} check(s) failed: {', '.join(failed)}")
    return 1 if failed else 0
