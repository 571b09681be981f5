"""epl.split: tensor-parallel classifier and MoE parity with the local model, memory per
device, the collectives inserted, checkpoints and the errors before training."""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import AnnotationError, PlanError
from tests import split_models as sm

CLASSES = 1000
STEPS, ROWS = 5, 8
TOL = 1e-5


def _config(devices, colocate=True, **extra):
  return epl.Config(dict({"cluster.devices_per_worker": devices,
                          "cluster.colocate_split_and_replicate": colocate}, **extra))


@functools.lru_cache(maxsize=None)
def _local_classifier(classes=CLASSES, dense="layers"):
  data = sm.classification_data(STEPS * ROWS, classes)
  trunk, head = sm.local_scopes()
  return sm.train(lambda: sm.classifier(classes, trunk, head, dense), data, STEPS, ROWS,
                  fetch=("loss", "accuracy", "logits", "predictions")), data


def _assert_close(got, want, what):
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=what)


def _assert_same_training(run, local):
  for step, (got, want) in enumerate(zip(run.fetched, local.fetched)):
    for key in want:
      _assert_close(got[key], want[key], "%s at step %d" % (key, step))
  for key, want in local.evaluated.items():          # evaluation: any batch size
    _assert_close(run.evaluated[key], want, "evaluated " + key)
  assert sorted(run.variables) == sorted(local.variables)
  for name, value in local.variables.items():
    _assert_close(run.variables[name], value, name)


# (devices per worker, colocate, trunk device_count, split device_count)
CLASSIFIER_CASES = {
    "2 devices": (2, True, 2, 2),
    "4 devices": (4, True, 4, 4),
    "4 devices, 2 replicas": (4, True, 2, 2),
    "3 devices, trunk apart": (3, False, 1, 2),
}


@pytest.mark.parametrize("case", sorted(CLASSIFIER_CASES))
def test_split_classifier_trains_the_local_model(case):
  devices, colocate, trunk_count, split_count = CLASSIFIER_CASES[case]
  local, data = _local_classifier()
  trunk, head = sm.scopes(trunk_count, split_count)
  run = sm.train(lambda: sm.classifier(CLASSES, trunk, head), data, STEPS, ROWS,
                 config=_config(devices, colocate), initial=local.initial,
                 fetch=("loss", "accuracy", "logits", "predictions"))
  _assert_same_training(run, local)
  # the split argmax picks the same class among 1,000 for every row (spread over the parts'
  # class ranges, so the accuracy comparison is not one of zeros)
  predicted = np.concatenate([f["predictions"] for f in run.fetched])
  assert len({int(p) * split_count // CLASSES for p in predicted}) > 1, predicted
  plan = run.parallel.plan
  split_tg = next(t for t in plan.taskgraphs if t.placement.kind == "split")
  assert split_tg.placement.devices == split_count
  parts = [v for v in run.graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)
           if v.op.name.startswith("classifier/kernel/part_")]
  assert len(parts) == split_count
  assert len({v.device for v in parts}) == split_count        # one part per device


def test_keras_dense_classifier_with_uneven_shards():
  classes = CLASSES + 1                         # 1001 over 4 devices: 251, 250, 250, 250
  local, data = _local_classifier(classes, "keras")
  trunk, head = sm.scopes(4, 4)
  run = sm.train(lambda: sm.classifier(classes, trunk, head, "keras"), data, STEPS, ROWS,
                 config=_config(4), initial=local.initial, fetch=("loss", "accuracy", "logits", "predictions"))
  _assert_same_training(run, local)
  kernel_parts = sorted((v.op.name, v.shape.as_list()) for v in run.graph.get_collection(
      tf.GraphKeys.TRAINABLE_VARIABLES) if "classifier/kernel/part_" in v.op.name)
  assert [s for _, s in kernel_parts] == [[16, 251], [16, 250], [16, 250], [16, 250]]


def test_split_weights_start_as_slices_of_the_local_ones():
  """With seeded initializers the split model starts from the local model's weights."""
  local, data = _local_classifier()
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: sm.classifier(CLASSES, trunk, head), data, 1, ROWS, config=_config(2))
  for name in ("classifier/kernel", "classifier/bias", "fc1/kernel"):
    np.testing.assert_array_equal(run.initial[name], local.initial[name], err_msg=name)


