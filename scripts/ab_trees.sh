#!/usr/bin/env bash
# Before/after on one GPU in one device call: copies of earlier commits' moekit/ that the same
# benchmark imports, lane after lane, so the comparison is same-machine (H200s differ by 2-4%
# from call to call).
#
#   bash scripts/ab_trees.sh REV [REV ...]
#
# writes _ab/<rev>/moekit for each REV (git archive; _ab/ is ignored by git, so the device run must
# carry it) and prints the device_session.sh settings that run bench_layer on each tree and on the
# working tree. E.g. (session 15, the stored sums: 2131.7 -> 1996.2 us at DeepSeek-V3 TP8 T=8192):
#
#   bash scripts/ab_trees.sh 72730bc
#   # then, through the device tool, with carry [".whl", ".peers", "_ab"]:
#   BENCH_ENV_layer_72730bc="PYTHONPATH=$PWD/_ab/72730bc:/tmp/site" PHASES="lanes" \
#     LANES="0:layer@new,layer@72730bc" BENCH_ARGS_layer="--quick --tokens 8192" bash scripts/device_session.sh
#
#   bash scripts/ab_trees.sh --own REV [REV ...]
#
# also archives each REV's benchmarks/ (without its Markdown and stored results), so that an
# earlier tree runs its own benchmark scripts: device_session.sh's "ab" phase, e.g.
#   PHASES="ab" AB_REVS="17fff7f 7df8786" AB_CMD="python3 benchmarks/bench_layer.py --quick" bash scripts/device_session.sh
set -euo pipefail
cd "$(dirname "$0")/.."
own=""
[ "${1:-}" = "--own" ] && { own=1; shift; }
[ $# -ge 1 ] || { echo "usage: $0 [--own] REV [REV ...]" >&2; exit 2; }
lanes="layer@new"
envs=""
for rev in "$@"; do
  short=$(git rev-parse --short "$rev")
  rm -rf "_ab/$short"
  mkdir -p "_ab/$short"
  git archive "$short" moekit ${own:+benchmarks} | tar -x -C "_ab/$short"
  [ -n "$own" ] && rm -rf "_ab/$short/benchmarks/results" && find "_ab/$short/benchmarks" -name '*.md' -delete
  lanes="$lanes,layer@$short"
  envs="$envs BENCH_ENV_layer_$short=\"PYTHONPATH=\$PWD/_ab/$short:/tmp/site\""
  echo "_ab/$short/moekit: $(git log -1 --format='%h %s' "$short" | cut -c1-90)"
done
echo
echo "device command (carry [\".whl\", \".peers\", \"_ab\"]):"
echo "  $envs PHASES=\"lanes\" LANES=\"0:$lanes\" BENCH_ARGS_layer=\"--quick --tokens 8192\" bash scripts/device_session.sh"
