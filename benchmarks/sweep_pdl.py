#!/usr/bin/env python3
"""Experiment: programmatic dependent launch (``moekit.ops._common``) off, with every kernel
triggering its successor at once (mode 1), and with the trigger left to the programs' exit (mode
2), same process, back to back in a CUDA graph as the benchmarks time them (inputs rotated past
the L2): token-movement ops, routing at decode and the one-row GEMV; MSLK 1.1.0 alongside where
it has the op. Prints µs for each setting and whether the outputs of off and mode 1 are bitwise
equal (combine/split of the padded layout leave unmoved rows unwritten: those differ).

Also times two candidates for top-1 scatter-add against the atomic kernel: a plain
read-add-write of each output row (no atomics; valid only when every token receives at most one
row: what the access pattern itself reaches), and the same under a per-(token, block) lock taken
with a compare-and-swap (correct for any indices; one row per program or column blocks, with or
without an L2 prefetch of the output row before the lock). The locked whole-row variant became
``scatter_add_dense_tokens``'s top-1 path.

    python benchmarks/sweep_pdl.py [scatter1]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import torch  # noqa: E402

from moekit.benchmarking import bench_us, floor_us, rotations, try_import_mslk  # noqa: E402


def _timed(make, sets, mode: int):
    """mode 0: PDL off; 1: every kernel triggers its successor at once; 2: as its programs exit."""
    from moekit import settings

    with settings.override(pdl=mode > 0, pdl_mode=mode or None):
        fns = [make(s) for s in sets]
        out = fns[0]()
        torch.cuda.synchronize()
        return bench_us(fns, replays=30), out


def _equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        )
    return a == b


def _line(name, nbytes, make, sets, peer=None, fresh=None):
    """fresh: builds a new output for the equality check (in-place ops keep accumulating)."""
    off, o1 = _timed(make, sets, 0)
    on, o2 = _timed(make, sets, 1)
    late, _ = _timed(make, sets, 2)
    if fresh is not None:
        o1, o2 = fresh(False), fresh(True)
    eq = _equal(o1, o2)
    fl = floor_us(nbytes)
    mslk = None
    if peer is not None:
        try:
            fns = [peer(s) for s in sets]
            fns[0]()
            torch.cuda.synchronize()
            mslk = bench_us(fns, replays=30)
        except Exception as e:  # noqa: BLE001
            print(f"  MSLK error: {type(e).__name__}: {str(e)[:120]}")
    m = f"{mslk:.2f}" if mslk else "—"
    print(
        f"| {name} | {fl:.2f} | {off:.2f} | {100 * fl / off:.1f} | {on:.2f} | {100 * fl / on:.1f} | {late:.2f} | "
        f"{100 * fl / late:.1f} | {m} | {eq} |",
        flush=True,
    )


def _candidate_row(name, fns, nbytes):
    """Time one scatter candidate (its callables over the input sets) and print its table row."""
    fns[0]()
    us = bench_us(fns, replays=30)
    fl = floor_us(nbytes)
    print(f"| {name} | {fl:.2f} | {us:.2f} | {100 * fl / us:.1f} | — | — | — | — | — | — |", flush=True)


def _unique_rmw_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rmw(out_ptr, in_ptr, tok_ptr, A, T, D, n_db, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rb = pid // n_db
        db = pid - rb * n_db
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < A
        tok = tl.load(tok_ptr + rows, mask=live, other=-1).to(tl.int64)
        ok = live & (tok >= 0) & (tok < T)
        cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (cols < D)[None, :]
        v = tl.load(
            in_ptr + rows[:, None] * D + cols[None, :],
            mask=live[:, None] & (cols < D)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        o = out_ptr + tok[:, None] * D + cols[None, :]
        cur = tl.load(o, mask=m, other=0.0)
        tl.store(o, (cur.to(tl.float32) + v.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)

    return rmw


def _locked_rmw_kernel():
    """Top-1 scatter-add candidate: one row (``N_CH`` chunks of ``BLOCK_D``) or one column block
    (``N_CH`` = 1, ``n_db`` blocks per row) per program. Take the (token, block) lock with a CAS,
    read-add-write the output slice, release. Correct with duplicate tokens (they serialize); no
    atomics on the data. ``PREFETCH``: the output lines are prefetched into the L2 before the CAS,
    so the read after it does not wait on HBM."""
    import triton
    import triton.language as tl

    @triton.jit
    def locked(
        out_ptr,
        in_ptr,
        tok_ptr,
        lock_ptr,
        A,
        T,
        D,
        n_db,
        BLOCK_D: tl.constexpr,
        N_CH: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid // n_db
        db = pid - row * n_db
        tok = tl.load(tok_ptr + row).to(tl.int64)
        if (row < A) & (tok >= 0) & (tok < T):
            base = db * BLOCK_D * N_CH
            vs = ()
            for i in tl.static_range(N_CH):
                cols = base + i * BLOCK_D + tl.arange(0, BLOCK_D)
                vs = vs + (
                    tl.load(
                        in_ptr + row.to(tl.int64) * D + cols, mask=cols < D, other=0.0, eviction_policy="evict_first"
                    ),
                )
            o_row = out_ptr + tok * D
            if PREFETCH:
                for i in tl.static_range(N_CH):
                    lines = tl.minimum(base + i * BLOCK_D + tl.arange(0, BLOCK_D // 64) * 64, D - 1)
                    tl.inline_asm_elementwise(
                        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                        "=r,l",
                        [o_row + lines],
                        dtype=tl.int32,
                        is_pure=False,
                        pack=1,
                    )
            lock = lock_ptr + tok * n_db + db
            while tl.atomic_cas(lock, 0, 1, sem="acquire") != 0:
                pass
            for i in tl.static_range(N_CH):
                cols = base + i * BLOCK_D + tl.arange(0, BLOCK_D)
                cur = tl.load(o_row + cols, mask=cols < D, other=0.0, cache_modifier=".cg")
                tl.store(
                    o_row + cols,
                    (cur.to(tl.float32) + vs[i].to(tl.float32)).to(out_ptr.dtype.element_ty),
                    mask=cols < D,
                )
            tl.debug_barrier()
            tl.atomic_xchg(lock, 0, sem="release")

    return locked


def main() -> int:
    if not torch.cuda.is_available():
        print("sweep_pdl: needs a CUDA GPU; nothing to do on this machine.")
        return 0
    import triton

    import bench_gather_scatter as bgs
    import bench_shuffling as bsh
    from moekit.ops import gather_scatter as ops
    from moekit.ops import index_shuffling
    from moekit.ops._triton import grouped_gemm as GG
    from moekit.ops.shuffling import combine_shuffling, split_shuffling
    from moekit.testing import random_m_sizes

    mslk = bgs._mslk_ops() if try_import_mslk() else {}
    mslk_sh = bsh._mslk_ops() if try_import_mslk() else {}
    D = bgs.D
    print(
        "| case | floor µs | PDL off µs | % floor | PDL early µs | % floor | PDL late µs | % floor | MSLK µs | "
        "equal (off vs early) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    only = sys.argv[1] if len(sys.argv) > 1 else ""  # "scatter1": the top-1 scatter-add lines only
    for T, K in ((2048, 1), (4096, 1), (16384, 1), (2048, 4)):
        if only == "scatter1" and K != 1:
            continue
        a = T * K
        g_bytes = 2 * a * D * 2 + a * 10
        q_bytes = a * D * 2 + a * D + a * 4 + a * 10
        s_bytes = a * D * 2 + 2 * T * D * 2 + a * 4
        sets = [bgs.make_set(T, 16, K, seed) for seed in range(rotations(max(g_bytes, s_bytes)))]
        if K == 1 and only != "scatter1":

            def gq(fn):
                return lambda s: lambda: fn(s["x"], s["tidx"], s["eidx"], s["scores"])

            _line(
                f"gather_scale T={T}",
                g_bytes,
                gq(ops.gather_scale_dense_tokens),
                sets,
                gq(mslk["gather_scale_dense_tokens"]) if "gather_scale_dense_tokens" in mslk else None,
            )
            name = "gather_scale_quant_dense_tokens"
            _line(
                f"gather_scale_quant T={T}",
                q_bytes,
                gq(ops.gather_scale_quant_dense_tokens),
                sets,
                gq(mslk[name]) if name in mslk else None,
            )

        def sc(fn, **kw):
            return lambda s: lambda: fn(s["out"], s["rows"], s["tidx"], **kw)

        def fresh(pdl, s=sets[0]):
            from moekit import settings

            with settings.override(pdl=pdl):
                o = s["out"].clone()
                ops.scatter_add_dense_tokens(o, s["rows"], s["tidx"])
                torch.cuda.synchronize()
            return o

        peer = sc(mslk["scatter_add_dense_tokens"]) if "scatter_add_dense_tokens" in mslk else None
        _line(f"scatter_add default T={T} K={K}", s_bytes, sc(ops.scatter_add_dense_tokens), sets, peer, fresh)
        if K == 1:
            rmw = _unique_rmw_kernel()
            for br, bd, w in ((4, 1024, 8), (1, 1024, 4), (2, 1024, 4), (1, 2048, 8), (2, 2048, 8)):
                n_db = triton.cdiv(D, bd)

                def mk(s, br=br, bd=bd, w=w, n_db=n_db):
                    return lambda: rmw[(triton.cdiv(T, br) * n_db,)](
                        s["out"], s["rows"], s["tidx"], T, T, D, n_db, BLOCK_R=br, BLOCK_D=bd, num_warps=w
                    )

                _candidate_row(
                    f"top-1 plain read-add-write T={T} ({br}x{bd}, {w} warps)", [mk(s) for s in sets], s_bytes
                )
            locked = _locked_rmw_kernel()
            locks = torch.zeros(T * triton.cdiv(D, 512), dtype=torch.int32, device="cuda")
            for bd, n_ch, w, pf in (
                (1024, 1, 2, False),
                (1024, 1, 2, True),
                (1024, 1, 4, True),
                (1024, 5, 4, True),
                (1024, 5, 8, True),
                (1024, 5, 4, False),
            ):
                n_db = triton.cdiv(D, bd * n_ch)

                def mk(s, bd=bd, w=w, n_db=n_db, n_ch=n_ch, pf=pf):
                    return lambda: locked[(T * n_db,)](
                        s["out"],
                        s["rows"],
                        s["tidx"],
                        locks,
                        T,
                        T,
                        D,
                        n_db,
                        BLOCK_D=bd,
                        N_CH=n_ch,
                        PREFETCH=pf,
                        num_warps=w,
                    )

                chk = sets[0]["out"].clone()
                want = chk.float().index_add_(0, sets[0]["tidx"].long(), sets[0]["rows"].float())
                locked[(T * n_db,)](
                    chk,
                    sets[0]["rows"],
                    sets[0]["tidx"],
                    locks,
                    T,
                    T,
                    D,
                    n_db,
                    BLOCK_D=bd,
                    N_CH=n_ch,
                    PREFETCH=pf,
                    num_warps=w,
                )
                ok = torch.allclose(chk.float(), want, atol=0.05, rtol=0.01) and int(locks.sum()) == 0
                _candidate_row(
                    f"top-1 locked read-add-write T={T} ({n_ch}x{bd}, {w} warps, prefetch {pf}; correct {ok})",
                    [mk(s) for s in sets],
                    s_bytes,
                )
            # Duplicates (top-4 indices) through the locked kernel: still correct?
            s4 = bgs.make_set(T // 4, 16, 4, 99)
            chk = s4["out"].clone()
            want = chk.float().index_add_(0, s4["tidx"].long(), s4["rows"].float())
            locked[(T * 5,)](
                chk, s4["rows"], s4["tidx"], locks, T, T // 4, D, 5, BLOCK_D=1024, N_CH=1, PREFETCH=True, num_warps=4
            )
            print(
                f"  locked kernel with 4 rows per token: correct "
                f"{torch.allclose(chk.float(), want, atol=0.1, rtol=0.02)}, locks free {int(locks.sum()) == 0}"
            )

    if only == "scatter1":
        return 0
    for layout in ("dense", "padded"):
        for EP, T in ((8, 4096), (2, 4096)):
            probe = bsh.make_set(layout, EP, T, 0)
            nbytes = 2 * probe["moved"] * D * 2
            sets = [probe] + [bsh.make_set(layout, EP, T, seed) for seed in range(1, rotations(nbytes))]

            def cmb(fn):
                return lambda s: lambda: fn(s["tokens"], s["counts"], s["start"], s["end"], s["padded"])

            def spl(fn):
                return lambda s: lambda: fn(s["combined"], s["counts"], s["start"], s["end"], s["padded"], False)

            _line(
                f"combine {layout} EP={EP} T={T}",
                nbytes,
                cmb(combine_shuffling),
                sets,
                cmb(mslk_sh["combine_shuffling"]) if "combine_shuffling" in mslk_sh else None,
            )
            _line(
                f"split {layout} EP={EP} T={T}",
                nbytes,
                spl(split_shuffling),
                sets,
                spl(mslk_sh["split_shuffling"]) if "split_shuffling" in mslk_sh else None,
            )

    for T, E, K in ((1, 128, 4), (1, 16, 1), (128, 128, 8)):
        sets = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        _line(
            f"index_shuffling T={T} E={E} K={K}",
            T * E * 2,
            lambda s: lambda: index_shuffling(s, top_k=K),
            sets,
            (lambda s: lambda: torch.ops.mslk.index_shuffling(s)) if K == 1 and mslk else None,
        )

    fp8 = torch.float8_e4m3fn
    for name, G, N, K in (("scout-tp8-w13", 16, 2048, 5120), ("qwen3-w2", 128, 2048, 768)):
        for dtype in (torch.bfloat16, fp8):
            elem = 1 if dtype == fp8 else 2
            x = torch.randn(1, K, device="cuda").to(dtype)
            w = (torch.randn(G * N, K, device="cuda") / K**0.5).to(dtype)
            xs = torch.rand(1, device="cuda") if dtype == fp8 else None
            ws = torch.rand(G * N, device="cuda") if dtype == fp8 else None
            sets = [random_m_sizes(1, G, device="cuda", seed=i) for i in range(rotations(N * K * elem))]
            _line(
                f"GEMV {name} {'fp8' if dtype == fp8 else 'bf16'}",
                N * K * elem + K * elem + 2 * N,
                lambda ms: lambda: GG.grouped_gemm(x, w, ms, x_scale=xs, w_scale=ws),
                sets,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
