#!/bin/bash
# Controller matrix after the gate change (two averages per arm, a margin for plain decoding;
# docs/controller.md, "Near-ties"): quiet and busy calibration, float32 then bfloat16.
cd "$(dirname "$0")/../../.."
mkdir -p runs/s23
M=ar,chain,tree-4,tree-8,tree-16,tree-32,tree-64,tree-128,bastion
for dt in float32 bfloat16; do
  echo "== quiet $dt $(date +%T)"
  BASTION_CACHE=$(mktemp -d) .venv/bin/bastion bench --datasets mt-bench,humaneval,math --num-prompts 4 \
    --max-new-tokens 128 --modes $M --dtype $dt --threads 2 --out runs/s23/$dt-quiet --fresh --no-progress > runs/s23/$dt-quiet.log 2>&1
  echo "== busy $dt $(date +%T)"
  scripts/bench_busy_calibration.sh runs/s23/$dt-busy $dt 4
done
echo "== done $(date +%T)"
