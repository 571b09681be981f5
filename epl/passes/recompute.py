"""Gradient checkpointing pass (``gradient_checkpoint.type``): backward recomputes forward
activations from checkpoints instead of keeping them.

Expects: the clones (replicate, micro_batch), the schedule's control dependencies and the
plan's checkpoint settings (``plan.memory``: the type, the last TaskGraph it applies to, the
user's ``"checkpoints"`` collection by name). Works out on the user's ops (copy 0, micro-batch
0), then builds the same in every copy and micro-batch of this worker:

1. Checkpoints: the collection's tensors, or with ``auto`` the forward graph's *separators*
   (tensors every later forward op depends on only through them: a residual block's output,
   a transformer layer's output): the last separator of each repeated block (name scopes that
   differ only by a number: ``layer_3/``, ``block_4/``) when the model has >= 3 of them, else
   about sqrt(n) separators spaced evenly by activation size.
2. Every backward op that reads a forward tensor that is not kept anyway (a checkpoint, a
   weight, a constant, an input, the output of a random or stateful op -- so dropout masks are
   reused, not re-drawn -- or an op inside a while loop / cond) reads instead a recomputed copy:
   the forward ops between that tensor and the checkpoints it needs, cloned once per segment
   (the set of checkpoints the segment starts from).
3. A segment's recomputation waits (control dependency) for the gradients flowing into the
   backward ops that use it, so it runs when backward reaches the segment, not during forward.

Forward activations then live only until forward is done with them; a segment's are rebuilt
one segment at a time in backward. Returns ``Recomputed``.
"""
import dataclasses
import math
import re
from typing import Tuple

import numpy as np
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import (DATA_SOURCE_OPS, PLACEHOLDER_OPS, RANDOM_OPS, READ_OPS,
                           VARIABLE_OPS, mutates)
from epl.passes.clone import clone_ops

_BLOCK = re.compile(r"^(.*?)(\d+)$")
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


@dataclasses.dataclass(frozen=True)
class Recomputed:
  checkpoints: Tuple[str, ...] = ()      # checkpoint tensors (user's names)
  segments: int = 0                      # recomputed segments per copy
  recomputed_ops: int = 0                # ops cloned for recomputation, all copies
  rewired: int = 0                       # backward inputs now reading recomputed tensors
  check_op: tf.Operation = None          # check_gradients: recomputed == forward, once

  def __str__(self):
    return "Recomputed(%d checkpoints, %d segments, %d ops cloned, %d inputs rewired)" % (
        len(self.checkpoints), self.segments, self.recomputed_ops, self.rewired)


def _kept(op, forward):
  """True when ``op``'s outputs are kept in memory anyway (or must not be recomputed)."""
  return (op not in forward or op.type in VARIABLE_OPS or op.type in READ_OPS and
          op.inputs and op.inputs[0].op.type in VARIABLE_OPS or op.type == "Const" or
          op.type in RANDOM_OPS or op.type in PLACEHOLDER_OPS or op.type in DATA_SOURCE_OPS or
          mutates(op) or compat.in_control_flow(op) or not op.inputs)


def _source(op):
  return (not op.inputs or op.type in PLACEHOLDER_OPS or op.type in DATA_SOURCE_OPS or
          op.type in VARIABLE_OPS or op.type in READ_OPS and op.inputs[0].op.type in VARIABLE_OPS)


def _bytes(t):
  dims = t.shape.as_list() if t.shape.rank is not None else []
  return int(np.prod([d or 1 for d in dims])) * max(t.dtype.size, 1)


def separators(forward_ops):
  """Forward tensors that separate the forward graph (see the module docstring), in order."""
  # sources (inputs, labels, weights, constants) feed anywhere: they separate nothing
  ops = sorted((op for op in forward_ops if not _source(op)), key=compat.op_id)
  index = {op: i for i, op in enumerate(ops)}
  reach = []
  for op in ops:
    users = [index[c] for t in op.outputs for c in t.consumers() if c in index]
    reach.append(max(users, default=index[op]))
  out, farthest = [], -1
  for i, op in enumerate(ops):
    if farthest <= i and len(op.outputs) == 1 and op.outputs[0].dtype.is_floating and \
        reach[i] > i:
      out.append(op.outputs[0])
    farthest = max(farthest, reach[i])
  return out


def _block_of(name):
  """('layer_', 3) for 'model/layer_3/dense/MatMul', or None: the first numbered scope."""
  for part in name.split("/")[:-1]:
    match = _BLOCK.match(part)
    if match and match.group(1):
      return match.group(1), int(match.group(2))
  return None


