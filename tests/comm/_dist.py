"""Spawn helper for multi-process tests (gloo on the CPU, NCCL on GPUs).

``run_distributed(fn, world_size, backend)`` starts ``world_size`` fresh processes (spawn), each
initializing the default process group on a free local port with short timeouts and with NVLink
multicast disabled, runs ``fn(rank, world_size, *args)`` and returns every rank's return value
(or raises with every failing rank's traceback). ``fn`` must be a module-level function.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, backend, port, fn, args, out_dir, pg_timeout_s):
    os.environ.update(NO_MULTICAST_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    status = None
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s), **kwargs
        )
        status = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        status = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(status, f)
    # Leave together and without C++ teardown: tearing the process group down (or letting gloo's
    # threads be destroyed at interpreter exit) while a peer is still finishing once aborted a rank
    # ("terminate called without an active exception", SIGABRT) after every scenario had passed.
    try:
        if dist.is_initialized():
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer that failed already reported through its file
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn, world_size: int, backend: str = "gloo", args: tuple = (), timeout_s: float = 120.0, pg_timeout_s: float = 60.0
) -> list:
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST_ENV)
    out_dir = tempfile.mkdtemp(prefix="moekit_dist_")
    try:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, backend, free_port(), fn, args, out_dir, pg_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test did not finish within {timeout_s:g} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (process died)")
                results.append(None)
                continue
            with open(path, "rb") as f:
                kind, val = pickle.load(f)
            if kind == "error":
                errors.append(f"rank {r}:\n{val}")
                results.append(None)
            else:
                results.append(val)
        if errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run_scenarios(rank: int, scenarios: dict, *args) -> dict:
    """Run every ``name -> fn(rank, *args)`` and report ``name -> "ok" | traceback`` (a failing
    scenario does not stop the others; collectives inside must stay matched across ranks)."""
    out = {}
    for name, fn in scenarios.items():
        t0 = time.monotonic()
        try:
            fn(rank, *args)
            out[name] = "ok"
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
        # progress on the worker's stdout: shows where a run stopped if it is killed
        print(
            f"[rank {rank}] {name}: {'ok' if out[name] == 'ok' else 'FAILED'} ({time.monotonic() - t0:.1f} s)",
            flush=True,
        )
    return out


def merge(results: list[dict]) -> dict:
    """Per scenario: "ok" if every rank passed, else the failing ranks' tracebacks."""
    names = results[0].keys()
    merged = {}
    for n in names:
        bad = [f"rank {r}: {res[n]}" for r, res in enumerate(results) if res.get(n) != "ok"]
        merged[n] = "ok" if not bad else "\n".join(bad)
    return merged
