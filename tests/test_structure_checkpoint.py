"""Structural checks of the rewrite, checkpoints epl <-> local, and introspection."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing.values import read_values
from epl.testing import run_model
from tests import models

DATA = models.regression_data(64)


def _epl_run(devices=4, steps=2, model=models.mlp, **config):
  return run_model(model, DATA, 4, steps,
                   config=epl.Config(dict({"cluster.devices_per_worker": devices}, **config)),
                   strategies=[lambda: epl.replicate(1)])


@pytest.mark.parametrize("max_splits", [1, 2, 5])
def test_each_gradient_synchronised_exactly_once(max_splits):
  res = _epl_run(**{"communication.max_splits": max_splits})
  pg = res.parallel
  with res.graph.as_default():
    trainable = sorted(v.op.name for v in tf.trainable_variables())
  synced = pg.sync_report.variables()
  assert sorted(synced) == trainable                     # every variable, once
  assert 1 <= len(pg.sync_report.buckets) <= max_splits
  assert (len(pg.sync_report.buckets) > 1) == (max_splits > 1)
  # buckets are cut in the order backprop computes the gradients: the last layer's first,
  # so each bucket's sum starts while the earlier layers' backprop still runs
  layers = [v.split("/")[0] for bucket in pg.sync_report.buckets for v in bucket]
  assert layers == sorted(layers, reverse=True), layers     # dense_2, dense_1, dense
  # inside one worker the sum is in-graph (no TF collective: see epl.collectives), one AddN
  # per bucket, read by every copy
  ops = res.graph.get_operations()
  assert not [op for op in ops if op.type.startswith("Collective")]
  sums = [op for op in ops if op.type == "AddN" and "epl_all_reduce" in op.name]
  assert len(sums) == len(pg.sync_report.buckets)
  assert len(pg.sync_report.collective_ops) == len(pg.sync_report.buckets) * pg.num_copies


@pytest.mark.parametrize("max_splits,expected", [
    (1, [8]), (2, [5, 3]), (5, [4, 1, 1, 1, 1]), (8, [3, 1, 1, 1, 1, 1])])
def test_buckets_end_at_the_closest_edge(max_splits, expected):
  """A 4-layer MLP's gradients in backprop order (bias, kernel; last layer first): runs of
  similar bytes, a big kernel is not glued to the small bias before it when that overshoots."""
  import types
  from epl.passes.grad_sync import _buckets
  sizes = [10, 5120, 512, 262144, 512, 262144, 512, 262144]
  items = [types.SimpleNamespace(size=s) for s in sizes]
  buckets = _buckets(items, max_splits)
  assert [len(b) for b in buckets] == expected
  assert [i for b in buckets for i in b] == items                # contiguous, in order


def test_copies_on_distinct_devices_and_inputs_per_replica():
  res = _epl_run(devices=4)
  g, rep = res.graph, res.parallel.clones()
  matmul = g.get_operation_by_name("dense/MatMul")
  devices = [rep.op(c, matmul).device for c in range(4)]
  assert len(set(devices)) == 4 and all("CPU:0" not in d for d in devices)
  sources = [op for op in g.get_operations() if op.type == "IteratorGetNext"]
  assert len(sources) == 4                               # each replica reads its own batch
  kernel = [res.parallel.replication.mirrored["dense/kernel"][c].device for c in range(4)]
  assert kernel == devices


def test_no_annotation_changes_nothing():
  res = run_model(models.mlp, DATA, 4, 2, config=epl.Config({"cluster.devices_per_worker": 4}))
  assert res.parallel.plan.is_local
  assert not [op for op in res.graph.get_operations() if op.name.startswith("EPL_REPLICA")]


def test_format_is_readable():
  res = _epl_run(devices=2)
  text = res.parallel.format()
  assert "2 model replica(s) x 1 shard(s)" in text
  assert "TaskGraph 0" in text and "/device:CPU:2" in text
  assert "Gradient sync: 6 variable(s)" in text
  assert "forward" in text and "backward" in text and "apply" in text


def _build(use_epl):
  """The MLP trained with Adam (on 2 devices under epl); returns the train op."""
  if use_epl:
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
  x, y = tf.data.make_one_shot_iterator(
      tf.data.Dataset.from_tensor_slices(DATA).batch(4).repeat()).get_next()
  loss = models.mlp(x, y, lambda i: _Null())
  step = tf.train.get_or_create_global_step()
  return tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)


def _train_and_save(path, use_epl, steps=3):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    train = _build(use_epl)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=path, save_checkpoint_secs=None,
                                           save_checkpoint_steps=1000, save_summaries_steps=None,
                                           log_step_count_steps=None) as sess:
      for _ in range(steps):
        sess.run(train)
      values = read_values(sess, tf.global_variables())
  return values


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def _restore(path, use_epl):
  """Builds the model and restores ``path`` with a plain Session + Saver."""
  g = tf.Graph()
  with g.as_default():
    train = _build(use_epl)
    saver = tf.train.Saver()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      saver.restore(sess, tf.train.latest_checkpoint(path))
      values = read_values(sess, tf.global_variables())
      copies = {}
      if use_epl:
        for name, ops in epl.Graph.get().replication.mirrored.items():
          copies[name] = [sess.run(op.outputs[0]) for op in ops]
      sess.run(train)                        # training continues after the restore
  return values, copies


def test_checkpoint_epl_to_local_and_back(tmp_path):
  saved = _train_and_save(str(tmp_path / "epl"), use_epl=True)
  names = [n for n, _ in tf.train.list_variables(str(tmp_path / "epl"))]
  assert "dense/kernel" in names and not [n for n in names if "EPL_REPLICA" in n]
  local, _ = _restore(str(tmp_path / "epl"), use_epl=False)
  for name, value in saved.items():
    np.testing.assert_array_equal(local[name], value, err_msg=name)
  assert local["global_step"] == 3

  saved = _train_and_save(str(tmp_path / "local"), use_epl=False, steps=2)
  restored, copies = _restore(str(tmp_path / "local"), use_epl=True)
  for name, value in saved.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  assert copies and all(len(v) == 2 for v in copies.values())
  for name, values in copies.items():                # every copy got the restored values
    for v in values:
      np.testing.assert_array_equal(v, saved[name], err_msg=name)


def test_monitored_session_resumes_from_a_local_checkpoint(tmp_path):
  saved = _train_and_save(str(tmp_path / "ck"), use_epl=False, steps=2)
  resumed = _train_and_save(str(tmp_path / "ck"), use_epl=True, steps=1)
  assert resumed["global_step"] == 3
  assert not np.array_equal(resumed["dense/kernel"], saved["dense/kernel"])
