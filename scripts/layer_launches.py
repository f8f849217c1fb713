#!/usr/bin/env python3
"""What moekit's MoE layer launches on an sm_90 GPU (H100 / H200), found and compiled on the CPU.

``moe_forward`` (the routed experts from float32 router logits, as ``benchmarks/bench_layer.py``
times them) runs on meta tensors that read as CUDA ones on a card of 132 SMs, 50 MB of L2 and
compute capability 9.0; every Triton launch it makes is recorded and compiled for sm_90 through
ptxas (``tests/ops/_sm90.py``), with programmatic dependent launch as inside the CUDA graphs the
benchmarks replay (``--no-pdl``: as an eager call launches them), and the experimental Gluon
kernels' launches are named (``gluon``; their own compile tests live in
``tests/ops/test_gg_gluon*.py``). So the launchers' rules (paths, tiles, stages, TMA, early
epilogues) pick what they pick on the GPU, from shapes alone, and a host read of device data
(``.item()``, ``.tolist()``: none is allowed on the layer's path) fails the case.

    python scripts/layer_launches.py [--models qwen3-30b-a3b,...] [--tokens 1,4,...,16384]
        [--dtype bf16,fp8] [--knobs NAME=value,...] [--no-pdl] [--json PATH]

One row per launch: the case, the kernel, warps, stages, shared memory, registers per thread,
stack frame bytes, local-memory accesses inside its MMA loops, ptxas's reason for making its wgmma
synchronous (else "-") and its tile constants. Exit 1 when a case fails to run, or a launch does
not compile, has its wgmma serialized or needs more than 227 KB of shared memory; exit 2 where
there is no ptxas to compile with (Triton's NVIDIA backend). Knobs
(``--knobs``, as ``$MOEKIT_KNOBS``) change what the launchers pick. About 5-10 s a new kernel
variant on two cores (Triton's cache keeps the compiled ones).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def launch_modules() -> list[str]:
    """The ``moekit.ops._triton`` modules that launch through ``moekit.ops._common.launch`` (the
    name the compile driver replaces with its recorder)."""
    folder = os.path.join(ROOT, "moekit", "ops", "_triton")
    out = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py"):
            with open(os.path.join(folder, f)) as fh:
                src = fh.read()
            names = re.findall(r"^from moekit\.ops\._common import (\([^)]*\)|[^\n]*)", src, re.M)
            if any(re.search(r"\blaunch\b", n) for n in names):
                out.append("moekit.ops._triton." + f[:-3])
    return out


DEFAULT_MODELS = "qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout,llama4-maverick"
DEFAULT_TOKENS = "1,4,16,64,256,1024,2048,8192,16384"
SMEM_LIMIT = 227 * 1024  # shared memory one block may use on sm_90

# Run in tests/ops/_sm90.py's compile driver (its ``RECORDS`` and recording ``launch``): the CUDA
# queries answered for an sm_90 card, meta tensors read as CUDA ones, and a marker record ahead of
# each case's launches.
_SNIPPET = """
import traceback
import types

_props = types.SimpleNamespace(multi_processor_count=132, L2_cache_size=50 * 2**20, major=9, minor=0,
                               name="sm_90 (meta)")
torch.cuda.get_device_properties = lambda *a, **k: _props
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.current_device = lambda: 0
torch.cuda.is_current_stream_capturing = lambda: False
torch.Tensor.is_cuda = property(lambda self: True)

import moekit.ops._triton.gg_gluon as _GL
import moekit.ops._triton.grouped_gemm as _GG


class _GluonLaunch:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            RECORDS.append({"gluon": self.name, "num_warps": kwargs.get("num_warps", 4)})
        return go


for _name in ("_gg_gluon_kernel", "_gg_gluon_ws_kernel"):
    setattr(_GL, _name, _GluonLaunch(_name))
# Meta tensors have no addresses: TMA wherever the strides allow it (as on the GPU's aligned tensors).
_GG._tma_ok = _GG._tma_fits = lambda t, block: t.stride(-1) == 1

from moekit.layers.functional import moe_forward
from moekit.testing.data import MODEL_SHAPES

for model, T, dtype in CASES:
    RECORDS.append({"case": [model, T, dtype]})
    s = MODEL_SHAPES[model]
    fp8 = dtype == "fp8"
    m = "meta"
    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scales = {}
    if fp8:
        scales = dict(w13_scale_e2F=torch.empty(s.E, 2 * s.F, device=m), w2_scale_eD=torch.empty(s.E, s.D, device=m))
    try:
        moe_forward(torch.empty(T, s.D, dtype=torch.bfloat16, device=m), None,
                    torch.empty(s.E, 2 * s.F, s.D, dtype=wdt, device=m), torch.empty(s.E, s.D, s.F, dtype=wdt, device=m),
                    s.routing_config, logits_TE=torch.empty(T, s.E, dtype=torch.float32, device=m),
                    e_score_correction_bias=torch.empty(s.E, device=m) if s.n_group else None, **scales)
    except Exception as e:  # noqa: BLE001
        RECORDS.append({"case_error": f"{type(e).__name__}: {e}"[:600] + "\\n" + traceback.format_exc()[-1500:]})
