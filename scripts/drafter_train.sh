#!/usr/bin/env bash
# Background drafter training (resumes from runs/drafter/train/ckpt.pt; re-reads new data shards).
# Usage: scripts/drafter_train.sh [extra bastion train-drafter flags]; log: runs/drafter/train.log
cd "$(dirname "$0")/.." && . .venv/bin/activate
export BASTION_THREADS=${BASTION_THREADS:-1} OMP_NUM_THREADS=${BASTION_THREADS:-1}
nohup bastion train-drafter --stages train --ship runs/drafter/ship "$@" > runs/drafter/train.nohup 2>&1 &
echo $! > runs/drafter/train.pid
echo "train job pid $(cat runs/drafter/train.pid)"
