#!/usr/bin/env python3
"""Benchmark: the fused MoE-tail collective and all_reduce_rms_norm on 2 GPUs (NVLink, peer
pointers, no multicast) vs NCCL and torch's symmetric-memory one-shot all-reduce, side by side.

    python benchmarks/bench_collective.py [--quick] [--nproc 2]
    torchrun --nproc-per-node 2 benchmarks/bench_collective.py [--quick]

Per M (tokens), L=3584 (latent), H=7168 (hidden), bf16, medians of CUDA-graph replays
(``moekit.benchmarking.bench_us``; inputs rotated past the L2), the slowest rank's time:

- ``fused``: ``moekit.comm.CollectiveKernel`` (routed all-reduce + RMSNorm of [M, L], shared
  reduce-scatter of [M, H] along the hidden dim), one launch.
- ``NCCL tail``: NCCL all_reduce of [M, L] + RMSNorm in PyTorch + the transpose copy + NCCL
  reduce_scatter_tensor of [M, H] along the hidden dim.
- ``torch 1-shot AR``: ``torch.ops.symm_mem.one_shot_all_reduce`` of the latent alone (input
  already in symmetric memory, not rotated).
- ``ARN``: ``moekit.comm.AllReduceRMSNorm`` at [M, 7168] vs NCCL all_reduce + RMSNorm.

``egress MB`` is what the fused call must send per rank over NVLink; ``% floor`` is that at the
measured P2P write bandwidth over the measured time (latency dominates small M). MSLK 1.1.0
has no tensor-parallel MoE-tail collective: its column reads "n/a". Rank 0 prints the table and
calls ``save_rows("collective", ...)``; targets are checked at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST_ENV)

import torch  # noqa: E402

L, H, EPS = 3584, 7168, 1e-6
M_FULL = [1, 4, 16, 64, 128, 512]
M_QUICK = [1, 16, 128]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agree_ok(ok: bool) -> bool:
    """True when the call worked on every rank (so all ranks take the same path)."""
    import torch.distributed as dist

    f = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(f, op=dist.ReduceOp.MIN)
    return bool(f.item())


def _time(fns, label: str):
    """Max over ranks of the median µs per call, or "error" (agreed across ranks)."""
    import torch.distributed as dist

    from moekit.benchmarking import bench_us

    ok = True
    try:
        fns[0]()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"  [{label}] error: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ok = False
    if not _agree_ok(ok):
        return "error"
    try:
        us = bench_us(fns, replays=15)
    except Exception as e:  # noqa: BLE001
        print(f"  [{label}] error while timing: {type(e).__name__}: {str(e)[:200]}", flush=True)
        us = float("nan")
    t = torch.tensor([us], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = float(t.item())
    return "error" if v != v else v


def _p2p_write_gbps(group) -> float | None:
    """Bandwidth of a 64 MB copy into the peer's memory (both ranks at once), GB/s per rank."""
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        n = 32 << 20
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        hdl = symm_mem.rendezvous(buf, group.group_name)
        peer = (dist.get_rank(group) + 1) % dist.get_world_size(group)
        dst = hdl.get_buffer(peer, (n,), torch.bfloat16)
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            dst.copy_(src)
        b.record()
        b.synchronize()
        gbps = 10 * n * 2 / (a.elapsed_time(b) * 1e-3) / 1e9
        dist.barrier()
        del dst, hdl, buf
        return gbps
    except Exception as e:  # noqa: BLE001
        print(f"  P2P bandwidth probe failed: {type(e).__name__}: {e}", flush=True)
        return None


