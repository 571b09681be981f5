"""#50: micro-batches as stage functions (passes/stage_functions.py) -- each stage's forward
and backward one graph function, called once per action of the schedule.

Parity with the local script at M = 16 and 64, 1F1B and GPipe, the step written three ways
(``minimize``, ``compute_gradients``/``apply_gradients``, ``tf.gradients`` without a global
step), ref and resource variables, the session opened first (tests/test_ordering.py's
harness); the graph's size flat in M on the GPT-style stack of bench/scale.py; the in-flight
bound of each schedule from epl.memory; what falls back to clones and what is refused.
"""
import logging

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import NotImplementedYetError, PlanError
from tests.real_scripts import gpt2_lm
from tests.test_ordering import STYLES, _same, _step, _train


def _four_stages(style, optimizer="adam", resource=False, cond=False):
  """4 stages of dense layers with GPT-2's layer norm; ``cond``: a v1 tf.cond in stage 1."""
  def build(scope):
    with tf.variable_scope("", use_resource=resource):
      x = tf.placeholder(tf.float32, [None, 16], name="x")
      y = tf.placeholder(tf.int64, [None], name="y")
      h = x
      for s in range(4):
        with scope(s):
          h = tf.layers.dense(gpt2_lm.norm(h, "ln%d" % s) if s else h, 16, tf.nn.relu,
                              name="d%d" % s)
          if cond and s == 1:
            h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: h * 2.0, lambda: h)
      with scope(3):
        loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="out"))
      return _step(loss, optimizer, style), loss, {"x": x, "y": y}
  return build


def _feeds(micro, steps=2, rows_per_micro=2, seed=0):
  rng = np.random.RandomState(seed)
  rows = micro * rows_per_micro
  return [{"x": rng.randn(rows, 16).astype(np.float32), "y": rng.randint(0, 10, rows)}
          for _ in range(steps)]


def _stages(i):
  return epl.replicate(1, name="stage%d" % i)


def _config(micro, strategy="PreferBackward", mode="functions", devices=4, **more):
  return dict({"cluster.devices_per_worker": devices, "pipeline.num_micro_batch": micro,
               "pipeline.strategy": strategy, "graph.micro_batches": mode}, **more)


def _calls(pg):
  calls = pg.results["micro_batch"].calls
  assert calls is not None, pg.results["micro_batch"]
  return calls


@pytest.mark.parametrize("micro", [16, 64])
@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_parity_at_16_and_64_micro_batches_each_way_the_step_is_written(micro, strategy):
  feeds = _feeds(micro)
  for style in STYLES:
    build = _four_stages(style)
    pg = _same(_train(build, feeds=feeds), build, _config(micro, strategy), feeds)
    calls = _calls(pg)
    assert len(calls.calls) == 2 * 4 * micro                   # one call per action
    assert len(calls.bodies) == 8
    # every body sits on its stage's CPU device: TF's single-threaded executor runs it
    assert {c.get_attr("executor_type") for c in calls.calls.values()} == {
        b"SINGLE_THREADED_EXECUTOR"}


def test_a_body_runs_single_threaded_only_on_one_cpu_device():
  from tensorflow.core.framework import function_pb2
  from epl.passes.stage_bodies import executor_type
  fdef = function_pb2.FunctionDef()
  fdef.node_def.add(name="a", op="Identity", device="/job:worker/task:0/device:CPU:1")
  fdef.node_def.add(name="copied", op="Const")                 # a copied constant: the call's
  cpu1 = "/job:worker/replica:0/task:0/device:CPU:1"
  assert executor_type(fdef, cpu1) == "SINGLE_THREADED_EXECUTOR"
  assert executor_type(fdef, "/job:worker/replica:0/task:0/device:GPU:1") == ""   # streams
  assert executor_type(fdef, "/job:worker/replica:0/task:0/device:CPU:2") == ""   # send/recv
  fdef.node_def.add(name="b", op="Identity", device="/job:worker/task:1/device:CPU:1")
  assert executor_type(fdef, cpu1) == ""                       # a node on another task