def test_collectives_per_split_layer():
  """One gathered copy per consuming device for each tensor entering the split classifier
  (features, labels), one row slice per copy for each gradient leaving it; the split weights'
  gradients are all-reduced only across replicas."""
  local, data = _local_classifier()
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: sm.classifier(CLASSES, trunk, head), data, 1, ROWS,
                 config=_config(4), initial=local.initial)
  pg = run.parallel
  bridges = pg.results["bridge"]
  # per replica: features and labels gathered once on each of the 2 split devices (the
  # shards' matmuls and their kernel gradients share one); the features' gradient (summed
  # over the shards by tf.gradients on the first one) sliced to each of the 2 copies
  assert bridges.count("gather") == 2 * 2 * 2
  assert bridges.count("scatter") == 2 * 2
  crossings = pg.plan.crossings
  assert {(x.tensor.split(":")[0], x.gather, x.backward) for x in crossings} == {
      ("fc2/Relu", True, False), ("labels", True, False), ("gradients/AddN_3", False, True)}
  assert {x.consumer for x in crossings if x.tensor == "fc2/Relu:0"} == {
      "classifier/MatMul_part0", "classifier/MatMul_part1",
      "gradients/classifier/MatMul_part0_grad/MatMul_1",
      "gradients/classifier/MatMul_part1_grad/MatMul_1"}
  sync = pg.results["gradient_sync"]
  reduced = {v for bucket in sync.buckets for v in bucket}
  assert {"classifier/kernel/part_0", "classifier/kernel/part_1", "classifier/bias/part_0",
          "classifier/bias/part_1"} <= reduced
  # the labels from epl.plan.placement.TRANSITIONS: all-gather in, reduce-scatter back
  assert {(x.collective, x.gather) for x in crossings} == {("all_gather", True),
                                                           ("reduce_scatter", False)}
  text = pg.format()
  for line in ("'split': split(device_count=2)",
               "replica 0: parts on /device:CPU:1, /device:CPU:2; replica 1: parts on "
               "/device:CPU:3, /device:CPU:4",
               "Split boundaries (9 crossing tensor(s); 8 gather(s) into split parts, 4 "
               "scatter(s) out)",
               "trunk -> split: all_gather fc2/Relu:0 -> classifier/MatMul_part0 (rows)",
               "split -> trunk: reduce_scatter gradients/AddN_3:0 -> "
               "gradients/fc2/Relu_grad/ReluGrad (rows, gradient, out)"):
    assert line in text, text


