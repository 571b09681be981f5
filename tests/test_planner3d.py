"""The 3D planner (#51): transformer shapes, the cost model, the search, Megatron's table.

Pure Python (no TensorFlow): every number here is computed from the published shapes and
the cluster description, none is copied from a run of the planner.
"""
import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from epl.plan.auto.cost3d import Layout, check, price, try_price
from epl.plan.auto.errors import PlannerError
from epl.plan.auto.search3d import (candidates, fit_recompute, megatron_layout, megatron_table,
                                    plan_3d, plan_config)
from epl.plan.auto.transformer import (MEGATRON_TABLE, SHAPES, Transformer, megatron_rows,
                                       selene, shape)

# Narayanan et al. 2021, table 1: the parameter counts (billions) of the scaling table's rows
PUBLISHED_PARAMETERS = (1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0)


def test_published_shapes_have_their_published_parameter_counts():
  for row, billions in zip(MEGATRON_TABLE, PUBLISHED_PARAMETERS):
    assert round(SHAPES[row[0]].parameters / 1e9 + 1e-9, 1) == pytest.approx(billions, abs=0.051), row[0]
  assert SHAPES["gpt3-175b"].parameters / 1e9 == pytest.approx(175, rel=0.01)
  assert SHAPES["gpt3-13b"].parameters / 1e9 == pytest.approx(13, rel=0.05)
  assert SHAPES["gpt3-6.7b"].parameters / 1e9 == pytest.approx(6.7, rel=0.03)
  assert SHAPES["gpt2-1.5b"].parameters / 1e9 == pytest.approx(1.5, rel=0.06)


def test_flops_and_activations_agree_with_the_papers_formulas():
  g = SHAPES["megatron-76b"]
  b = 3
  # eq. 3 = 4 forward passes of the blocks (forward, 2 x backward, recompute) + 3 of the logits
  ours = 4 * g.layers * g.flops_per_block(b) + 3 * g.flops_head(b)
  assert g.megatron_flops(b) == pytest.approx(ours, rel=1e-12)
  s, h, a = g.seq, g.hidden, g.heads
  # Korthikanti et al.: 34 s b h + 5 a s^2 b per block without TP; 10 + 24 / t + 5as/ht with
  assert g.activation_bytes(b) == pytest.approx(s * b * h * 34 + 5 * a * s * s * b)
  assert g.activation_bytes(b, tp=8) == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))


def test_bad_shapes_and_layouts_are_refused_with_the_reason():
  with pytest.raises(PlannerError, match="hidden=100 is not a multiple of heads=3"):
    Transformer("x", layers=2, hidden=100, heads=3, seq=8, vocab=10)
  with pytest.raises(PlannerError, match="no transformer 'nope'"):
    shape("nope")
  g, c = SHAPES["megatron-1.7b"], selene(32)
  assert "the cluster has 32" in check(g, c, Layout(2, 2, 2, 1), 512)
  assert "does not divide the 24 heads" in check(g, c, Layout(16, 1, 2, 1), 512)
  assert "not a whole number" in check(g, c, Layout(1, 1, 32, 3), 512)
  assert "dp is 1" in check(g, selene(8), Layout(8, 1, 1, 1, zero="v1"), 512)
  with pytest.raises(PlannerError, match="recompute names 1 stages of 2"):
    price(g, c, Layout(1, 2, 16, 1, recompute=(True,)), 512)


def test_each_knob_moves_time_and_memory_the_way_it_should():
  g, c, batch = SHAPES["megatron-18b"], selene(256), 1024
  base = price(g, c, Layout(8, 2, 16, 1), batch)
  again = price(g, c, Layout(8, 2, 16, 1, recompute=(True, True)), batch)
  assert again.step_s > base.step_s and max(again.memory) < max(base.memory)
  for level in ("v0", "v1", "v2"):
    zero = price(g, c, Layout(8, 2, 16, 1, zero=level), batch)
    assert max(zero.memory) < max(base.memory)
  off = price(g, c, Layout(8, 2, 16, 1, zero="v1", offload=True), batch)
  assert max(off.memory) < max(price(g, c, Layout(8, 2, 16, 1, zero="v1"), batch).memory)
  assert off.parts["optimizer"] > base.parts["optimizer"]
  gpipe = price(g, c, Layout(8, 2, 16, 1, schedule="gpipe"), batch)
  assert gpipe.memory[0] > base.memory[0] and gpipe.step_s == pytest.approx(base.step_s)
  # 1F1B: the first stage holds the most micro-batches in flight
  deep = price(g, c, Layout(8, 4, 8, 1), batch)
  assert deep.memory[0] > deep.memory[1] > deep.memory[2]
  # TP across nodes is priced at the network's bandwidth, not NVLink's
  assert price(g, c, Layout(16, 1, 16, 1), batch).parts["tp"] > base.parts["tp"] * 2
  # more stages, same micro-batches per copy: a larger bubble
  assert price(g, c, Layout(8, 4, 8, 2), batch).parts["bubble"] > base.parts["bubble"]


