#!/bin/bash
# Final-vs-v4 DFlash-alone benchmark (the #17 resolution table).
cd /work/main
for dt in float32 bfloat16; do
  for name in final v4; do
    if [ $name = final ]; then d=drafting/checkpoints/smollm2-dflash; else d=runs/final/v4-shipped; fi
    echo "== $name $dt $(date +%T)"
    .venv/bin/bastion bench --threads 2 --drafter $d --dtype $dt --datasets mt-bench,humaneval --num-prompts 6 --max-new-tokens 128 --modes ar,chain,tree-32,tree-64 --out runs/final/$name-$dt --fresh --no-progress 2>&1 | tail -30
  done
done
date +%T > runs/final/finished
