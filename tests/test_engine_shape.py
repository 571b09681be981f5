"""The engine's shape: the plan drives the rewrite, the pass list is real, no import cycle,
modules stay small, the TF hooks are reversible."""
import ast
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
import epl.passes
from epl import _tf_compat as compat
from epl.plan.build import build_plan
from epl.plan.plan import ParallelPlan
from epl.runtime import driver
from tests import models

EPL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "epl")


# ---- the plan is the whole input -----------------------------------------------------------
def _model_graph(config, model, stages):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(1)
    epl.init(epl.Config(config))
    data = models.regression_data(64)
    x, y = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).batch(4).repeat()).get_next()
    strategies = [lambda i=i: epl.replicate(1, name="stage_%d" % i) for i in range(stages)]
    from epl.testing.parity import Stages
    loss = model(x, y, Stages(strategies))
    step = tf.train.get_or_create_global_step()
    tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  state = epl.Env.get()._state
  return g, build_plan(g, state.recorder, state.config, state.cluster)


def _nodes(graph):
  return sorted((n.name, n.op, n.device, tuple(n.input), n.SerializeToString(deterministic=True))
                for n in graph.as_graph_def().node)


@pytest.mark.parametrize("config,model,stages", [
    ({"cluster.devices_per_worker": 2}, models.mlp, 1),                          # DP
    ({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 4},
     models.mlp_two_stages, 2),                                                  # pipeline
    ({"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2},
     models.mlp_two_stages, 2),                                                  # hybrid
], ids=["dp", "pipeline", "hybrid"])
def test_a_reloaded_plan_drives_an_identical_rewrite(config, model, stages):
  first, plan = _model_graph(config, model, stages)
  second, _ = _model_graph(config, model, stages)       # the same model, built again
  assert _nodes(first) == _nodes(second)
  reloaded = ParallelPlan.from_json(plan.to_json())
  assert reloaded == plan
  driver.run_passes(first, plan, 0)
  driver.run_passes(second, reloaded, 0)
  assert len(first.get_operations()) > len(second.get_operations()) / 2 > 0
  assert _nodes(first) == _nodes(second)


def _split_graph():
  from tests import split_models as sm
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 4,
                         "cluster.colocate_split_and_replicate": True}))
    trunk, head = sm.scopes(2, 2)
    sm.classifier(50, trunk, head)
  state = epl.Env.get()._state
  return g, build_plan(g, state.recorder, state.config, state.cluster)


def test_a_reloaded_split_plan_drives_an_identical_rewrite():
  first, plan = _split_graph()
  second, _ = _split_graph()
  assert plan.parts and plan.crossings
  reloaded = ParallelPlan.from_json(plan.to_json())
  assert reloaded == plan
  driver.run_passes(first, plan, 0)
  driver.run_passes(second, reloaded, 0)
  assert _nodes(first) == _nodes(second)


def test_rewrite_runs_the_pass_list_in_its_order(monkeypatch):
  ran = []

  def recording(run):
    def wrapper(ctx):
      ran.append(run.__name__)
      return run(ctx)
    wrapper.__name__ = run.__name__
    return wrapper
  original = epl.passes.PASSES
  monkeypatch.setattr(epl.passes, "PASSES", tuple(recording(p) for p in original))
  g, plan = _model_graph({"cluster.devices_per_worker": 2}, models.mlp, 1)
  pg = driver.run_passes(g, plan, 0)
  assert ran == [p.__name__ for p in original]
  assert list(pg.results) == ran
  assert ran[0] == "analyze" and ran[-2:] == ["race_delay", "writes_after_reads"]