"""

_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_F", "BLOCK_E", "STAGES", "SCATTER", "EARLY_EPI", "PAIR", "MIX",
              "USE_TMA", "X_TMA", "ROWS", "PERM_S", "USE_PDL")  # fmt: skip


def collect(cases: list[tuple[str, int, str]], knobs: str = "", pdl: bool = True, timeout: int = 7200) -> list[dict]:
    """One dict per launch (``tests/ops/_sm90.py``'s compile record plus ``case``), a ``gluon``
    record per Gluon launch, a ``case_error`` record per case that failed to run. ``pdl``: the
    kernels that take ``USE_PDL`` compiled as a CUDA-graph capture launches them on sm_90."""
    from tests.ops._sm90 import compile_launches

    old = os.environ.get("MOEKIT_KNOBS")
    if knobs:
        os.environ["MOEKIT_KNOBS"] = knobs
    try:
        snippet = f"CASES = {json.dumps(cases)}\n" + _SNIPPET
        raw = compile_launches(snippet, launch_modules(), timeout=timeout, pdl=pdl, serialized=True)
    finally:
        if knobs:
            if old is None:
                os.environ.pop("MOEKIT_KNOBS", None)
            else:
                os.environ["MOEKIT_KNOBS"] = old
    out, case = [], None
    for r in raw:
        if "case" in r:
            case = r["case"]
            continue
        out.append({**r, "case": case})
    return out


def problems(rec: dict) -> list[str]:
    """What fails a launch record (see the module docstring)."""
    if "case_error" in rec:
        return [f"the case failed: {rec['case_error']}"]
    if "gluon" in rec:
        return []
    bad = []
    if rec["error"]:
        bad.append(f"does not compile: {rec['error'][:300]}")
    if rec["serialized"]:
        bad.append(f"wgmma serialized: {rec['serialized']}")
    if rec["shared"] is not None and rec["shared"] > SMEM_LIMIT:
        bad.append(f"{rec['shared']} bytes of shared memory (> {SMEM_LIMIT})")
    return bad


def row(rec: dict) -> list[str]:
    model, T, dtype = rec["case"]
    head = [model, str(T), dtype]
    if "case_error" in rec:
        return head + ["(case failed)"] + [""] * 7
    if "gluon" in rec:
        return head + [rec["gluon"] + " (Gluon)", str(rec["num_warps"])] + [""] * 6
    c = rec["constants"]
    tiles = " ".join(f"{k}={c[k]}" for k in _TILE_KEYS if k in c)
    kb = f"{rec['shared'] / 1024:.1f}" if rec["shared"] is not None else "?"
    return head + [rec["kernel"], str(rec["num_warps"]), kb, str(rec["regs"]), str(rec["stack"]),
                   str(rec["loop_spills"]), rec["serialized"] or "-", tiles]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS)
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--knobs", default="", help="NAME=value,... as $MOEKIT_KNOBS")
    ap.add_argument("--no-pdl", action="store_true", help="compile as eager calls launch (no PDL)")
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    from moekit.testing.data import MODEL_SHAPES

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODEL_SHAPES]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {sorted(MODEL_SHAPES)}")
    dtypes = [d for d in args.dtype.split(",") if d]
    if not set(dtypes) <= {"bf16", "fp8"}:
        ap.error(f"--dtype takes bf16 and / or fp8, got {args.dtype!r}")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        ap.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens takes positive batch sizes, got {args.tokens!r}")
    if args.knobs:
        from moekit.settings import parse_knobs

        parse_knobs(args.knobs)  # ValueError naming an unknown knob or value
    cases = [(m, t, d) for m in models for t in tokens for d in dtypes]
    try:
        recs = collect(cases, args.knobs, pdl=not args.no_pdl)
    except BaseException as e:  # tests/ops/_sm90.py skips (pytest's Skipped) where ptxas is missing
        if type(e).__name__ != "Skipped":
            raise
        print(f"layer_launches: cannot compile for sm_90 here: {e}", file=sys.stderr)
        return 2
    cols = ["model", "T", "dtype", "kernel", "warps", "shared KB", "regs", "stack", "loop spills", "serialized",
            "tiles"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    bad = []
    for r in recs:
        print("| " + " | ".join(row(r)) + " |")
        bad += [f"{' '.join(map(str, r['case']))} {r.get('kernel', r.get('gluon', ''))}: {p}" for p in problems(r)]
    launches = sum("case_error" not in r for r in recs)
    print(f"\n{len(cases)} cases, {launches} launches; {len(bad)} problem(s)")
    for b in bad:
        print("  " + b)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
