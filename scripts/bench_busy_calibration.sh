#!/bin/bash
# `bastion bench` whose calibration runs beside a second CPU-heavy process (a one-thread matmul
# loop), stopped when the benchmark proper begins: how the adaptive mode copes with a latency
# model fitted on a busy machine (docs/controller.md). The calibration cache is a fresh folder.
# usage: scripts/bench_busy_calibration.sh OUT DTYPE [PROMPTS_PER_SET] [REPEATS]
set -u
out=$1; dtype=$2; np=${3:-2}; reps=${4:-1}
cd "$(dirname "$0")/.."
bastion=${BASTION:-.venv/bin/bastion}
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ${PYTHON:-.venv/bin/python} -c "
import numpy as np
a = np.random.rand(700, 700)
while True:
    a = a @ a; a /= np.abs(a).max()
" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
: > "$out.log"  # the benchmark appends, so the line written when the second process stops stays
BASTION_CACHE=$(mktemp -d) $bastion bench --datasets mt-bench,humaneval,math --num-prompts "$np" \
  --max-new-tokens 128 --modes ar,chain,tree-4,tree-8,tree-16,tree-32,tree-64,tree-128,bastion \
  --dtype "$dtype" --threads 2 --repeats "$reps" --out "$out" --fresh --no-progress >> "$out.log" 2>&1 &
bench=$!
until grep -q "bastion bench:" "$out.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 1; done
kill $busy
echo "second process stopped at $(date +%T), when the benchmark began" >> "$out.log"
wait $bench
