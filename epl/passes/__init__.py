"""The rewrite passes, in the order they run: ``PASSES`` is the list ``rewrite`` executes.

Each pass is one module with one entry function ``<name>(ctx) -> result``: it receives a
``RewriteContext`` (the graph, the frozen plan, this worker's view, the results of the passes
before it, by name) and returns its own frozen result; it never reads global state. Adding a
pass is one module plus one line here.

  analyze        which ops each model copy owns, mirrored variables, singletons
  replicate      place copy 0, clone copies 1..n-1, wire singletons, build the replica sync
  micro_batch    clone each copy's forward + backward per micro-batch (pipeline.num_micro_batch)
  bridge         connect each replica's split TaskGraphs, and stages replicated on fewer
                 devices, to its copies (gather / scatter), per micro-batch
  schedule       order each stage's micro-batches (PreferBackward / PreferForward)
  recompute      backward recomputes forward segments from checkpoints (gradient_checkpoint)
  step_reads     updates wait for every read of their variable in the step; reads of a shared
                 variable (global_step) see one value in every copy and micro-batch
  owners         which copy owns each trained variable's optimizer state (zero.level)
  gradient_sync  accumulate micro-batch gradients (over clones, or over session runs:
                 run_sums), all-reduce them across copies, rewire the optimizer's apply ops
  zero           each copy keeps and updates the optimizer state of its share (zero.level v0)
  offload        weights, slots and the update on the host CPU (offload.level v0)
  apply_groups   the update in sequential groups balanced by size (optimizer.num_apply_group)
  race_delay     tests only (testing.race_delay_ms): every read of a variable that no write of
                 it waits for yet starts late -- a write left unordered runs first
  writes_after_reads
                 the step's one ordering invariant: every write of a variable after every
                 read of it in the step (across copies, stages, micro-batches, aliases)
"""
from epl.passes.analyze import analyze
from epl.passes.apply_groups import apply_groups
from epl.passes.bridge import bridge
from epl.passes.grad_sync import gradient_sync
from epl.passes.micro_batch import micro_batch
from epl.passes.offload import offload
from epl.passes.ordering import writes_after_reads
from epl.passes.race_delay import race_delay
from epl.passes.owners import owners
from epl.passes.recompute import recompute
from epl.passes.replicate import replicate
from epl.passes.schedule import schedule
from epl.passes.step_reads import step_reads
from epl.passes.zero import zero

PASSES = (analyze, replicate, micro_batch, bridge, schedule, recompute, step_reads, owners,
          gradient_sync, zero, offload, apply_groups, race_delay,
          writes_after_reads)
