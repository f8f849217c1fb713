#!/usr/bin/env bash
# Issues 14 and 15's acceptance grids in one or two device calls (scripts/device_session.sh lanes on
# GPU 0; JSON rows under $OUT/results.tgz, json_layer_<part>/): PART=prefill (the card's ceilings,
# issue 15's grid, Llama 4 Scout bf16 beside MSLK) or PART=decode (issue 14's grid, Scout's decode
# sizes beside MSLK, Llama 4 Maverick). Then, on the development machine:
#   python benchmarks/acceptance.py --ceilings <card_ceilings JSON> --rows <the layer JSON files>
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=qwen3-30b-a3b,deepseek-v3-tp8,gpt-oss-120b,llama4-scout
case "${PART:?PART=prefill or PART=decode}" in
  prefill)
    export LANES="0:card_ceilings,layer@grid,layer@mslk"
    export BENCH_ARGS_layer_grid="--lean --tokens 256,1024,2048,8192,16384 --models $MODELS --dtype bf16,fp8"
    export BENCH_ARGS_layer_mslk="--quick --tokens 256,1024,2048,8192,16384 --models llama4-scout --dtype bf16" ;;
  decode)
    export LANES="0:layer@grid,layer@mslk,layer@maverick"
    export BENCH_ARGS_layer_grid="--lean --tokens 1,4,16,64,256 --models $MODELS --dtype bf16,fp8"
    export BENCH_ARGS_layer_mslk="--quick --tokens 1,4,16,64,256 --models llama4-scout --dtype bf16"
    export BENCH_ARGS_layer_maverick="--quick --tokens 1,256,1024,2048,8192,16384 --models llama4-maverick --dtype bf16,fp8" ;;
  *) echo "PART=prefill or PART=decode, got $PART" >&2; exit 2 ;;
esac
PHASES=lanes BUDGET_S=${BUDGET_S:-575} exec bash scripts/device_session.sh
