#!/bin/bash
# Controller matrix with steps superseding the calibration at the sizes they measure (a no-op in all four runs: none of their models had a residual):
# quiet and busy calibration, float32 then bfloat16, 3 prompts per dataset, 2 passes; outputs in
# runs/s27/matrix, condensed by scripts/matrix_summary.py into summary.json here.
PROMPTS=3 REPEATS=2 exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s27/matrix "float32 bfloat16"
