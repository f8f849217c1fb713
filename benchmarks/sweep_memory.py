#!/usr/bin/env python3
"""Launch-configuration sweep of moekit's memory-bound kernels on the GPU (a tuning aid, not a
benchmark of record).

    python benchmarks/sweep_memory.py [--ops silu_mul,quantize,...]

For each op and shape it times the configuration the shape buckets pick today ("default") and a
grid of alternatives (tile sizes, warps, persistent pipelined vs one tile per program), by
patching the module-level config function the launcher calls, and prints every time plus the
best. Inputs are the benchmarks' own (rotated past the L2 where one set fits in it), so times
compare with ``bench_*.py``. The winners are then written into the shape-bucket functions by hand:
nothing here runs at library run time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import triton  # noqa: E402

from moekit.benchmarking import floor_us, rotations, time_call  # noqa: E402


@contextlib.contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def sweep(title: str, nbytes: float, module, fname: str, cands: list, make_call, sets) -> None:
    """Time ``make_call(s)()`` with ``module.fname`` returning each candidate (None: the default)."""
    res = []
    for cand in [None] + cands:
        if cand is None:
            t = time_call(make_call, sets)
        else:
            with patched(module, fname, lambda *a, _c=cand, **k: _c):
                t = time_call(make_call, sets)
        res.append((t, cand))
    fl = floor_us(nbytes)
    default = res[0][0]
    ok = [(t, c) for t, c in res if isinstance(t, float)]
    print(f"== {title}: floor {fl:.2f} us, default {default if isinstance(default, str) else f'{default:.2f}'} us")
    for t, c in sorted(ok, key=lambda r: r[0])[:8]:
        print(f"   {t:8.2f} us  {100 * fl / t:5.1f}%  {c if c is not None else 'default'}")
    bad = [c for t, c in res if not isinstance(t, float)]
    if bad:
        print(f"   ({len(bad)} configs failed: {bad[:3]})")
    sys.stdout.flush()


# --------------------------------------------------------------------------- activation


def sweep_silu_mul(shapes) -> None:
    from moekit.ops import silu_mul
    from moekit.ops._triton import activation as act

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T, F in shapes:
        nbytes = 3 * T * F * 2
        n = rotations(nbytes)
        sets = [
            (
                torch.randn(T, F, device="cuda", dtype=torch.bfloat16),
                torch.randn(T, F, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(n)
        ]
        cands = []
        for tile in (1024, 2048, 4096, 8192):
            bf = min(tile, F)
            bt = max(1, tile // bf)
            n_tiles = triton.cdiv(T, bt) * triton.cdiv(F, bf)
            for w in (2, 4, 8):
                if bt * bf < 32 * w * 8:
                    continue
                cands.append(act.TileConfig(bt, bf, w, 1, n_tiles))
                if w == 4:
                    for st, pps in ((3, 8), (4, 4)):
                        cands.append(act.TileConfig(bt, bf, w, st, min(n_tiles, pps * sms)))
        sweep(f"silu_mul T={T} F={F}", nbytes, act, "tile_config", cands, lambda s: lambda: silu_mul(s[0], s[1]), sets)


def _pipe_cands(q, T, C, c1, c2, sms, block_ts=(1, 2, 4), warps=(2, 4, 8)):
    cands = []
    for bt in block_ts:
        nb = triton.cdiv(T, bt)
        for w in warps:
            if bt * (c1 + c2) < 32 * w * 8 or bt * (c1 + c2) > 16384:
                continue
            cands.append(q.PipeConfig(bt, c1, True, 1, w, nb, c2))
            cands.append(q.PipeConfig(bt, c1, True, 3, w, min(nb, 4 * sms), c2))
    return cands


def sweep_silu_mul_quant(shapes) -> None:
    from moekit.ops import silu_mul_quant
    from moekit.ops._triton import activation as act
    from moekit.ops._triton import quantize as q

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T, F in shapes:
        nbytes = 2 * T * F * 2 + T * F + 4 * T
        n = rotations(nbytes)
        sets = [
            (
                torch.randn(T, F, device="cuda", dtype=torch.bfloat16),
                torch.randn(T, F, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(n)
        ]
        cands = _pipe_cands(q, T, F, triton.next_power_of_2(F), 0, sms)
        sweep(
            f"silu_mul_quant T={T} F={F}",
            nbytes,
            act,
            "silu_mul_quant_config",
            cands,
            lambda s: lambda: silu_mul_quant(s[0], s[1]),
            sets,
        )


def sweep_quantize(shapes) -> None:
    from moekit.ops import quantize_fp8_row
    from moekit.ops._triton import quantize as q

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T, K in shapes:
        nbytes = T * K * 2 + T * K + 4 * T
        n = rotations(nbytes)
        sets = [torch.randn(T, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        c1, c2 = q.row_tiles(K, 8, True)
        cands = _pipe_cands(q, T, K, c1, c2, sms) + _pipe_cands(
            q, T, K, triton.next_power_of_2(K), 0, sms, block_ts=(1, 2), warps=(4, 8)
        )
        sweep(
            f"quantize_fp8_row T={T} K={K}",
            nbytes,
            q,
            "quantize_config",
            cands,
            lambda s: lambda: quantize_fp8_row(s),
            sets,
        )


# --------------------------------------------------------------------------- gather / scatter


def sweep_gather_scatter(cases) -> None:
    import bench_gather_scatter as bgs

    from moekit.ops import gather_scatter as ops
    from moekit.ops._triton import gather_scatter as k

    D = bgs.D
    for T, E, K in cases:
        a = T * K
        g_bytes = 2 * a * D * 2 + a * 10
        q_bytes = a * D * 2 + a * D + a * 4 + a * 10
        s_bytes = a * D * 2 + 2 * T * D * 2 + a * 4
        n = rotations(max(g_bytes, s_bytes))
        sets = [bgs.make_set(T, E, K, seed) for seed in range(n)]
        tiles = []
        for bd in (1024, 2048):
            for br in (1, 2, 4):
                for w in (2, 4, 8):
                    if br * bd < 32 * w * 8:
                        continue
                    tiles.append((br, bd, triton.cdiv(D, bd), w))
        if K == 1 and T > 1:
            # Column-block tiles (BLOCK_R, BLOCK_D, 0, n_db, warps) and whole rows (head + tail).
            gt = [(br, bd, 0, nd, w, 0) for br, bd, nd, w in tiles]
            gt += [
                (br, 4096, 1024, 1, w, pps)
                for br in (1, 2, 4)
                for w in (1, 2, 4, 8)
                for pps in (4, 8, 16)
                if br * 5120 >= 32 * w * 8
            ]
            sweep(
                f"gather_scale T={T} E={E}",
                g_bytes,
                k,
                "_gather_tiles",
                gt,
                lambda s: lambda: ops.gather_scale_dense_tokens(s["x"], s["tidx"], s["eidx"], s["scores"]),
                sets,
            )
            qt = [(br, 1024, 5, True, w) for br in (1, 2, 4) for w in (1, 2, 4, 8) if br * 5120 >= 32 * w * 8]
            sweep(
                f"gather_scale_quant T={T} E={E}",
                q_bytes,
                k,
                "_quant_tiles",
                qt,
                lambda s: lambda: ops.gather_scale_quant_dense_tokens(s["x"], s["tidx"], s["eidx"], s["scores"]),
                sets,
            )
        sweep(
            f"scatter_add atomic T={T} E={E} K={K}",
            s_bytes,
            k,
            "_tiles",
            tiles,
            lambda s: lambda: ops.scatter_add_dense_tokens(s["out"], s["rows"], s["tidx"]),
            sets,
        )
        # Deterministic (bucketed inverse map): (BLOCK_T, BLOCK_D, n_db, warps, BLOCK_A) of the sum.
        if a > k._SCAN_MAX_ROWS:
            bt = [
                (tb, bd, triton.cdiv(D, bd), w, 256)
                for tb in (1, 2, 4)
                for bd in (512, 1024, 2048)
                for w in (1, 2, 4, 8)
                if 16 * 32 * w <= tb * bd <= 64 * 32 * w
            ]
            sweep(
                f"scatter_add deterministic T={T} E={E} K={K}",
                s_bytes,
                k,
                "_bucket_tiles",
                bt,
                lambda s: lambda: ops.scatter_add_dense_tokens(s["out"], s["rows"], s["tidx"], deterministic=True),
                sets,
            )


def sweep_shuffling(cases) -> None:
    import bench_shuffling as bsh

    from moekit.ops.shuffling import combine_shuffling, split_shuffling
    from moekit.ops._triton import shuffling as k

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    D = bsh.D
    for layout, EP, T in cases:
        probe = bsh.make_set(layout, EP, T, 0)
        n = rotations(2 * probe["moved"] * D * 2)
        sets = [probe] + [bsh.make_set(layout, EP, T, seed) for seed in range(1, n)]
        nbytes = 2 * probe["moved"] * D * 2
        cands = []
        for br in (1, 2):
            for wm in (4096, 2048):
                wt = triton.next_power_of_2(D % wm) if D % wm else 0
                units = triton.cdiv(T, br)
                for pps, w in ((8, 4), (16, 4), (16, 8), (32, 4), (8, 2), (16, 2), (8, 8)):
                    cands.append((br, wm, wt, max(1, min(units, pps * sms)), w))
        sweep(
            f"combine {layout} EP={EP} T={T}",
            nbytes,
            k,
            "_config",
            cands,
            lambda s: lambda: combine_shuffling(s["tokens"], s["counts"], s["start"], s["end"], s["padded"]),
            sets,
        )
        sweep(
            f"split {layout} EP={EP} T={T}",
            nbytes,
            k,
            "_config",
            cands,
            lambda s: lambda: split_shuffling(s["combined"], s["counts"], s["start"], s["end"], s["padded"], False),
            sets,
        )


def sweep_gather_stream(shapes) -> None:
    """gather_scale: the buckets' choice ("default") against the persistent pipelined whole-row
    kernel (``_gather_scale_stream_kernel``) at several programs per SM, rows per unit and warps;
    every result checked against ``moekit.reference``. (Run 24 compared it with one whole row per
    program, the kernel it replaced.)"""
    import bench_gather_scatter as bgs

    from moekit import ops, reference
    from moekit.ops._triton import gather_scatter as k

    D = bgs.D
    for T, E in shapes:
        a = T
        nbytes = 2 * a * D * 2 + a * 10
        fl = floor_us(nbytes)
        n = rotations(nbytes)
        sets = [bgs.make_set(T, E, 1, seed) for seed in range(n)]
        s0 = sets[0]
        want = reference.gather_scale_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
        make = lambda s: lambda: ops.gather_scale_dense_tokens(s["x"], s["tidx"], s["eidx"], s["scores"])
        res = []
        for cand in [None] + [(pps, br, w) for pps in (4, 8, 16) for br in (1, 2) for w in (2, 4)]:
            with contextlib.ExitStack() as st:
                if cand is not None:
                    pps, br, w = cand
                    st.enter_context(patched(k, "_gather_tiles", lambda *a_, _c=(br, 4096, 1024, 1, w, pps), **kw: _c))
                t = time_call(make, sets)
                got = ops.gather_scale_dense_tokens(s0["x"], s0["tidx"], s0["eidx"], s0["scores"])
                good = bool(torch.equal(got, want.to(got.dtype)))
            res.append((t, cand, good))
        d = res[0][0]
        print(
            f"== gather_scale T={T} E={E}: floor {fl:.2f} us, default {d if isinstance(d, str) else f'{d:.2f}'} us",
            flush=True,
        )
        for t, c, g in sorted([r for r in res if isinstance(r[0], float)], key=lambda r: r[0])[:8]:
            name = "default" if c is None else f"stream {c[0]}pps/{c[1]}r/{c[2]}w"
            print(f"   {t:8.2f} us  {100 * fl / t:5.1f}%  {name}" + ("" if g else "  WRONG"), flush=True)


def sweep_quant_tiles(shapes) -> None:
    """gather_scale_quant: rows per program x warps x chunk width of the one-pass kernel."""
    import bench_gather_scatter as bgs

    from moekit.ops import gather_scatter as ops
    from moekit.ops._triton import gather_scatter as k

    D = bgs.D
    for T, E in shapes:
        q_bytes = T * D * 2 + T * D + T * 4 + T * 10
        sets = [bgs.make_set(T, E, 1, seed) for seed in range(rotations(q_bytes))]
        qt = [
            (br, bd, D // bd, True, w)
            for bd in (512, 1024)
            for br in (1, 2)
            for w in (1, 2, 4, 8)
            if br * D >= 32 * w * 8
        ]
        sweep(
            f"gather_scale_quant T={T} E={E}",
            q_bytes,
            k,
            "_quant_tiles",
            qt,
            lambda s: lambda: ops.gather_scale_quant_dense_tokens(s["x"], s["tidx"], s["eidx"], s["scores"]),
            sets,
        )


WALKS = {
    "load-after-store": {"_PIPELINE": False},
    "pipelined": {"_PIPELINE": True},
}


def sweep_shuffle_walks(cases) -> None:
    """The shuffle kernel's two ways through held rows (``WALKS``: the next unit's loads after
    this unit's stores, or before them) x a few launch configs; every result checked against
    ``moekit.reference``."""
    import bench_shuffling as bsh

    from moekit import reference
    from moekit.ops.shuffling import combine_shuffling, split_shuffling
    from moekit.ops._triton import shuffling as k
    from moekit.reference.shuffling import shuffle_row_map

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    D = bsh.D
    wt = triton.next_power_of_2(D % 2048) if D % 2048 else 0
    for layout, EP, T in cases:
        probe = bsh.make_set(layout, EP, T, 0)
        n = rotations(2 * probe["moved"] * D * 2)
        sets = [probe] + [bsh.make_set(layout, EP, T, seed) for seed in range(1, n)]
        nbytes = 2 * probe["moved"] * D * 2
        fl = floor_us(nbytes)
        rows = probe["tokens"].shape[0]
        cands = [None] + [
            (br, 2048, wt, max(1, min(triton.cdiv(rows, br), pps * sms)), w)
            for br, pps, w in (
                (1, 16, 4),
                (1, 8, 4),
                (1, 16, 2),
                (1, 24, 2),
                (2, 8, 8),
                (2, 4, 4),
                (2, 6, 4),
                (2, 12, 4),
            )
        ]
        s0 = probe
        ro, rc = reference.combine_shuffling(s0["tokens"], s0["counts"], s0["start"], s0["end"], s0["padded"])
        src, valid, _ = shuffle_row_map(s0["counts"], rows, s0["start"], s0["end"], s0["padded"])
        covered = src[valid]
        moved = s0["moved"]
        for op in ("combine", "split"):
            print(f"== {op} {layout} EP={EP} T={T}: floor {fl:.2f} us", flush=True)
            if op == "combine":
                make = lambda s: lambda: combine_shuffling(s["tokens"], s["counts"], s["start"], s["end"], s["padded"])
            else:
                make = lambda s: (
                    lambda: split_shuffling(s["combined"], s["counts"], s["start"], s["end"], s["padded"], False)
                )
            for walk, switches in WALKS.items():
                with contextlib.ExitStack() as st:
                    for name, value in switches.items():
                        st.enter_context(patched(k, name, value))
                    res = []
                    for cand in cands:
                        with contextlib.ExitStack() as st2:
                            if cand is not None:
                                st2.enter_context(patched(k, "_config", lambda *a, _c=cand, **kw: _c))
                            t = time_call(make, sets)
                            good = "-"
                            if isinstance(t, float):
                                if op == "combine":
                                    o, c = combine_shuffling(
                                        s0["tokens"], s0["counts"], s0["start"], s0["end"], s0["padded"]
                                    )
                                    good = bool(torch.equal(c, rc) and torch.equal(o[:moved], ro[:moved]))
                                else:
                                    back = split_shuffling(
                                        ro, s0["counts"], s0["start"], s0["end"], s0["padded"], False
                                    )
                                    good = bool(torch.equal(back[covered], s0["tokens"][covered]))
                        res.append((t, cand, good))
                ok = sorted([r for r in res if isinstance(r[0], float)], key=lambda r: r[0])
                d = res[0][0]
                dtxt = f"{d:.2f} us {100 * fl / d:.1f}%" if isinstance(d, float) else str(d)
                best = ", ".join(
                    f"{t:.2f} ({100 * fl / t:.1f}%) {c[0]}r/{c[3] // sms}pps/{c[4]}w" if c else f"{t:.2f} default"
                    for t, c, _ in ok[:3]
                )
                wrong = [c for t, c, g in res if g is False]
                print(
                    f"   {walk:24s} default {dtxt} | best {best}" + (f" | WRONG {wrong}" if wrong else ""), flush=True
                )


ALL = {
    "silu_mul": lambda: sweep_silu_mul([(2048, 2048), (2048, 8192), (16384, 2048)]),
    "silu_mul_quant": lambda: sweep_silu_mul_quant([(2048, 2048), (2048, 8192), (16384, 2048)]),
    "quantize": lambda: sweep_quantize([(2048, 5120), (16384, 5120)]),
    "gather_scatter": lambda: sweep_gather_scatter([(2048, 16, 1), (2048, 16, 4), (16384, 16, 4), (1, 16, 1)]),
    "shuffling": lambda: sweep_shuffling([("padded", 8, 4096), ("dense", 8, 4096)]),
    "quant_tiles": lambda: sweep_quant_tiles([(2048, 16), (2048, 128), (4096, 16)]),
    "gather_stream": lambda: sweep_gather_stream([(2048, 16), (4096, 16), (4096, 128), (16384, 16)]),
    "shuffle_walks": lambda: sweep_shuffle_walks(
        [(lay, ep, t) for t in (4096, 16384) for lay in ("dense", "padded") for ep in (2, 8)]
    ),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(ALL), help=f"comma list of {sorted(ALL)}")
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh (QUICK=1); no effect")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_memory: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    t0 = time.time()
    for name in args.ops.split(","):
        print(f"#### {name} ({time.time() - t0:.0f} s)", flush=True)
        ALL[name]()
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
