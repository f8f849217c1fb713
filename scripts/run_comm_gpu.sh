#!/usr/bin/env bash
# GPU tier of moekit.comm on a multi-GPU machine (no network needed): the symmetric-memory tests
# (tests/comm, markers gpu + multigpu, every visible GPU) and benchmarks/bench_collective.py on 2
# GPUs, with NVLink multicast disabled everywhere. Prints a short summary at the end.
#
#   bash scripts/run_comm_gpu.sh            # tests + full benchmark (kept under 10 min in all)
#   QUICK=1 bash scripts/run_comm_gpu.sh    # tests + benchmark --quick
#   SKIP_TESTS=1 / SKIP_BENCH=1             # one half only
#
# Benchmark rows go to $OUT/collective.json (or $MOEKIT_BENCH_DIR) when set.
set -uo pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PY=${PYTHON:-python}
LOG=${TMPDIR:-/tmp}/moekit_comm_gpu.$$
mkdir -p "$LOG"

$PY - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, GPUs: {torch.cuda.device_count()}",
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), sep="\n  ")
import moekit.comm as c
print("moekit.comm backends:", c.available_backends())
PY

rc_tests=0 rc_bench=0
t0=$SECONDS
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "=== tests/comm (gpu) ==="
  timeout ${TESTS_TIMEOUT:-330} $PY -m pytest tests/comm -m gpu -q -rA -p no:cacheprovider 2>&1 | tee "$LOG/tests.log"
  rc_tests=${PIPESTATUS[0]}
fi
t1=$SECONDS
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "=== benchmarks/bench_collective.py ${QUICK:+--quick} ==="
  timeout ${BENCH_TIMEOUT:-240} $PY benchmarks/bench_collective.py ${QUICK:+--quick} 2>&1 | tee "$LOG/bench.log"
  rc_bench=${PIPESTATUS[0]}
fi
t2=$SECONDS

echo
echo "=== summary ==="
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "tests: rc=$rc_tests in $((t1 - t0)) s: $(grep -E '(passed|failed|skipped|error).* in [0-9.]+s' "$LOG/tests.log" | tail -1)"
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' "$LOG/tests.log" | sed 's/^/  /'
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "benchmark: rc=$rc_bench in $((t2 - t1)) s"
  grep -E '^(target|targets:|rows saved)' "$LOG/bench.log" | sed 's/^/  /'
fi
echo "logs: $LOG"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
