"""The ConfigProto epl needs in every session on its graph, merged into the user's."""
import tensorflow.compat.v1 as tf


def session_config(cluster, plan, config, user_config, remote_tasks=()):
  """Returns a copy of ``user_config`` (or a new ConfigProto) with epl's settings.

  * virtual CPU devices: ``device_count["CPU"] = devices + 1`` (CPU:0 stays the host), and,
    with several of them, per-session threads so that ops on different virtual devices really
    run concurrently (TF's shared pool is sized once per process). With one device the shared
    pool is kept: per-session pools cost ~100 us per step here (bench/overhead.py);
  * ``allow_soft_placement`` so that host-only kernels (input pipeline, savers) still place;
  * ``cluster.run_visible_devices`` -> ``gpu_options.visible_device_list``;
  * ``graph.grappler``: off -> ``rewrite_options.disable_meta_optimizer`` (unless the user's
    ConfigProto sets rewrite options itself). Grappler's passes cost 63% of TF's first step on
    a graph of model copies and micro-batches, and on these machines the steady step was the
    same without them (docs/benchmarks.md, "Real model sizes"); with micro-batches and
    Grappler on, its arithmetic optimizer is turned off (it folds the running sum of the
    micro-batch gradients into one AddN that keeps all M alive). With Grappler, TF's classic
    per-partition optimizer goes off too (``optimizer_options.opt_level`` L0: no common
    subexpression elimination, no constant folding, unless the user's ConfigProto sets
    optimizer options): on a 131k-op pipeline graph it was 3 of the first step's 7 s, and
    the steady step stayed the same.
  ``plan`` is None for a session opened before the model is built: the Config decides.
  """
  merged = tf.ConfigProto()
  if user_config is not None:
    merged.CopyFrom(user_config)
  for kind, count in cluster.session_device_count().items():
    merged.device_count[kind] = max(count, merged.device_count.get(kind, 0))
  if cluster.virtual_devices and cluster.gpu_num_per_worker > 1 and not cluster.distributed:
    # (a distributed session takes its threads from the server's config instead)
    merged.use_per_session_threads = True
    merged.inter_op_parallelism_threads = max(merged.inter_op_parallelism_threads,
                                              2 * cluster.gpu_num_per_worker + 2)
  merged.allow_soft_placement = True
  micro = plan.num_micro_batch if plan is not None else config.pipeline.num_micro_batch
  if _grappler_off(cluster, plan, config, micro) and \
      not merged.graph_options.HasField("rewrite_options"):   # the user's own choice stays
    merged.graph_options.rewrite_options.disable_meta_optimizer = True
    if not merged.graph_options.HasField("optimizer_options"):
      merged.graph_options.optimizer_options.opt_level = tf.OptimizerOptions.L0
  elif micro > 1:
    # Grappler's arithmetic optimizer folds the running sum of micro-batch gradients into one
    # AddN that waits for the last micro-batch, keeping all M weight gradients alive.
    from tensorflow.core.protobuf import rewriter_config_pb2
    merged.graph_options.rewrite_options.arithmetic_optimization = \
        rewriter_config_pb2.RewriterConfig.OFF
  if config.cluster.run_visible_devices:
    merged.gpu_options.visible_device_list = config.cluster.run_visible_devices
  if cluster.distributed:
    from epl.runtime.server import session_target_config
    session_target_config(cluster, merged)
    for task in remote_tasks:                # stages this worker drives on other workers
      merged.device_filters.append("/job:worker/task:%d" % task)
  return merged


def _grappler_off(cluster, plan, config, micro):
  """graph.grappler: "off", or "auto" where this worker's graph holds clones of the model."""
  setting = config.graph.grappler
  if setting != "auto":
    return setting == "off"
  if plan is None:                      # a session opened before the model: the Config decides
    return micro > 1 or cluster.gpu_num_per_worker > 1
  return micro > 1 or plan.for_worker(cluster.worker_index).num_copies > 1
