"""A worker's side of an elastic job (``epl-launch --min_workers``; epl/launch/elastic.py).

* On fewer workers than the job started with (``launch.elastic_workers``), each worker runs
  ``pipeline.num_micro_batch`` x started / now micro-batches, so a step still reads as many
  batches as the job's first layout did: the global batch is kept (a fed batch is cut into
  more pieces of the rows each worker feeds -- its share of the global batch).
* When the launcher asks the job to grow (``launch.resize_file`` exists), the chief stops after
  its next checkpoint, at the start of its next training run (so the script's own code after
  the checkpointed step still runs; a job whose last step it was just ends), with exit code
  75 (``RESIZE_EXIT``); every launcher then gathers the hosts again and the job resumes from
  that checkpoint on all of them.
"""
import logging
import os
import sys

from epl.config import Config
from epl.errors import ConfigError
from epl.launch.elastic import RESIZE_EXIT

log = logging.getLogger("epl")


def keep_global_batch(config, workers):
  """``config`` with ``pipeline.num_micro_batch`` scaled for ``workers`` (the job's workers
  now) from ``launch.elastic_workers`` (the workers it started with); ``config`` itself when
  the job is not elastic or has its first size.

  Raises:
    ConfigError: the started workers' micro-batches do not divide among ``workers``.
  """
  started = config.launch.elastic_workers
  if not started or started == workers:
    return config
  micro = config.pipeline.num_micro_batch
  if (micro * started) % workers:
    raise ConfigError(
        "elastic job: %d worker(s) x pipeline.num_micro_batch=%d micro-batches cannot be "
        "shared by the %d worker(s) left, so the global batch cannot be kept; set "
        "pipeline.num_micro_batch to a multiple of %d (then every job size down to "
        "epl-launch --min_workers keeps it), or raise --min_workers" % (
            started, micro, workers, _lcm_needed(started, workers)))
  scaled = micro * started // workers
  log.info("elastic job on %d of the %d worker(s) it started with: pipeline.num_micro_batch "
           "%d -> %d keeps the global batch", workers, started, micro, scaled)
  return Config(dict(config.to_dict(), **{"pipeline.num_micro_batch": scaled}), environ={})


def _lcm_needed(started, workers):
  """The smallest micro-batch count m with m * started divisible by workers."""
  m = 1
  while (m * started) % workers:
    m += 1
  return m


def resize_asked(config, chief):
  """True when this worker is the chief of an elastic job whose launcher asked it to stop at
  its next checkpoint (launch.resize_file exists)."""
  resize = config.launch.resize_file
  return bool(chief and resize and os.path.exists(resize))


def stop():
  """Ends the worker for the resize (its launcher gathers the hosts again). ``sys.exit``, not
  ``raise SystemExit``: epl's exit watch sees the code and skips the farewell that would wait
  for the peers, who wait in the step for this worker (epl.runtime.heartbeat.ExitCode)."""
  sys.exit(RESIZE_EXIT)
