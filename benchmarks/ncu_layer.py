#!/usr/bin/env python3
"""Hardware counters of each kernel of one MoE layer forward (the routed experts from router
logits, as ``bench_layer.py`` times them), read by Nsight Compute: duration, DRAM bytes and
throughput, achieved occupancy, registers and grid, each kernel replayed from a cold L2.

    python benchmarks/ncu_layer.py [--models qwen3-30b-a3b,deepseek-v3-tp8] [--tokens 1,4] [--dtype bf16,fp8] [--stalls] [--sol] [--atomics]

runs ``ncu`` on itself (``--clock-control none``: the clocks as they are) over one forward per
case, after warm-up calls that compile every kernel, and prints one table row per kernel. A
diagnosis aid (kernels run one at a time, without the PDL overlap of a CUDA-graph replay), not a
benchmark of record. Needs Nsight Compute (``ncu`` on the PATH or under /opt/nvidia) and a GPU
whose counters the machine exposes. ``--stalls`` adds, per kernel, instructions executed, cycles
and the average number of warps stalled per issue for each reason (ncu's
``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``; ``long_sb``: waiting on
global memory, ``wait``/``short_sb``/``math``: fixed latencies and pipes, ``barrier``,
``not_sel``: ready but another warp issued). ``--sol`` adds L2 and SM throughput, the tensor-core
pipes' active cycles (% of peak over the kernel's duration) and the bytes through L2 and written
to DRAM. ``--atomics`` adds the L2 reductions a scatter-add epilogue sends (``red`` / ``atom``
sectors) and the share of time L2's atomic units are busy. Each case's forward starts with a marker launch
(``torch.cuda._sleep``), which splits the rows into cases whatever kernels the path launches.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes_read.sum": "MB read",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
}
#: ``--stalls``: what the warps of a kernel wait on (average warps stalled per issued instruction).
STALLS = {
    "smsp__inst_executed.sum": "inst",
    "sm__cycles_elapsed.avg": "cycles",
    **{f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": label for r, label in (
        ("long_scoreboard", "long_sb"), ("short_scoreboard", "short_sb"), ("wait", "wait"),
        ("math_pipe_throttle", "math"), ("mio_throttle", "mio"), ("lg_throttle", "lg"), ("barrier", "barrier"),
        ("membar", "membar"), ("no_instruction", "no_inst"), ("dispatch_stall", "dispatch"),
        ("not_selected", "not_sel"), ("selected", "selected"), ("drain", "drain"), ("sleeping", "sleeping"),
        ("branch_resolving", "branch"), ("imc_miss", "imc"),
    )},
}  # fmt: skip
#: ``--sol``: where a kernel sits against each unit's peak (% of peak sustained over its duration:
#: L2 slices, SM issue / pipes, Hopper's tensor-core (gmma) pipe) and what crossed L2 and DRAM.
SOL = {
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %",
    "lts__t_bytes.sum": "L2 MB",
    "dram__bytes_write.sum": "MB written",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed": "gmma %",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed": "hmma %",
}
#: ``--atomics``: the reductions a scatter-add epilogue sends to L2 (fire-and-forget ``red`` and
#: value-returning ``atom``, in 32-byte sectors), the L2's atomic units' busy share (% of peak over
#: the kernel's duration) and the SM-side global reduction instructions, against L2's plain writes.
ATOMICS = {
    "smsp__inst_executed_op_global_red.sum": "red inst",
    "lts__t_sectors_op_red.sum": "red sectors",
    "lts__t_sectors_op_atom.sum": "atom sectors",
    "lts__t_sectors_op_write.sum": "write sectors",
    "lts__d_atomic_input_cycles_active.avg.pct_of_peak_sustained_elapsed": "L2 atomic %",
    "lts__t_sectors_op_red_lookup_hit.sum": "red hit sectors",
}
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: the first launch of every profiled case


def _ncu() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if not found:
        found = next(iter(glob.glob("/usr/local/cuda*/bin/ncu")), None)
    if not found:
        raise SystemExit("ncu_layer: Nsight Compute (ncu) not found")
    return found


def run_cases(models: list[str], tokens: list[int], dtypes: list[str]) -> None:
    """The profiled process: warm up every case, then one forward per case between
    cudaProfilerStart / Stop (NVTX-free ranges: ncu's --profile-from-start off)."""
    import torch

    from moekit.layers.functional import moe_forward, quantize_expert_weights
    from moekit.testing import MODEL_SHAPES, random_expert_weights

    cases = []
    for model in models:
        s = MODEL_SHAPES[model]
        w = random_expert_weights(s, dtype=torch.bfloat16, device="cuda", seed=0)
        for dt in dtypes:
            if dt == "fp8":
                w13, w13s = quantize_expert_weights(w["w13_e2FD"])
                w2, w2s = quantize_expert_weights(w["w2_eDF"])
            else:
                w13, w2, w13s, w2s = w["w13_e2FD"], w["w2_eDF"], None, None
            for T in tokens:
                x = torch.randn(T, s.D, device="cuda", dtype=torch.bfloat16)
                logits = (x @ w["router_DE"]).float()

                def fwd(x=x, logits=logits, w13=w13, w2=w2, w13s=w13s, w2s=w2s, s=s, w=w):
                    return moe_forward(x, None, w13, w2, s.routing_config, logits_TE=logits,
                                       e_score_correction_bias=w.get("e_score_correction_bias"),
                                       w13_scale_e2F=w13s, w2_scale_eD=w2s)  # fmt: skip

                for _ in range(2):
                    fwd()
                cases.append((f"{model} {dt} T={T}", fwd))
    torch.cuda.synchronize()
    for name, fwd in cases:
        print(f"@@case {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda._sleep(1)  # the case marker (MARKER)
        fwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3-tp8")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--stalls", action="store_true", help="add instructions, cycles and warp stall reasons")
    ap.add_argument("--sol", action="store_true", help="add L2 / SM / tensor-pipe throughput and L2 bytes")
    ap.add_argument("--atomics", action="store_true", help="add L2 reductions (red/atom sectors, atomic-unit busy %%)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="accepted for device_session.sh; no effect")
    a = ap.parse_args()
    models, tokens, dtypes = a.models.split(","), [int(t) for t in a.tokens.split(",")], a.dtype.split(",")
    import torch

    if not torch.cuda.is_available():
        print("ncu_layer needs a CUDA GPU (and Nsight Compute); nothing to do on this machine")
        return 0
    if a.child:
        run_cases(models, tokens, dtypes)
        return 0
    metrics = {**METRICS, **(STALLS if a.stalls else {}), **(SOL if a.sol else {}), **(ATOMICS if a.atomics else {})}
    metrics = _available(metrics)
    cmd = [_ncu(), "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw", "--print-units",
           "base",
           "--metrics", ",".join(metrics), sys.executable, os.path.abspath(__file__), "--child",
           "--models", a.models, "--tokens", a.tokens, "--dtype", a.dtype]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1
    print(table(proc.stdout, metrics))
    return 0


def _available(metrics: dict) -> dict:
    """``metrics`` less those this GPU's Nsight Compute does not list (``--query-metrics``; one
    unknown name fails the whole profile), each dropped one named."""
    proc = subprocess.run([_ncu(), "--query-metrics"], capture_output=True, text=True)
    have = {ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip() and "__" in ln.split()[0]}
    if proc.returncode != 0 or not have:
        return metrics
    for m in metrics:  # (launch__ attributes are not listed, and always there)
        if m.split(".")[0] not in have and not m.startswith("launch__"):
            print(f"ncu_layer: this GPU's ncu has no {m.split('.')[0]}; left out")
    return {m: label for m, label in metrics.items() if m.split(".")[0] in have or m.startswith("launch__")}


def table(out: str, metrics: dict) -> str:
    """The Markdown table of ncu's ``--csv --page raw`` output ``out``: one row per kernel, named
    by the case whose marker launch came before it (the markers themselves are not listed)."""
    # The child's case markers come in order, one per profiled range; ncu's CSV rows after them.
    order = [ln[len("@@case ") :] for ln in out.splitlines() if ln.startswith("@@case ")]
    lines = [ln for ln in out.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    rows = [r for r in rows if r.get("ID", "").isdigit()]  # skip the units row
    text = ["| case | kernel | " + " | ".join(metrics.values()) + " |", "|---|---|" + "---|" * len(metrics)]
    case_i = -1
    for r in rows:
        name = r.get("Kernel Name", "?")
        if MARKER in name:
            case_i += 1
            continue
        vals = []
        for m, label in metrics.items():
            v = r.get(m, "")
            try:
                f = float(v.replace(",", ""))
                if label == "us":
                    f /= 1000.0  # ns
                elif label.startswith("MB") or label.endswith(" MB"):
                    f /= 1e6
                counts = label in ("inst", "cycles", "regs", "grid", "block") or label.endswith(("sectors", " inst"))
                v = f"{f:.1f}" if f < 1e6 and not counts else f"{f:.0f}"
            except ValueError:
                pass
            vals.append(v)
        case = order[case_i] if 0 <= case_i < len(order) else "?"
        text.append(f"| {case} | {name[:48]} | " + " | ".join(vals) + " |")
    return "\n".join(text)


if __name__ == "__main__":
    sys.exit(main())