def test_recomputation_is_the_fewest_leading_stages_and_no_subset_is_faster():
  g, batch = SHAPES["megatron-39b"], 256
  c = dataclasses.replace(selene(64), memory=40e9)
  layout = Layout(8, 4, 2, 1)
  chosen = fit_recompute(g, c, layout, batch)
  assert chosen is not None and any(chosen.layout.recompute)
  k = sum(chosen.layout.recompute)
  assert chosen.layout.recompute == (True,) * k + (False,) * (4 - k)
  for subset in itertools.product((False, True), repeat=4):
    other = price(g, c, dataclasses.replace(layout, recompute=subset), batch)
    if other.fits:
      assert other.step_s >= chosen.step_s - 1e-12


def test_the_search_finds_the_exhaustive_optimum_on_a_small_case():
  g = Transformer("small", layers=8, hidden=2048, heads=16, seq=1024, vocab=32000)
  c = dataclasses.replace(selene(16), memory=24e9)
  plan = plan_3d(g, c, 64)
  best = None
  for layout in candidates(g, c, 64):
    for subset in itertools.product((False, True), repeat=layout.pp):
      priced = try_price(g, c, dataclasses.replace(layout, recompute=subset), 64)
      if priced is not None and priced.fits and (best is None or priced.step_s < best):
        best = priced.step_s
  assert plan.best.fits and plan.best.step_s == pytest.approx(best, rel=1e-12)


def test_a_budget_data_parallelism_meets_gives_data_parallelism_and_a_tight_one_does_not():
  g = SHAPES["gpt2-1.5b"]
  roomy = plan_3d(g, selene(8), 64)
  assert (roomy.best.layout.tp, roomy.best.layout.pp) == (1, 1)
  tight = plan_3d(g, selene(8), 64, memory=12e9)
  assert tight.best.layout.tp * tight.best.layout.pp > 1 or tight.best.layout.zero or \
      any(tight.best.layout.recompute)
  assert max(tight.best.memory) <= 12e9 * selene(8).usable_memory
  with pytest.raises(PlannerError, match="no layout of gpt3-175b"):
    plan_3d(SHAPES["gpt3-175b"], selene(8), 64)


def test_megatron_scaling_table_predicted_and_beaten():
  """#51's anchor: for each row, Megatron's configuration priced by the cost model lies
  within 25 % of its published TFLOP/s per GPU and fits; the plan chosen fits and is no
  slower under the same cost model."""
  rows = megatron_table()
  assert len(rows) == len(MEGATRON_TABLE) >= 6
  for row in rows:
    assert abs(row["error"]) <= 0.25, (row["model"], row["error"])
    assert row["megatron"].fits, row["model"]
    assert row["plan"].best.fits, row["model"]
    assert row["plan"].best.step_s <= row["megatron"].step_s * (1 + 1e-12), row["model"]


def test_the_175b_plan_on_1024_gpus_is_a_3d_layout_and_its_config_names_it():
  plan = plan_3d(SHAPES["gpt3-175b"], selene(1024), 1536)
  layout = plan.best.layout
  assert layout.tp > 1 and layout.pp > 1 and layout.dp > 1 and layout.gpus == 1024
  config = plan_config(plan.best)
  assert config["pipeline.num_micro_batch"] == 1536 // (layout.dp * layout.rows)
  assert config.get("zero.level", "") == layout.zero
  assert plan.considered > 100


def test_plan_config_names_checkpointing_as_the_leading_taskgraphs():
  g = SHAPES["megatron-39b"]
  c = dataclasses.replace(selene(64), memory=40e9)
  priced = fit_recompute(g, c, Layout(8, 4, 2, 1), 256)
  config = plan_config(priced)
  k = sum(priced.layout.recompute)
  assert config["gradient_checkpoint.type"] == "auto"
  assert config.get("gradient_checkpoint.end_taskgraph", 3) == k - 1
  import epl
  epl.Config(config)                      # every key is one epl knows, with a valid value


def test_megatron_layout_is_the_tables_configuration():
  for row in megatron_rows():
    layout = megatron_layout(row)
    assert (layout.tp, layout.pp, layout.gpus) == (row["tp"], row["pp"], row["gpus"])


