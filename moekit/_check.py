"""``moekit check``: run every public op on this machine's device and compare it with its float32
reference on the CPU, on small random inputs. Prints one line per op; exits 1 if any fails."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

import torch

from moekit import reference as ref
from moekit.testing import assert_close, random_m_sizes, tie_free_scores

CHECKS: list[tuple[str, Callable[[torch.device], None]]] = []


def check(name: str):
    def deco(fn: Callable[[torch.device], None]) -> Callable[[torch.device], None]:
        CHECKS.append((name, fn))
        return fn

    return deco


def _dt(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@check("index_shuffling")
def _index_shuffling(device: torch.device) -> None:
    from moekit.ops.routing import index_shuffling

    for T, E, k in [(1, 16, 1), (37, 6, 2), (128, 257, 8)]:
        s = tie_free_scores(T, E, seed=T + E)
        got = index_shuffling(s.to(device), top_k=k)
        want = ref.index_shuffling(s, top_k=k)
        V = int(want[0][E + 1])
        assert_close(got[0].cpu(), want[0], msg=f"counts T={T} E={E} k={k}")
        assert_close(got[1].cpu()[:V], want[1][:V], msg="expert_indices")
        assert_close(got[2].cpu()[:V], want[2][:V], msg="token_indices")


@check("gather_scale_dense_tokens / scatter_add_dense_tokens")
def _gather_scatter(device: torch.device) -> None:
    from moekit.ops.gather_scatter import gather_scale_dense_tokens, scatter_add_dense_tokens

    T, E, D, k = 33, 16, 256, 2
    s = tie_free_scores(T, E, seed=1)
    _, eidx, tidx = ref.index_shuffling(s, top_k=k)
    x = torch.randn(T, D)
    dt = _dt(device)
    got = gather_scale_dense_tokens(x.to(device, dt), tidx.to(device), eidx.to(device), s.to(device))
    assert_close(got.float().cpu(), ref.gather_scale_dense_tokens(x.to(dt), tidx, eidx, s).float(), dtype=dt)
    out = torch.randn(T, D)
    rows = torch.randn(T * k, D)
    o = out.to(device, dt).clone()
    scatter_add_dense_tokens(o, rows.to(device, dt), tidx.to(device))
    r = out.to(dt).clone()
    ref.scatter_add_dense_tokens(r, rows.to(dt), tidx)
    assert_close(o.float().cpu(), r.float(), dtype=dt)


@check("grouped_gemm")
def _grouped_gemm(device: torch.device) -> None:
    from moekit.ops.grouped_gemm import grouped_gemm

    G, N, K, M = 4, 64, 128, 48
    dt = _dt(device)
    x = torch.randn(M, K).to(dt)
    w = (torch.randn(G * N, K) / K**0.5).to(dt)
    m = random_m_sizes(M, G, seed=3)
    got = grouped_gemm(x.to(device), w.to(device), m.to(device))
    assert_close(got.float().cpu(), ref.grouped_gemm(x, w, m).float(), dtype=dt)


@check("silu_mul")
def _silu_mul(device: torch.device) -> None:
    from moekit.ops.activation import silu_mul

    dt = _dt(device)
    h = torch.randn(17, 96).to(dt)
    got = silu_mul(h.to(device)[:, :48], h.to(device)[:, 48:])
    assert_close(got.float().cpu(), ref.silu_mul(h[:, :48], h[:, 48:]).float(), dtype=dt)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"moekit check on {device}")
    failed = 0
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        try:
            fn(device)
            status = "ok"
        except Exception as exc:  # report every op, then fail at the end
            failed += 1
            status = f"FAIL: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(f"  {name:<55} {status}  ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0
