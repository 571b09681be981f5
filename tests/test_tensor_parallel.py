"""Tensor parallelism of transformer blocks (Megatron-LM's pattern) on the GPT-2-style
language model (tests/real_scripts/gpt2_lm.py) with everything at once: ZeRO, gradient
checkpointing and AMP inside pipeline stages on one worker and across two, checkpoints across
layouts, memory per device, heads that do not divide over the parts. The layouts alone (TP 2 and
4, TP 2 x DP 2, DP 2 x PP 2 x TP 2), with each weight's cut as its use asks
(epl.sharding.layout), are tests/test_tp_published.py's, on GPT-2 as published."""
import contextlib
import functools
import importlib.util
import itertools
import json
import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.plan import picture
from tests import split_models as sm
from tests.real_scripts import gpt2_lm
from tests.test_multiworker import launch

ROWS, STEPS = 8, 3


def _build(stage, heads):
  t = gpt2_lm.build(None, stage, heads=heads)
  return dict(inputs=(t["placeholders"]["context"],), loss=t["loss"], train_op=t["train_op"])


def _cuts(graph):
  """{variable: [(offset, shape) of each part]} of the split variables."""
  out = {}
  for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    info = v._get_save_slice_info()          # pylint: disable=protected-access
    if info is not None:
      out.setdefault(info.full_name, []).append((tuple(info.var_offset), tuple(info.var_shape)))
  return {k: sorted(v) for k, v in out.items()}


def _data():
  return (gpt2_lm.make_data(ROWS * STEPS + 3)["context"],)


@functools.lru_cache(maxsize=None)
def _local(heads):
  return sm.train(lambda: _build(lambda i: contextlib.nullcontext(), heads), _data(), STEPS,
                  ROWS)


def _parity(stage, config, heads=2, rtol=1e-5):
  """Trains the LM under epl (``stage(i)``: the scope of stage i) from the local run's
  weights; its losses and weights are the local run's within ``rtol``."""
  local = _local(heads)
  run = sm.train(lambda: _build(stage, heads), _data(), STEPS, ROWS,
                 config=epl.Config(config), initial=local.initial)
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=rtol, atol=rtol)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=rtol, atol=rtol, err_msg=name)
  return run


def _tp_stages(i):
  return epl.split(2, name="stage%d" % i)


RECIPE = {"cluster.devices_per_worker": 8, "pipeline.num_micro_batch": 4}
FP16_RTOL = 3e-3                 # tests/test_amp.py: AMP O1 against the float32 model


# TP 2, TP 4, TP 2 x DP 2 and DP 2 x PP 2 x TP 2 with 4 micro-batches (cuts, all-reduce counts,
# what each device holds): tests/test_tp_published.py, on GPT-2 as published
# ZeRO v1 + gradient checkpointing in fp32 on the same layout: tests/test_ordering.py (GPT-2's
# trainer, under the race amplifier)
@pytest.mark.parametrize("layout,stage,config,rtol", [
    ("DP 2 x PP 2 x TP 2, 4 micro-batches, ZeRO v1, gradient checkpointing, AMP O1", _tp_stages,
     dict(RECIPE, **{"zero.level": "v1", "gradient_checkpoint.type": "auto",
                     "amp.level": "O1"}), FP16_RTOL),
])
def test_the_3d_recipe_on_one_worker_trains_the_local_model(tmp_path, layout, stage, config,
                                                            rtol):
  """Tensor parallel inside pipeline stages, data parallel around them, with ZeRO, gradient
  checkpointing and AMP: 8 devices of one worker."""
  run = _parity(stage, config, rtol=rtol)
  plan = run.parallel.plan
  assert len(plan.copies) == 2, layout            # DP 2 around the parts
  calls = run.parallel.results["micro_batch"].calls     # TP stages as stage functions (#50)
  assert calls is not None and len(calls.calls) == 2 * 2 * 2 * 4, layout
  stages = [t.name for t in plan.taskgraphs]
  assert [t.placement.kind for t in plan.taskgraphs] == ["split"] * len(stages), layout
  # the plan's picture: each device holds one (stage, part, replica)
  labels = picture.device_labels(plan)
  held = sorted(re.match(r"(\w+) · part (\d)/2 \(replica (\d)\)", text).groups()
                for d in labels for _, text in labels[d])
  assert held == sorted(itertools.product(stages, "01", "01")), labels
  assert len(labels) == len(held), labels
  if importlib.util.find_spec("matplotlib"):
    devices = config["cluster.devices_per_worker"]
    assert run.parallel.draw(str(tmp_path / "plan.png")) == (round((1.6 + 2.4 * devices) * 100),
                                                             round((1.4 + 1.6) * 100))


