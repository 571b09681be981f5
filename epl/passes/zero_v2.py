"""ZeRO v2 (``zero.level: "v2"``, the weights partitioned too), the part of the ZeRO pass
(zero.py) that places each trained variable once and hands its value to the copies that read
it: inside one worker every copy reads the owner device's variable (``partition_weights``);
across workers the owner's worker broadcasts the weights it owns at the start of each step,
the other workers read the received values, and a step ends on every worker once every
owner's update of it ran (``partition_across``). Also the helpers zero.py shares with it.
"""
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.errors import NotImplementedYetError
from epl.op_tables import RESOURCE_READ_OPS, VARIABLE_OPS, variable_dtype, variable_shape
from epl.passes.slots import ancestors


CHECKPOINT_OPS = ("Save", "Restore", "MergeV2Checkpoints")
# handle reads ``_rewire_reads`` hands a value instead (ReadVariableOp), or that run outside
# the step (VarIsInitializedOp)
_HANDLE_READS_KEPT = frozenset({"ReadVariableOp", "VarIsInitializedOp"})


def read_var(var_op):
  """A read of the variable ``var_op`` (ref or resource)."""
  if var_op.type == "VarHandleOp":
    return tf.raw_ops.ReadVariableOp(resource=var_op.outputs[0], dtype=var_op.get_attr("dtype"))
  return tf.identity(var_op.outputs[0])


def replace_update(name, mine, instead, live=()):
  """What waited for a copy's update ops ``mine`` of ``name`` waits for ``instead``. An
  update that hands a value on (a sparse optimizer's scatter read by its next step: Adam's
  ``m_t`` of an embedding) is replaced with the ops reading it, up to where the chain ends;
  so is a read that waits for the update of a variable it writes (a resource variable's
  sparse Adam reads ``m`` and ``v`` back after its scatters: those slots are never
  initialised in a copy that does not own them), except reads of ``live`` variables."""
  chain = _dead_chain([op for op in mine if op is not None], set(live))
  for op in chain:
    for t in op.outputs:
      outside = [c for c in t.consumers() if c not in chain]
      if outside:
        raise NotImplementedYetError(
            "zero.level: the update %s of %s has a data output that %s reads; only "
            "updates that other ops wait for (control dependencies) are supported" % (
                op.name, name, outside[0].name))
    for waiter in list(compat.control_outputs(op)):
      if waiter not in chain:
        compat.replace_control_inputs(waiter, {op: instead})


def _dead_chain(mine, live):
  """``data_chain(mine)`` and the reads that wait for a write of it to a variable not in
  ``live`` (with their own data chains)."""
  written = {t.op for op in mine for t in op.inputs if t.op.type in VARIABLE_OPS} - live
  chain = data_chain(mine)
  while True:
    reads = {w for op in chain for w in compat.control_outputs(op)
             if w not in chain and w.type in RESOURCE_READ_OPS and w.inputs and
             w.inputs[0].op in written}
    if not reads:
      return chain
    chain |= data_chain(sorted(reads, key=compat.op_id))


def data_chain(ops, limit=64):
  """``ops`` and the ops that read their outputs, directly or through others (at most
  ``limit`` more: an optimizer's update chain; beyond it, what reads the update is not the
  optimizer's)."""
  chain, work = set(ops), list(ops)
  while work:
    op = work.pop()
    for t in op.outputs:
      for c in t.consumers():
        if c not in chain and len(chain) < len(ops) + limit:
          chain.add(c)
          work.append(c)
  return chain


def bucket(ctx, key, names):
  """One owner worker's variables (``key``: TaskGraph, dtype, sender) as a broadcast sees
  them: (group, my position, the root's position, shapes, sizes)."""
  get = ctx.graph.get_operation_by_name
  group, me = ctx.worker.client_group(key[0])
  root = list(ctx.plan.clients).index(key[2])
  shapes = [variable_shape(get(v)) for v in names]
  if not all(s.is_fully_defined() for s in shapes):
    raise NotImplementedYetError(
        "zero.level %s across workers needs variables of static shape; %s has %s" % ((
            ctx.plan.memory.zero,) + next((v, s) for v, s in zip(names, shapes)
                                          if not s.is_fully_defined())))
  return group, me, root, shapes, [s.num_elements() for s in shapes]


