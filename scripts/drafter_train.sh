#!/usr/bin/env bash
# Background drafter training: resumes from runs/drafter/train/ckpt.pt or the committed data/drafter-train/
# state, whichever is newer (the committed one when their recipes differ); re-reads new data shards;
# exports each best-tau drafter to the shipped folder.
# Usage: scripts/drafter_train.sh [extra bastion train-drafter flags]; log: runs/drafter/train.log
# Give it the machine: no test suite or benchmark beside it (pause with kill -STOP / kill -CONT).
cd "$(dirname "$0")/.." && . .venv/bin/activate
mkdir -p runs/drafter
nohup bastion train-drafter --stages train --ship drafting/checkpoints/smollm2-dflash "$@" \
  > runs/drafter/train.nohup 2>&1 &
echo $! > runs/drafter/train.pid
echo "train job pid $(cat runs/drafter/train.pid)"
