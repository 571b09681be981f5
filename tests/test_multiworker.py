"""Multi-worker runs under epl-launch (localhost processes): parity, faults, resume."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from epl.testing import run_model
from tests import models
from tests.ports import private_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "dp_worker.py")


class Launched:
  def __init__(self, returncode, stdout, stderr, seconds):
    self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds


def launch(args, timeout=180, env=None):
  """Runs epl-launch; on timeout it is stopped with SIGTERM so it stops its workers."""
  full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                  CUDA_VISIBLE_DEVICES="", **(env or {}))
  start = time.time()
  proc = subprocess.Popen([sys.executable, "-m", "epl.launch.cli"] + args, env=full_env,
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    raise AssertionError("epl-launch did not finish in %d s:\n%s\n%s" % (timeout, out[-2000:],
                                                                        err[-2000:]))
  return Launched(proc.returncode, out, err, time.time() - start)


MEMORY_PASSES = {"EPL_GRADIENT_CHECKPOINT_TYPE": "auto", "EPL_OFFLOAD_LEVEL": "v0",
                 "EPL_OPTIMIZER_NUM_APPLY_GROUP": "2", "EPL_LOG_LEVEL": "debug"}


COMMUNICATION = {"EPL_COMMUNICATION_FP16": "true", "EPL_COMMUNICATION_NUM_COMMUNICATORS": "3",
                 "EPL_COMMUNICATION_MAX_SPLITS": "3"}


AMP = {"EPL_AMP_LEVEL": "O1", "EPL_AMP_LOSS_SCALE": "dynamic"}
ZERO = {"EPL_ZERO_LEVEL": "v0", "EPL_LOG_LEVEL": "debug"}
PIECES = {"TEST_PIECE_BYTES": "40"}      # every bucket all-reduced in pieces of 10 floats
PIECES_FP16 = dict(PIECES, EPL_COMMUNICATION_FP16="true")
ZERO_ACCUMULATE = dict(ZERO, EPL_PIPELINE_NUM_MICRO_BATCH="2")
ZERO_V1 = {"EPL_ZERO_LEVEL": "v1", "EPL_LOG_LEVEL": "debug"}
ZERO_V1_ACCUMULATE = dict(ZERO_V1, EPL_PIPELINE_NUM_MICRO_BATCH="2")
ZERO_V2 = {"EPL_ZERO_LEVEL": "v2", "EPL_LOG_LEVEL": "debug"}
ZERO_V2_ACCUMULATE = dict(ZERO_V2, EPL_PIPELINE_NUM_MICRO_BATCH="2")
# clip_by_global_norm reads every gradient: each worker's norm must be of the reduced ones.
# It binds (local_run checks that the unclipped run differs), and the learning rate makes a
# wrong norm visible at 1e-5 (at 0.01 the clipped steps are too small to show it)
CLIP = {"TEST_CLIP_NORM": "0.3", "TEST_LR": "0.3"}
ZERO_V1_CLIP = dict(ZERO_V1, **CLIP)
ZERO_V2_CLIP = dict(ZERO_V2, **CLIP)


def local_run(tmp_path, model, global_batch, steps, seed, every_step=False, alternate=False,
              clip_norm=None, lr=0.01):
  """The single-device run the workers are compared with; writes the data and its initial
  values where dp_worker.py reads them."""
  rng = np.random.RandomState(seed)
  x = rng.randn(steps * global_batch, 8).astype(np.float32)
  y = rng.randint(0, 4, steps * global_batch).astype(np.int64)
  local = run_model(model, (x, y), global_batch, steps, every_step=every_step,
                    alternate=alternate, clip_norm=clip_norm, lr=lr)
  if clip_norm is not None:                 # the clip binds: without it, another model
    free = run_model(model, (x, y), global_batch, steps, initial=local.initial, lr=lr)
    assert not np.allclose(free.losses[1:], local.losses[1:], rtol=1e-4), local.losses
  np.savez(tmp_path / "data.npz", x=x, y=y)
  np.savez(tmp_path / "initial.npz", **local.initial)
  return local


@pytest.mark.parametrize("model,alternate", [("wide", False), ("mlp", True)],
                         ids=["a 4 MiB kernel", "two train ops in alternate steps"])
def test_zero_v2_a_read_after_a_step_sees_every_owners_update(tmp_path, model, alternate):
  """ZeRO v2 across workers: a variable lives on its owner's task only, and another worker
  reads it there. Each worker's step must end only once every owner's update of that step
  ran: a read (an evaluation, the chief's checkpoint) right after a step on either worker
  holds that step's values. Every variable is read on each worker right after every step
  (the 4 MiB kernel's update took milliseconds after the other worker's step returned:
  that worker read the step before's values). With two train ops in alternate steps (GAN
  scripts), a worker that owns none of a train op's variables still joins the broadcast of
  its weights (it hung: only its updates started its broadcast)."""
  steps, batch = 4, 4
  local = local_run(tmp_path, getattr(models, model), 2 * batch, steps, seed=3,
                    every_step=True, alternate=alternate)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), WORKER, str(tmp_path), model, str(steps), str(batch)],
               env=dict(ZERO_V2, TEST_EVERY_STEP="1", **({"TEST_ALTERNATE": "1"} if alternate
                                                       else {})))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(2)]
  owners = [set(r["__zero_owners__"]) for r in results]
  assert owners[0] == owners[1] == {0, 1}, owners
  losses = np.mean([r["__losses__"] for r in results], axis=0)   # each worker's: its batch
  np.testing.assert_allclose(losses, local.losses, rtol=1e-5, atol=1e-5)
  for w, r in enumerate(results):
    for k, values in enumerate(local.steps):
      for name, value in values.items():
        np.testing.assert_allclose(r["__step%d__/%s" % (k, name)], value, rtol=1e-5,
                                   atol=1e-5, err_msg="worker %d, after step %d: %s" % (
                                       w, k, name))


@pytest.mark.parametrize("workers,devices,env", [
    (2, 1, None), (2, 2, None), (2, 2, MEMORY_PASSES), (2, 1, COMMUNICATION), (2, 2, AMP),
    (2, 1, ZERO), (2, 2, ZERO), (2, 2, ZERO_ACCUMULATE), (2, 1, ZERO_V1_CLIP), (2, 2, ZERO_V1),
    (2, 2, ZERO_V1_ACCUMULATE), (2, 1, ZERO_V2_CLIP), (2, 2, ZERO_V2),
    (2, 2, ZERO_V2_ACCUMULATE),
    (2, 2, PIECES), (2, 1, PIECES_FP16)],
    ids=["2x1", "2x2", "2x2 checkpointing+offload+apply groups",
         "2x1 fp16 buckets on 3 channels", "2x2 amp O1 dynamic loss scale",
         "2x1 zero v0", "2x2 zero v0", "2x2 zero v0 with 2 micro-batches",
         "2x1 zero v1 clipped by the global norm", "2x2 zero v1",
         "2x2 zero v1 with 2 micro-batches", "2x1 zero v2 clipped by the global norm",
         "2x2 zero v2",
         "2x2 zero v2 with 2 micro-batches", "2x2 all-reduce in pieces",
         "2x1 all-reduce in pieces in float16"])
def test_multiworker_parity(tmp_path, workers, devices, env):
  steps, batch = 5, 4
  micro = int((env or {}).get("EPL_PIPELINE_NUM_MICRO_BATCH", 1))
  global_batch = workers * devices * batch * micro
  clip = (env or {}).get("TEST_CLIP_NORM")
  local = local_run(tmp_path, models.mlp, global_batch, steps, seed=1,
                    clip_norm=float(clip) if clip else None,
                    lr=float((env or {}).get("TEST_LR", 0.01)))
  out = launch(["--num_workers", str(workers), "--gpu_per_worker", str(devices),
                "--log_dir", str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp", str(steps),
                str(batch)], env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(workers)]
  if env is MEMORY_PASSES:  # the passes ran on every worker
    for w in range(workers):
      log = (tmp_path / "logs" / ("worker_%d.log" % w)).read_text()
      for result in ("Recomputed(", "Offloaded(", "ApplyGroups("):
        assert result in log, log[-3000:]
  zeros = (ZERO, ZERO_ACCUMULATE, ZERO_V1, ZERO_V1_ACCUMULATE, ZERO_V1_CLIP, ZERO_V2,
           ZERO_V2_ACCUMULATE, ZERO_V2_CLIP)
  if env in zeros:                                # slots shared out over the job's copies
    for r in results:
      assert sorted(set(r["__zero_owners__"])) == list(range(workers * devices))
  if env in (ZERO_V2, ZERO_V2_ACCUMULATE, ZERO_V2_CLIP):  # each weight on its owner's task
    total = int(results[0]["__weights_total__"])
    held = [int(r["__weights_here__"]) for r in results]
    assert sum(held) == total and max(held) < total, (held, total)
  if env in (ZERO_V1, ZERO_V1_ACCUMULATE, ZERO_V2, ZERO_V2_ACCUMULATE):
    # gradients reach their owners by a reduce-scatter
    # (an all-to-all of the owners' chunks on CPU)
    # v2: and one scalar all-reduce ends the step job-wide (zero_v2._step_end)
    ends = [1] if env in (ZERO_V2, ZERO_V2_ACCUMULATE) else []
    for r in results:
      assert r["__exchanges__"] >= 1 and list(r["__reduce_sizes__"]) == ends, r
  if env in (ZERO_V1_CLIP, ZERO_V2_CLIP):  # the norm reads every gradient: all-reduced
    for r in results:
      assert r["__exchanges__"] == 0 and len(r["__reduce_sizes__"]) >= 1, r
  if env is AMP:
    for w in range(workers):
      log = (tmp_path / "logs" / ("worker_%d.log" % w)).read_text()
      assert "amp O1: " in log and "dynamic loss scale" in log, log[-3000:]
  # each worker's fetched loss is the mean over its copies; their mean is the global loss
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  # float16 on the wire: ~3 decimal digits per gradient (scaled by 128 before the cast)
  # AMP: float16 matmuls (see tests/test_amp.py for the tolerance)
  rtol = {id(COMMUNICATION): 2e-3, id(PIECES_FP16): 2e-3, id(AMP): 3e-3}.get(id(env), 1e-5)
  tol = rtol * np.maximum(1, np.abs(local.losses))
  assert (np.abs(losses - local.losses) <= tol).all(), (losses, local.losses)
  for r in results:                                   # every worker holds the same model
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=rtol, atol=rtol, err_msg=name)
  if env in (PIECES, PIECES_FP16):   # more collectives than buckets, each at most a piece
    most = 10 if env is PIECES else 20                 # 40 bytes of float32 or float16
    for r in results:
      assert len(r["__reduce_sizes__"]) > 2 and max(r["__reduce_sizes__"]) <= most, r
      # every kernel's gradient (a MatMul) streamed in blocks of rows
      assert sorted(r["__streamed__"]) == ["dense/kernel", "dense_1/kernel", "dense_2/kernel"]
  else:
    assert all(len(r["__streamed__"]) == 0 for r in results)   # gradients under 2 MiB
  if env is COMMUNICATION:  # 3 buckets, each on its own channel (group), in float16
    for r in results:
      assert list(r["__reduce_dtypes__"]) == ["float16"] * 3
      assert len(set(r["__reduce_groups__"])) == 3
  elif env is PIECES_FP16:
    assert all(d == "float16" for r in results for d in r["__reduce_dtypes__"])
  else:
    assert all(d == "float32" for r in results for d in r["__reduce_dtypes__"])


@pytest.mark.parametrize("counts,devices,batch", [("2,1", 3, 4), ("3,1", 2, 6)],
                         ids=["2:1, a replica per worker", "3:1, one replica on both workers"])
def test_stages_with_different_device_counts_across_workers(tmp_path, counts, devices, batch):
  """Pipelines with per-stage device counts and 2 micro-batches on 2 workers: 2:1 with one
  model replica per worker (x 3 devices; the stages' gradients all-reduced across the
  workers), and 3:1 as one replica spanning 2 workers x 2 devices (worker 0 drives it, its
  stage_0 copy on worker 1 too; worker 1 serves). Each trains the local model."""
  workers, steps, micro = 2, 5, 2
  clients = workers * devices // sum(int(c) for c in counts.split(","))
  global_batch = clients * batch * micro
  local = local_run(tmp_path, models.mlp_two_stages, global_batch, steps, seed=3)
  out = launch(["--num_workers", str(workers), "--gpu_per_worker", str(devices),
                "--log_dir", str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp_two_stages",
                str(steps), str(batch), counts],
               env={"EPL_PIPELINE_NUM_MICRO_BATCH": str(micro)})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  client_workers = range(0, workers, workers // clients)        # the others only serve
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in client_workers]
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  assert (np.abs(losses - local.losses) <= 1e-5 * np.maximum(1, np.abs(local.losses))).all(), \
      (losses, local.losses)
  for r in results:
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_replica_spanning_workers_with_zero_v2(tmp_path):
  """replicate(device_count=4) on 2 workers x 2 devices: one model replica, driven by worker 0
  (its copies on worker 1's devices too; worker 1 serves), with zero.level v2 -- all inside
  one session, so ZeRO's in-worker path; trains the local model."""
  steps, batch = 5, 8
  local = local_run(tmp_path, models.mlp, batch, steps, seed=5)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp", str(steps), str(batch),
                "4"], env={"EPL_ZERO_LEVEL": "v2"})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  r = dict(np.load(tmp_path / "worker_0.npz"))
  assert sorted(set(r["__zero_owners__"])) == [0, 1, 2, 3]
  np.testing.assert_allclose(r["__losses__"], local.losses, rtol=1e-5, atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_epl_launch_runs_the_quickstart_example(tmp_path):
  out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                str(tmp_path / "logs"), "examples/quickstart/run.sh"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "Iteration 10 , Loss:" in out.stdout            # worker 0's output is streamed
  assert "Iteration 10 , Loss:" in (tmp_path / "logs" / "worker_1.log").read_text()
  assert "all workers finished" in out.stdout


def test_io_slicing_each_worker_reads_only_its_files(tmp_path):
  files = []
  for f in range(5):
    path = tmp_path / ("part_%d.txt" % f)
    path.write_text("\n".join(str(f * 100 + i) for i in range(3)) + "\n")
    files.append(str(path))
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), os.path.join(ROOT, "tests", "workers", "io_worker.py"),
                str(tmp_path)] + files)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  read = [sorted(int(v) for v in (tmp_path / ("read_%d.txt" % w)).read_text().split())
          for w in range(2)]
  expect = [sorted(f * 100 + i for f in fs for i in range(3)) for fs in ([0, 2, 4], [1, 3])]
  assert read == expect


