#!/usr/bin/env bash
# A worker for the launcher tests: records the pids it starts in $1, leaves a background
# process behind, and (rank 0) fails once both workers have started them, while rank 1 is
# slow to stop on SIGTERM.
pids="$1"
sleep 30 &
echo $! >> "$pids"
python - "$pids" <<'PY'
import os, signal, sys, time
with open(sys.argv[1], "a") as f:
  f.write("%d\n" % os.getpid())
rank = int(os.environ.get("EPL_LAUNCH_WORKER_INDEX", "0"))
if rank == 0:                     # fail once both workers have started everything (a loaded
  deadline = time.time() + 20     # machine can take seconds to start the other python)
  while len(open(sys.argv[1]).read().split()) < 4 and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(0.2)
  sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))
time.sleep(30)
PY
