#!/usr/bin/env bash
# Runs a Python worker as a grandchild of epl-launch (the kernel's parent-death signal does
# not reach it; epl's watchdog must).
exec_args=("$@")
python "${exec_args[@]}"
