#!/usr/bin/env bash
# The local launch script: epl-launch runs it once per worker.
cd "$(dirname "$0")" && python train.py
