"""Gradient accumulation over session runs (``plan.accumulate_runs`` R > 1): gradient_sync's
first half when micro-batches are runs, not clones (epl.runtime.accumulation runs them).

Each gradient of each copy has a sum on the copy's device, kept between runs (a resource
variable in no collection: not saved, not in the user's init op; the runtime zeroes it in a
new session). Every run adds its weighted gradient (``adds``); every run fetches the same
targets, so a step is one fetch signature for TF to compile, and the runtime feeds ``last``:
False in runs 0..R-2, True in the last. The sums' reads wait for the run's add and for
``gate``, a tensor that is dead unless ``last`` (TF's Switch): in runs 0..R-2 the reads and
everything after them -- the all-reduce, clipping, the optimizer -- do not run, and neither
does any other update of the step (``gate_updates``: global_step, the optimizer's own
counters), while the forward and backward run in full, batch-norm statistics included. In the
last run the update reads the sums, then ``resets`` zero them.

A sparse gradient stays sparse: a dense sum of its values and a count per row; the last run
hands the optimizer the rows some run touched with their sums, as the local gradient's
duplicate rows would be summed by its sparse update (Momentum's moves only those rows).
"""
import dataclasses

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import mutates


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """One gradient's sums (one per copy): see the module docstring."""
  variable: str
  readers: tuple                      # names of the user's update ops reading the gradient
  adds: tuple                         # ops
  resets: tuple
  inits: tuple


class RunSums:
  """Builds the sums of one rewrite; ``accumulators``, ``last`` and ``gate`` for the runtime."""

  def __init__(self, graph, host, runs):
    self.runs = runs
    self.accumulators = []
    self._factors = {}
    self._constants, self._shared_zeros = {}, {}     # (device, shape, dtype) -> ops
    with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(host), tf.name_scope("epl_accumulate"):
      self.last = tf.placeholder_with_default(True, [], name="last_run")
      _, alive = tf.raw_ops.Switch(data=self.last, pred=self.last)
      self.gate = tf.identity(alive, name="gate")

  def factor(self, copy, dtype, weights, mean, stride=1):
    """The scalar copy ``copy``'s gradients of ``dtype`` are multiplied by before they are
    added: its run's row weight (``weights``: accumulate's Weights, or None), divided by the
    runs for ``mean``; built once per copy, dtype and TaskGraph stride. None: no factor."""
    key = (copy, dtype, stride)
    if key not in self._factors:
      factor = weights.of(copy, 0, dtype, stride) if weights is not None else None
      if mean:
        inverse = tf.constant(1.0 / self.runs, dtype)
        factor = inverse if factor is None else factor * inverse
      self._factors[key] = factor
    return self._factors[key]

  def summed(self, device, g, factor, shape, name):
    """The tensor the update reads instead of ``g`` (one copy's gradient, a Tensor or
    IndexedSlices, of a variable of ``shape``): the sum over the step's runs of ``factor``
    (a scalar or None) times ``g``. Returns (summed, adds, resets, inits)."""
    with tf.device(device):
      if isinstance(g, tf.IndexedSlices):
        if factor is not None:
          g = tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
        return self._sparse(g, shape, name)
      total = _Sum(shape, g.dtype, name)
      add = _add(total, g, factor)
      with tf.control_dependencies([add, self.gate.op]):
        summed = total.read()
      with tf.control_dependencies([summed.op]):    # (its zeros too: a Fill in every run)
        reset = total.assign(self._zeros(device, shape, total.dtype))
      return summed, [add], [reset], [total.assign(self._zeros(device, shape, total.dtype,
                                                               shared=True))]

  def _zeros(self, device, shape, dtype, shared=False):
    """Zeros of ``shape`` on ``device``: a Fill of a shape and a zero made once per device,
    shape and dtype (every sum of a copy with that shape reads them); ``shared``: the Fill
    too (initial values: the init run is the only one that needs them). A sum's reset makes
    its own Fill under the reset's control dependencies. (tf.zeros made 3 ops per call:
    a third of this pass's ops, at ~150 us each to build.)"""
    key = (device, tuple(shape.as_list()), dtype)
    if key not in self._constants:
      with tf.control_dependencies(None):
        self._constants[key] = (tf.constant(shape.as_list(), tf.int32), tf.constant(0, dtype))
    dims, zero = self._constants[key]
    if not shared:
      return tf.raw_ops.Fill(dims=dims, value=zero)
    if key not in self._shared_zeros:
      with tf.control_dependencies(None):
        self._shared_zeros[key] = tf.raw_ops.Fill(dims=dims, value=zero)
    return self._shared_zeros[key]

  def _sparse(self, g, shape, name):
    values, count = _Sum(shape, g.values.dtype, name), _Sum(shape[:1], tf.float32, name + "_rows")
    ones = tf.ones_like(g.indices, tf.float32)
    adds = [tf.raw_ops.ResourceScatterAdd(resource=values.handle, indices=g.indices,
                                          updates=g.values),
            tf.raw_ops.ResourceScatterAdd(resource=count.handle, indices=g.indices,
                                          updates=ones)]
    with tf.control_dependencies(adds + [self.gate.op]):
      touched = tf.reshape(tf.where(count.read() > 0), [-1])
      summed = tf.IndexedSlices(_loose(tf.gather(values.read(), touched)),
                                _loose(tf.cast(touched, g.indices.dtype)), g.dense_shape)
    def zeros():
      return [values.assign(tf.zeros(shape, values.dtype)),
              count.assign(tf.zeros(shape[:1], tf.float32))]
    with tf.control_dependencies([summed.values.op, summed.indices.op]):
      resets = zeros()
    return summed, adds, resets, zeros()

  def record(self, variable, readers, adds, resets, inits):
    self.accumulators.append(Accumulator(variable, tuple(sorted(readers)), tuple(adds),
                                         tuple(resets), tuple(inits)))

  def gate_updates(self, ctx, clones):
    """Every update of the step (apply-phase ops that write, in every copy) waits for the
    gate: none runs before the last run."""
    for op, phase in ctx.phase.items():
      if phase == "apply" and mutates(op):
        for c in range(ctx.worker.num_copies):
          copy = clones.op(c, op)
          if copy is not None:
            compat.add_control_inputs(copy, [self.gate.op])