def test_parity_on_resource_variables_and_replicated_stages():
  """Two replicas of the 4-stage pipeline on 8 devices (DP 2 x PP 4), resource variables,
  the weights' gradients all-reduced from the last calls' sums."""
  feeds = _feeds(16, rows_per_micro=4)
  build = _four_stages("tf.gradients", resource=True)
  pg = _same(_train(build, feeds=feeds), build, _config(16, devices=8), feeds)
  assert len(_calls(pg).calls) == 2 * 2 * 4 * 16


@pytest.mark.parametrize("micro", [16, 64])
def test_stages_of_device_count_2_train_the_local_model_each_way(micro):
  """``replicate(device_count=2)`` stages (a replica's 2 copies share its rows, fed through
  placeholders): every copy calls the bodies on its rows; an input pipeline cut across a
  stage's devices falls back (test_an_iterator_cut_across_a_stages_devices_falls_back)."""
  feeds = _feeds(micro, rows_per_micro=2 * 2)
  for style in STYLES:
    build = _four_stages(style)
    pg = _same(_train(build, feeds=feeds), build, _config(micro, devices=8), feeds,
               scopes=lambda i: epl.replicate(2, name="stage%d" % i))
    assert pg.plan.shards == 2 and len(_calls(pg).calls) == 2 * 2 * 4 * micro


def test_an_iterator_cut_across_a_stages_devices_falls_back():
  """(An input pipeline's batch per micro-batch: its parity is tests/test_pipeline.py's.)"""
  rng = np.random.RandomState(0)
  data = (rng.randn(64, 16).astype(np.float32), rng.randint(0, 10, 64))
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(_config(4, mode="auto", devices=4)))
    x, y = tf.data.Dataset.from_tensor_slices(data).repeat().batch(
        8).make_one_shot_iterator().get_next()
    h = x
    for s in range(2):
      with epl.replicate(2, name="stage%d" % s):
        h = tf.layers.dense(h, 16, tf.nn.relu, name="d%d" % s)
    with epl.replicate(2, name="stage1"):
      loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="out"))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      assert np.isfinite(sess.run([loss, train])[0])
    micro_batches = epl.Graph.get().results["micro_batch"]
  assert micro_batches.calls is None and "input pipeline" in micro_batches.fallback


def test_transformer_blocks_at_16_micro_batches():
  from epl.testing import assert_parity
  from tests import models
  assert_parity(models.transformer_two_stages, epl.Config(_config(16, devices=2)), copies=16,
                batch=1, strategies=[lambda i=i: epl.replicate(1, name="stage_%d" % i)
                                     for i in range(2)], optimizer="momentum", steps=3)


def _gpt_ops(layers, micro, split=1):
  """Ops of bench/scale.py's GPT-style stack on 4 stages after epl's rewrite (``split``:
  each stage an epl.split of that many parts)."""
  import bench.scale as scale
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(_config(micro, devices=4 * split)))
    scale.build(tf, epl, layers, 64, 4, 4, split=split)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())          # epl rewrites here
    return len(graph.get_operations()), epl.Graph.get()


@pytest.mark.parametrize("layers", [6, 12])
def test_the_graph_does_not_grow_with_micro_batches(layers):
  at16, pg = _gpt_ops(layers, 16)
  at64, pg64 = _gpt_ops(layers, 64)
  _calls(pg)
  assert at64 <= 1.25 * at16, (at16, at64)


def test_a_v1_cond_in_a_stage_falls_back_to_clones_and_functions_refuse_it(caplog):
  feeds = _feeds(4)
  build = _four_stages("minimize", cond=True)
  local = _train(build, feeds=feeds)
  with caplog.at_level(logging.INFO, logger="epl"):
    pg = _same(local, build, _config(4, mode="auto"), feeds)
  micro = pg.results["micro_batch"]
  assert micro.calls is None and "tf.cond" in micro.fallback, micro
  assert "not stage functions" in caplog.text
  with pytest.raises(NotImplementedYetError, match="'functions' cannot build this step.*cond"):
    _train(build, _config(4), local[2], feeds, scopes=_stages)