def _place_once(ctx, name, device, partitioned, colocated, updates):
  """v2: the user's variable ``name``, its slots (with what TF keeps with them) and copy 0's
  update of it on ``device``; the other copies' updates replaced by copy 0's."""
  graph, clones = ctx.graph, ctx.clones()
  get = graph.get_operation_by_name
  members = [name] + sorted(s for s, v in partitioned.items() if v == name)
  for member in members:
    user = get(member)
    for op in [user] + user.outputs[0].consumers():
      if not op.type.startswith(CHECKPOINT_OPS):     # the Saver's ops stay on the host
        compat.set_device(op, device)
    for op in colocated.get(member, []):
      if op.name.startswith(tuple(m + "/" for m in members)):   # its initialiser, its slots'
        compat.set_device(op, device)
      elif op is not user and op not in user.outputs[0].consumers():
        # bookkeeping TF put next to it (Adam's beta powers): stays with its copy
        compat.drop_colocation(op, members)
  for op in updates[name]:
    compat.set_device(op, device)
  for c in range(1, ctx.worker.num_copies):  # one update: the others' never run
    for op in updates[name]:
      mine = clones.op(c, op)
      if mine is not None:
        replace_update(name, [mine], op)


def _step_reads(ctx, var):
  """The step's reads of ``var`` (a ref variable's one snapshot serves every other use too,
  an evaluation's). Not a read that nothing in the step takes: a resource variable's graph
  element (``<var>/Read/ReadVariableOp``, what ``sess.run(var)`` fetches) -- made to wait
  for the owner worker's broadcast, a fetch of the variable between steps ran a collective
  the other workers never joined (a hang until the collective timeout)."""
  step = ctx.result("analyze").cloned_set
  return [op for op in var.outputs[0].consumers()
          if op in step and op.type in ("Identity", "ReadVariableOp") and
          any(c in step for c in _users(op))]


def _users(op):
  return [c for t in op.outputs for c in t.consumers()] + list(compat.control_outputs(op))


def _rewire_reads(ctx, var, value_of, skip_first=True):
  """Every copy's and micro-batch's read of ``var`` (copy 0's own too unless ``skip_first``)
  handed ``value_of(read)`` instead: its consumers and the ops that wait for it."""
  clones = ctx.clones()
  for read in _step_reads(ctx, var):
    real = value_of(read)
    for c in range(ctx.worker.num_copies):
      for m in range(ctx.plan.num_micro_batch):
        clone = clones.op(c, read, m)
        if clone is None or (clone is read and skip_first):
          continue
        for mine in clone.outputs:
          for consumer in list(mine.consumers()):
            for i, t in enumerate(consumer.inputs):
              if t is mine:
                compat.update_input(consumer, i, real)
        for waiter in list(compat.control_outputs(clone)):   # the schedule's order
          compat.replace_control_inputs(waiter, {clone: real.op})


def partition_weights(ctx, owners, updates, partitioned, colocated):
  """v2: each trained variable, its slots and its update once, on the owner's device."""
  get = ctx.graph.get_operation_by_name
  for name, j in owners.items():
    device = ctx.clones().op(j, get(name)).device
    _place_once(ctx, name, device, partitioned, colocated, updates)
    _rewire_reads(ctx, get(name), lambda read: read.outputs[0])
    _rewire_handle_reads(ctx, get(name), device)


def _rewire_handle_reads(ctx, var, device):
  """v2 inside a worker: the ops of other copies and micro-batches that read a resource
  variable through its handle (``ResourceGather``: an embedding lookup) read the user's
  variable instead, on its device (the clones are never initialised): only the rows they
  pick travel."""
  if var.type != "VarHandleOp":
    return
  clones = ctx.clones()
  step = ctx.result("analyze").cloned_set
  for op in [c for c in var.outputs[0].consumers() if c in step and
             c.type in RESOURCE_READ_OPS and c.type not in _HANDLE_READS_KEPT]:
    for c in range(ctx.worker.num_copies):
      for m in range(ctx.plan.num_micro_batch):
        clone = clones.op(c, op, m)
        if clone is None or clone is op:
          continue
        compat.update_input(clone, 0, var.outputs[0])
        compat.set_device(clone, device)


