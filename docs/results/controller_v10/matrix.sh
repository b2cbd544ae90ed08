#!/bin/bash
# Controller matrix (docs/controller.md, "The cold start, primed") after the few-row engine
# changes, the bfloat16 drafter under a float32 target and the primed gate: quiet and busy
# calibration, float32 then bfloat16. Run from any clone; outputs go to runs/s22/.
exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s22 "float32 bfloat16" -quiet-v2
