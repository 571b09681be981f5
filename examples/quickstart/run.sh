#!/usr/bin/env bash
# The local launch script of EPL's quick start: epl-launch runs it once per worker.
cd "$(dirname "$0")" && python local_model.py