def test_a_training_step_never_moves_logits_or_a_weight_shard_between_devices():
  """The split loss, argmax and accuracy combine per-row vectors ([batch] maxima, sums of
  exps, label logits) across the parts: no tensor with a class dimension is received by
  another device in a training step (read off the step's partition graphs)."""
  classes, devices = 1000, 2
  x, y = sm.classification_data(ROWS, classes)
  with tf.Graph().as_default() as graph:
    epl.init(_config(devices))
    t = sm.classifier(classes, *sm.scopes(devices, devices))
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      metadata = tf.RunMetadata()
      sess.run([t["train_op"], t["accuracy"], t["loss"]], {t["inputs"][0]: x, t["inputs"][1]: y},
               options=tf.RunOptions(output_partition_graphs=True), run_metadata=metadata)
  received = []                   # the sources of tensors sent to another device
  for partition in metadata.partition_graphs:     # (a control edge sends a "ctrl" dummy)
    received += [n.attr["tensor_name"].s.decode().split("_", 2)[2] for n in partition.node
                 if n.op == "_Send" and "/ctrl/" not in n.input[0]]
  shapes = {}
  for name in received:          # (not fed batches, nor what Grappler added: control edges)
    op = next((o for o in graph.get_operations() if o.name == name), None)
    if op is not None:
      shapes[name] = [o.shape.as_list() if o.shape.rank is not None else None
                      for o in op.outputs]
  assert any("xentropy" in n for n in shapes), sorted(shapes)     # the loss's combine
  wide = {n: s for n, s in shapes.items() if any(
      d is None or classes // devices in d or classes in d for d in s)}
  assert not wide, wide


def test_memory_of_the_classifier_per_device_is_a_shard():
  classes, devices = 8000, 4
  data = sm.classification_data(ROWS, classes)
  split_trunk, split_head = sm.scopes(devices, devices)
  split = sm.train(lambda: sm.classifier(classes, split_trunk, split_head), data, 1, ROWS,
                   config=_config(devices), measure_memory=True)
  dp_trunk = lambda: epl.replicate(1, name="all")     # noqa: E731  each device: everything
  dp = sm.train(lambda: sm.classifier(classes, dp_trunk, dp_trunk), data, 1, ROWS,
                config=_config(devices), measure_memory=True)
  for v in split.graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    if v.op.name.startswith("classifier/kernel/part_"):
      assert v.shape.as_list() == [16, classes // devices]
  split_devices = [d for d in split.memory.devices() if d.startswith("/device:")
                   and not d.endswith("CPU:0")]
  assert len(split_devices) == devices
  trunk_bytes = 2 * 4 * (sm.FEATURES * 32 + 32 + 32 * 16 + 16)     # weights + momentum
  head_bytes = 2 * 4 * (16 * classes + classes)
  for d in split_devices:
    # each device: the trunk, and a quarter of the classifier and of its momentum slot
    assert split.memory.held(d) == trunk_bytes + head_bytes // devices, d
    assert dp.memory.held(d) == trunk_bytes + head_bytes, d
  # measured: the allocator's bytes after initialisation (a fresh process with TF's BFC
  # allocator, whose statistics are the sum over the virtual devices)
  # each layout in a process of its own (no session's leftovers in the other's count)
  measured = {}
  for layout in ("split", "data_parallel"):
    out = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "workers",
                                      "allocator_bytes.py"), str(classes), str(devices),
         layout], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    measured.update(json.loads(out.stdout.strip().splitlines()[-1]))
  # (ideal ratio 0.26.) TF's BFC allocator counts a chunk it did not split -- one under twice
  # the request -- whole, and which chunks those are depends on the order the devices'
  # initializers allocate in: the data-parallel count varied from 4.40 to 4.88 MB over fresh
  # processes here and reached 5.35 MB in two CI runs (11-29, 12-02), the split one 1.14 to
  # 1.25 MB. So the saving is bounded, not matched: at least 0.8 of the N-1 copies' bytes,
  # at most 1.5 of them (a chunk counts at most twice its request)
  assert measured["split"] < 0.45 * measured["data_parallel"], measured
  saved = (devices - 1) * head_bytes            # the classifier's other N-1 copies
  assert 0.8 * saved < measured["data_parallel"] - measured["split"] < 1.5 * saved, measured
  split_peak = max(split.memory.peak(d) for d in split_devices)
  dp_peak = max(dp.memory.peak(d) for d in split_devices)
  assert 0 < split_peak < 0.5 * dp_peak, (str(split.memory), str(dp.memory))
  # every op sits on the device of the ops TF colocates it with (a gradient AddN colocated
  # with part 0 but placed with part 1 once made TF's placer move part 0's matmuls to the host)
  for op in split.graph.get_operations():
    for group in op.colocation_groups():
      target = split.graph.get_operation_by_name(group.decode()[len("loc:@"):])
      assert not op.device or not target.device or op.device == target.device, (
          op.name, op.device, target.name, target.device)


MOE_CASES = {"2 devices": (2, False), "4 devices": (4, False),
             "2 devices, gate inside the split scope": (2, True)}


@functools.lru_cache(maxsize=None)
def _local_moe(steps, gate_in_experts=False):
  data = sm.moe_data(3 * ROWS)
  trunk, experts = sm.local_scopes()
  return sm.train(lambda: sm.moe_model(4, 4, trunk, experts, gate_in_experts), data, steps,
                  ROWS, fetch=("loss", "output", "moe")), data


def _moe_scopes(devices):
  return (lambda: epl.replicate(devices, name="trunk"),
          lambda: epl.split(devices, name="experts"))


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_matches_dense_experts(case):
  """4 experts split over 2 / 4 devices vs every expert computed locally with the same gate:
  the layer's output, the loss, the gradients (one SGD step with rate 1 moves each weight by
  its gradient) and 3 steps of training."""
  devices, gate_in_experts = MOE_CASES[case]
  local, data = _local_moe(3, gate_in_experts)
  trunk, experts = _moe_scopes(devices)
  model = lambda: sm.moe_model(4, 4, trunk, experts, gate_in_experts)   # noqa: E731
  run = sm.train(model, data, 3, ROWS, config=_config(devices), initial=local.initial,
                 fetch=("loss", "output", "moe"))
  one_local, _ = _local_moe(1, gate_in_experts)    # the same data, one step
  one = sm.train(model, data, 1, ROWS, config=_config(devices), initial=local.initial)
  for name, value in one_local.variables.items():
    _assert_close(local.initial[name] - one.variables[name], local.initial[name] - value,
                  "gradient of " + name)
  _assert_same_training(run, local)
  parts = [v for v in run.graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)
           if v.op.name.startswith("experts_in/part_")]
  assert [v.shape.as_list()[0] for v in parts] == [4 // devices] * devices


@pytest.mark.parametrize("devices", [2, 4])
def test_moe_dispatch_and_combine_are_an_all_to_all(devices):
  """Only the experts' slices of the dispatched tokens cross between the copies and the
  parts (forward and gradients): never the tokens, the dispatch or combine masks."""
  trunk, experts = _moe_scopes(devices)
  run = sm.train(lambda: sm.moe_model(4, 4, trunk, experts), sm.moe_data(ROWS), 1, ROWS,
                 config=_config(devices))
  plan, bridges = run.parallel.plan, run.parallel.results["bridge"]
  assert plan.crossings and {x.collective for x in plan.crossings} == {"all_to_all"}
  graph = run.graph
  for x in plan.crossings:                     # [experts of one part, tokens, capacity, ...]
    shape = graph.get_tensor_by_name(x.tensor).shape.as_list()
    assert x.batch_major and x.axis == 1 and shape[0] == 4 // devices, (str(x), shape)
  # per part: the dispatched slices in and their gradient in; per part and copy: the
  # outputs' rows out and the gradient's rows out
  assert bridges.count("gather") == 2 * devices
  assert bridges.count("scatter") == 2 * devices * devices
  assert "all_to_all" in run.parallel.format()


def test_checkpoint_of_a_split_model_restores_into_the_local_model(tmp_path):
  local, data = _local_classifier()
  trunk, head = sm.scopes(2, 2)
  path = str(tmp_path / "model.ckpt")

  def save(sess, t):
    tf.train.Saver().save(sess, path)
  graph = tf.Graph()
  with graph.as_default():
    epl.init(_config(2))
    t = sm.classifier(CLASSES, trunk, head)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sm.load_whole(sess, tf.global_variables(), local.variables)
      tf.train.Saver().save(sess, path)
  graph = tf.Graph()
  with graph.as_default():
    nulls = sm.local_scopes()
    sm.classifier(CLASSES, *nulls)
    with tf.Session() as sess:
      tf.train.Saver().restore(sess, path)
      restored = sm.whole_values(sess, tf.global_variables())
  for name, value in local.variables.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)


