import json

import pytest

from epl.cluster import Cluster, parse_tf_config
from epl.errors import PlanError
from epl.plan import ParallelPlan, TaskGraphPlan


def test_virtual_devices_keep_cpu0_as_host():
  c = Cluster.local(devices_per_worker=2, has_gpu=False)
  assert c.devices_of(0) == ("/device:CPU:1", "/device:CPU:2")
  assert c.host(0) == "/device:CPU:0"
  assert c.session_device_count() == {"CPU": 3}
  assert (c.worker_num, c.gpu_num_per_worker, c.total_gpu_num, c.virtual_devices) == (1, 2, 2,
                                                                                       True)


def test_gpu_devices():
  c = Cluster.from_environment(0, "", visible_gpus=4)
  assert c.devices_of(0)[3] == "/device:GPU:3" and not c.virtual_devices
  with pytest.raises(PlanError, match="sees only 4 GPU"):
    Cluster.from_environment(8, "", visible_gpus=4)


def test_tf_config_chief_worker_ps_order():
  conf = {"cluster": {"worker": ["h1:1", "h2:2"], "chief": ["h0:0"], "ps": ["h3:3"]},
          "task": {"type": "worker", "index": 1}}
  hosts, index = parse_tf_config(json.dumps(conf))
  assert hosts == ("h0:0", "h1:1", "h2:2", "h3:3") and index == 2
  c = Cluster.from_environment(2, json.dumps(conf), 0)
  assert c.worker_num == 4 and c.total_gpu_num == 8
  assert c.device(1, 0) == "/job:worker/replica:0/task:1/device:CPU:1"


@pytest.mark.parametrize("conf,message", [
    ({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"index": 0}}, "more than once"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}, "out of range"),
    ({"cluster": {}, "task": {}}, "no 'chief'"),
])
def test_bad_tf_config(conf, message):
  with pytest.raises(PlanError, match=message):
    parse_tf_config(json.dumps(conf))


def test_plan_json_round_trip():
  tg = TaskGraphPlan(0, "stage_0", "replicate", 1, "x.py:3",
                     {"forward": ("a", "b"), "backward": ("c",), "apply": ()})
  plan = ParallelPlan((tg,), 2, 1, 1, "PreferBackward",
                      ((("/device:CPU:1",),), (("/device:CPU:2",),)), "/device:CPU:0", "mean",
                      5, False, 600)
  again = ParallelPlan.from_json(plan.to_json())
  assert again == plan
  assert "copy 1 (replica 1, shard 0): /device:CPU:2" in str(again)
