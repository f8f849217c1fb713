"""The ``moekit`` command: ``env`` (what this machine offers), ``bench`` (time the MoE pipeline
and its ops), ``check`` (every public op, ``moekit.ops.__all__``, against its float32 reference
on this machine: one line per op, a non-zero exit on any failure)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_env(args: argparse.Namespace) -> int:
    from moekit.envinfo import collect, format_env

    print(format_env(collect()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from moekit import _bench

    return _bench.main(args)


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

    b = sub.add_parser("bench", help="benchmark the MoE pipeline (moekit vs torch vs MSLK when importable)")
    b.add_argument("--model", default=None, help="model shape (default: llama4-scout on CUDA, tiny on CPU)")
    b.add_argument("--tokens", default=None, help="comma-separated token counts (default depends on device)")
    b.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="routed expert precision")
    b.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    b.add_argument("--json", default=None, help="also write the rows to this JSON file")
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
