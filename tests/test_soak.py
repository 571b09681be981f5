"""Soak: a minute of training per case (bench/soak.py); threads, memory and liveness flat.

Cases: data parallelism on 2 devices, 2 workers x 1 device, a 2-stage pipeline with 4
micro-batches. Runs them at the same time (about 70 s of CI). bench/soak.py --seconds 600 is
the 10-minute version recorded in docs/benchmarks.md.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOAK = os.path.join(ROOT, "bench", "soak.py")


def test_a_minute_of_training_keeps_threads_and_memory_flat():
  out = subprocess.run([sys.executable, SOAK, "--seconds", "60", "--interval", "6", "--json"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  assert lines, out.stdout[-2000:] + out.stderr[-3000:]
  report = json.loads(lines[-1])
  assert sorted(report) == ["dp2/worker0", "pipeline2/worker0", "workers2x1/worker0",
                            "workers2x1/worker1"]
  for name, r in report.items():
    if r["problems"]:       # in full (pytest shortens a long assertion message)
      pytest.fail("%s:\n%s" % (name, "\n".join(r["problems"])), pytrace=False)
    samples = r["samples"]
    assert samples[-1]["t"] >= 60, (name, samples[-1])
    steps = [s["steps"] for s in samples[:-1]]          # (the last sample: after the close)
    assert all(b > a for a, b in zip(steps, steps[1:])), (name, steps)   # never stalled
    threads = [s["threads"] for s in samples[1:-1]]                       # while training
    assert max(threads) < 400, (name, threads)
    middle, end = samples[len(samples) // 2], samples[-2]
    assert end["threads"] <= middle["threads"] + 4, (name, threads)
    assert end["rss_mb"] <= middle["rss_mb"] * 1.05, (name, middle, end)
  assert out.returncode == 0, out.stderr[-2000:]
