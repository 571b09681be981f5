"""The rewrite passes, in the order they run.

Each pass is one module with one entry function; it receives the plan and what earlier passes
returned, never reads global state. ``rewrite`` runs them in ``PIPELINE`` order and returns the
``ParallelGraph`` that the runtime uses (fetch mapping, replica sync) and users inspect.

  analyze        which ops one model copy owns (epl.passes.analyze)
  replicate      place copy 0, clone copies 1..n-1, wire singletons, build the replica sync
  micro_batch    clone each copy's forward + backward per micro-batch (pipeline.num_micro_batch)
  schedule       order each stage's micro-batches (PreferBackward / PreferForward)
  gradient_sync  accumulate micro-batch gradients, all-reduce them across copies, rewire the
                 optimizer's apply ops
"""
PIPELINE = ("analyze", "replicate", "micro_batch", "schedule", "gradient_sync")
