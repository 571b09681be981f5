"""``GraphState``: what epl knows about the one graph it manages in this process.

Created by ``epl.init``; handed explicitly to the hook dispatcher and the driver (nothing below
``epl.entry`` looks it up through a global).
"""
from epl.annotate import Recorder


class GraphState:
  """The managed graph, its config and cluster, the annotations recorded while it is built,
  and, once rewritten, the ParallelGraph and the runtime helpers built for it."""

  def __init__(self, graph, config, cluster):
    self.config = config
    self.cluster = cluster
    self.bind(graph)
    self.parallel = None        # epl.runtime.parallel_graph.ParallelGraph once rewritten
    self.passes_running = False  # epl's passes build ops: no split rule acts on them
    self.amp = None             # epl.amp.Amp once amp.level transformed the graph
    self.collections = {}       # epl.add_to_collection: key -> [tensor]
    self.server = None          # this worker's tf.train.Server in a multi-worker job
    self.fetch_mapper = None    # epl.runtime.fetch.FetchMapper when copies merge
    self.feeds = None           # epl.runtime.feeds.FeedSplitter alongside it
    self.heartbeat = None       # epl.runtime.heartbeat.Heartbeat of a multi-worker worker
    self.exits = None           # epl.runtime.heartbeat.ExitCode alongside it
    self.start_round = 0        # the start-up barrier's instance (epl.runtime.server)
    self.auto_scope = None      # auto.layout's split scope until the first gradients
    self.auto_scope_thread = None   # the thread that opened it (scopes are thread-local)

  def bind(self, graph):
    """Manages ``graph`` from now on (before anything was recorded for another one)."""
    self.graph = graph
    self.recorder = Recorder(graph)
    self.version_at_init = graph.version

  @property
  def untouched(self):
    """Nothing recorded and no op built since epl.init: the model went elsewhere, or not yet."""
    return self.graph.version == self.version_at_init
