"""Jobs started by Slurm and MPI (#52): the variables a real ``srun`` / ``mpirun`` sets are
read for the rank, the world size and the hosts (epl.scheduler); bad or contradicting ones
are one clear error; and real processes started as srun and mpirun start them train the
local model -- ``srun python train.py``, ``srun epl-launch ...``, several tasks per host,
and three namespace hosts behind a compressed node list."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from epl.launch.spec import parser, settings_from_args, worker_specs
from epl.scheduler import SchedulerError, detect, expand_counts, expand_nodelist
from epl.testing import cluster as testbed
from tests import models
from tests.ports import private_ports
from tests.test_multiworker import local_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "dp_worker.py")


def slurm(rank, size, nodelist, per_node, local, node, job="4242"):
  """What srun sets in task ``rank``'s environment (the variables epl reads, and others)."""
  return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(local),
          "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": nodelist,
          "SLURM_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": per_node,
          "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": per_node,
          "SLURM_STEP_NUM_TASKS": str(size), "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0",
          "SLURM_JOB_NUM_NODES": str(len(expand_nodelist(nodelist))),
          "SLURMD_NODENAME": expand_nodelist(nodelist)[node]}


def ompi(rank, size, local, local_size):
  return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
          "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
          "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "OMPI_COMM_WORLD_NODE_RANK": str(local)}


# ---- reading the variables (pure) ---------------------------------------------------------
def test_slurms_compressed_node_lists_and_task_counts():
  assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
  assert expand_nodelist("a,b[1-2],c") == ["a", "b1", "b2", "c"]
  assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]
  assert expand_nodelist("r[1-2]n[1,3]") == ["r1n1", "r1n3", "r2n1", "r2n3"]
  assert expand_counts("2(x3),1") == [2, 2, 2, 1] and expand_counts("4") == [4]
  for bad, match in (("node[01-03", "unmatched '\\['"), ("node]1", "unmatched '\\]'"),
                     ("n[3-1]", "not N or N-M"), ("n[a-b]", "not N or N-M"), ("", "empty")):
    with pytest.raises(SchedulerError, match=match):
      expand_nodelist(bad)
  with pytest.raises(SchedulerError, match="not N or N\\(xK\\)"):
    expand_counts("2(3)")


def test_slurm_places_tasks_host_by_host_with_a_port_per_task_on_a_host():
  env = slurm(3, 5, "node[01-03,07]", "2(x2),1", local=1, node=1)
  for counts in ("2,2,1", "2,2,1,1"):     # 4 nodes need 4 counts, adding up to the 5 tasks
    env["SLURM_STEP_TASKS_PER_NODE"] = counts
    with pytest.raises(SchedulerError, match="do not describe"):
      detect(env)
  env = slurm(3, 5, "node[01-02,07]", "2(x2),1", local=1, node=1)
  p = detect(env, base_port=30000)
  assert (p.source, p.rank, p.size, p.local_rank) == ("Slurm", 3, 5, 1)
  assert p.hosts == ("node01:30000", "node01:30001", "node02:30000", "node02:30001",
                     "node07:30000")
  assert p.job_id == "slurm-4242.0" and "task 3 of 5" in p.describe()
  # the step's variables (srun inside an allocation) win over the job's
  env = dict(slurm(1, 2, "node[01-02]", "1(x2)", local=0, node=1), SLURM_NTASKS="8",
             SLURM_JOB_NODELIST="node[01-08]", SLURM_TASKS_PER_NODE="1(x8)")
  assert detect(env).hosts == ("node01:22220", "node02:22220")
  # one task: a local job
  assert detect(slurm(0, 1, "node01", "1", local=0, node=0)) is None
  assert detect({}) is None


@pytest.mark.parametrize("change,match", [
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is not a task of the job: SLURM_STEP_NUM_TASKS=2"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a whole number"),
    ({"SLURM_NODEID": "0"}, "--distribution=block"),
    ({"SLURM_LOCALID": "1"}, "--distribution=block"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     "Open MPI says task 0 of 2 .* but Slurm says task 1 of 2"),
])
def test_bad_or_contradicting_scheduler_variables_are_one_clear_error(change, match):
  env = dict(slurm(1, 2, "node[01-02]", "1(x2)", local=0, node=1), **change)
  with pytest.raises(SchedulerError, match=match):
    detect(env)


