"""EPL's manual, chapter 5 (Parallelism API Examples).

  5.1    with epl.replicate(device_count=1): model()            (8 GPUs -> 8 replicas;
         here 4 virtual devices -> 4)
  5.2    num_micro_batch 4, stage_0 / stage_1                    (8 GPUs -> 4 pipeline
         replicas; here 4 devices -> 2)
  5.3.1  colocate_split_and_replicate; replicate(8): resnet(); split(8): classification()
         (scaled to 2 devices; without colocation a replica needs the sum of the counts)
  5.3.2  MoE: total_gpu_num from epl.Env; set_default_strategy(replicate(total_gpu_num));
         AttentionAndGating(); split(total_gpu_num): MOE_Variable_Define();
         MOE_Calculation_Define() after the scope
"""
import numpy as np

import epl
from tests import split_models as sm
from tests.manual import snippets as s
from tests.manual.test_ch1_easy_parallel_library import _pipeline


def test_5_1_data_parallelism_one_replica_per_device():
  def build(x, y, under_epl):
    with s.scope(under_epl, lambda: epl.replicate(device_count=1)):
      return s.model(x, y)
  pg = s.assert_trains_the_local_model(build, s.devices(4), copies=4)
  assert pg.plan.total_copies == 4


def test_5_2_pipeline_replicated_over_the_devices():
  pg = s.assert_trains_the_local_model(
      _pipeline, s.devices(4, **{"pipeline.num_micro_batch": 4}), copies=2 * 4)
  assert pg.plan.total_copies == 2 and pg.plan.num_micro_batch == 4


def test_5_3_1_large_scale_classification():
  s.assert_classification_trains_the_local_model(2)


def test_5_3_1_without_colocation_a_replica_takes_the_sum_of_the_counts():
  rows_xy = sm.classification_data(3 * 8, 1000)
  local = sm.train(lambda: sm.classifier(1000, *sm.local_scopes()), rows_xy, 3, 8)
  run = sm.train(lambda: sm.classifier(1000, *sm.scopes(2, 2)), rows_xy, 3, 8,
                 s.devices(4), initial=local.initial)
  plan = run.parallel.plan
  trunk = {c.devices[0][0] for c in plan.copies}
  head = set(plan.copies[0].devices[1])
  assert len(trunk) == len(head) == 2 and not trunk & head   # 2 + 2 devices, one replica
  s.close([f["loss"] for f in run.fetched], [f["loss"] for f in local.fetched], 1e-5, "loss")


def test_5_3_2_moe_transformer_experts_split_the_rest_replicated():
  rows, steps = 8, 3
  data = sm.moe_data(rows * steps)
  local = sm.train(lambda: s.moe_build(False), data, steps, rows)
  config = s.devices(2, **{"cluster.colocate_split_and_replicate": True})
  run = sm.train(lambda: s.moe_build(True), data, steps, rows, config, initial=local.initial)
  s.close([f["loss"] for f in run.fetched], [f["loss"] for f in local.fetched], 1e-5, "loss")
  for name, value in local.variables.items():
    s.close(run.variables[name], value, 1e-5, name)
  plan = run.parallel.plan
  assert [tg.placement.kind for tg in plan.taskgraphs] == ["replicate", "split"]
  parts = [v for v in run.graph.get_collection("variables") if "experts_in/part_" in v.op.name]
  assert len(parts) == 2                         # the experts' weights are split, by expert
  assert {x.collective for x in plan.crossings} == {"all_to_all"}
  assert np.isfinite(run.fetched[-1]["loss"])