@pytest.mark.parametrize("micro", [4, 16])
def test_checkpointing_recomputes_inside_the_backward_calls_and_trains_the_local_model(micro):
  """gradient_checkpoint.type auto as stage functions: the user's backward reads recomputed
  segments (built once, before the bodies are cut), so the backward calls recompute and the
  forward calls hand on only checkpoints; each way the step is written, at 1e-5."""
  feeds = _feeds(micro)
  for style in STYLES:
    build = _four_stages(style)
    pg = _same(_train(build, feeds=feeds), build,
               _config(micro, **{"gradient_checkpoint.type": "auto"}), feeds)
    assert len(_calls(pg).calls) == 2 * 4 * micro
    done = pg.results["recompute"]
    assert done.recomputed_ops > 0 and done.rewired > 0, done


def _residual(stages, dropout):
  from tests.test_recompute import residual_mlp
  return residual_mlp(dropout=dropout, stages=[
      lambda: epl.replicate(1, name="stage_0"), lambda: epl.replicate(1, name="stage_1")]
                      if stages else None)


def test_checkpointing_with_dropout_reuses_the_forward_calls_masks_and_checks_itself(
    monkeypatch):
  """Dropout under stage functions with checkpointing: the recomputation reads the forward
  call's masks (handed on), so the model is the one trained without checkpointing;
  check_gradients compares forward and recomputed tensors in the first step and catches a
  recompute that draws new masks."""
  from tests.test_recompute import (_assert_same, _config as rc_config, _train as rc_train,
                                    redraw_masks)
  build = _residual(True, 0.3)
  keys = {"pipeline.num_micro_batch": 4, "graph.micro_batches": "functions"}
  plain = rc_train(build, rc_config(2, **keys))
  gc_keys = dict(keys, **{"gradient_checkpoint.type": "auto",
                          "gradient_checkpoint.check_gradients": True})
  checked = rc_train(build, rc_config(2, **gc_keys), initial=plain.initial)
  _assert_same(checked, plain)
  assert checked.parallel.results["micro_batch"].calls is not None
  assert checked.parallel.results["recompute"].check_op is not None
  redraw_masks(monkeypatch)
  with pytest.raises(tf.errors.InvalidArgumentError, match="check_gradients"):
    rc_train(build, rc_config(2, **gc_keys), initial=plain.initial)


def test_checkpointing_lowers_what_the_forward_calls_hand_on():
  """A deep stage 0 (8 dense blocks): under 1F1B its device holds 4 micro-batches' saved
  activations; with checkpointing only their checkpoints (the blocks' outputs)."""
  peaks = {kind: _held("PreferBackward", 8, blocks=8, checkpoint=kind, rows=128)
           for kind in ("", "auto")}
  assert peaks["auto"] < 0.75 * peaks[""], peaks


