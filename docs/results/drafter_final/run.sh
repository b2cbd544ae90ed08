#!/bin/bash
# Final-vs-v4 benchmark of the DFlash drafter alone (docs/drafter.md, "Where the drafter stands"):
# the shipped final state against the step-17,253 export, taken from git history.
cd "$(dirname "$0")/../../.."
v4=runs/final/v4-shipped
mkdir -p $v4
for f in config.json model.safetensors; do
  git show ec791b1:drafting/checkpoints/smollm2-dflash/$f > $v4/$f
done
for dt in float32 bfloat16; do
  for name in final v4; do
    if [ $name = final ]; then d=drafting/checkpoints/smollm2-dflash; else d=$v4; fi
    echo "== $name $dt $(date +%T)"
    .venv/bin/bastion bench --threads 2 --drafter $d --dtype $dt --datasets mt-bench,humaneval --num-prompts 6 \
      --max-new-tokens 128 --modes ar,chain,tree-32,tree-64 --out runs/final/$name-$dt --fresh --no-progress
  done
done