def choose_checkpoints(forward_ops):
  """``auto``: the last separator of each repeated block, else ~sqrt(n) by size."""
  seps = separators(forward_ops)
  if not seps:
    return []
  blocks = {}
  for t in seps:
    block = _block_of(t.op.name)
    if block is not None:
      blocks.setdefault(block[0], {})[block[1]] = t          # the last one wins
  stem = max(blocks, key=lambda s: len(blocks[s]), default=None)
  if stem is not None and len(blocks[stem]) >= 3:
    return [blocks[stem][i] for i in sorted(blocks[stem])]
  k = max(1, int(round(math.sqrt(len(forward_ops)))))
  sizes = np.cumsum([_bytes(t) for t in seps], dtype=np.float64)
  marks = [sizes[-1] * (j + 1) / (k + 1) for j in range(k)]
  chosen = {int(np.searchsorted(sizes, m)) for m in marks}
  return [seps[i] for i in sorted(chosen) if i < len(seps)]


@dataclasses.dataclass
class _Segment:
  ops: list          # forward ops to recompute, creation order
  uses: list         # (backward op, input index, forward tensor)
  waits: list        # backward ops the recomputation waits for


def _segments(forward, backward, checkpoints, stage_of=None):
  """The recompute segments of the user's ops (see the module docstring); ``stage_of``: op ->
  stage, to keep each stage's segments apart (stage functions)."""
  keep = set(checkpoints)
  needed = {}
  for b in sorted(backward, key=compat.op_id):
    if b.type in _SHAPE_OPS:
      continue          # it runs as soon as forward made the tensor, and keeps no activation
    for i, t in enumerate(b.inputs):
      if t.op in forward and t not in keep and not _kept(t.op, forward):
        needed.setdefault(t, []).append((b, i))
  groups = {}
  for t, uses in needed.items():
    ops, starts, work = set(), set(), [t]
    while work:
      x = work.pop()
      if x in keep:
        starts.add(x)
        continue
      if x.op in ops or _kept(x.op, forward):
        continue
      ops.add(x.op)
      work.extend(x.op.inputs)
    key = (frozenset(starts), stage_of(t.op) if stage_of else None)
    group = groups.setdefault(key, _Segment([], [], []))
    group.ops = sorted(set(group.ops) | ops, key=compat.op_id)
    group.uses += [(b, i, t) for b, i in uses]
  for group in groups.values():
    users = {b for b, _, _ in group.uses}
    after, work = set(), list(users)          # backward ops that will depend on the segment
    while work:
      x = work.pop()
      for out in x.outputs:
        for c in out.consumers():
          if c in backward and c not in after:
            after.add(c)
            work.append(c)
      for c in compat.control_outputs(x):
        if c in backward and c not in after:
          after.add(c)
          work.append(c)
    waits = {t.op for b in users for t in b.inputs if t.op in backward}
    group.waits = sorted(waits - after - users, key=compat.op_id)
  return list(groups.values())


def template(ctx, boundaries=False):
  """(checkpoints, segments) of the user's ops (copy 0, micro-batch 0), or None when the plan
  checkpoints nothing. ``boundaries``: a tensor one stage's forward hands to another's is a
  checkpoint too (stage functions: it is handed on anyway, and a segment then never spans two
  stages' bodies)."""
  memory = ctx.plan.memory
  if not memory.gradient_checkpoint:
    return None
  graph, plan = ctx.graph, ctx.plan
  last = memory.checkpoint_end_taskgraph
  tgs = {t.index for t in plan.taskgraphs if not plan.is_split(t.index) and
         (last < 0 or t.index <= last)}
  step = ctx.result("analyze").cloned_set
  forward = {op for op, p in ctx.phase.items() if p == "forward" and op in step and
             ctx.owner.get(op) in tgs}
  backward = {op for op, p in ctx.phase.items() if p == "backward" and op in step}
  if memory.gradient_checkpoint == "collection":
    checkpoints = [graph.get_tensor_by_name(n) for n in memory.checkpoints]
  else:
    checkpoints = []
    for tg in sorted(tgs):
      checkpoints += choose_checkpoints([op for op in forward if ctx.owner[op] == tg])
  if boundaries:
    chosen = set(checkpoints)
    checkpoints += [t for op in sorted(forward, key=compat.op_id) for t in op.outputs
                    if t not in chosen and any(
                        ctx.phase.get(c) == "forward" and ctx.owner.get(c) != ctx.owner[op]
                        for c in t.consumers())]
  return checkpoints, _segments(forward, backward, checkpoints,
                                ctx.owner.get if boundaries else None)


