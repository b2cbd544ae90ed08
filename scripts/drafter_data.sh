#!/usr/bin/env bash
# Background data generation for the drafter (resumable): prompts + target responses/features.
# Usage: scripts/drafter_data.sh [extra bastion train-drafter flags]; log: runs/drafter/prompts_data.log
cd "$(dirname "$0")/.." && . .venv/bin/activate
export BASTION_THREADS=${BASTION_THREADS:-1} OMP_NUM_THREADS=${BASTION_THREADS:-1}
nohup bastion train-drafter --stages prompts,data "$@" > runs/drafter/data.nohup 2>&1 &
echo $! > runs/drafter/data.pid
echo "data job pid $(cat runs/drafter/data.pid)"