# ---- errors before training -----------------------------------------------------------
def _build_and_start(body, devices=2, **extra):
  graph = tf.Graph()
  with graph.as_default():
    epl.init(_config(devices, **extra))
    body()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())


def test_split_mistakes_are_clear_errors():
  with pytest.raises(AnnotationError, match="default strategy must be epl.replicate"):
    _build_and_start(lambda: epl.set_default_strategy(epl.split(2)))

  def too_many():
    x = tf.placeholder(tf.float32, [None, 4])
    with epl.split(8, name="wide"):
      tf.layers.dense(x, 8)
  with pytest.raises(PlanError, match=r"split 'wide' asks for device_count=8 but the job has 2"):
    _build_and_start(too_many)

  def shared_weight():
    x = tf.placeholder(tf.float32, [None, 4])
    with epl.replicate(2):
      w = tf.get_variable("w", [4, 4])
      h = tf.matmul(x, w)
    with epl.split(2):
      tf.layers.dense(tf.matmul(h, w), 10)
  with pytest.raises(PlanError, match=r"variable 'w' of TaskGraph .* is read by op"):
    _build_and_start(shared_weight)


def test_ops_after_the_split_scope_join_it_and_follow_its_rules():
  """EPL's rule: ops after a scope join the most recent TaskGraph -- the loss written after
  ``with epl.split`` is computed by the split rules too."""
  local, data = _local_classifier()

  def build():
    images = tf.placeholder(tf.float32, [None, sm.FEATURES], name="images")
    labels = tf.placeholder(tf.int64, [None], name="labels")
    with epl.replicate(2):
      h = tf.layers.dense(images, 32, activation=tf.nn.relu, kernel_initializer=sm._init(1),
                          name="fc1")
      features = tf.layers.dense(h, 16, activation=tf.nn.relu, kernel_initializer=sm._init(2),
                                 name="fc2")
    with epl.split(2):
      logits = tf.layers.dense(features, CLASSES, kernel_initializer=sm._init(3),
                               bias_initializer=tf.random_normal_initializer(seed=4),
                               name="classifier")
    loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    predictions = tf.argmax(logits, axis=1)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(predictions, labels), tf.float32),
                              name="accuracy")
    opt = tf.train.MomentumOptimizer(0.5, momentum=0.9)
    grads, variables = zip(*opt.compute_gradients(loss))
    grads, _ = tf.clip_by_global_norm(grads, 5.0)
    train_op = opt.apply_gradients(zip(grads, variables),
                                   global_step=tf.train.get_or_create_global_step())
    return dict(inputs=(images, labels), loss=loss, accuracy=accuracy, logits=logits,
                predictions=predictions, train_op=train_op)
  run = sm.train(build, data, STEPS, ROWS, config=_config(2), initial=local.initial,
                 fetch=("loss", "accuracy", "logits", "predictions"))
  _assert_same_training(run, local)