# ---- layers ------------------------------------------------------------------------------
def _modules():
  out = {}
  for root, _, files in os.walk(EPL):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(root, f)
        rel = os.path.relpath(path, os.path.dirname(EPL))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _imports(path, modules):
  """epl modules imported by ``path`` (module level and inside functions)."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + ["%s.%s" % (node.module, a.name) for a in node.names]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name and name != "epl":
        found.add(name)
  return found


def test_no_import_cycle_in_epl():
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        cycles.append(stack[stack.index(n):] + [n])
      elif n not in state:
        visit(n)
    stack.pop()
    state[m] = "done"
  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
  # below the public API nothing looks state up through epl.Env
  def reads_env(path):
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and
               n.value.id in ("Env", "cls") and n.attr in ("_current", "get")
               for n in ast.walk(ast.parse(open(path).read())))
  readers = sorted(m for m, p in modules.items() if reads_env(p))
  assert readers == ["epl.entry", "epl.env"], readers           # (env.py defines it)


def test_no_module_over_400_lines():
  long = {m: n for m, p in _modules().items() if (n := len(open(p).read().splitlines())) > 400}
  assert not long, long


def test_no_function_over_60_lines():
  """A function a newcomer can read in one screen: none in epl/ is over 60 lines."""
  long = {}
  for m, p in _modules().items():
    for node in ast.walk(ast.parse(open(p).read())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (n := node.end_lineno - node.lineno + 1) > 60:
          long["%s.%s" % (m, node.name)] = n
  assert not long, long


# ---- hooks -------------------------------------------------------------------------------
def test_the_hook_table_the_docs_describe_is_the_one_installed():
  """_tf_compat's docstring says how many hooks there are and lists every hooked function;
  the user guide says the same count: all three agree with ``_HOOKS``."""
  import re
  from epl import _tf_compat as compat
  words = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen"]
  count = len(compat._HOOKS)  # pylint: disable=protected-access
  said = re.search(r"\* (\w+) hooks \(the ``_HOOKS`` table\)", compat.__doc__).group(1)
  assert words.index(said) + 10 == count, (said, count)
  guide = open(os.path.join(os.path.dirname(EPL), "docs", "user_guide.md")).read()
  assert re.search(r"\b%s documented hooks" % words[count - 10], guide), count
  table = compat.__doc__.split("why\n")[1]
  for owner, attr, _ in compat._HOOKS:  # pylint: disable=protected-access
    assert attr.lstrip("_") in table.replace("._", "."), (owner, attr)

def test_hooks_forward_what_they_get():
  """Every hook takes ``*args, **kwargs`` (or TF's own ``**keywords``) and forwards them: none
  re-declares a TF signature, which would narrow TF's API for every caller in the process."""
  import inspect
  from epl import _tf_compat as compat
  for owner, attr, make_wrapper in compat._HOOKS:  # pylint: disable=protected-access
    original = compat._state.ORIGINALS.get((owner, attr), getattr(owner, attr))  # pylint: disable=protected-access
    kinds = [p.kind for p in inspect.signature(make_wrapper(original)).parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD in kinds, (owner, attr, kinds)
    if attr != "_apply_op_helper":            # its TF signature is (op_type_name, name, **kw)
      assert inspect.Parameter.VAR_POSITIONAL in kinds, (owner, attr, kinds)


def test_hooks_are_reversible():
  from tensorflow.python.client import session
  from tensorflow.python.training import optimizer
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config())
  assert compat.installed() and getattr(session.BaseSession.run, "__epl_hook__", False)
  compat.uninstall()
  try:
    assert not compat.installed()
    assert not hasattr(session.BaseSession.run, "__epl_hook__")
    assert not hasattr(optimizer.Optimizer.apply_gradients, "__epl_hook__")
    with tf.Graph().as_default(), tf.Session() as sess:     # plain TF works as before
      assert sess.run(tf.constant(2.0) * 3) == 6.0
  finally:
    with tf.Graph().as_default():
      epl.init(epl.Config())                                  # back for the other tests
  assert compat.installed()


def test_config_is_immutable_and_read_in_one_place():
  c = epl.Config({"pipeline.num_micro_batch": 2})
  with pytest.raises(AttributeError, match="read-only"):
    c.pipeline.num_micro_batch = 7
  assert c.get("pipeline.num_micro_batch") == c.pipeline.num_micro_batch == 2
  with pytest.raises(AttributeError, match="did you mean 'pipeline.num_micro_batch'"):
    c.pipeline.num_micro_batches  # noqa: B018
  import re
  reads = re.compile(r"""environ(?:\.get\(|\[)\s*["']EPL_""")
  readers = sorted(m for m, p in _modules().items() if reads.search(open(p).read()))
  assert readers == [], readers        # epl.config reads every EPL_<SECTION>_<KEY> by its Key


def test_second_init_on_an_annotated_graph_is_refused():
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config())
    with epl.replicate(1, name="stage_0"):
      tf.layers.dense(tf.constant(np.ones([2, 2], np.float32)), 1)
    with pytest.raises(epl.EplError, match=r"epl.init\(\) was already called for this graph, "
                       r"and the TaskGraph\(s\) annotated since \('stage_0' at "
                       r"test_engine_shape.py:\d+\) would be dropped"):
      epl.init(epl.Config())


