"""EPL's manual, chapter 1 (Easy Parallel Library), §1.2 Examples: every snippet as written,
completed into a runnable script (tests/manual/snippets.py), on virtual CPU devices.

  1.2.1  with epl.replicate(device_count=1): model()          -> data parallelism
  1.2.2  num_micro_batch 4; stage_0 / stage_1 replicate(1)    -> a 2-stage pipeline; on 4
         devices replicated twice
  1.2.3  colocate_split_and_replicate; replicate(8): ResNet(); split(8): classification()
         -> scaled to 2 devices (8 virtual devices on 2 cores only slow it down)
"""
import pytest

import epl
from epl.errors import PlanError
from tests.manual import snippets as s


def test_1_2_1_data_parallelism_degree_is_the_device_count():
  def build(x, y, under_epl):
    with s.scope(under_epl, lambda: epl.replicate(device_count=1)):
      return s.model(x, y)
  for n in (2, 4):
    pg = s.assert_trains_the_local_model(build, s.devices(n), copies=n)
    assert pg.plan.total_copies == n


def _pipeline(x, y, under_epl):
  with s.scope(under_epl, lambda: epl.replicate(device_count=1, name="stage_0")):
    h = s.model_part1(x)
  with s.scope(under_epl, lambda: epl.replicate(device_count=1, name="stage_1")):
    return s.model_part2(h, y)


@pytest.mark.parametrize("n", [2, 4])
def test_1_2_2_pipeline_with_4_micro_batches_replicated_over_the_extra_devices(n):
  # "If the total GPU number is 4, EPL will automatically apply two-degree data parallelism
  # over the model pipeline": each step reads replicas x 4 micro-batches of the script's batch
  pg = s.assert_trains_the_local_model(
      _pipeline, s.devices(n, **{"pipeline.num_micro_batch": 4}), copies=n // 2 * 4)
  assert len(pg.plan.taskgraphs) == 2 and pg.plan.total_copies == n // 2


def test_1_2_2_pipeline_on_a_device_count_it_does_not_divide_is_refused():
  with pytest.raises(PlanError, match=r"3.*2|2.*3"):
    s.train(_pipeline, s.data(64), 4, 1, s.devices(3, **{"pipeline.num_micro_batch": 4}))


def test_1_2_3_tensor_model_parallelism_data_parallel_trunk_split_classifier():
  run = s.assert_classification_trains_the_local_model(2)
  kinds = [tg.placement.kind for tg in run.parallel.plan.taskgraphs]
  assert kinds == ["replicate", "split"]
