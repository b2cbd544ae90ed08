#!/bin/bash
# Controller matrix with the pair bar (batched only; single-stream code as in v12): quiet and busy
# calibration, float32 then bfloat16, 3 prompts per dataset, 2 passes; outputs in runs/s25/matrix,
# condensed by scripts/matrix_summary.py into summary.json here.
PROMPTS=3 REPEATS=2 exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s25/matrix "float32 bfloat16"
