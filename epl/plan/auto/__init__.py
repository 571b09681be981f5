"""The automatic pipeline planner (DAPPLE's planner, re-done in pure Python; no TensorFlow).

Input: a layer profile in PipeDream/DAPPLE's text format, the batch size it was taken at
(``pbs``), the global batch size (``gbs``) and the devices. Output: a ``PipelinePlan``.

API for the rest of epl::

  plan_pipeline(profile, pbs, gbs, devices, cost_model="dapple", memory=None, speeds=None,
                parameter_factor=4.0, schedule="1f1b", progress=None) -> PipelinePlan
      profile: Profile, path, or States; devices: DeviceSpec or "8,16" / "2x8";
      cost_model: "dapple" | "dapple-published" | "simulate"; memory: bytes per device;
      speeds: relative speed per device; progress: callable(phase, done, total, detail)
      (epl.plan.auto.cli.Progress prints it). Raises PlannerError (an epl.errors.PlanError).

  PipelinePlan (frozen): stages (tuple of Stage), micro_batches, predicted_iteration_s,
      speedup (over one device), peak_memory_per_device (bytes, by device id),
      cost_model, data_parallel_speedup, schedule; .replicas, .to_json_dict(), .to_json().
  Stage (frozen): first_state, last_state, layers (profile node ids, topological order),
      devices (global ids, server-major), compute_ms, parameter_bytes.

  balance_stages(layer_costs, num_stages) -> ((first, last), ...)
      contiguous split of per-layer costs into k stages minimising the largest (exact); the
      split for ``auto.auto_parallel`` with ``pipeline.num_stages`` (used by
      ``epl/runtime/auto_stages.py``), given profiled per-layer costs.

  Profile.parse(text) / Profile.load(path) / profile.dump()     the profile format
  build_states(profile) -> States                               PipeDream's cuts
  DeviceSpec(servers, intra_bandwidth, inter_bandwidth, allreduce_bandwidth),
      DeviceSpec.parse("8,16"), DeviceSpec.from_seps([8, 16]), DeviceSpec.grid(2, 8)
  get_model(name) -> cost model; Workload(profile, pbs, gbs, spec, ...) to score plans.

Modules: profile (format), states (cuts), devices (network rules), workload (arrays the
models read), dapple / simulate (cost models, cost.py: their interface), layouts + dp (stages
along device orders), placements (DAPPLE's per-stage fresh/append/scatter DP), refine (local
search), search (plan_pipeline), balance, pipeline (result types), render + cli (epl-plan).

Example:
  >>> from epl.plan.auto import plan_pipeline
  >>> plan = plan_pipeline("vgg-19-pbs-32.txt", pbs=32, gbs=2048, devices="8,16")
  >>> plan.replicas, round(plan.speedup, 1)
  ((15, 1), 14.0)
"""
import importlib

_EXPORTS = {
    "plan_pipeline": "epl.plan.auto.search",
    "PipelinePlan": "epl.plan.auto.pipeline",
    "Stage": "epl.plan.auto.pipeline",
    "balance_stages": "epl.plan.auto.balance",
    "Profile": "epl.plan.auto.profile",
    "Node": "epl.plan.auto.profile",
    "build_states": "epl.plan.auto.states",
    "States": "epl.plan.auto.states",
    "DeviceSpec": "epl.plan.auto.devices",
    "PlannerError": "epl.plan.auto.errors",
    "get_model": "epl.plan.auto.models",
    "Estimate": "epl.plan.auto.cost",
    "Workload": "epl.plan.auto.workload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  # Lazy: ``epl-plan --help`` imports this package and must not pay for numpy and the search.
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError("module 'epl.plan.auto' has no attribute %r" % name)