@pytest.mark.parametrize("mode,warned", [
    ("missing", "has no relocation for _ZN3tsl6random13NoSuchFunctionEv"),
    ("untested", "is not among the versions the hook was tested on (0.0.1); set "
                 "communication.native_hooks_untested_tf to try it"),
])
def test_a_native_hook_that_cannot_go_in_warns_and_the_job_trains(tmp_path, mode, warned):
  """A TF build without the hooks' symbols, or a TF version they were not tested on: epl.init
  warns once per hook, saying what is lost, and the 2-worker job trains without them."""
  import subprocess
  import sys
  root = os.path.dirname(EPL)
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                        "--log_dir", str(tmp_path), os.path.join(root, "tests", "workers",
                                                                  "native_worker.py"), mode],
                       env=env, cwd=root, capture_output=True, text=True, timeout=180)
  text = out.stdout + out.stderr
  assert out.returncode == 0, text[-3000:]
  assert text.count("trained; request ids unique: False, rendezvous released: False") == 2
  assert "could not make TensorFlow's request ids unique (" in text and warned in text and \
      "a step TF rejects as a duplicate request" in text, text[-3000:]
  assert "could not stop TensorFlow keeping every rendezvous" in text, text[-3000:]
  if mode == "untested":                     # the key opts in: the hooks go in
    out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                          "--log_dir", str(tmp_path / "in"), os.path.join(
                              root, "tests", "workers", "native_worker.py"), mode],
                         env=dict(env, EPL_COMMUNICATION_NATIVE_HOOKS_UNTESTED_TF="true"),
                         cwd=root, capture_output=True, text=True, timeout=180)
    assert "trained; request ids unique: True, rendezvous released: True" in out.stdout, \
        out.stdout[-3000:] + out.stderr[-3000:]


def test_tf_hooks_below_python_go_in_and_come_out():
  """The two import-slot hooks of a multi-worker epl.init (epl._tf_compat.native) change only
  libtensorflow_cc's slots, and restore() (compat.uninstall) gives back exactly what was there."""
  from epl._tf_compat import native
  assert not compat.request_ids_unique() and not compat.aborted_rendezvous_released()
  try:
    assert compat.unique_request_ids() is None and compat.release_aborted_rendezvous() is None
    assert compat.request_ids_unique() and compat.aborted_rendezvous_released()
    hooks = dict(native._hooks)  # pylint: disable=protected-access
    for slots in hooks.values():
      assert slots.values() and all(v != slots._original[s]  # pylint: disable=protected-access
                                    for s, v in zip(slots.slots, slots.values()))
    assert isinstance(compat.pinned_rendezvous(), int)   # TF's vector is found and read
  finally:
    native.restore()
  assert not compat.request_ids_unique() and not compat.aborted_rendezvous_released()
  for slots in hooks.values():
    assert slots.values() == [slots._original[s] for s in slots.slots]  # pylint: disable=protected-access
