"""``GraphState``: what epl knows about the one graph it manages in this process.

Created by ``epl.init``; handed explicitly to the hook dispatcher and the driver (nothing below
``epl.entry`` looks it up through a global).
"""
from epl.annotate import Recorder


class GraphState:
  """The managed graph, its config and cluster, the annotations recorded while it is built,
  and, once rewritten, the ParallelGraph and the runtime helpers built for it."""

  def __init__(self, graph, config, cluster):
    self.graph = graph
    self.config = config
    self.cluster = cluster
    self.recorder = Recorder(graph)
    self.parallel = None        # epl.runtime.parallel_graph.ParallelGraph once rewritten
    self.collections = {}       # epl.add_to_collection: key -> [tensor]
    self.server = None          # this worker's tf.train.Server in a multi-worker job
    self.fetch_mapper = None    # epl.runtime.fetch.FetchMapper when copies merge
    self.feeds = None           # epl.runtime.feeds.FeedSplitter alongside it
