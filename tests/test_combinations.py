"""The feature-combination matrix (issue: the large-model recipe in one job): every pair of
epl's features (tests/matrix_model.py) trains the local model -- 1e-5, AMP within its float16
tolerance -- or is refused before training with its reason. ``EXPECTED`` is the matrix; the
user guide prints it (test_the_user_guide_prints_this_matrix), and the recipe's whole set
runs at once across two workers.
"""
import glob
import itertools
import os
import re

import numpy as np
import pytest

import epl
from epl.errors import NotImplementedYetError
from tests import matrix_model as mm
from tests import split_models as sm
from tests.test_multiworker import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, STEPS = 10, 2          # 10 rows: uneven pieces (4 copies x M) wherever a stage is bridged
AMPLIFY = 20                     # ms: the race amplifier's delay (testing.race_delay_ms)
FP16_RTOL = 3e-3                 # tests/test_amp.py: AMP O1 against the float32 model
WORKS = "works"
ONE_KEY = "one key"              # ZeRO v1 / v2: two values of zero.level
REFUSED = {}   # pair -> the refusal's reason (a regex of its message); none left since #51
PAIRS = list(itertools.combinations(mm.FEATURES, 2))


def expected(pair):
  if set(pair) == {"zero_v1", "zero_v2"}:
    return ONE_KEY
  return "refused" if pair in REFUSED else WORKS


def _data():
  return mm.data(ROWS * STEPS + 3)


def _local(features, variant=mm.Variant()):
  return sm.train(lambda: mm.build(features, local=True, variant=variant), _data(), STEPS,
                  ROWS, race_free=True, session_first=variant.session_first)


def _close(got, want, features, what):
  rtol = FP16_RTOL if "amp" in features else 1e-5
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=what)


def train_cell(pair, variant, local, amplify=AMPLIFY):
  """The pair under epl, written as ``variant`` says, from ``local``'s weights; the race
  amplifier on (``amplify`` ms)."""
  config = dict(mm.config(pair), **{"testing.race_delay_ms": amplify})
  return sm.train(lambda: mm.build(pair, variant=variant), _data(), STEPS, ROWS,
                  config=epl.Config(config), initial=local.initial,
                  session_first=variant.session_first)


def check_cell(pair, variant, amplify=AMPLIFY):
  """One cell, one variant: the local model (or the refusal the matrix expects)."""
  local = _local(pair, variant)
  if pair in REFUSED:
    with pytest.raises(NotImplementedYetError, match=REFUSED[pair]):
      train_cell(pair, variant, local, amplify)
    return None
  run = train_cell(pair, variant, local, amplify)
  for got, want in zip(run.fetched, local.fetched):
    _close(got["loss"], want["loss"], pair, "loss (%s)" % variant)
  for name, value in local.variables.items():
    _close(run.variables[name], value, pair, "%s (%s)" % (name, variant))
  assert len(run.parallel.plan.copies) >= 2          # data parallel around every layout
  return run


ONE_WORKER = [p for p in PAIRS if "dp_workers" not in p and expected(p) != ONE_KEY]


@pytest.mark.parametrize("pair", ONE_WORKER, ids="+".join)
def test_a_pair_on_one_worker_trains_the_local_model_or_is_refused(pair):
  """Each pair written one of the ways users write it (``mm.variant_for``: consecutive cells
  walk the step written 3 ways x ref / resource x SGD / Adam x session first or not;
  bench/matrix.py runs every cell every way), under the race amplifier."""
  check_cell(pair, mm.variant_for(ONE_WORKER.index(pair)))