def run(rank: int, world: int, quick: bool) -> None:
    import torch.distributed as dist
    import torch.nn.functional as Fn

    import moekit.comm as comm
    from moekit.benchmarking import environment, markdown_table, rotations, save_rows, try_import_mslk

    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    R, S = world, H // world
    ms = M_QUICK if quick else M_FULL
    max_m = max(ms)
    t_start = time.time()
    p2p = _p2p_write_gbps(group)
    ck = comm.CollectiveKernel(
        group=group,
        rank=rank,
        tp_size=R,
        latent_dim=L,
        hidden_dim=H,
        max_m=max_m,
        max_token_ctas=max_m,
        rms_eps=EPS,
        fp32_internal=False,
        backend="symm_mem",
    )
    arn = comm.AllReduceRMSNorm(group, max_m, H, eps=EPS, fp32_internal=False, backend="symm_mem")
    gamma_l = (torch.rand(L, device=dev) + 0.5).to(torch.bfloat16)
    gamma_h = (torch.rand(H, device=dev) + 0.5).to(torch.bfloat16)
    one_shot_in = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        one_shot_in = symm_mem.empty((max_m, L), dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(one_shot_in, group.group_name)
        one_shot_in.normal_()
    except Exception as e:  # noqa: BLE001
        print(f"  torch symmetric-memory one-shot unavailable: {type(e).__name__}: {e}", flush=True)
    if not _agree_ok(one_shot_in is not None):
        one_shot_in = None
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    mslk = "n/a" if try_import_mslk() is not None else None

    def torch_norm(x, g):
        return Fn.rms_norm(x.float(), (x.shape[-1],), g.float(), EPS).to(torch.bfloat16)

    rows = []
    for M in ms:
        per_set = M * (L + H) * 2
        n = rotations(per_set)
        sets = [
            (torch.randn(M, L, device=dev).to(torch.bfloat16), torch.randn(M, H, device=dev).to(torch.bfloat16))
            for _ in range(n)
        ]
        sh_out = torch.empty(M, S, device=dev, dtype=torch.bfloat16)
        # correctness spot check of the fused call against the NCCL pipeline (rank-local view)
        lo, so = ck(sets[0][0], sets[0][1], gamma_l)
        ref_lat = sets[0][0].clone()
        dist.all_reduce(ref_lat)
        ref_sh = sets[0][1].view(M, R, S).transpose(0, 1).contiguous()
        rs(sh_out, ref_sh.view(R * M, S))
        if not (
            torch.allclose(lo.float(), torch_norm(ref_lat, gamma_l).float(), rtol=3e-2, atol=3e-2)
            and torch.allclose(so.float(), sh_out.float(), rtol=2e-2, atol=2e-2)
        ):
            print(f"  WARNING: fused output disagrees with the NCCL pipeline at M={M}", flush=True)

        fused = _time([lambda s=s: ck(s[0], s[1], gamma_l) for s in sets], "fused")

        def nccl_tail(s):
            lat, sh = s
            dist.all_reduce(lat)
            torch_norm(lat, gamma_l)
            rs(sh_out, sh.view(M, R, S).transpose(0, 1).contiguous().view(R * M, S))

        nccl = _time([lambda s=s: nccl_tail(s) for s in sets], "NCCL tail")
        one = "error"
        if one_shot_in is not None:
            view = one_shot_in[:M]
            one = _time(
                [lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group.group_name)], "torch one-shot"
            )
        xs = [torch.randn(M, H, device=dev).to(torch.bfloat16) for _ in range(rotations(M * H * 2))]
        ours_arn = _time([lambda x=x: arn(x, gamma_h) for x in xs], "all_reduce_rms_norm")

        def nccl_arn(x):
            dist.all_reduce(x)
            torch_norm(x, gamma_h)

        nccl_a = _time([lambda x=x: nccl_arn(x) for x in xs], "NCCL AR + norm")

        egress = (R - 1) * M * (L + S) * 2
        row = {"M": M, "fused µs": fused, "NCCL tail µs": nccl, "torch 1-shot AR µs": one, "MSLK": mslk}
        num = lambda v: isinstance(v, float)  # noqa: E731
        if num(fused) and num(nccl):
            row["fused/NCCL"] = fused / nccl
        if num(fused) and num(one):
            row["fused/1-shot"] = fused / one
        row["ARN µs"] = ours_arn
        row["NCCL AR+norm µs"] = nccl_a
        if num(ours_arn) and num(nccl_a):
            row["ARN/NCCL"] = ours_arn / nccl_a
        row["egress MB"] = egress / 1e6
        if num(fused):
            row["fused GB/s"] = egress / fused / 1e3
            if p2p:
                row["% floor"] = 100.0 * (egress / (p2p * 1e9) * 1e6) / fused
        rows.append(row)
        if rank == 0:
            print(
                f"M={M}: "
                + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "M"),
                flush=True,
            )
    ck.check()
    arn.check()
    if rank == 0:
        env = environment()
        print()
        bw = f"; P2P write {p2p:.0f} GB/s per rank" if p2p else ""
        print(f"## MoE-tail collective, {R} GPUs ({env.get('gpu')}), L={L}, H={H}, bf16, CUDA graphs{bw}")
        print(
            f"torch {env['torch']}, triton {env['triton']}, {env['date']}, "
            f"command: python benchmarks/bench_collective.py{' --quick' if quick else ''}"
        )
        print()
        print(markdown_table(rows))
        print()
        checks = []
        for r in rows:
            M = r["M"]
            if M <= 16 and "fused/NCCL" in r:
                checks.append((f"M={M}: fused <= 0.25x NCCL tail", r["fused/NCCL"] <= 0.25, r["fused/NCCL"]))
            if M <= 128 and "fused/1-shot" in r:
                checks.append(
                    (f"M={M}: fused <= torch one-shot AR of the latent", r["fused/1-shot"] <= 1.0, r["fused/1-shot"])
                )
            if M <= 128 and "ARN/NCCL" in r:
                checks.append(
                    (f"M={M}: all_reduce_rms_norm <= 0.5x NCCL AR + norm", r["ARN/NCCL"] <= 0.5, r["ARN/NCCL"])
                )
        for what, ok, ratio in checks:
            print(f"target {'PASS' if ok else 'MISS'}: {what} (ratio {ratio:.2f})")
        passed = sum(ok for _, ok, _ in checks)
        print(f"targets: {passed}/{len(checks)} met; total {time.time() - t_start:.0f} s")
        meta = dict(env, world_size=R, latent_dim=L, hidden_dim=H, p2p_gbps=p2p, quick=quick)
        path = save_rows("collective", rows, meta)
        if path:
            print(f"rows saved to {path}")
    ck.close()
    arn.close()


def _worker(rank: int, world: int, port: int, quick: bool) -> None:
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, timeout=timedelta(seconds=180), device_id=torch.device("cuda", rank)
    )
    try:
        run(rank, world, quick)
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="M in {1, 16, 128} only (about a minute)")
    ap.add_argument("--nproc", type=int, default=2, help="GPUs (ranks) to use when not under torchrun")
    args = ap.parse_args()
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu < 2:
        print(f"bench_collective needs CUDA and at least 2 GPUs (found {ngpu}); nothing to do.")
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timedelta(seconds=180), device_id=torch.device("cuda", local))
        try:
            run(dist.get_rank(), dist.get_world_size(), args.quick)
        finally:
            dist.destroy_process_group()
        return 0
    import torch.multiprocessing as mp

    nproc = min(args.nproc, ngpu)
    mp.start_processes(_worker, args=(nproc, _free_port(), args.quick), nprocs=nproc, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
