"""MoE dispatch and combine as an all-to-all between the model copies and the expert parts.

GShard's MoE layer (the contract ``epl.split`` expects, see docs/user_guide.md) is four
einsums around expert weights ``[E, ...]`` that a split TaskGraph shards along E:

    expert_inputs  = einsum("gsec,gsm->egcm", dispatch, x)       # tokens to their experts
    hidden         = relu(einsum("egcm,emh->egch", expert_inputs, w_in))
    expert_outputs = einsum("egch,ehm->egcm", hidden, w_out)
    y              = einsum("gsec,egcm->gsm", combine, expert_outputs)   # back to the tokens

When ``x``, ``dispatch`` and ``combine`` come from a replicated TaskGraph (each model copy
holds its own rows g), the dispatch and combine einsums run in every copy on its own rows, and
only the expert slices travel:

* dispatch: each copy cuts its ``[E, g_c, C, M]`` into the parts' expert slices; part i
  concatenates the copies' slices along g (``epl.passes.bridge``, ``Collectives.gather_rows``);
* combine: part i's ``[E_i, g, C, M]`` is cut into the copies' rows (``Collectives.rows_of``);
  each copy concatenates the parts' slices along E and combines its own tokens.

That is an all-to-all in both directions (and in the gradients, which take the same paths
back): a part receives its experts' tokens, never the whole batch or the dispatch masks. The
ops built here are recorded as ``Recorder.twins`` of the copies' op they follow (so they are
cloned per copy) and in ``Recorder.exchange_axes`` (the batch axis of what they exchange), from
which ``epl.plan.split.crossings`` derives the bridge. Without replicated operands (a model
built entirely inside the split scope) the rules fall back to computing the dispatch per part
and summing the parts' combines (epl.sharding.rules.einsum).
"""
import tensorflow.compat.v1 as tf

SPLIT = "split"


def _copies_taskgraph(scope, tensor):
  """Index of the replicated TaskGraph whose copies each compute ``tensor`` on their own rows,
  or None (a sharded value, an op of a split TaskGraph, no annotation)."""
  recorder = scope.recorder
  if not isinstance(tensor, tf.Tensor) or scope.lookup(tensor) is not None:
    return None
  op = tensor.op
  while op.name in recorder.twins:
    op = recorder.graph.get_operation_by_name(recorder.twins[op.name])
  index = recorder.taskgraph_of(scope.rank_of(op))
  if index is None or recorder.specs[index].kind == SPLIT:
    return None
  return index


def _batch_letter(scope, specs, tensors):
  """The einsum letter of the copies' batch axis: every one of ``tensors`` is computed by the
  same replicated TaskGraph and carries that letter first (or not at all); else None."""
  owners = {_copies_taskgraph(scope, t) for t in tensors}
  if not tensors or None in owners or len(owners) != 1:
    return None
  letter = specs[0][0]
  if any(letter in s and s.index(letter) != 0 for s in specs):
    return None
  return letter


def _twin(recorder, ops, original):
  for op in ops:
    recorder.twins[op.name] = original.name


def dispatch(scope, tensor, axis, sharded):
  """``tensor`` = einsum(dispatch, x) of the copies, cut into ``sharded``'s parts along
  ``axis`` (the expert axis) in each copy; the bridge gathers the slices' rows into the parts.
  Returns the per-part slices, or None when the einsum's operands are not the copies' own."""
  made = tensor.op
  specs, out_spec = made.get_attr("equation").decode().replace(" ", "").split("->")
  specs = specs.split(",")
  batch = _batch_letter(scope, specs, list(made.inputs))
  if batch is None or batch not in out_spec or out_spec.index(batch) == axis:
    return None
  recorder = scope.recorder
  _twin(recorder, [made], made.inputs[0].op)          # the dispatch runs in every copy
  rank = tensor.shape.rank
  pieces, offset = [], 0
  for size in sharded.sizes:
    begin, extent = [0] * rank, [-1] * rank
    begin[axis], extent[axis] = offset, size
    piece = tf.slice(tensor, begin, extent)
    _twin(recorder, [piece.op] + [t.op for t in piece.op.inputs[1:]], made)
    recorder.exchange_axes[piece.op.name] = out_spec.index(batch)
    pieces.append(piece)
    offset += size
  return pieces


def combine(scope, build, kw, specs, position, sharded):
  """The einsum ``kw`` over the copies' operands and the sharded one at ``position`` (summed
  over its expert letter), run in every copy on the parts' concatenation -- whose inputs the
  bridge cuts into the copies' rows. Returns its outputs, or None when the other operands are
  not the copies' own or the sharded operand lacks their batch axis."""
  inputs = list(kw["inputs"])
  whole = inputs[position]
  others = [(s, t) for j, (s, t) in enumerate(zip(specs, inputs)) if j != position]
  batch = _batch_letter(scope, [s for s, _ in others], [t for _, t in others])
  if batch is None or batch not in specs[position] or whole.op.type != "ConcatV2" or \
      list(whole.op.inputs[:-1]) != list(sharded.parts):
    return None
  recorder = scope.recorder
  source = others[0][1].op
  _twin(recorder, [whole.op, whole.op.inputs[-1].op], source)   # concatenated in each copy
  recorder.exchange_axes[whole.op.name] = specs[position].index(batch)
  outputs = build(**kw)
  _twin(recorder, [o.op for o in outputs], source)
  return outputs