def test_epl_plan_prints_and_draws_a_transformer_plan(tmp_path):
  png = tmp_path / "plan.png"
  out = subprocess.run([sys.executable, "-m", "epl.plan.auto.cli", "--transformer", "gpt3-175b",
                        "--gpus", "1024", "--gbs", "1536", "--png", str(png)],
                       capture_output=True, text=True, check=True).stdout
  assert "TP 8 x PP" in out and "epl.Config:" in out and png.stat().st_size > 1000
  data = json.loads(subprocess.run(
      [sys.executable, "-m", "epl.plan.auto.cli", "--transformer", "gpt2-1.5b", "--gpus", "8",
       "--gbs", "64", "--json"], capture_output=True, text=True, check=True).stdout)
  assert data["tp"] * data["pp"] * data["dp"] == 8
  bad = subprocess.run([sys.executable, "-m", "epl.plan.auto.cli", "--transformer", "gpt3-175b",
                        "--gpus", "8", "--gbs", "64"], capture_output=True, text=True)
  assert bad.returncode == 2 and "no layout of gpt3-175b" in bad.stderr


# --- the planner's own transformer profiles (committed: no DAPPLE data needed) ------------
from epl.plan.auto import plan_pipeline                                    # noqa: E402
from epl.plan.auto.profile import Profile                                  # noqa: E402
from epl.plan.auto.transformer import (ANALYTIC_PROFILES, MEASURED_PROFILE,  # noqa: E402
                                       measured, profile_path, to_profile)


def test_the_committed_analytic_profiles_are_what_the_code_makes():
  for name, shape_name, cluster, rows in ANALYTIC_PROFILES:
    with open(profile_path(name)) as f:
      assert f.read() == to_profile(SHAPES[shape_name], cluster(), rows).dump(), name
  profile = Profile.load(profile_path("gpt3-6.7b-a100-pbs-1"))
  g = SHAPES["gpt3-6.7b"]
  assert [n.name for n in profile.nodes] == ["embed"] + ["h%d" % i for i in range(32)] + ["head"]
  assert sum(n.parameter_bytes for n in profile.nodes) == pytest.approx(4 * g.parameters)


def test_the_committed_measured_profile_is_epl_profilers_per_block():
  profile = Profile.load(profile_path(MEASURED_PROFILE))
  names = [n.name for n in profile.nodes]
  assert names[:7] == ["h%d" % i for i in range(6)] + ["lm_head"]
  block = Transformer("l6", layers=6, hidden=256, heads=4, seq=32, vocab=512)
  times = sorted(n.forward_ms + n.backward_ms for n in profile.nodes[:6])
  assert times[-1] < 2 * times[0]                         # six equal blocks, measured
  for node in profile.nodes[:6]:
    assert node.parameter_bytes == 4 * block.block_parameters
    assert node.activation_bytes == 4 * 8 * 32 * 256          # 8 rows x seq x hidden, float32
  timed = measured(block, profile, rows=8)
  assert timed.measured_block_s == pytest.approx(
      sum(n.forward_ms for n in profile.nodes[:6]) / 6 / 1000 / 8)
  cpu = dataclasses.replace(selene(8), name="cpu", memory=64e6, efficiency=1.0)
  plan = plan_3d(timed, cpu, 64, max_tp=4)
  assert plan.best.fits


@pytest.mark.parametrize("name,pbs,devices", [("gpt2-1.5b-v100-pbs-4", 4, "2x4"),
                                               (MEASURED_PROFILE, 8, "1x8")])
@pytest.mark.parametrize("model", ["dapple", "simulate"])
def test_pipeline_planner_on_transformer_profiles(name, pbs, devices, model):
  """The planner's generic promises on its own profiles: a tighter memory limit is kept and
  gives more stages, never slower than pure data parallelism, the same input the same plan,
  ``accept`` keeps to what it allows."""
  path = profile_path(name)
  gbs = 16 * pbs
  free = plan_pipeline(path, pbs, gbs, devices, cost_model=model)
  assert free.speedup >= free.data_parallel_speedup * (1 - 1e-9)
  assert plan_pipeline(path, pbs, gbs, devices, cost_model=model) == free
  limit = 0.6 * max(free.peak_memory_per_device)
  tight = plan_pipeline(path, pbs, gbs, devices, cost_model=model, memory=limit)
  assert max(tight.peak_memory_per_device) <= limit
  assert len(tight.stages) > len(free.stages)
  assert tight.predicted_iteration_s >= free.predicted_iteration_s * (1 - 1e-12)
  with pytest.raises(PlannerError, match="nothing fits"):
    plan_pipeline(path, pbs, gbs, devices, cost_model=model, memory=1e3)
  two = plan_pipeline(path, pbs, gbs, devices, cost_model=model,
                      accept=lambda counts: len(counts) == 2)
  assert len(two.stages) in (1, 2)                  # 2 stages, or data parallelism (faster)
  assert len(two.stages) == 2 or two.speedup == pytest.approx(two.data_parallel_speedup)