def partition_across(ctx, owners, updates, partitioned, colocated, local):
  """v2 across workers: each trained variable, its slots and its update exist once, on the
  owner copy's device (its worker's task). At the start of a step each owner worker sends
  the weights it owns in one broadcast per (TaskGraph, dtype); the other workers' copies
  read the received values and run no update of them (they wait for the gradients'
  reduce-scatter instead, which brings the owner its sum). No worker reads another's
  variable inside a step; the user's reads between steps do (``_step_end``)."""
  graph, worker, plan = ctx.graph, ctx.worker, ctx.plan
  get = graph.get_operation_by_name
  job = plan.copies
  exchanged = ctx.result("gradient_sync").exchanged
  buckets = {}
  for name, k in owners.items():
    var = get(name)
    tg = ctx.owner.get(var)
    here = job[k].client == worker.index
    device = ctx.clones().op(local[k], var).device if here else \
        job[k].devices[tg][plan.part_of(name)]
    _place_once(ctx, name, device, partitioned, colocated, updates)
    dtype = variable_dtype(var)
    buckets.setdefault((tg, dtype.name, job[k].client), []).append(name)
    if here:
      _rewire_reads(ctx, var, lambda read: read.outputs[0])
  ends, every_update = {}, {op for ops in updates.values() for op in ops}
  for key in sorted(buckets):    # {(TaskGraph, an op that waited for updates): what ran}
    for waiter, ran in _gather_bucket(ctx, key, sorted(buckets[key]), updates, exchanged):
      if waiter not in every_update:        # updates ordered among themselves: their finish
        ends.setdefault((key[0], waiter.name), set()).add(ran)
  upstream = ancestors(op for ran in ends.values() for op in ran)  # cannot wait for an end
  for tg, waiter in sorted(ends):
    assert get(waiter) not in upstream, waiter
    _step_end(ctx, tg, get(waiter), ends[tg, waiter])


def _step_end(ctx, tg, waiter, ran):
  """v2 across workers: ``waiter`` (an optimizer's finish, so its train op), which waited
  for updates, also waits for a scalar all-reduce among the workers that each joins once
  its own of them ran (``ran``: its updates, or the exchange it waits for instead); one
  round trip a step. Without it a worker's step ended once the gradients were exchanged,
  and a read right after it (an evaluation, the chief's save) of a weight another worker
  owns raced its update and got the step before's value."""
  group, me = ctx.worker.client_group(tg)
  with ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.device(group[me]), tf.name_scope("epl_zero/step_end"):
    with tf.control_dependencies(sorted(ran, key=compat.op_id)):
      token = tf.zeros([1])
    end = ctx.collectives.all_reduce([token], [group[me]], "sum", group=group,
                                     clients=list(ctx.plan.clients))[0]
  compat.add_control_inputs(waiter, [end.op])


def _gather_bucket(ctx, key, names, updates, exchanged):
  """v2 across workers: one owner worker's weights (of one TaskGraph and dtype) broadcast
  at the start of the step (every read of them in the step waits for it on the sender too:
  a run that reads them joins it on every worker -- a train op that updates none of the
  sender's weights as well), elsewhere the received values replace every read of them.
  Returns [(an op that waited for an update of them, this worker's update or the exchange
  it waits for instead)]."""
  graph, worker = ctx.graph, ctx.worker
  get = graph.get_operation_by_name
  tg, dtype_name, sender = key
  group, me, root, shapes, sizes = bucket(ctx, key, names)
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_zero"):
    if worker.index == sender:
      reads = []
      for v in names:                                # each read where its variable lives
        with tf.device(get(v).device):
          reads.append(tf.reshape(read_var(get(v)), [-1]))
      with tf.device(group[me]):
        flat = tf.concat(reads, axis=0) if len(reads) > 1 else reads[0]
      sent = ctx.collectives.broadcast(flat, group[me], group, root)
      mine = [op for v in names for op in updates[v]]
      for op in mine:            # the weights are sent as they were before this step's update
        compat.add_control_inputs(op, [sent.op])
      for read in (r for v in names for r in _step_reads(ctx, get(v))):
        compat.add_control_inputs(read, [sent.op])
      return [(w, op) for op in mine for w in compat.control_outputs(op)]
    with tf.device(group[me]):
      received = ctx.collectives.broadcast(tf.zeros([sum(sizes)], dtype_name), group[me],
                                           group, root)
      pieces = tf.split(received, sizes) if len(names) > 1 else [received]
      values = {v: tf.reshape(p, s) for v, p, s in zip(names, pieces, shapes)}
  sync = ctx.result("gradient_sync")
  done = {v: sync.reduced.get(v, exchanged.get((tg, dtype_name), received.op)) for v in names}
  waited = [(w, done[v]) for v in names for op in updates[v]
            for w in compat.control_outputs(op)]
  for v in names:
    _rewire_reads(ctx, get(v), lambda read, v=v: values[v], skip_first=False)
    for op in updates[v]:                         # this worker runs no update of them
      replace_update(v, [op], done[v])
  return waited
