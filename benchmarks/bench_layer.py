"""The routed experts of one MoE layer, from router logits to output: moekit (automatic pipeline,
and the sorted one pinned) vs vLLM 0.33's Triton fused_moe (routing precomputed: its
``us_moe_only``; bf16 and its fp8_w8a8 per-channel variant) vs MSLK (top-1 sigmoid) vs plain
PyTorch, one process, every output checked against a float32 reference before it is timed.

    python benchmarks/bench_layer.py [--quick] [--models qwen3-30b-a3b,deepseek-v3-tp8] [--dtype bf16,fp8]
        [--tokens 1,4,16,64,256] [--lean] [--alt-knobs NAME=value,...] [--compile]

``--alt-knobs``: moekit also with those kernel-choice knobs pinned (``MOEKIT_KNOBS``' form), in
the same process on the same inputs (default / knobs / knobs / default): an A/B that a process's
own slow or fast mode does not decide (``alt_us``, ``alt/moekit``; ``layer_bench.run``).
``--compile``: moekit's forward through ``torch.compile(fullgraph=True)`` (as a serving engine
that compiles its model runs it; traced again whenever the knobs change), e.g. with
``--alt-knobs GG_DEVICE_TMA=0``: the traced graphs' descriptors made in the kernels against the
pointer loads.

vLLM's harness is found at $MOEKIT_VLLM_HARNESS, .peers/vllm_fused_moe or ../shared/peers/vllm_fused_moe.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moekit import layer_bench
from moekit.benchmarking import markdown_table, save_rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--models",
        default=None,
        help="default: qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout (--quick: the first two)",
    )
    p.add_argument("--dtype", default="bf16,fp8")
    p.add_argument("--tokens", default=None)
    p.add_argument("--lean", action="store_true", help="moekit's automatic pipeline and vLLM only (A/B lanes)")
    p.add_argument(
        "--alt-knobs", default="", help="also time moekit with these knobs pinned, e.g. DECODE_FUSED_MIN_TOP_K=4"
    )
    p.add_argument("--compile", action="store_true", help="moekit through torch.compile(fullgraph=True)")
    a = p.parse_args()
    from moekit.settings import parse_knobs

    try:
        alt = parse_knobs(a.alt_knobs)
    except ValueError as exc:
        p.error(f"--alt-knobs: {exc}")
    if not torch.cuda.is_available():
        print("bench_layer needs CUDA; nothing to do on this machine")
        return 0
    models = (a.models or "qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout").split(",")
    if a.quick and not a.models:
        models = models[:2]
    tokens = (
        [int(t) for t in a.tokens.split(",")]
        if a.tokens
        else (layer_bench.GPU_TOKENS_QUICK if a.quick else layer_bench.GPU_TOKENS)
    )
    rows, wrong = [], []
    for dt in a.dtype.split(","):  # every model in bf16 first: a run cut short loses FP8 rows first
        for m in models:
            print(f"== {m} {dt}", flush=True)
            try:
                rows += layer_bench.run(m, tokens, dt == "fp8", a.quick, lean=a.lean, alt_knobs=alt or None,
                                        compiled=a.compile)  # fmt: skip
                save_rows("bench_layer", rows)  # after every model: a run cut short keeps its rows
            except AssertionError as exc:  # a wrong result: fail the benchmark (after the other models)
                print(f"   {m} {dt} WRONG RESULT: {exc}")
                wrong.append(f"{m} {dt}: {exc}")
            except Exception as exc:  # keep the other models' rows
                print(f"   {m} {dt} failed: {type(exc).__name__}: {exc}")
    cols = ["model", "T", "dtype", "path", "floor_us", "moekit_us", "decode_us", "sorted_us", "det_us", "vllm_us", "torch_us",
            "mslk_us", "floor/moekit", "moekit/vllm", "moekit/mslk", "moekit/torch"]  # fmt: skip
    if alt:  # the same-process A/B's columns after moekit's own
        at = cols.index("moekit_us") + 1
        cols[at:at] = ["moekit_us_2", "alt_path", "alt_us", "alt_us_2", "alt/moekit"]
    print(markdown_table(rows, cols))
    save_rows("bench_layer", rows)
    if wrong:
        print("wrong results:\n" + "\n".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
