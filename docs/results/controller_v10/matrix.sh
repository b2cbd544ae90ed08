#!/bin/bash
# Controller matrix (docs/controller.md, "The cold start, primed") after the few-row engine
# changes, the bfloat16 drafter under a float32 target and the primed gate: quiet and busy
# calibration, float32 then bfloat16. Run from any clone; outputs go to runs/s22/.
cd "$(dirname "$0")/../../.."
mkdir -p runs/s22
M=ar,chain,tree-4,tree-8,tree-16,tree-32,tree-64,tree-128,bastion
for dt in float32 bfloat16; do
  echo "== quiet $dt $(date +%T)"
  BASTION_CACHE=$(mktemp -d) .venv/bin/bastion bench --datasets mt-bench,humaneval,math --num-prompts 4 \
    --max-new-tokens 128 --modes $M --dtype $dt --threads 2 --out runs/s22/$dt-quiet-v2 --fresh --no-progress > runs/s22/$dt-quiet-v2.log 2>&1
  echo "== busy $dt $(date +%T)"
  scripts/bench_busy_calibration.sh runs/s22/$dt-busy $dt 4
done
echo "== done $(date +%T)"