SPLIT_ACROSS_WORKERS = {
    "one replica over 2 workers x 1 device": (1, "classifier"),
    "2 workers x 2 devices, data-parallel replicas": (2, "classifier"),
    "MoE, 2 workers x 2 devices, data-parallel replicas": (2, "moe"),
}


@pytest.mark.skipif(os.environ.get("EPL_SKIP_MULTIWORKER") == "1", reason="multi-process")
@pytest.mark.parametrize("case", sorted(SPLIT_ACROSS_WORKERS))
def test_split_across_two_workers(tmp_path, case):
  from tests.test_multiworker import launch
  devices, model = SPLIT_ACROSS_WORKERS[case]
  if model == "moe":
    local, data = _local_moe(3)
    steps, keys = 3, ("loss",)
  else:
    local, data = _local_classifier()
    steps, keys = STEPS, ("loss", "accuracy", "logits")
  np.savez(tmp_path / "data.npz", x=data[0], y=data[1])
  np.savez(tmp_path / "initial.npz", **local.initial)
  worker = os.path.join(os.path.dirname(__file__), "workers", "split_worker.py")
  out = launch(["--num_workers", "2", "--gpu_per_worker", str(devices), "--log_dir",
                str(tmp_path / "logs"), worker, str(tmp_path), str(steps), str(ROWS),
                str(devices), model])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  clients = [dict(np.load(p)) for p in sorted(tmp_path.glob("client*.npz"))]
  assert len(clients) == (1 if devices == 1 else 2)
  res = clients[0]
  assert any("task:1" in d for d in res["__devices__"])     # a shard lives on worker 1
  if devices == 1:
    for key in keys:
      _assert_close(res["__" + key + "__"], np.array([f[key] for f in local.fetched]), key)
  else:                      # each worker's loss is the mean over its half of the rows
    losses = np.mean([c["__loss__"] for c in clients], axis=0)
    _assert_close(losses, np.array([f["loss"] for f in local.fetched]), "loss")
  for c in clients:
    for name, value in local.variables.items():
      _assert_close(c[name], value, name)
