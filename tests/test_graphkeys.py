"""Every ``epl.GraphKeys`` kind -- GLOBAL_* (job-wide) and LOCAL_* (this worker) x mean, sum
and concat -- fetched in a training step on 1 worker x 2 devices, 2 workers x 1 device and
2 workers x 2 devices, in data parallelism and in a 2-stage pipeline with 2 micro-batches,
against the numbers the local run gives for the same pieces (docs/user_guide.md, "What a
fetch returns"). The fed batch makes the pieces known: copies x micro-batches, in order.
Then a vote fed to each client, fetched in a run with no train op (copy 0 only)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import epl
from tests import graphkeys_model as m
from tests import zygote
from tests.ports import private_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(values, pieces_here, pieces_all):
  """``pieces_*``: (per-piece losses, per-piece per-example losses) of this worker / job."""
  for kind in m.KINDS:
    pieces = pieces_all if kind.startswith("GLOBAL") else pieces_here
    np.testing.assert_allclose(values[kind], m.expected(pieces[0], pieces[1], kind),
                               rtol=1e-5, atol=1e-6, err_msg=kind)


@pytest.mark.parametrize("stages", [1, 2])
def test_every_kind_on_one_worker_with_two_devices(stages):
  micro = 2 if stages == 2 else 1
  initial = m.initial_values()
  x, y = m.data(2)
  values = m.fetch_under_epl(epl.Config({"cluster.devices_per_worker": 2,
                                         "pipeline.num_micro_batch": micro}),
                             stages, initial, x, y)
  local = m.local_values(initial, x, y, 2)
  _check(values, local, local)
  for kind in m.VOTE_KINDS:                  # one client: its own vote
    np.testing.assert_allclose(values["vote_" + kind], [1.0], err_msg=kind)


@pytest.mark.parametrize("devices,stages", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_every_kind_on_two_workers(tmp_path, devices, stages):
  micro = 2 if stages == 2 else 1
  spans = stages > devices                   # one replica over both workers: worker 1 serves
  clients = 1 if spans else 2
  per_client = (1 if spans else devices // stages) * micro
  initial = m.initial_values()
  x, y = m.data(clients * per_client)
  np.savez(tmp_path / "job.npz", __x__=x, __y__=y, __clients__=clients, **initial)
  hosts = ["localhost:%d" % p for p in private_ports(2)]
  procs = []
  for i in range(2):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               EPL_LOG_PROGRESS_SECS="0", EPL_CLUSTER_DEVICES_PER_WORKER=str(devices),
               TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                     "task": {"type": "worker", "index": i}}))
    procs.append(subprocess.Popen(
        zygote.python() + [os.path.join(ROOT, "tests", "workers", "graphkeys_worker.py"),
         str(tmp_path), str(stages), str(micro)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  errs = [p.communicate(timeout=240)[1] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
  local = m.local_values(initial, x, y, clients * per_client)
  for w in range(clients):
    values = dict(np.load(tmp_path / ("worker_%d.npz" % w)))
    mine = slice(w * per_client, (w + 1) * per_client)
    _check(values, (local[0][mine], local[1][mine]), local)
    # a run with no train op (copy 0 only; a stop vote): GLOBAL_* still job-wide, over every
    # client's copy 0 -- it returned this client's own value, and a vote to stop split the job
    for kind in m.VOTE_KINDS:
      np.testing.assert_allclose(values["vote_" + kind], m.expected_vote(
          kind, w + 1.0, [c + 1.0 for c in range(clients)]), err_msg=kind)