def test_mpi_takes_its_hosts_from_the_machine_list_and_checks_the_local_ranks():
  with pytest.raises(SchedulerError, match="does not tell it where the other tasks run.*"
                                           "EPL_LAUNCH_MACHINE_LIST"):
    detect(ompi(1, 4, 1, 2))
  p = detect(dict(ompi(3, 4, 1, 2), EPL_LAUNCH_MACHINE_LIST="a,a,b,b"), base_port=100)
  assert p.hosts == ("a:100", "a:101", "b:100", "b:101") and p.source == "Open MPI"
  with pytest.raises(SchedulerError, match="list the hosts in rank order"):
    detect(dict(ompi(2, 4, 1, 2), EPL_LAUNCH_MACHINE_LIST="a,a,b,b"))
  with pytest.raises(SchedulerError, match="names 3 host\\(s\\) but Open MPI started 4"):
    detect(dict(ompi(2, 4, 0, 2), EPL_LAUNCH_MACHINE_LIST="a,b,c"))
  p = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0",
              "EPL_LAUNCH_MACHINE_LIST": "x:5,y:5"})
  assert (p.source, p.hosts) == ("PMI", ("x:5", "y:5"))
  # mpirun inside a Slurm allocation of as many tasks: Slurm's node list names the hosts
  env = dict(ompi(1, 2, 0, 1), SLURM_JOB_NODELIST="node[01-02]", SLURM_TASKS_PER_NODE="1(x2)")
  assert detect(env).hosts == ("node01:22220", "node02:22220")


def test_a_tf_config_of_another_size_than_the_scheduler_started_is_refused():
  env = dict(slurm(0, 2, "node[01-02]", "1(x2)", local=0, node=0),
             TF_CONFIG='{"cluster": {"worker": ["localhost:1"]}, "task": {"index": 0}}')
  from epl.cluster import Cluster
  with pytest.raises(SchedulerError, match="TF_CONFIG names 1 worker\\(s\\) but Slurm started 2"):
    Cluster.from_process(1, env, 0)
  env["EPL_LAUNCH_WORKER_INDEX"] = "0"                 # epl-launch's own worker: its TF_CONFIG
  assert Cluster.from_process(1, env, 0)[0].worker_num == 1


def test_epl_launch_under_srun_starts_its_tasks_worker_of_the_job(tmp_path):
  script = tmp_path / "train.py"
  script.write_text("")
  env = dict(slurm(3, 4, "node[01-02]", "2(x2)", local=1, node=1),
             EPL_LAUNCH_PORT_RANGE="31000-31009")
  args = parser().parse_args(["--gpu_per_worker", "2", str(script)])
  s = settings_from_args(args, environ=env)
  assert (s.num_workers, s.machine_rank, s.local_slot) == (4, 3, 1)
  assert s.hosts == ("node01:31000", "node01:31001", "node02:31000", "node02:31001")
  assert s.job_id == "slurm-4242.0" and "Slurm: task 3 of 4" in s.scheduler
  spec, = worker_specs(s, {}, gpus_on_host=4)
  assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"       # its task's GPUs on the host
  assert '"index": 3' in spec.env["TF_CONFIG"]
  for flags, match in ((["--num_workers", "2"], "--num_workers 2 but Slurm started 4"),
                       (["--machine_rank", "0"], "--machine_rank 0 but Slurm says this is "
                                                 "task 3")):
    with pytest.raises(SystemExit, match=match):
      settings_from_args(parser().parse_args(flags + [str(script)]), environ=env)
  with pytest.raises(SystemExit, match="SLURM_PROCID=4 is not a task"):
    settings_from_args(args, environ=dict(env, SLURM_PROCID="4"))