def rebuild(ctx, segments, c, m, here):
  """Builds the segments' recomputation in copy ``c``, micro-batch ``m`` (``here``: the
  user's op -> its op there, None where absent) and rewires its backward users to it.
  Returns ([(user's forward op, its recomputed op)], inputs rewired, [(forward tensor,
  recomputed tensor)] of float tensors for the check)."""
  graph = ctx.graph
  made, rewired, pairs = [], 0, []
  for s, seg in enumerate(segments):
    ops = [here(op) for op in seg.ops]
    if any(op is None for op in ops):
      continue                              # this TaskGraph has no copy here
    copy = clone_ops(graph, ops, "epl_recompute/c%d_m%d_s%d" % (c, m, s),
                     lambda op: op.device, node_cache=ctx.nodes)
    made.extend((op, copy[x.name]) for op, x in zip(seg.ops, ops))
    waits = [w for w in (here(op) for op in seg.waits) if w is not None]
    if waits:
      roots = [copy[op.name] for op in ops
               if not any(t.op.name in copy for t in op.inputs)]
      with graph.as_default(), tf.name_scope(None), tf.device(roots[0].device), \
          tf.control_dependencies(waits):
        start = tf.no_op(name="epl_recompute/start_c%d_m%d_s%d" % (c, m, s))
      made.append((seg.ops[0], start))
      for root in roots:
        compat.add_control_inputs(root, [start])
    for b, i, t in seg.uses:
      user = here(b)
      original = here(t.op)
      new = copy[original.name].outputs[t.value_index]
      if user.inputs[i].op is original:
        compat.update_input(user, i, new)
        rewired += 1
        if new.dtype.is_floating:
          pairs.append((original.outputs[t.value_index], new))
  return made, rewired, pairs


def recompute(ctx):
  """Runs the pass; see the module docstring. With stage functions the micro_batch pass
  already rebuilt the user's ops (``on_template``): the bodies hold the recomputation."""
  micro = ctx.results.get("micro_batch")
  if micro is not None and micro.recomputed is not None:
    return micro.recomputed
  found = template(ctx)
  if found is None:
    return Recomputed()
  checkpoints, segments = found
  clones = ctx.clones()
  cloned = rewired = 0
  pairs = []                                      # (forward tensor, recomputed), copy 0
  for c in range(ctx.worker.num_copies):
    for m in range(ctx.plan.num_micro_batch):
      here = lambda op: clones.op(c, op, m) if (c, m) != (0, 0) else op   # noqa: E731
      made, n, found_pairs = rebuild(ctx, segments, c, m, here)
      cloned += sum(1 for _, op in made if op.type != "NoOp")
      rewired += n
      if (c, m) == (0, 0):
        pairs = found_pairs
  check = _check(ctx.graph, pairs) if ctx.plan.memory.check_gradients and pairs else None
  return Recomputed(tuple(t.name for t in checkpoints), len(segments), cloned, rewired, check)


def on_template(ctx):
  """Stage functions' recompute (micro_batch pass, before the bodies are cut): the user's
  backward reads recomputed tensors, so the forward bodies hand on only checkpoints and the
  backward bodies recompute. Returns (Recomputed without its check, {made op: the user's
  forward op it recomputes}, the check's pairs) or None."""
  found = template(ctx, boundaries=True)
  if found is None:
    return None
  checkpoints, segments = found
  made, rewired, pairs = rebuild(ctx, segments, 0, 0, lambda op: op)
  ctx.nodes.refresh()                       # the users' NodeDefs read the recomputed tensors
  done = Recomputed(tuple(t.name for t in checkpoints), len(segments),
                    sum(1 for _, op in made if op.type != "NoOp"), rewired)
  return done, {op: forward for forward, op in made}, pairs


def check_apart(ctx, pairs):
  """Stage functions' check op (gradient_checkpoint.check_gradients), or None: the user's
  forward and recomputed tensors of ``pairs`` run inside calls, so the check compares them in
  a clone of their own, made before the calls (it reads the step's inputs and weights: the
  same values as micro-batch 0's calls, its random ops drawn once for both sides)."""
  if not ctx.plan.memory.check_gradients or not pairs:
    return None
  sources = set(ctx.result("analyze").sources)
  ops, work = set(), [t.op for pair in pairs for t in pair]
  while work:
    op = work.pop()
    if op in ops or op in sources or _source(op) and op.type != "Const":
      continue
    ops.add(op)
    work.extend(t.op for t in op.inputs)

  def values_only(_, node):          # the check needs values, not the step's waits
    node.input[:] = [x for x in node.input if not x.startswith("^")]

  clone = clone_ops(ctx.graph, sorted(ops, key=compat.op_id), "epl_recompute/check_inputs",
                    lambda op: op.device, node_cache=ctx.nodes, edit=values_only)
  return _check(ctx.graph, [tuple(clone[t.op.name].outputs[t.value_index] for t in pair)
                            for pair in pairs])


def _check(graph, pairs):
  """One op that fails when a recomputed tensor differs from the one forward made (the
  runtime runs it with the first training step only: it keeps the forward tensors alive)."""
  seen, checks = set(), []
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_recompute/check"):
    for forward, again in pairs:
      if forward in seen:
        continue
      seen.add(forward)
      with tf.device(again.device):
        checks.append(tf.debugging.assert_near(
            again, forward, rtol=1e-5, atol=1e-6, summarize=4,
            message="gradient_checkpoint.check_gradients: the recomputed %s differs from the "
                    "forward one" % forward.name))
    return tf.group(*checks, name="all")
