import json

import pytest

from epl.cluster import Cluster, parse_tf_config
from epl.errors import PlanError
from epl.plan.placement import Replicate, Split, bridge
from epl.plan.plan import Communication, Copy, Gradient, ParallelPlan, TaskGraphPlan


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
    ({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"index": 0}}, "names one server twice"),
    ({"cluster": {"worker": ["localhost:2222", "127.0.0.1:2222"]}, "task": {"index": 1}},
     r"task 0 'localhost:2222' and task 1 '127.0.0.1:2222' are the same address \(loopback\)"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}, "out of range"),
    ({"cluster": {}, "task": {}}, "no 'chief'"),
])
def test_bad_tf_config(conf, message):
  with pytest.raises(PlanError, match=message):
    parse_tf_config(json.dumps(conf))


def test_plan_json_round_trip_and_worker_views():
  tg = TaskGraphPlan(index=0, name="stage_0", placement=Replicate(1), location="x.py:3",
                     ops={"forward": ("a", "b"), "backward": ("c",), "apply": ()})
  w = "/job:worker/replica:0/task:%d/device:CPU:%d"
  copies = tuple(Copy(replica=r, shard=0, client=r // 2, devices=((w % (r // 2, r % 2 + 1),),))
                 for r in range(4))
  plan = ParallelPlan(
      taskgraphs=(tg,), copies=copies, shards=1, num_micro_batch=2,
      pipeline_strategy="PreferBackward", schedule=(("F0", "F1", "B0", "B1"),),
      hosts=(w % (0, 0), w % (1, 0)),
      gradients=(Gradient(variable="v", tensors=("g:0",), applied=("g:0",)),),
      shared_variables=("step",),
      communication=Communication(reduce_method="sum", max_splits=3, sparse_as_dense=True,
                                  clip_after_allreduce=False, timeout=60))
  again = ParallelPlan.from_json(plan.to_json())
  assert again == plan
  assert "copy 3 (replica 3, shard 0, worker 1): %s" % (w % (1, 2)) in str(again)
  assert plan.op_index["c"] == (0, "backward")
  one = plan.for_worker(1)
  assert one.num_copies == 2 and one.device_of(1, 0) == w % (1, 2)
  assert one.client_group(0) == ((w % (0, 1), w % (1, 1)), 1)
  assert plan.group_of(0) == tuple(c.devices[0][0] for c in copies)


def test_placement_transitions_table():
  assert bridge(Replicate(1), Split(4)).forward == "all_gather"
  assert bridge(Replicate(1), Split(4)).backward == "reduce_scatter"
  assert bridge(Split(2), Split(2)).forward == "all_to_all"
  assert str(Split(4)) == "split(device_count=4)"


def test_a_lone_virtual_device_is_the_host_itself():
  c = Cluster.local(devices_per_worker=1, has_gpu=False)
  assert c.devices_of(0) == ("/device:CPU:0",) and c.session_device_count() == {"CPU": 1}
  spread = Cluster(("a:1", "b:2"), 0, 1, False)
  assert spread.device(1, 0) == "/job:worker/replica:0/task:1/device:CPU:0"
