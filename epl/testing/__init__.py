"""Test helpers shipped with epl: ``assert_parity`` runs a model locally and under epl;
``race_free_step`` runs a local step with all its reads before its updates."""
from epl.testing.parity import ParityResult, assert_parity, run_model  # noqa: F401
from epl.testing.reference import race_free_step, step_cut  # noqa: F401
