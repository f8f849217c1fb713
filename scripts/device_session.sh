#!/usr/bin/env bash
# One device-machine call that does as much as possible: GPU tier of the ops and layers (split
# across the GPUs), the collective's multi-GPU tier, then benchmarks, with hard time limits so the
# whole call ends inside the 10-minute command limit. Writes logs and JSON to $OUT.
#   PHASES="tests comm bench lanes ab"   BENCHES="routing gather_scatter ..."   LANES="0:a,b 1:c"
#   QUICK=1   BUDGET_S=560   BENCH_ARGS_<name>="extra args for benchmarks/bench_<name>.py"
#   LANE_MAX_S=<s> (each lane entry's own time limit, else what is left of BUDGET_S: an entry that
#   hangs, as a kernel that never returns did in session 26, then costs only this much;
#   LANE_MAX_S_<name>[_<tag>]: one entry's own limit in place of it)
#   BENCH_ENV_<name>[_<tag>]="VAR=value ..." (environment of one lane entry; "name@tag" entries take
#   BENCH_ARGS_<name>_<tag>, else BENCH_ARGS_<name>; scripts/ab_trees.sh: earlier commits' trees)
#   TESTS="tests/ops ..." (GPU tier; on 2 GPUs the grouped-GEMM file runs on GPU 1, GEMM_K="-k expr")
#   TEST_GPU=0 (tests on GPU 0 only, while the lanes run on the others at once); TEST_K="expr" (pytest -k; the script adds the -k)
#   TEST_FLAGS="-q" (pytest verbosity of the GPU tier; "-v" names each test as it ends, which a
#   time-limited run that is cut before its summary still shows)
#   TEST_WORKERS=4 (pytest workers per GPU; --dist loadgroup puts the full-size model tests, the
#   xdist_group "full_size_models", on one worker: four of them at once ran an H200 out of memory)
#   (a name without a bench_<name>.py runs benchmarks/<name>.py: the sweep_*.py tuning aids)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
BUDGET_S=${BUDGET_S:-560}
left() { echo $(( BUDGET_S - (SECONDS - start) )); }
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
# $OUT returns at most 8 files: logs and JSON rows go to $RES, packed into one tarball at the end.
RES=/tmp/moekit_results; rm -rf "$RES"; mkdir -p "$RES"; export MOEKIT_BENCH_DIR="$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p "$TRITON_CACHE_DIR"
[ -f .devcache/triton.tgz ] && tar -xzf .devcache/triton.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
# Wheels carried from the development machine (the GPU machine has no network): .whl/ (MSLK, the
# benchmark peer) and .whl-hf/ (transformers and what it imports, for the integration's GPU tests).
for d in .whl .whl-hf; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
      && export PYTHONPATH="${PYTHONPATH%:/tmp/site}:/tmp/site"
  fi
done
# Say whether the carried wheels import (a module-level importorskip would otherwise hide it).
[ -d .whl-hf ] && python3 -c "import transformers, transformers.integrations.moe; print('transformers', transformers.__version__, 'imports')" 2>&1 | tail -n 4
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m moekit.cli env > "$RES/env.txt" 2>&1; head -20 "$RES/env.txt"
PHASES=${PHASES:-"tests comm bench"}
TESTS=${TESTS:-"tests/ops tests/layers tests/test_cli.py"}

