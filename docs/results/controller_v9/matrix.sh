#!/bin/bash
# Controller matrix (docs/controller.md, last section) with the final v4 drafter (+suffix): quiet and busy calibration, bfloat16 then float32.
exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s21 "bfloat16 float32"
