#!/usr/bin/env python3
"""Whole transformers models, default experts vs moekit: ``moekit bench --hf`` with its JSON rows
written under ``$MOEKIT_BENCH_DIR`` (for scripts/device_session.sh).

    python benchmarks/bench_hf.py [--hf qwen3-moe,gpt-oss] [any other ``moekit bench --hf`` option]

Without CUDA it says so and exits 0 (``moekit bench --hf`` itself runs tiny CPU models then).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def main(argv: list[str]) -> int:
    import torch

    argv = [a for a in argv if a != "--quick"]
    if not torch.cuda.is_available():
        print("bench_hf: needs a CUDA GPU for the full-size models; `moekit bench --hf all` runs tiny ones on a CPU.")
        return 0
    from moekit import settings
    from moekit.cli import main as cli_main

    if "--hf" not in argv:
        argv = ["--hf", "all"] + argv
    if "--json" not in argv:
        argv += ["--json", os.path.join(settings.get().bench_dir or ".", "hf_bench.json")]
    return cli_main(["bench", "--no-progress"] + argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