def _pids(stdout):
  import re
  return {int(w): int(p) for w, p in re.findall(r"worker (\d+) started \(pid (\d+)\)", stdout)}


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:                                   # a zombie is not alive
    with open("/proc/%d/stat" % pid) as f:
      return f.read().split()[2] != "Z"
  except OSError:
    return False


@pytest.mark.alone                  # finds its workers among every train_worker.py process
def test_killed_worker_stops_the_job(tmp_path):
  full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  proc = subprocess.Popen(
      [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2", "--gpu_per_worker", "1",
       "--log_dir", str(tmp_path / "logs"),
       os.path.join(ROOT, "tests", "workers", "train_worker.py"), str(tmp_path / "ck"),
       str(tmp_path), "1000", "0.2"], env=full_env, cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  log1 = tmp_path / "logs" / "worker_1.log"
  deadline = time.time() + 120
  while time.time() < deadline and not (log1.exists() and "step 3" in log1.read_text()):
    time.sleep(0.5)
  assert log1.exists() and "step 3" in log1.read_text(), "training did not start"
  pids = {}
  import re
  with open(log1) as f:
    pass
  # the launcher printed the pids on its stdout; read them from /proc instead of blocking
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        cmd = open("/proc/%s/cmdline" % pid).read()
      except OSError:
        continue
      if "train_worker.py" in cmd and "epl.launch" not in cmd:
        env = open("/proc/%s/environ" % pid, "rb").read().split(b"\0")
        idx = [e for e in env if e.startswith(b"EPL_LAUNCH_WORKER_INDEX=")]
        if idx:
          pids[int(idx[0].split(b"=")[1])] = int(pid)
  assert set(pids) == {0, 1}, pids
  killed_at = time.time()
  os.kill(pids[1], 9)
  out, err = proc.communicate(timeout=90)
  elapsed = time.time() - killed_at
  assert proc.returncode != 0
  assert elapsed < 60, elapsed
  assert "worker 1 failed" in err, err[-2000:]
  time.sleep(0.5)
  assert not [p for p in pids.values() if _alive(p)]


def test_worker_that_never_starts_is_an_error_within_60s(tmp_path):
  ports = private_ports(2)
  conf = json.dumps({"cluster": {"worker": ["localhost:%d" % p for p in ports]},
                     "task": {"type": "worker", "index": 0}})
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             TF_CONFIG=conf, EPL_CLUSTER_DEVICES_PER_WORKER="1",
             EPL_CLUSTER_STARTUP_TIMEOUT="15")
  start = time.time()
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "workers",
                                                     "train_worker.py"),
                        str(tmp_path / "ck"), str(tmp_path), "5", "0"], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert time.time() - start < 60
  assert "worker 0: not every one of the 2 workers joined within 15 s" in out.stderr, \
      out.stderr[-3000:]


