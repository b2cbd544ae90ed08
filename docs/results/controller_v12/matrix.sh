#!/bin/bash
# Controller matrix after the plain-baseline change (recent plain steps only, refreshed every
# PLAIN_REFRESH steps; docs/controller.md, "A stale plain baseline"): quiet and busy calibration,
# float32 then bfloat16; outputs in runs/s24/.
exec "$(dirname "$0")/../../../scripts/controller_matrix.sh" runs/s24 "float32 bfloat16"
