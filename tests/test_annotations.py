"""TaskGraph attribution rules and annotation errors (messages are asserted)."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import AnnotationError, PlanError


def _build(body, devices=2, **config):
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config(dict({"cluster.devices_per_worker": devices}, **config)))
    body()
  return g


def _x():
  return tf.placeholder(tf.float32, [None, 4], name="x")


def test_attribution_rules():
  def body():
    x = _x()                                            # before the first scope -> TG 0
    with epl.replicate(1, name="a"):
      h = tf.layers.dense(x, 3, name="d0")
    h = tf.nn.relu(h, name="after_a")                   # after scope a -> TG 0 (most recent)
    with epl.replicate(1, name="b"):
      y = tf.layers.dense(h, 1, name="d1")
    loss = tf.reduce_mean(y, name="loss")               # after scope b -> TG 1
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
  g = _build(body)
  with g.as_default():
    pg = epl.Graph.get()
  a, b = pg.plan.taskgraphs
  assert (a.name, b.name) == ("a", "b")
  assert {"x", "d0/MatMul", "after_a"} <= set(a.ops["forward"])
  assert {"d1/MatMul", "loss"} <= set(b.ops["forward"])
  # backward ops follow their forward op's TaskGraph; apply ops their variable's
  assert "gradients/d0/MatMul_grad/MatMul_1" in a.ops["backward"]
  assert "gradients/d1/MatMul_grad/MatMul_1" in b.ops["backward"]
  assert any(n.startswith("GradientDescent/update_d0/kernel") for n in a.ops["apply"])
  assert any(n.startswith("GradientDescent/update_d1/kernel") for n in b.ops["apply"])
  text = pg.format()
  assert "TaskGraph 0 'a'" in text and "not rewritten yet" in text


def test_each_set_default_strategy_call_starts_a_taskgraph():
  def body():
    x = _x()
    epl.set_default_strategy(epl.replicate(1, name="s0"))
    h = tf.layers.dense(x, 3, name="d0")
    epl.set_default_strategy(epl.replicate(1, name="s1"))
    tf.layers.dense(h, 1, name="d1")
  g = _build(body)
  with g.as_default():
    tgs = epl.Graph.get().plan.taskgraphs
  assert [t.name for t in tgs] == ["s0", "s1"]
  assert "d0/MatMul" in tgs[0].ops["forward"] and "d1/MatMul" in tgs[1].ops["forward"]


def test_nested_scopes_are_refused_with_both_locations():
  def body():
    with epl.replicate(1, name="outer"):
      with epl.replicate(1, name="inner"):
        pass
  with pytest.raises(AnnotationError, match=r"epl scopes cannot be nested: replicate\("
                     r"device_count=1, name='inner'\) at test_annotations.py:\d+ opened inside "
                     r"replicate\(device_count=1, name='outer'\) at test_annotations.py:\d+"):
    _build(body)


def _train_model(strategies, devices):
  def body():
    x = _x()
    h = x
    for i, s in enumerate(strategies):
      with s:
        h = tf.layers.dense(h, 2, name="d%d" % i)
    tf.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(h))
  g = _build(body, devices)
  with g.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())


def test_device_count_larger_than_the_worker():
  with pytest.raises(PlanError, match=r"replicate 'big' asks for device_count=3 but the job "
                     r"has 2 device\(s\); lower device_count or launch more workers / "
                     r"--gpu_per_worker 3"):
    _train_model([epl.replicate(3, name="big")], devices=2)


def test_devices_not_a_multiple_of_a_replica():
  with pytest.raises(PlanError, match=r"one model replica needs 2 device\(s\) \(s0: 1 \+ s1: 1\) "
                     r"but the worker has 3; .*--gpu_per_worker 2"):
    _train_model([epl.replicate(1, name="s0"), epl.replicate(1, name="s1")], devices=3)


def test_bad_device_count_and_strategy_arguments():
  with pytest.raises(AnnotationError, match="device_count must be a positive int"):
    epl.replicate(0)
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config())
    with pytest.raises(AnnotationError, match="expects epl.replicate"):
      epl.set_default_strategy("replicate")


def test_trainable_variable_updated_without_any_gradient_is_refused():
  def body():
    x = _x()
    with epl.replicate(1):
      w = tf.get_variable("w", [4, 1])
      score = tf.reduce_mean(tf.matmul(x, w))
      train = tf.assign_add(w, tf.ones([4, 1]) * score)   # no gradient: copies would differ
    return train
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    train = body()
    with tf.Session() as sess:
      with pytest.raises(PlanError, match=r"no gradient for trainable variable 'w:0', which op "
                         r"'AssignAdd' updates in the training step"):
        sess.run(train, {"x:0": np.ones([2, 4])})


def test_init_under_eager_is_refused():
  code = ("import epl, tensorflow as tf\n"
          "try:\n  epl.init()\nexcept epl.EplError as e:\n  print('ERR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
                            "PATH": "/usr/bin:/bin"})
  assert "ERR epl.init() needs TensorFlow graph mode" in out.stdout, out.stderr[-2000:]
  assert "disable_v2_behavior()" in out.stdout


def test_only_the_chief_writes_checkpoints(tmp_path):
  """A non-chief worker's Saver.save (MonitoredTrainingSession with is_chief=True on every
  worker, as EPL's examples do) writes nothing."""
  from epl.cluster import Cluster
  from epl.entry import activate
  from epl.runtime.state import GraphState
  for index, writes in ((1, False), (0, True)):
    g = tf.Graph()
    with g.as_default():
      epl.init(epl.Config())
      # pretend to be worker `index` of two
      activate(GraphState(g, epl.Config(), Cluster(("a:1", "b:2"), index, 1, False)))
      tf.Variable(1.0, name="v")
      saver = tf.train.Saver()
      with tf.Session() as sess:             # a local session: no server is needed here
        sess.run(tf.global_variables_initializer())
        saver.save(sess, str(tmp_path / ("w%d" % index) / "model"))
    assert (tmp_path / ("w%d" % index)).exists() == writes