class _Sum:
  """A sum kept between runs, as raw resource ops (a tf.Variable costs ~5 ms to build and
  would join the graph's collections)."""

  def __init__(self, shape, dtype, name):
    self.shape, self.dtype = shape, dtype.base_dtype
    self.handle = tf.raw_ops.VarHandleOp(dtype=self.dtype, shape=shape,
                                         shared_name=tf.get_default_graph().unique_name(
                                             "epl_accumulate/" + name),
                                         name="epl_accumulate/" + name)

  def read(self):
    return tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)

  def assign(self, value):
    return tf.raw_ops.AssignVariableOp(resource=self.handle, value=value)


def _add(total, g, factor):
  """``total`` += ``factor`` * ``g`` in place. A weighted gradient is added by one fused
  kernel (gradient descent's: var -= alpha * delta, with alpha = -factor): ``g * factor``
  then an add would allocate and write a gradient-sized tensor per run: 85M floats took 30 ms
  (60 with malloc) against 13 for the add alone on a 2-core host."""
  if factor is None:
    return tf.raw_ops.AssignAddVariableOp(resource=total.handle, value=g)
  if g.dtype.base_dtype.is_floating or g.dtype.base_dtype.is_complex:
    return tf.raw_ops.ResourceApplyGradientDescent(var=total.handle, alpha=-factor, delta=g)
  return tf.raw_ops.AssignAddVariableOp(resource=total.handle, value=g * factor)


def _loose(t):
  """``t`` with an unknown first dimension (the rows touched vary per step)."""
  return tf.placeholder_with_default(t, [None] + t.shape.as_list()[1:])