def test_resume_continues_from_the_saved_step_on_every_worker(tmp_path):
  args = ["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs"),
          os.path.join(ROOT, "tests", "workers", "train_worker.py"), str(tmp_path / "ck"),
          str(tmp_path)]
  out = launch(args + ["4", "0"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  import tensorflow.compat.v1 as tf
  saved = tf.train.load_checkpoint(str(tmp_path / "ck"))
  assert saved.get_tensor("global_step") == 4
  out = launch(args + ["6", "0"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  for w in range(2):
    start = np.load(tmp_path / ("start_%d.npz" % w))
    assert int(start["global_step"]) == 4
    for name in start.files:
      np.testing.assert_array_equal(start[name], saved.get_tensor(name), err_msg=name)
  assert tf.train.load_checkpoint(str(tmp_path / "ck")).get_tensor("global_step") == 6


def test_two_stages_across_two_workers_worker1_only_serves(tmp_path):
  steps, batch, micro = 4, 4, 4
  rng = np.random.RandomState(2)
  x = rng.randn(steps * micro * batch, 8).astype(np.float32)
  y = rng.randint(0, 4, steps * micro * batch).astype(np.int64)
  local = run_model(models.mlp_two_stages, (x, y), micro * batch, steps)
  np.savez(tmp_path / "data.npz", x=x, y=y)
  np.savez(tmp_path / "initial.npz", **local.initial)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), os.path.join(ROOT, "tests", "workers",
                                                     "pipeline_worker.py"),
                str(tmp_path), str(steps), str(batch), str(micro)])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "holds no first stage" in (tmp_path / "logs" / "worker_1.log").read_text()
  res = dict(np.load(tmp_path / "client.npz"))
  assert any("task:1" in d for d in res["__devices__"])      # stage 1 lives on worker 1
  np.testing.assert_allclose(res["__losses__"], local.losses, rtol=1e-5, atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(res[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_port_in_use_is_a_clear_error(tmp_path):
  import socket
  busy = socket.socket()
  busy.bind(("localhost", 0))
  busy.listen(1)
  port = busy.getsockname()[1]
  try:
    conf = json.dumps({"cluster": {"worker": ["localhost:%d" % port, "localhost:1"]},
                       "task": {"type": "worker", "index": 0}})
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               TF_CONFIG=conf, EPL_CLUSTER_DEVICES_PER_WORKER="1")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", "import epl, tensorflow.compat.v1 as tf;"
                          "tf.disable_v2_behavior(); epl.init()"], env=env,
                         capture_output=True, text=True, timeout=120)
  finally:
    busy.close()
  assert out.returncode != 0 and time.time() - start < 60
  assert "worker 0 could not start its server on localhost:%d" % port in out.stderr, \
      out.stderr[-2000:]
  assert "is the port in use?" in out.stderr


@pytest.mark.parametrize("level", ["v1", "v2"])
def test_zero_across_workers_leaves_a_sparse_gradients_variable_unowned(tmp_path, level):
  """An embedding read by tf.nn.embedding_lookup has a sparse gradient: across workers ZeRO
  gives it no owner (every copy keeps its slots, its gradient all-gathered); the rest is
  partitioned as usual, and the job trains the local model."""
  steps, batch = 5, 4
  local = local_run(tmp_path, models.embedding, 2 * batch, steps, seed=1)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), WORKER, str(tmp_path), "embedding", str(steps),
                str(batch)], env={"EPL_ZERO_LEVEL": level})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(2)]
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  np.testing.assert_allclose(losses, local.losses, rtol=1e-5, atol=1e-5)
  for r in results:
    assert sorted(set(r["__zero_owners__"])) == [0, 1]
    assert len(r["__zero_owners__"]) == len([g for g in local.variables if "/" in g and
                                             g.split("/")[-1] in ("kernel", "bias")]), r
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("level", ["v0", "v2"])
def test_zero_across_workers_checkpoint_holds_every_owners_slots(tmp_path, level):
  """ZeRO v0 over 2 workers: each Adam slot lives on its owner's worker, and the chief's
  checkpoint (written by worker 0 alone) holds every slot's trained value -- also those that
  worker 1 owns and updates -- so a restore (here: the local model) gets the whole state.
  v2: the weights too live on their owner's worker only; the checkpoint holds them trained."""
  train = os.path.join(ROOT, "tests", "workers", "train_worker.py")
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), train, str(tmp_path / "ck"), str(tmp_path), "6", "0"],
               env={"EPL_ZERO_LEVEL": level})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  import tensorflow.compat.v1 as tf
  reader = tf.train.load_checkpoint(str(tmp_path / "ck"))
  names = reader.get_variable_to_shape_map()
  slots = sorted(n for n in names if n.endswith(("/Adam", "/Adam_1")))
  assert len(slots) == 8 and reader.get_tensor("global_step") == 6
  for name in slots:                      # trained: no slot is still at its zero start
    assert np.abs(reader.get_tensor(name)).max() > 0, name
  start = np.load(tmp_path / "start_0.npz")
  weights = [n for n in names if n.endswith(("kernel", "bias"))]
  assert len(weights) == 4
  for name in weights:                    # trained, whichever worker owns them
    assert not np.allclose(reader.get_tensor(name), start[name]), name


