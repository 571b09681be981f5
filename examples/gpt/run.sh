#!/usr/bin/env bash
# The local launch script: epl-launch runs it once per worker.
#   epl-launch --num_workers 2 --gpu_per_worker 4 run.sh       # DP 2 x PP 2 x TP 2
#   EPL_AMP_LEVEL=O1 epl-launch --num_workers 2 --gpu_per_worker 4 run.sh   # + AMP O1
cd "$(dirname "$0")" && python train.py