# ---- real processes ---------------------------------------------------------------------
def _clean_env(extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM", "OMPI_", "PMI_", "TF_CONFIG", "EPL_"))}
  env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", **extra)
  return env


def _assert_trains(tmp_path, local, workers):
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(workers)]
  losses = np.mean([r["__losses__"] for r in results], axis=0)     # each its shard's loss
  np.testing.assert_allclose(losses, local.losses, rtol=1e-5, atol=1e-5)
  for result in results:
    for name, value in local.variables.items():
      np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def _run_all(procs, timeout=240):
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs], outs


def test_srun_python_train_py_two_tasks_on_one_host_train_the_local_model(tmp_path):
  steps, batch = 4, 4
  local = local_run(tmp_path, models.mlp, 2 * batch, steps, seed=5)
  base = private_ports(1)[0]
  host = socket.gethostname()
  procs = [subprocess.Popen(
      [sys.executable, WORKER, str(tmp_path), "mlp", str(steps), str(batch)],
      env=_clean_env(dict(slurm(r, 2, host, "2", local=r, node=0),
                          EPL_LAUNCH_PORT_RANGE="%d-%d" % (base, base + 9))),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) for r in range(2)]
  codes, outs = _run_all(procs)
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
  assert "Slurm: task 1 of 2 (task 1 on its host %s)" % host in outs[1]
  _assert_trains(tmp_path, local, 2)


def test_mpirun_epl_launch_two_ranks_on_one_host_train_the_local_model(tmp_path):
  steps, batch = 4, 4
  local = local_run(tmp_path, models.mlp, 2 * batch, steps, seed=6)
  base = private_ports(1)[0]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "epl.launch.cli", "--gpu_per_worker", "1", "--log_dir",
       str(tmp_path / ("logs_%d" % r)), WORKER, str(tmp_path), "mlp", str(steps), str(batch)],
      env=_clean_env(dict(ompi(r, 2, r, 2), EPL_LAUNCH_MACHINE_LIST="localhost,localhost",
                          EPL_LAUNCH_PORT_RANGE="%d-%d" % (base, base + 9))),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) for r in range(2)]
  codes, outs = _run_all(procs)
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
  assert "epl-launch: Open MPI: task 0 of 2" in outs[0]
  _assert_trains(tmp_path, local, 2)


def test_a_task_outside_the_job_is_refused_before_anything_starts(tmp_path):
  env = _clean_env(slurm(1, 2, socket.gethostname(), "2", local=1, node=0))
  env["SLURM_PROCID"] = "2"
  out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--log_dir", str(tmp_path),
                        WORKER, str(tmp_path), "mlp", "1", "1"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "SLURM_PROCID=2 is not a task of the job" in out.stderr
  assert not os.path.exists(tmp_path / "worker_0.log")


@pytest.mark.skipif(testbed.available() is not None, reason=str(testbed.available()))
def test_srun_epl_launch_on_three_hosts_of_a_compressed_node_list(tmp_path):
  """node[01-02,07]: three namespace hosts that resolve each other's names, one srun task
  each running epl-launch with 2 devices; data parallelism over 6 devices trains the local
  model."""
  steps, batch = 3, 2
  local = local_run(tmp_path, models.mlp, 3 * 2 * batch, steps, seed=7)
  names = ["node01", "node02", "node07"]
  with testbed.Testbed(3, hostnames=names) as bed:
    procs = [bed.start(r, [sys.executable, "-m", "epl.launch.cli", "--gpu_per_worker", "2",
                           "--log_dir", str(tmp_path / ("logs_%d" % r)), WORKER, str(tmp_path),
                           "mlp", str(steps), str(batch)],
                       env=_clean_env(slurm(r, 3, "node[01-02,07]", "1(x3)", local=0, node=r)),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for r in range(3)]
    codes, outs = _run_all(procs)
  assert codes == [0, 0, 0], "\n".join(o[-3000:] for o in outs)
  assert "workers node01:22220,node02:22220,node07:22220" in outs[2]
  _assert_trains(tmp_path, local, 3)
