#!/bin/bash
# Controller matrix after the gate change (two averages per arm, a margin for plain decoding;
# docs/controller.md, "Near-ties"): quiet and busy calibration, float32 then bfloat16; outputs in runs/s23/.
exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s23 "float32 bfloat16"