run_lanes() {
  # Benchmarks in parallel lanes, one GPU each: LANES="0:routing,activation 1:grouped_gemm".
  pids=()
  for lane in ${LANES:-"0:routing,gather_scatter,shuffling,activation,layer 1:grouped_gemm"}; do
    gpu=${lane%%:*}; list=${lane#*:}
    (
      for entry in ${list//,/ }; do
        # "name" or "name@tag": the same script twice with BENCH_ARGS_<name>_<tag> (e.g. a sweep split
        # over both GPUs); logs go to bench_<name>[_<tag>].log.
        b=${entry%%@*}; tag=${entry#*@}; [ "$tag" = "$entry" ] && tag=""
        t=$(left); [ "$t" -lt 20 ] && { echo "== out of time before bench_$entry" >> "$RES/lane$gpu.txt"; break; }
        # per-benchmark arguments, e.g. BENCH_ARGS_layer="--models llama4-scout"; a tagged entry's
        # BENCH_ARGS_<name>_<tag> when set, else BENCH_ARGS_<name>
        extra_var="BENCH_ARGS_$b${tag:+_$tag}"
        [ -n "$tag" ] && [ -z "${!extra_var+x}" ] && extra_var="BENCH_ARGS_$b"
        script=benchmarks/bench_$b.py; [ -f "$script" ] || script=benchmarks/$b.py
        env_var="BENCH_ENV_$b${tag:+_$tag}"  # environment for this entry, e.g. BENCH_ENV_layer_nopdl="MOEKIT_PDL=0"
        max_var="LANE_MAX_S_$b${tag:+_$tag}"; max=${!max_var:-${LANE_MAX_S:-}}  # an entry's own limit first
        lim=$((t-10)); [ -n "$max" ] && [ "$max" -lt "$lim" ] && lim=$max
        # JSON rows per entry (json_<name>[_<tag>]/): tagged lanes of one benchmark write the same
        # file name, and the last one used to overwrite the others' rows.
        CUDA_VISIBLE_DEVICES=$gpu MOEKIT_BENCH_DIR="$RES/json_$b${tag:+_$tag}" timeout $lim env ${!env_var:-} \
          python3 "$script" ${QUICK:+--quick} ${!extra_var:-} > "$RES/bench_$b${tag:+_$tag}.log" 2>&1
        echo "== bench_$entry on GPU $gpu rc=$? at $((SECONDS - start))s" >> "$RES/lane$gpu.txt"
      done
    ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$RES"/lane*.txt
  for f in "$RES"/bench_*.log; do echo "-- $f"; grep -E "^\|" "$f" | head -n ${BENCH_TAIL:-40}; done
}
# TEST_GPU=<i>: the tests run on that GPU alone while the lanes (on the other GPUs) run alongside.
lanes_pid=""
if [[ " $PHASES " == *" lanes "* ]] && [ -n "${TEST_GPU:-}" ]; then
  run_lanes > "$RES/lanes_summary.txt" 2>&1 &
  lanes_pid=$!
fi
if [[ " $PHASES " == *" tests "* ]]; then
  t=$(( $(left) * ${TESTS_SHARE:-55} / 100 ))
  echo "== gpu tests (limit ${t}s) on $NGPU GPU(s)"
  if [ -n "${TEST_GPU:-}" ]; then
    CUDA_VISIBLE_DEVICES=$TEST_GPU timeout $t python3 -m pytest ${TEST_FLAGS:--q} -rs -m gpu -p no:cacheprovider --dist loadgroup -n ${TEST_WORKERS:-4} \
      --timeout ${TEST_TIMEOUT:-240} --durations=12 ${TEST_K:+-k "$TEST_K"} $TESTS > "$RES/tests_all.log" 2>&1
  elif [ "$NGPU" -ge 2 ]; then
    # GEMM tests on GPU 1 (when $TESTS names tests/ops or the GEMM file), everything else on GPU 0,
    # each with a few workers.
    p1=""
    if [[ " $TESTS " == *" tests/ops "* || "$TESTS" == *test_grouped_gemm* ]]; then
      CUDA_VISIBLE_DEVICES=1 timeout $t python3 -m pytest ${TEST_FLAGS:--q} -rs -m gpu -p no:cacheprovider --dist loadgroup -n 4 --timeout ${TEST_TIMEOUT:-240} --durations=12 \
        ${GEMM_K:+-k "$GEMM_K"} tests/ops/test_grouped_gemm.py > "$RES/tests_gemm.log" 2>&1 &
      p1=$!
    fi
    CUDA_VISIBLE_DEVICES=0 timeout $t python3 -m pytest ${TEST_FLAGS:--q} -rs -m gpu -p no:cacheprovider --dist loadgroup -n 4 --timeout ${TEST_TIMEOUT:-240} --durations=12 \
      $TESTS --ignore=tests/ops/test_grouped_gemm.py > "$RES/tests_other.log" 2>&1
    [ -n "$p1" ] && wait $p1
  else
    timeout $t python3 -m pytest ${TEST_FLAGS:--q} -rs -m gpu -p no:cacheprovider --dist loadgroup -n ${TEST_WORKERS:-4} --timeout ${TEST_TIMEOUT:-240} --durations=12 ${TEST_K:+-k "$TEST_K"} $TESTS > "$RES/tests_all.log" 2>&1
  fi
  for f in "$RES"/tests_*.log; do echo "-- $f"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$f" | tail -n 25; done
fi
if [[ " $PHASES " == *" comm "* ]] && [ "$NGPU" -ge 2 ]; then
  t=$(( $(left) * ${COMM_SHARE:-45} / 100 ))
  echo "== comm gpu tests (limit ${t}s)"
  # The collective's tier, then the layers' multi-GPU tests (expert parallelism over NCCL).
  timeout $t python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -rf tests/comm > "$RES/tests_comm.log" 2>&1
  timeout $(( $(left) > 60 ? 60 : 10 )) python3 -m pytest -q -m multigpu -p no:cacheprovider --timeout 120 -rf tests/layers \
    >> "$RES/tests_comm.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$RES/tests_comm.log" | tail -n 25
fi
if [[ " $PHASES " == *" bench "* ]]; then
  for b in ${BENCHES:-routing gather_scatter shuffling activation grouped_gemm layer collective}; do
    t=$(left); [ "$t" -lt 20 ] && { echo "== out of time before bench_$b"; break; }
    echo "== bench_$b (limit $((t-10))s)"
    extra_var="BENCH_ARGS_$b"
    script=benchmarks/bench_$b.py; [ -f "$script" ] || script=benchmarks/$b.py  # bench_<b>.py or a sweep
    timeout $((t-10)) python3 "$script" ${QUICK:+--quick} ${!extra_var:-} > "$RES/bench_$b.log" 2>&1
    echo "rc=$?"; tail -n ${BENCH_TAIL:-30} "$RES/bench_$b.log"
  done
fi
if [[ " $PHASES " == *" lanes "* ]] && [ -z "${TEST_GPU:-}" ]; then
  run_lanes
fi
# Before/after on one GPU: AB_CMD (e.g. "python3 benchmarks/bench_layer.py --quick") run in each of
# the trees _ab/<rev> that `scripts/ab_trees.sh --own REV ...` wrote (their own moekit/ and
# benchmarks/), AB_ROUNDS rounds of the trees in turn (A B A B: the machine's drift hits both).
if [[ " $PHASES " == *" ab "* ]]; then
  for r in $(seq 1 ${AB_ROUNDS:-2}); do
    for rev in ${AB_REVS:?AB_REVS names the _ab/ trees}; do
      t=$(left); [ "$t" -lt 20 ] && { echo "== out of time before $rev round $r"; break 2; }
      ( cd "_ab/$rev" && PYTHONPATH="$PWD:/tmp/site" MOEKIT_BENCH_DIR="$RES/ab_${rev}_r$r" OUT="$RES/ab_${rev}_r$r" \
        timeout $((t-10)) bash -c "${AB_CMD:?AB_CMD is the command run in each tree}" ) > "$RES/ab_${rev}_r$r.log" 2>&1
      echo "== ab $rev round $r rc=$? at $((SECONDS - start))s"
    done
  done
  for f in "$RES"/ab_*.log; do echo "-- $f"; grep -E "^\|" "$f" | head -n ${BENCH_TAIL:-40}; done
fi
[ -n "$lanes_pid" ] && { wait $lanes_pid; cat "$RES/lanes_summary.txt"; }
tar -czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
tar -czf "$OUT/triton.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
echo "== done in $((SECONDS - start))s"
