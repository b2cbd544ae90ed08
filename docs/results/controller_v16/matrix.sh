#!/bin/bash
# Controller matrix, float32 only, on a 2-core avx2-only AMD EPYC (CPU family 23, no avx512, no AMX):
# quiet and busy calibration, 3 prompts per dataset, 2 passes; outputs in runs/s29/matrix,
# condensed by scripts/matrix_summary.py into summary.json here.
PROMPTS=3 REPEATS=2 exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s29/matrix "float32"
