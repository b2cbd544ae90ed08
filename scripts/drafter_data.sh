#!/usr/bin/env bash
# Background data generation for the drafter (resumable): token shards appended to data/drafter/.
# Usage: scripts/drafter_data.sh [extra bastion train-drafter flags]; log: runs/drafter/data.log
# Give it the machine: no test suite or benchmark beside it (pause with kill -STOP / kill -CONT).
cd "$(dirname "$0")/.." && . .venv/bin/activate
mkdir -p runs/drafter
nohup bastion train-drafter --stages data "$@" > runs/drafter/data.nohup 2>&1 &
echo $! > runs/drafter/data.pid
echo "data job pid $(cat runs/drafter/data.pid)"