# (TP 2 x DP 2 across 2 workers is the stage-less case of the one below)
@pytest.mark.parametrize("layout,devices,stages,config,rtol", [
    # ZeRO v1 across the workers: the learned positions' gradient is sparse (tf.gather), so
    # wpe stays unowned (its slots on every copy); every other variable has an owner
    ("DP 2 x PP 2 x TP 2, 4 micro-batches, ZeRO v1, checkpointing: 2 workers x 4", 4, 2,
     {"pipeline.num_micro_batch": 4, "gradient_checkpoint.type": "auto", "zero.level": "v1"},
     1e-5),
    # replicated stages (stage functions), GPT-2's step clipped by the global norm
    ("DP 2 x PP 2, 4 micro-batches, ZeRO v2: 2 workers x 2", 2, -2,
     {"pipeline.num_micro_batch": 4, "zero.level": "v2"}, 1e-5),
])
def test_the_3d_recipe_across_workers_trains_the_local_model(tmp_path, layout, devices, stages,
                                                             config, rtol):
  """Each worker holds one replica of the tensor-parallel (and pipelined) model and feeds
  half of every step's rows; the gradients are all-reduced across the workers."""
  local = _local(2)
  np.savez(tmp_path / "data.npz", context=_data()[0])
  np.savez(tmp_path / "initial.npz", **local.initial)
  worker = os.path.join(os.path.dirname(__file__), "workers", "tp_worker.py")
  out = launch(["--num_workers", "2", "--gpu_per_worker", str(devices), "--log_dir",
                str(tmp_path / "logs"), worker, str(tmp_path), str(STEPS), str(ROWS),
                str(stages), json.dumps(config)], timeout=400)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  clients = [dict(np.load(p)) for p in sorted(tmp_path.glob("client*.npz"))]
  assert len(clients) == 2, layout
  assert not any("task:1" in d for d in clients[0]["__devices__"][:2 * stages])
  if config.get("zero.level"):
    owned = set(clients[0]["__owned__"])           # the same on both workers
    assert owned == set(clients[1]["__owned__"]), owned
    assert any("wte" in n for n in owned) and not any("wpe" in n for n in owned), owned
  losses = np.mean([c["__loss__"] for c in clients], axis=0)   # each: the mean of its half
  np.testing.assert_allclose(losses, [f["loss"] for f in local.fetched], rtol=rtol, atol=rtol)
  for c in clients:
    for name, value in local.variables.items():
      np.testing.assert_allclose(c[name], value, rtol=rtol, atol=rtol, err_msg=name)


def _saved_or_restored(stage, config, directory, initial=None):
  """The LM under ``config`` (None: the local script): trained STEPS steps from ``initial``
  and saved to ``directory``, or (``initial`` None) restored from it; its whole values."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    if config is not None:
      epl.init(epl.Config(config))
    t = _build(stage, 2)
    variables = tf.global_variables()
    with tf.Session() as sess:
      if initial is None:
        tf.train.Saver().restore(sess, tf.train.latest_checkpoint(str(directory)))
        return sm.whole_values(sess, variables)
      sess.run(tf.global_variables_initializer())
      sm.load_whole(sess, variables, initial)
      data = _data()[0]
      for s in range(STEPS):
        sess.run(t["train_op"], {t["inputs"][0]: data[s * ROWS:(s + 1) * ROWS]})
      tf.train.Saver().save(sess, str(directory / "model.ckpt"),
                            global_step=tf.train.get_global_step())
      return sm.whole_values(sess, variables)


def test_a_3d_checkpoint_restores_into_the_local_script_and_a_data_parallel_layout(tmp_path):
  """DP 2 x PP 2 x TP 2 with ZeRO v1 saves the local script's checkpoint: every weight
  whole, every Adam slot once."""
  local = _local(2)
  saved = _saved_or_restored(_tp_stages, dict(RECIPE, **{"zero.level": "v1"}), tmp_path,
                             local.initial)
  assert saved["global_step"] == STEPS
  for name, value in local.variables.items():
    np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
  for stage, config in ((lambda i: contextlib.nullcontext(), None),
                        (lambda i: epl.replicate(1, name="dp"),
                         {"cluster.devices_per_worker": 2})):
    restored = _saved_or_restored(stage, config, tmp_path)
    assert sorted(restored) == sorted(saved)
    for name, value in saved.items():
      np.testing.assert_array_equal(restored[name], value, err_msg=name)


def _held(stage, config):
  run = sm.train(lambda: _build(stage, 2), _data(), 1, ROWS, config=epl.Config(config),
                 measure_memory=True)
  devices = sorted(d for d in run.memory.devices() if d.startswith("/device:") and
                   not d.endswith("CPU:0"))        # the accelerators, not the host
  return [run.memory.held(d) for d in devices]


def test_tensor_parallel_and_zero_divide_what_each_device_holds():
  """epl.memory per device: TP 2 holds about half of DP's variables (each block's weights
  and their Adam slots are cut in 2; layer norms and row-parallel biases are whole, on the
  first part); ZeRO v1 over the 2 replicas also halves the slots."""
  dp = _held(lambda i: epl.replicate(1, name="dp"), {"cluster.devices_per_worker": 2})
  tp = _held(lambda i: epl.split(2, name="tp"), {"cluster.devices_per_worker": 4})
  zero = _held(lambda i: epl.split(2, name="tp"), {"cluster.devices_per_worker": 4,
                                                   "zero.level": "v1"})
  assert len(dp) == 2 and len(tp) == 4 and dp[0] == dp[1] > 0
  assert max(tp) <= 0.6 * dp[0] and min(tp) >= 0.4 * dp[0], (tp, dp)
  assert max(zero) <= 0.45 * dp[0], (zero, dp)          # weights / 2 + slots / 4
  assert sum(zero) < 0.7 * sum(tp), (zero, tp)


def test_heads_that_do_not_divide_over_the_parts_run_gathered_and_the_strict_key_says_why():
  """2 heads over 4 parts: the reshape into heads runs on the gathered value (the same model,
  listed in the plan with the reason); split.gather_fallback "refuse" names it."""
  run = _parity(lambda i: epl.split(4, name="tp"), {"cluster.devices_per_worker": 4}, heads=2)
  reasons = [g.reason for g in run.parallel.plan.gathers if g.in_step]
  assert reasons and all("every part must hold whole heads" in r for r in reasons), reasons
  with pytest.raises(epl.errors.PlanError, match=r"(?s)gather_fallback is \"refuse\".*2 heads "
                                                 r"of 8: every part must hold whole heads; "
                                                 r"give epl.split a device_count"):
    sm.train(lambda: _build(lambda i: epl.split(4, name="tp"), 2), _data(), 1, ROWS,
             config=epl.Config({"cluster.devices_per_worker": 4,
                                "split.gather_fallback": "refuse"}))
