"""The race-free local step: every read of the step first, then every update.

Plain TF1 lets an optimizer's in-place update of a ref variable (``tf.layers`` variables
under ``tf.disable_v2_behavior()``) run while the backward pass still reads the weight: an
input gradient that reads ``kernel`` through ``tf.reshape(kernel, ...)`` or a late reader
nothing orders against the update may see the new value. Which order TF picks changes from
run to run, so the local script is not one model but several. epl's run equals this order
(every reader of a weight in the step runs before its update); ``race_free_step`` runs a local
step in it, as the reference the parity tests compare with.

    loss_value = race_free_step(sess, train_op, feed_dict, fetches=loss)

How: the first run computes, without updating anything, every input of the step's update
ops that is not itself computed after an update (gradients, clipped or not, learning rates,
the batch-norm moving-average deltas); the second run runs ``train_op`` with those tensors
fed, so no update can run before any of its step's reads.
"""
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import mutates
from epl.passes.slots import ancestors

# updates a step makes: a variable written through a ref input or a resource handle
_RESOURCE_WRITES = ("ResourceApply", "ResourceSparseApply", "AssignVariableOp",
                    "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatter")


def _writes(op):
  if any(arg.is_ref for arg in op.op_def.input_arg):
    return mutates(op) and op.type not in ("Identity", "RefIdentity")
  return op.type.startswith(_RESOURCE_WRITES)


def _downstream(ops, within):
  seen, work = set(), list(ops)
  while work:
    op = work.pop()
    if op in seen or op not in within:
      continue
    seen.add(op)
    work.extend(c for t in op.outputs for c in t.consumers())
    work.extend(compat.control_outputs(op))
  return seen


def step_cut(train_ops):
  """The tensors ``race_free_step`` computes first for ``train_ops`` (an op, a tensor or a
  list of them): every input of an update of the step that no update comes before."""
  train_ops = train_ops if isinstance(train_ops, (list, tuple)) else [train_ops]
  ops = [t if isinstance(t, tf.Operation) else t.op for t in train_ops]
  step = ancestors(ops)
  updates = [op for op in step if _writes(op)]
  after = _downstream(updates, step)
  cut = []
  for op in updates:
    for t in op.inputs:
      if t.dtype._is_ref_dtype or t.dtype == tf.resource or t.op in after:  # pylint: disable=protected-access
        continue
      # (a tensor inside a tf.cond / while_loop cannot be fetched: computed in the 2nd run)
      if t not in cut and op.graph.is_feedable(t) and op.graph.is_fetchable(t.op) and \
          not compat.in_control_flow(t.op):
        cut.append(t)
  return sorted(cut, key=lambda t: t.name)


def race_free_step(sess, train_op, feed_dict=None, fetches=None):
  """Runs one step of ``train_op`` with all of its reads before any of its updates.

  Args:
    sess: a session on a graph epl does not manage (the local reference).
    train_op: what the script runs to train (an op, a tensor, or a list of them).
    feed_dict: the step's feeds.
    fetches: what the script fetches with it (a loss); evaluated in the first run, before any
      update, as TF evaluates it beside the train op.
  Returns:
    The value of ``fetches`` (None without).
  """
  cut = step_cut(train_op)
  values, fetched = sess.run((cut, fetches), feed_dict) if fetches is not None else \
      (sess.run(cut, feed_dict), None)
  feeds = dict(feed_dict or {})
  feeds.update(zip(cut, values))
  sess.run(train_op, feeds)
  return fetched