def test_auto_parallel_across_workers_runs_worker_0s_plan(tmp_path):
  """auto.auto_parallel with 2 stages on 2 workers x 2 devices: the stages come from measured
  times, which can differ between workers; worker 1 is made to cut them elsewhere
  (TEST_SKEW_PLAN), so acting on its own plan would build another graph than worker 0's.
  Every worker takes worker 0's plan (published on its task) and trains the local model."""
  steps, batch, micro = 4, 4, 2
  local = local_run(tmp_path, models.mlp, 2 * batch * micro, steps, seed=4)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "2", "--log_dir",
                str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp", str(steps), str(batch),
                "auto"], env={"EPL_AUTO_AUTO_PARALLEL": "true", "EPL_PIPELINE_NUM_STAGES": "2",
                              "EPL_PIPELINE_NUM_MICRO_BATCH": str(micro), "TEST_SKEW_PLAN": "1"})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(2)]
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  np.testing.assert_allclose(losses, local.losses, rtol=1e-5, atol=1e-5)
  for r in results:
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_auto_parallel_error_on_worker_0_ends_every_worker_with_it(tmp_path):
  """Worker 0's plan fails (more stages than the model has layers): the others, which wait
  for its plan instead of making their own, end with its error, not a start-up timeout."""
  local_run(tmp_path, models.mlp, 8, 1, seed=4)
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp", "1", "4", "auto"],
               env={"EPL_AUTO_AUTO_PARALLEL": "true", "EPL_PIPELINE_NUM_STAGES": "9"})
  assert out.returncode != 0 and out.seconds < 60, out      # not the start-up timeout
  logs = [(tmp_path / "logs" / ("worker_%d.log" % w)).read_text() for w in range(2)]
  assert "PlanError: auto.auto_parallel: the model has" in logs[0], logs[0][-3000:]
  # worker 1 ends with worker 0's error, or is stopped by epl-launch first
  assert "PlanError: auto.auto_parallel on worker 0: auto.auto_parallel: the model has" in \
      logs[1] or "Traceback" not in logs[1], logs[1][-3000:]