def test_only_the_chief_writes_summaries(tmp_path):
  from epl.cluster import Cluster
  from epl.entry import activate
  from epl.runtime.state import GraphState
  counts = {}
  for index in (1, 0):
    g = tf.Graph()
    with g.as_default():
      epl.init(epl.Config())
      activate(GraphState(g, epl.Config(), Cluster(("a:1", "b:2"), index, 1, False)))
      logdir = tmp_path / ("w%d" % index)
      writer = tf.summary.FileWriter(str(logdir))
      summary = tf.Summary(value=[tf.Summary.Value(tag="loss", simple_value=1.0)])
      writer.add_summary(summary, 1)
      writer.close()
      counts[index] = sum(1 for path in logdir.iterdir()
                          for event in tf.train.summary_iterator(str(path))
                          if event.HasField("summary"))
  assert counts == {0: 1, 1: 0}


def test_fed_batch_with_fewer_rows_than_copies_is_refused():
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    with epl.replicate(1):
      x = tf.placeholder(tf.float32, [None, 4], name="features")
      loss = tf.reduce_mean(tf.layers.dense(x, 1))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train, {x: np.ones([3, 4])})                 # uneven: 2 + 1 rows, weighted
      assert sess.run(loss, {x: np.ones([1, 4])}).shape == ()   # evaluation: any size
      with pytest.raises(PlanError, match=r"the batch fed to 'features' has 1 rows, fewer than "
                         r"this worker's 2 model copies x 1 micro-batch\(es\) \(2\): a training "
                         r"run needs at least one row per copy and micro-batch"):
        sess.run(train, {x: np.ones([1, 4])})


def test_notebook_layout_init_first_then_the_model_in_a_new_graph():
  """epl.init() at the top, the model (with its annotation) in `with tf.Graph().as_default()`:
  epl moves to the graph the model is built in."""
  epl.init(epl.Config({"cluster.devices_per_worker": 2}))
  g = tf.Graph()
  with g.as_default():
    with epl.replicate(1):
      x = tf.placeholder(tf.float32, [None, 4], name="x")
      loss = tf.reduce_mean(tf.layers.dense(x, 1))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train, {x: np.ones([4, 4])})
      assert epl.Graph.get().num_copies == 2


def test_annotations_in_an_empty_graph_and_the_model_elsewhere_is_refused():
  with tf.Graph().as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1, name="everything"))
  g = tf.Graph()
  try:
    with g.as_default():
      x = tf.placeholder(tf.float32, [None, 4], name="x")
      tf.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.layers.dense(x, 1)))
      with tf.Session() as sess:
        with pytest.raises(epl.EplError, match=r"this session runs a graph epl does not "
                           r"manage, while the epl annotations \('everything' at "
                           r"test_annotations.py:\d+\) were made for another graph that has "
                           r"no model: the model would train as the plain local script"):
          sess.run(tf.global_variables_initializer())
  finally:
    with tf.Graph().as_default():
      epl.init(epl.Config())                 # the other tests start from a usable epl
