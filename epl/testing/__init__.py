"""Test helpers shipped with epl: ``assert_parity`` runs a model locally and under epl."""
from epl.testing.parity import ParityResult, assert_parity, run_model  # noqa: F401
