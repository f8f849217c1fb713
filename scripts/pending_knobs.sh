#!/usr/bin/env bash
# The knobs built on the CPU and not yet timed on a GPU, in one device call (scripts/device_session.sh:
# their GPU tests first, then each A/B in one process on GPU 0; JSON rows under $OUT/results.tgz):
#   DECODE_ROUTE_ROWS (session 50, off): moe_decode's first launch routes on a row per warp;
#   SWIGLU_PAIR_MIX + SWIGLU_SMALL_STAGES=5 (session 49, off / 4): 5-stage 64-row SwiGLU tiles.
# Then, if a knob pays: its default on, its comment, RESULTS.md with this command.
# Session 51 (H100) ran it: both knobs level or mixed, both stay off (RESULTS.md, session 51); the
# script stays as the template for the next knob built without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export BENCH_ARGS_layer_rows="--lean --quick --models qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-tp8 --tokens 1,4 --dtype fp8,bf16 --alt-knobs DECODE_ROUTE_ROWS=1"
export BENCH_ARGS_layer_stages="--lean --quick --models qwen3-30b-a3b,gpt-oss-120b --tokens 1024,2048 --dtype fp8,bf16 --alt-knobs SWIGLU_PAIR_MIX=1,SWIGLU_SMALL_STAGES=5"
export PHASES="tests lanes" TESTS="tests/ops/test_moe_decode.py tests/ops/test_grouped_gemm_swiglu.py"
export TEST_K="row_per_warp or gpu_matches or mixed" TEST_WORKERS=${TEST_WORKERS:-8} TEST_FLAGS="-q -rf"
export TESTS_SHARE=${TESTS_SHARE:-25} LANES="0:layer@rows,layer@stages" LANE_MAX_S=${LANE_MAX_S:-120} BENCH_TAIL=40
BUDGET_S=${BUDGET_S:-300} exec bash scripts/device_session.sh
