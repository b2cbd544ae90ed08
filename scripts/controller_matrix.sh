#!/bin/bash
# The controller matrix (docs/controller.md): every fixed budget, chain and bastion on mt-bench,
# humaneval and math (4 prompts each, 128 tokens), once on a quiet machine and once with a second
# CPU-heavy process during the calibration (scripts/bench_busy_calibration.sh), per dtype, each
# with a fresh calibration. Runs from any clone.
# usage: [PROMPTS=4] [REPEATS=1] scripts/controller_matrix.sh OUT_DIR "DTYPES" [QUIET_SUFFIX]
#   writes OUT_DIR/DTYPE-quiet{SUFFIX} and OUT_DIR/DTYPE-busy (results and .log); REPEATS > 1 runs
#   every prompt that many times and reports medians over passes (bastion bench --repeats)
set -u
out=$1; dtypes=$2; suffix=${3:-}; np=${PROMPTS:-4}; reps=${REPEATS:-1}
cd "$(dirname "$0")/.."
mkdir -p "$out"
M=ar,chain,tree-4,tree-8,tree-16,tree-32,tree-64,tree-128,bastion
for dt in $dtypes; do
  echo "== quiet $dt $(date +%T)"
  BASTION_CACHE=$(mktemp -d) .venv/bin/bastion bench --datasets mt-bench,humaneval,math --num-prompts "$np" \
    --max-new-tokens 128 --modes $M --dtype "$dt" --threads 2 --repeats "$reps" --out "$out/$dt-quiet$suffix" --fresh --no-progress \
    > "$out/$dt-quiet$suffix.log" 2>&1
  echo "== busy $dt $(date +%T)"
  scripts/bench_busy_calibration.sh "$out/$dt-busy" "$dt" "$np" "$reps"
done
echo "== done $(date +%T)"
