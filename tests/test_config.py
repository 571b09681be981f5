import pytest

import epl
from epl.config import KEYS, Config
from epl.errors import ConfigError, NotImplementedYetError


def test_defaults_and_attribute_access():
  c = Config(environ={})
  assert c.pipeline.num_micro_batch == 1
  assert c.communication.gradients_reduce_method == "mean"
  assert c.get("cluster.device_place_prefer_intra_node") is True
  assert set(c.to_dict()) == set(KEYS)


def test_every_reference_key_exists():
  reference = """pipeline.num_micro_batch pipeline.num_stages pipeline.strategy
  gradient_checkpoint.type gradient_checkpoint.end_taskgraph gradient_checkpoint.check_gradients
  zero.level offload.level amp.level amp.loss_scale amp.debug_log optimizer.num_apply_group
  cluster.device_place_prefer_intra_node cluster.run_visible_devices
  cluster.colocate_split_and_replicate cluster.devices_per_worker
  communication.num_communicators communication.sparse_as_dense communication.max_splits
  communication.fp16 communication.fp16_scale communication.clip_after_allreduce
  communication.gradients_reduce_method io.slicing io.unbalanced_io_slicing io.drop_last_files
  auto.auto_parallel""".split()
  assert set(reference) <= set(KEYS)


def test_precedence_dict_over_env_over_default():
  env = {"EPL_COMMUNICATION_MAX_SPLITS": "3", "EPL_CLUSTER_DEVICES_PER_WORKER": "4"}
  c = Config({"communication.max_splits": 2}, environ=env)
  assert c.communication.max_splits == 2
  assert c.cluster.devices_per_worker == 4


def test_env_bools_and_case_insensitive_choices():
  c = Config({"communication.gradients_reduce_method": "SUM"},
             environ={"EPL_COMMUNICATION_SPARSE_AS_DENSE": "true"})
  assert c.communication.gradients_reduce_method == "sum"
  assert c.communication.sparse_as_dense is True
  assert Config(environ={"EPL_COMMUNICATION_SPARSE_AS_DENSE": "0"}).communication.sparse_as_dense \
      is False


def test_unknown_key_suggests_closest():
  with pytest.raises(ConfigError, match=r"Unknown epl config key 'pipeline.num_micro_batches': "
                                        r"did you mean 'pipeline.num_micro_batch'\?"):
    Config({"pipeline.num_micro_batches": 2}, environ={})


def test_unknown_env_key_is_an_error():
  with pytest.raises(ConfigError, match=r"Unknown epl config key 'pipeline.num_microbatch' "
                     r"\(from environment variable EPL_PIPELINE_NUM_MICROBATCH\): did you mean "
                     r"'pipeline.num_micro_batch' \(environment variable "
                     r"EPL_PIPELINE_NUM_MICRO_BATCH\)\?"):
    Config(environ={"EPL_PIPELINE_NUM_MICROBATCH": "2"})



def _unbuilt_v1(monkeypatch):
  """Every value of every key is built now: test the refusal with a stand-in that is not."""
  import dataclasses
  from epl import config as config_module
  key = config_module.KEYS["zero.level"]
  monkeypatch.setitem(config_module.KEYS, "zero.level",
                      dataclasses.replace(key, built=("", "v0", "v2")))


def test_an_env_value_not_built_is_refused_naming_the_variable(monkeypatch):
  _unbuilt_v1(monkeypatch)
  with pytest.raises(epl.errors.NotImplementedYetError, match=r"'zero.level'='v1' \(from "
                     r"environment variable EPL_ZERO_LEVEL\): .* remove the variable"):
    Config(environ={"EPL_ZERO_LEVEL": "v1"})


def test_wrong_type_names_key_value_and_expectation():
  with pytest.raises(ConfigError, match=r"'communication.max_splits' got 'five'; expected an int"):
    Config({"communication.max_splits": "five"}, environ={})
  with pytest.raises(ConfigError, match=r"'communication.gradients_reduce_method' got 'avg'; "
                                        r"expected one of 'mean', 'sum'"):
    Config({"communication.gradients_reduce_method": "avg"}, environ={})
  with pytest.raises(ConfigError, match=r"EPL_COMMUNICATION_SPARSE_AS_DENSE"):
    Config(environ={"EPL_COMMUNICATION_SPARSE_AS_DENSE": "maybe"})
  with pytest.raises(ConfigError, match=r"expected a bool"):
    Config({"communication.sparse_as_dense": 1}, environ={})


def test_not_built_key_is_refused_but_default_is_fine(monkeypatch):
  _unbuilt_v1(monkeypatch)
  Config({"zero.level": ""}, environ={})
  with pytest.raises(NotImplementedYetError,
                     match=r"'zero.level'='v1': this feature is not implemented yet"):
    Config({"zero.level": "v1"}, environ={})


def test_loss_scale_type():
  assert Config(environ={}).amp.loss_scale == "dynamic"
  with pytest.raises(ConfigError, match='"dynamic" or a positive number'):
    Config({"amp.loss_scale": -1}, environ={})


def test_config_is_read_only():
  c = Config(environ={})
  with pytest.raises(AttributeError):
    c.pipeline = None
  assert "max_splits" in repr(Config({"communication.max_splits": 2}, environ={}))
  assert epl.Config is Config