def test_random_streams_do_not_restart_when_a_run_fetches_something_else():
  """A call's dropout masks come from stateless kernels seeded per call by one stateful op
  outside the calls: a step that fetches one more tensor (another run signature, for which TF
  instantiates the functions anew) continues the stream instead of restarting it -- the job
  trains the model it trains when every step fetches the same."""
  def build(scope):
    x = tf.placeholder(tf.float32, [None, 16], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    with scope(0):
      h = tf.nn.dropout(tf.layers.dense(x, 32, tf.nn.relu, name="d0"), rate=0.5)
    with scope(1):
      logits = tf.layers.dense(h, 10, name="out")
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    return (tf.train.GradientDescentOptimizer(0.5).minimize(loss), loss,
            tf.reduce_mean(logits), {"x": x, "y": y})

  def run(extra_every):
    graph = tf.Graph()
    with graph.as_default():
      tf.set_random_seed(3)
      epl.init(epl.Config(_config(4, devices=2)))
      with tf.Session() as sess:
        train, loss, mean, ph = build(_stages)
        sess.run(tf.global_variables_initializer())
        losses = []
        for i, values in enumerate(_feeds(4, steps=6)):
          feed = {ph[k]: v for k, v in values.items()}
          fetches = [loss, train] + ([mean] if i % extra_every == 1 else [])
          losses.append(sess.run(fetches, feed)[0])
        assert epl.Graph.get().results["micro_batch"].calls is not None
        return losses, sess.run(tf.trainable_variables())

  same, mixed = run(10 ** 6), run(2)
  np.testing.assert_allclose(mixed[0], same[0], rtol=1e-6)
  for a, b in zip(mixed[1], same[1]):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_hidden_tensor_fetched_in_training_is_one_clear_error_and_a_collection_exports_it():
  """A tensor only its own body reads (a dense layer's pre-activation) is not a call's result:
  fetching it in a training run says so and how to keep it; in a collection it is one. A
  metric or a summary of a layer (ops the gradients do not need) runs per micro-batch."""
  def build(scope, export):
    x = tf.placeholder(tf.float32, [None, 16], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    with scope(0):
      h = tf.layers.dense(x, 16, tf.nn.relu, name="d0")
      norms = tf.reduce_sum(h * h, axis=1, name="norms")
    with scope(1):
      logits = tf.layers.dense(h, 10, name="out")
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
      accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    inner = tf.get_default_graph().get_tensor_by_name("d0/BiasAdd:0")
    if export:
      tf.add_to_collection("kept", inner)
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    return train, (accuracy, norms, inner), {"x": x, "y": y}

  values = _feeds(4)[0]
  for export in (False, True):
    graph = tf.Graph()
    with graph.as_default():
      epl.init(epl.Config(_config(4, devices=2)))
      train, (accuracy, norms, inner), ph = build(_stages, export)
      feed = {ph[k]: v for k, v in values.items()}
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(norms, feed)                        # evaluation: the model's ops
        _, acc, per_row = sess.run([train, accuracy, norms], feed)
        assert 0.0 <= acc <= 1.0
        np.testing.assert_allclose(per_row, before, rtol=1e-5)   # merged over micro-batches
        if export:
          assert sess.run([train, inner], feed)[1].shape == (8, 16)
        else:
          with pytest.raises(PlanError, match="d0/BiasAdd:0.*inside stage 0's forward"):
            sess.run([train, inner], feed)
          assert sess.run(inner, feed).shape == (8, 16)


def _held(strategy, micro, blocks=1, checkpoint="", rows=16):
  """epl.memory's step peak of stage 0's device on a 4-stage model with wide activations
  (``blocks`` dense blocks per stage, under ``block_<i>`` scopes)."""
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(_config(micro, strategy, **{"gradient_checkpoint.type": checkpoint})))
    x = tf.placeholder(tf.float32, [None, 64])
    h = x
    for s in range(4):
      with epl.replicate(1, name="stage_%d" % s):
        for b in range(blocks):
          with tf.variable_scope("block_%d" % (s * blocks + b)):
            h = h + tf.layers.dense(tf.layers.dense(h, 512, tf.nn.relu, name="s%d_a" % s),
                                    64, name="s%d_b" % s) if b else \
                tf.layers.dense(tf.layers.dense(h, 512, tf.nn.relu, name="s%d_a" % s), 64,
                                name="s%d_b" % s)
    train = tf.train.GradientDescentOptimizer(0.01).minimize(tf.reduce_mean(tf.square(h)))
    feed = {x: np.ones([micro * rows, 64], np.float32)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train, feed)
      report = epl.memory.measure(sess, train, feed_dict=feed)
      return report.peak("/device:CPU:1")


def test_1f1b_holds_at_most_stages_micro_batches_and_gpipe_all_of_them():
  """Stage 0 under 1F1B starts F(m + 4) only after B(m): its saved activations (the forward
  calls' results) stay at 4 micro-batches whatever M; under GPipe all M are held."""
  f16, f64 = _held("PreferBackward", 16), _held("PreferBackward", 64)
  g16, g64 = _held("PreferForward", 16), _held("PreferForward", 64)
  saved = 16 * 512 * 4                  # one micro-batch's hidden activations of stage 0
  fed = 16 * 64 * 4                     # one micro-batch's piece of the fed batch (held all step)
  # 1F1B: only the batch grows -- the fed array and its micro-batch pieces (slices copied
  # out of it), both alive at the peak when the executor runs the split early (under load on
  # CI: 930,560 -> 1,285,888 bytes, 1.4 pieces' worth over one copy of the growth)
  assert f64 - f16 <= 2 * 48 * fed + 0.1 * f16, (f16, f64)
  assert g64 - g16 >= 0.75 * 48 * saved, (g16, g64)          # GPipe: every micro-batch's
  assert g64 >= 2 * f64, (f64, g64)


# ---- split (TP) stages as stage functions (docs/design/tp_stage_functions.md, (a)) --------
def _gpt2_tp(style):
  """model.py's GPT-2 (tests/real_scripts/gpt2_lm.py: heads split under epl.split, wte tied
  across the two stages), the step written ``style``'s way, SGD (Adam's epsilon turns the
  zero-gradient key bias's float noise into full steps: gpt2_lm.build)."""
  def build(scope):
    context = tf.placeholder(tf.int32, [None, gpt2_lm.CTX + 1], name="context")
    logits = gpt2_lm.model(context[:, :-1], scope)
    with scope(1):
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=context[:, 1:], logits=logits))
    return _step(loss, "sgd", style), loss, {"context": context}
  return build


