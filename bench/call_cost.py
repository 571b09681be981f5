"""What one stage-function call costs TF here, apart from its work (#50's steady step).

  python bench/call_cost.py [--sizes 1,16,64] [--calls 128] [--repeats 20]

A chain of ``--calls`` calls (epl's own ``call_node``: StatefulPartitionedCall, Grappler off
inside) of one function holding K chained 32x32 MatMuls, taking K weights as arguments and
returning every product (K + 1 results, like a forward body handing on its activations),
on one virtual device ("same") or alternating between two ("cross": each call reads the
previous one's result from the other device, as stage s + 1 reads stage s). Prints the time
per call and, for comparison, K MatMuls as plain graph ops in one run.
"""
import argparse
import time

import numpy as np


def _graph(tf, k, calls, cross):
  from epl.passes.stage_bodies import call_node, config_proto
  f32 = tf.float32.as_datatype_enum
  graph = tf.Graph()
  with graph.as_default():
    x = tf.placeholder(tf.float32, [32, 32], name="x")
    weights = [tf.constant(np.eye(32, dtype=np.float32), name="w%d" % i) for i in range(k)]
    graph_def = tf.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    fdef = graph_def.library.function.add()
    fdef.signature.name = "body"
    fdef.attr["_noinline"].b = True
    fdef.signature.is_stateful = True
    fdef.signature.input_arg.add(name="a", type=f32)
    fdef.signature.output_arg.add(name="o", type=f32)
    previous = "a"
    for i in range(k):
      fdef.signature.input_arg.add(name="w%d" % i, type=f32)
      node = fdef.node_def.add(name="m%d" % i, op="MatMul")
      node.input.extend([previous, "w%d" % i])
      node.attr["T"].type = f32
      previous = "m%d:product:0" % i
      fdef.signature.output_arg.add(name="r%d" % i, type=f32)
      fdef.ret["r%d" % i] = previous
    fdef.ret["o"] = previous
    devices = ["/job:localhost/replica:0/task:0/device:CPU:%d" % d for d in (1, 2)]
    previous = "x:0"
    for i in range(calls):
      call_node(graph_def, "c%d" % i, "body", devices[i % 2 if cross else 0],
                [previous] + ["w%d:0" % j for j in range(k)], [f32] * (k + 1),
                [f32] * (k + 1), config_proto())
      previous = "c%d:0" % i
    tf.import_graph_def(graph_def, name="",
                        input_map=dict({"x:0": x}, **{"w%d:0" % j: w for j, w in enumerate(weights)}))
    return graph, x, graph.get_tensor_by_name(previous)


def _ops(tf, k, calls):
  graph = tf.Graph()
  with graph.as_default():
    x = tf.placeholder(tf.float32, [32, 32], name="x")
    h = x
    with tf.device("/device:CPU:1"):
      for _ in range(k * calls):
        h = tf.matmul(h, tf.constant(np.eye(32, dtype=np.float32)))
    return graph, x, h


def _time(tf, graph, x, out, repeats):
  config = tf.ConfigProto(device_count={"CPU": 3})
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  value = np.eye(32, dtype=np.float32) * 0.5
  with tf.Session(graph=graph, config=config) as sess:
    for _ in range(3):
      sess.run(out, {x: value})
    began = time.perf_counter()
    for _ in range(repeats):
      sess.run(out, {x: value})
    return (time.perf_counter() - began) / repeats


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="1,16,64", help="MatMuls (and weights) per body")
  parser.add_argument("--calls", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  print("%6s %12s %12s %14s" % ("K", "same us", "cross us", "as ops us"))
  for k in (int(s) for s in args.sizes.split(",")):
    same = _time(tf, *_graph(tf, k, args.calls, False), args.repeats) / args.calls
    cross = _time(tf, *_graph(tf, k, args.calls, True), args.repeats) / args.calls
    ops = _time(tf, *_ops(tf, k, args.calls), args.repeats) / args.calls
    print("%6d %12.1f %12.1f %14.1f" % (k, same * 1e6, cross * 1e6, ops * 1e6))


if __name__ == "__main__":
  main()
