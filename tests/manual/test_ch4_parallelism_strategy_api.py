"""EPL's manual, chapter 4 (Parallelism Strategy API): the primitives and their rules.

  4.1.1  replicate(device_count=None, name=None); with epl.replicate(device_count=1): model()
         -- device_count > 1 splits the replica's batch over its devices: the replica's
         batch stays the local batch (documented by EPL, built by epl)
  4.1.2  split(device_count=None, name=None); with epl.split(device_count=8): model() -- the
         whole model split (scaled to 2 devices)
  4.2    set_default_strategy(strategy); set_default_strategy(replicate(1)); model()
  4.3    different TaskGraphs on different devices; no nesting; only the forward part is
         annotated
"""
import pytest

import epl
from epl.errors import AnnotationError
from tests.manual import snippets as s


def _replicate(count):
  def build(x, y, under_epl):
    with s.scope(under_epl, lambda: epl.replicate(device_count=count)):
      return s.model(x, y)
  return build


def test_4_1_1_replicate_one_device_per_replica():
  pg = s.assert_trains_the_local_model(_replicate(1), s.devices(2), copies=2)
  assert pg.plan.total_copies == 2


def test_4_1_1_replicate_device_count_2_splits_the_replicas_batch():
  # "EPL will split the input batch into device_count parts ... and keeps the total batch
  # size of replicas the same as the original local batch size"
  pg = s.assert_trains_the_local_model(_replicate(2), s.devices(2), copies=1, batch=4)
  assert pg.plan.total_copies == 2 and pg.plan.shards == 2


def test_4_1_1_replicate_without_device_count_is_one_device_per_replica():
  pg = s.assert_trains_the_local_model(_replicate(None), s.devices(2), copies=2)
  assert pg.plan.total_copies == 2


@pytest.mark.parametrize("count", [2, None])
def test_4_1_2_split_the_whole_model_over_the_devices(count):
  def build(x, y, under_epl):
    with s.scope(under_epl, lambda: epl.split(device_count=count)):
      return s.model(x, y)
  pg = s.assert_trains_the_local_model(build, s.devices(2), copies=1, batch=4)
  assert [tg.placement.kind for tg in pg.plan.taskgraphs] == ["split"]
  assert pg.plan.taskgraphs[0].placement.devices == 2        # None: every device of the job


def test_4_2_set_default_strategy_replicate():
  def build(x, y, under_epl):
    if under_epl:
      epl.set_default_strategy(epl.replicate(device_count=1))
    return s.model(x, y)
  pg = s.assert_trains_the_local_model(build, s.devices(2), copies=2)
  assert len(pg.plan.taskgraphs) == 1


def test_4_2_each_call_starts_a_taskgraph_and_split_is_no_default():
  def build(x, y, under_epl):
    epl.set_default_strategy(epl.replicate(1))
    h = s.model_part1(x)
    epl.set_default_strategy(epl.replicate(1))
    return s.model_part2(h, y)
  _, _, _, pg = s.train(build, s.data(32), 4, 1, s.devices(2, **{"pipeline.num_micro_batch": 2}))
  assert len(pg.plan.taskgraphs) == 2
  with pytest.raises(AnnotationError, match="default strategy must be epl.replicate"):
    s.train(lambda x, y, u: epl.set_default_strategy(epl.split(2)), s.data(8), 4, 1,
            s.devices(2))


def test_4_3_taskgraphs_on_different_devices_no_nesting_forward_only():
  def build(x, y, under_epl):
    with epl.replicate(1, name="stage_0"):
      h = s.model_part1(x)
    with epl.replicate(1, name="stage_1"):
      return s.model_part2(h, y)              # backward and apply follow their forward ops
  _, _, _, pg = s.train(build, s.data(32), 4, 1, s.devices(2, **{"pipeline.num_micro_batch": 2}))
  first, second = (tg.placement for tg in pg.plan.taskgraphs)
  copy = pg.plan.copies[0]
  assert copy.devices[0] != copy.devices[1]
  apply_ops = pg.plan.taskgraphs[1].ops["apply"]
  assert any("logits" in name for name in apply_ops)          # stage_1's variables' updates

  def nested(x, y, under_epl):
    with epl.replicate(1, name="outer"):
      with epl.replicate(1, name="inner"):
        return s.model(x, y)
  with pytest.raises(AnnotationError, match="cannot be nested"):
    s.train(nested, s.data(8), 4, 1, s.devices(2))