def _split_stages(i):
  return epl.split(2, name="stage%d" % i)


@pytest.mark.parametrize("micro,replicas,strategy", [
    (16, 1, "PreferBackward"), (64, 1, "PreferBackward"), (16, 2, "PreferForward")],
    ids=["m16", "m64", "m16-dp2-gpipe"])
def test_tp_inside_two_pipeline_stages_trains_the_local_model_each_way(micro, replicas,
                                                                      strategy):
  feeds = [{"context": c} for c in np.split(
      gpt2_lm.make_data(2 * micro * replicas)["context"], 2)]
  for style in STYLES:
    build = _gpt2_tp(style)
    pg = _same(_train(build, feeds=feeds), build,
               _config(micro, strategy, devices=4 * replicas), feeds, scopes=_split_stages)
    calls = _calls(pg)
    assert len(calls.calls) == replicas * 2 * 2 * micro and len(calls.bodies) == 4
    for call in calls.calls.values():          # a body spans its stage's two part devices
      assert call.get_attr("executor_type") == b""
    library = {f.signature.name: f for f in pg.graph.as_graph_def().library.function}
    for call in calls.calls.values():
      devices = {tf.DeviceSpec.from_string(n.device).device_index
                 for n in library[call.get_attr("f").name].node_def if n.device}
      assert len(devices) == 2, devices


def test_tp_stages_graph_does_not_grow_with_micro_batches():
  at16, pg = _gpt_ops(6, 16, split=2)
  at64, _ = _gpt_ops(6, 64, split=2)
  assert len(_calls(pg).bodies) == 8
  assert at64 <= 1.25 * at16, (at16, at64)


def test_a_tf_collective_or_a_stage_across_workers_falls_back_to_clones():
  """A body runs in one process, and a TF collective in it would repeat its instance key in
  every call of a step: both fall back under 'auto' and are refused under 'functions'."""
  from epl.passes import stage_functions

  def build(scope):
    x = tf.placeholder(tf.float32, [None, 4], name="x")
    with scope(0):
      h = tf.layers.dense(x, 4, name="d0")
    with scope(1):
      summed = tf.raw_ops.CollectiveReduceV2(
          input=h, group_size=1, group_key=7, instance_key=7, ordering_token=[],
          merge_op="Add", final_op="Id")
      loss = tf.reduce_mean(tf.layers.dense(h + tf.stop_gradient(summed), 1, name="d1"))
    return tf.train.GradientDescentOptimizer(0.1).minimize(loss)

  def rewrite(mode):
    graph = tf.Graph()
    with graph.as_default():
      epl.init(epl.Config(_config(4, mode=mode, devices=2)))
      build(lambda i: epl.replicate(1, name="stage%d" % i))
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())          # epl rewrites here
      return epl.Graph.get()
  micro = rewrite("auto").results["micro_batch"]
  assert micro.calls is None and "CollectiveReduceV2" in micro.fallback, micro
  with pytest.raises(NotImplementedYetError, match="'functions' cannot build.*TF collective"):
    rewrite("functions")

  class Op:                                     # a stage's ops on two workers' devices
    def __init__(self, device):
      self.device, self.type = device, "MatMul"
  ctx = type("Ctx", (), {"plan": type("Plan", (), {"taskgraphs": [
      type("T", (), {"name": "stage0"})]})})
  member = {Op("/job:worker/replica:0/task:0/device:CPU:1"): (0, "F"),
            Op("/job:worker/replica:0/task:1/device:CPU:1"): (0, "F")}
  assert "several workers" in stage_functions._one_process(ctx, member)
  member.popitem()
  assert stage_functions._one_process(ctx, member) is None