def _across_workers(features, tmp_path, variant=mm.Variant()):
  local = _local(features, variant)
  data = _data()
  np.savez(tmp_path / "data.npz", x=data[0], y=data[1])
  np.savez(tmp_path / "initial.npz", **local.initial)
  worker = os.path.join(ROOT, "tests", "workers", "matrix_worker.py")
  out = launch(["--num_workers", "2", "--gpu_per_worker", str(mm.replica_devices(features)),
                "--log_dir", str(tmp_path / "logs"), worker, str(tmp_path), ",".join(features),
                str(STEPS), str(ROWS), variant.code(), str(AMPLIFY)], timeout=int(os.environ.get("CELL_TIMEOUT", "300")))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  clients = [dict(np.load(p)) for p in sorted(glob.glob(str(tmp_path / "client*.npz")))]
  assert len(clients) == 2
  losses = np.mean([c["__loss__"] for c in clients], axis=0)   # each: the mean of its half
  _close(losses, [f["loss"] for f in local.fetched], features, "loss")
  for c in clients:
    for name, value in local.variables.items():
      _close(c[name], value, features, name)


ACROSS = [p for p in PAIRS if "dp_workers" in p]


@pytest.mark.parametrize("pair", ACROSS, ids="+".join)
def test_a_pair_with_data_parallelism_across_workers_trains_the_local_model(pair, tmp_path):
  assert expected(pair) == WORKS
  _across_workers(pair, tmp_path, mm.variant_for(len(ONE_WORKER) + ACROSS.index(pair)))


CLIPPED = mm.Variant("compute_gradients")


@pytest.mark.parametrize("features,variant", [
    (("dp_workers", "zero_v2", "apply_groups"), mm.Variant()),
    (("dp_workers", "zero_v1", "offload"), mm.Variant()),
    (("dp_workers", "zero_v1", "mixed"), mm.Variant()),
    (("dp_workers", "zero_v1", "pipeline"), CLIPPED),
    (("dp_workers", "zero_v2", "pipeline", "split"), CLIPPED)],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else str(v))
def test_zero_cells_built_in_51_across_workers_train_the_local_model(features, variant,
                                                                     tmp_path):
  """ZeRO v2 x num_apply_group across 2 workers: each worker groups the updates of the
  weights its copies own, the others arrive by the owners' broadcast. ZeRO v1 x offload
  (ZeRO-Offload): each worker's host keeps the optimizer state of what it owns. ZeRO v1 x
  stages on different device counts: a narrower stage's owners are copies that run it.
  ZeRO x stage functions (pipeline; split stages) with the step clipped by the global norm:
  the norm reads every gradient, so each is all-reduced (the reduce-scatter to owners would
  leave each worker a partial norm) -- found from the calls' sums, not the user's gradient."""
  _across_workers(features, tmp_path, variant)


def test_the_recipe_set_at_once_across_workers_trains_the_local_model(tmp_path):
  """DP across 2 workers x pipeline with micro-batches x split x ZeRO v1 x AMP O1 x
  gradient checkpointing, in one job."""
  _across_workers(("dp_workers", "pipeline", "split", "zero_v1", "amp", "checkpointing"),
                  tmp_path)


def matrix_markdown():
  """The matrix as the user guide prints it."""
  names = [mm.NAMES[f] for f in mm.FEATURES]
  short = {WORKS: "yes", "refused": "refused", ONE_KEY: "-"}
  rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for a in mm.FEATURES:
    cells = []
    for b in mm.FEATURES:
      pair = tuple(sorted((a, b), key=mm.FEATURES.index))
      cells.append("" if a == b else short[expected(pair)])
    rows.append("| %s | %s |" % (mm.NAMES[a], " | ".join(cells)))
  return "\n".join(rows)


def test_the_user_guide_prints_this_matrix():
  guide = open(os.path.join(ROOT, "docs", "user_guide.md")).read()
  assert matrix_markdown() in guide, "docs/user_guide.md: paste\n" + matrix_markdown()
  for pair, reason in REFUSED.items():
    assert re.search(re.escape(mm.NAMES[pair[0]]) + r".*" + re.escape(mm.NAMES[pair[1]]),
                     guide), pair
