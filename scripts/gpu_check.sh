#!/usr/bin/env bash
# GPU tier + benchmarks on a CUDA machine that already has torch and triton and no network.
# Usage: bash scripts/gpu_check.sh [tests|bench|all] [pytest args...]
#   MOEKIT_BENCH_QUICK=1   pass --quick to every benchmark
#   MOEKIT_BENCHES="routing gather_scatter ..."   which benchmarks/bench_<name>.py to run
# Results: logs and JSON under $OUT (default ./out). MSLK (benchmark peer) is installed from
# .whl/ with --no-deps into /tmp/site when the wheel is there.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast must never be used on shared hosts (DESIGN.md §7).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -m moekit.cli env | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee -a "$OUT/env.txt"

rc=0
if [[ "$what" == "tests" || "$what" == "all" ]]; then
  timeout 1500 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 300 \
    -o addopts="" --junitxml="$OUT/gpu_junit.xml" "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  rc=${PIPESTATUS[0]}
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  quick=${MOEKIT_BENCH_QUICK:+--quick}
  for b in ${MOEKIT_BENCHES:-routing gather_scatter shuffling activation grouped_gemm layer}; do
    f="benchmarks/bench_$b.py"
    [[ -f "$f" ]] || continue
    echo "== $f $quick"
    timeout 600 python3 "$f" $quick 2>&1 | tee "$OUT/bench_$b.log" | tail -n 60
  done
fi
exit $rc
