"""The ``moekit`` command: ``env`` (what this machine offers), ``bench`` (time the MoE pipeline
and its ops), ``check`` (every public op, ``moekit.ops.__all__``, against its float32 reference
on this machine: one line per op, a non-zero exit on any failure).

``moekit bench`` runs one of three jobs:

* the layer benchmark (``moekit.layer_bench``; the default on a CUDA GPU, or with ``--model`` /
  ``--tokens``): one MoE layer, moekit vs its peers, with the roofline floor;
* ``--hf ARCH``: a whole transformers model with random weights, transformers' experts vs
  moekit's (``moekit.hfbench``);
* without CUDA and without those options: ``hfbench.cpu_default``, tiny models generating with
  moekit and with eager experts, tokens checked (no kernel timings on a CPU).

``--plot out.png`` draws the layer benchmark's rows (``moekit.benchplot``), from this run or
``--from`` earlier JSON files."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_env(args: argparse.Namespace) -> int:
    from moekit.envinfo import collect, format_env

    print(format_env(collect()))
    return 0


_HF_ONLY = ("layers", "prompt_len", "batch", "new_tokens", "reps", "size", "vocab", "baseline", "seed")


def _layer_bench(args: argparse.Namespace) -> tuple[int, list]:
    """The layer benchmark for each of ``--model``'s comma-separated models; (rc, rows)."""
    import copy
    import json
    import os
    import tempfile

    from moekit import layer_bench

    models = [m.strip() for m in args.model.split(",") if m.strip()] if args.model else [None]
    rows: list = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, m in enumerate(models):
            ns = copy.copy(args)
            ns.model = m
            ns.json = os.path.join(tmp, f"{i}.json")
            rc = layer_bench.main(ns)
            if rc:
                return rc, rows
            with open(ns.json) as f:
                rows += json.load(f)["rows"]
    if args.json:
        from moekit.benchmarking import environment

        with open(args.json, "w") as f:
            json.dump({"meta": environment(), "rows": rows}, f, indent=1)
    return 0, rows


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if args.from_ and not args.plot:
        print("--from gives --plot its rows: add --plot OUT.png")
        return 2
    if args.hf:
        layer_opts = [o for o, v in (("--model", args.model), ("--tokens", args.tokens)) if v]
        if layer_opts or args.dtype != "bf16":
            print(f"{', '.join(layer_opts or ['--dtype fp8'])}: layer benchmark options, not for --hf (which runs "
                  "bf16 on CUDA, float32 on a CPU)")  # fmt: skip
            return 2
        if args.plot:
            print("--plot draws the layer benchmark (measured vs the roofline floor per T); --hf has no floor")
            return 2
        from moekit import hfbench

        return hfbench.main(args)
    given = [f"--{k.replace('_', '-')}" for k in _HF_ONLY if getattr(args, k) is not None] + (
        ["--strict"] if args.strict else []
    )
    layer = args.model or args.tokens or args.plot or torch.cuda.is_available()
    if given and layer:
        print(f"{', '.join(given)} only apply to --hf runs (and to the CPU default job)")
        return 2
    if args.plot:
        from moekit import benchplot

        if args.from_:
            try:
                rows = benchplot.load_rows(args.from_)
                print(f"wrote {benchplot.plot(rows, args.plot)}")
            except ImportError as e:
                print(e)
                return 2
            except (OSError, ValueError) as e:
                print(f"moekit bench --plot: {e}")
                return 2
            return 0
        if not torch.cuda.is_available():
            print("moekit bench --plot runs the layer benchmark first, and its times mean something on a CUDA GPU "
                  "only; on this machine plot earlier rows: moekit bench --plot OUT.png --from ROWS.json (written "
                  "by `moekit bench --json` or benchmarks/bench_layer.py)")  # fmt: skip
            return 2
        try:
            benchplot._figure_cls()  # fail before the benchmark, not after it
        except ImportError as e:
            print(e)
            return 2
        rc, rows = _layer_bench(args)
        if rc:
            return rc
        print(f"wrote {benchplot.plot(rows, args.plot)}")
        return 0
    if layer:
        return _layer_bench(args)[0]
    from moekit import hfbench

    return hfbench.cpu_default(args)


def _cmd_check(args: argparse.Namespace) -> int:
    from moekit import _check

    return _check.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moekit",
        description="Fast Mixture-of-Experts inference kernels for PyTorch: environment, benchmarks, checks.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    e = sub.add_parser("env", help="print torch/triton/CUDA/GPU facts and the available backends")
    e.set_defaults(func=_cmd_env)

    b = sub.add_parser(
        "bench",
        help="benchmark moekit: one MoE layer vs its peers (GPU), a whole transformers model (--hf)",
        description="Without options: on a CUDA GPU the layer benchmark (one MoE layer of --model, moekit vs "
        "torch / MSLK / vLLM where available, with the roofline floor); on a CPU-only machine tiny random "
        "transformers models generating with moekit vs eager experts, tokens checked. --hf ARCH: a whole model "
        "(full-size config, random weights, a few layers) with transformers' default experts vs moekit.",
    )  # fmt: skip
    lay = b.add_argument_group("layer benchmark")
    lay.add_argument(
        "--model", default=None, help="model shape(s), comma-separated (default: llama4-scout on CUDA, tiny on CPU)"
    )
    lay.add_argument("--tokens", default=None, help="comma-separated token counts (default depends on device)")
    lay.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="routed expert precision")
    b.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    b.add_argument("--json", default=None, help="also write the rows to this JSON file")
    hf = b.add_argument_group("whole transformers model (--hf)")
    hf.add_argument(
        "--hf",
        default=None,
        metavar="ARCH",
        help="architecture(s), comma-separated, or 'all': qwen3-moe, mixtral, deepseek-v3, gpt-oss, llama4",
    )
    hf.add_argument("--layers", type=int, default=None, help="decoder layers (default 2; every one an MoE layer)")
    hf.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence (default 512; 64 tiny)")
    hf.add_argument("--batch", type=int, default=None, help="sequences (default 1)")
    hf.add_argument("--new-tokens", type=int, default=None, help="greedy tokens to generate (default 32; 16 tiny)")
    hf.add_argument(
        "--reps", type=int, default=None, help="timed runs per implementation, median (3 on CUDA, 5 on a CPU)"
    )
    hf.add_argument(
        "--size",
        default=None,
        choices=["auto", "full", "tiny"],
        help="full-size dims or a tiny scaled-down config (auto: full on CUDA, tiny on CPU)",
    )
    hf.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 32000; 512 tiny)")
    hf.add_argument(
        "--baseline",
        default=None,
        choices=["default", "eager", "grouped_mm", "batched_mm"],
        help="transformers experts implementation to compare with (default: transformers' default; "
        "eager for the CPU default job)",
    )
    hf.add_argument("--seed", type=int, default=None, help="weights and prompt seed (default 0)")
    hf.add_argument("--strict", action="store_true", help="fail on any token difference, rounding near-ties too")
    hf.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    pl = b.add_argument_group("plot")
    pl.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="draw the layer benchmark's measured times vs the roofline floor per T, one panel per model "
        "(needs matplotlib: pip install 'moekit[plot]')",
    )
    pl.add_argument(
        "--from",
        dest="from_",
        nargs="+",
        default=None,
        metavar="ROWS.json",
        help="plot these earlier JSON rows (moekit bench --json, benchmarks/bench_layer.py) instead of running",
    )
    b.set_defaults(func=_cmd_bench)

    c = sub.add_parser("check", help="compare every public op with its float32 reference on this machine")
    c.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    c.set_defaults(func=_cmd_check)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
