#!/bin/bash
# Controller matrix with the 1.3 bar for five or more and empty free proposals sent to the draft:
# quiet and busy calibration, float32 then bfloat16, 3 prompts per dataset, 2 passes; outputs in
# runs/s26/matrix, condensed by scripts/matrix_summary.py into summary.json here.
PROMPTS=3 REPEATS=2 exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s26/matrix "float32 bfloat16"
