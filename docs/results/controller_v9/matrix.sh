#!/bin/bash
# Controller matrix (docs/controller.md, last section) with the final v4 drafter (+suffix): quiet and busy calibration, bfloat16 then float32.
cd "$(dirname "$0")/../../.."
M=ar,chain,tree-4,tree-8,tree-16,tree-32,tree-64,tree-128,bastion
for dt in bfloat16 float32; do
  echo "== quiet $dt $(date +%T)"
  BASTION_CACHE=$(mktemp -d) .venv/bin/bastion bench --datasets mt-bench,humaneval,math --num-prompts 4 \
    --max-new-tokens 128 --modes $M --dtype $dt --threads 2 --out runs/s21/$dt-quiet --fresh --no-progress > runs/s21/$dt-quiet.log 2>&1
  echo "== busy $dt $(date +%T)"
  scripts/bench_busy_calibration.sh runs/s21/$dt-busy $dt 4
done
