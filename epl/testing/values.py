"""Setting and reading many variables in one ``session.run`` each (parity tests, tests/).

``Variable.load`` and ``sess.run(v)`` per variable run a new fetch set every time, and a new
fetch set costs TF a new executor for the whole graph: ~40 ms a variable on a BERT-sized graph
rewritten by epl, most of a short parity test's time. One run for all of them does the same."""


def load_values(sess, variables, values):
  """Sets each variable to ``values(variable)`` (an array) in one run of their initializers,
  as ``Variable.load`` does one at a time (it feeds the initializer's initial-value input)."""
  variables = list(variables)
  if not variables:
    return
  sess.run([v.initializer for v in variables],
           {v.initializer.inputs[1]: values(v) for v in variables})


def read_values(sess, variables):
  """``{variable's op name: value}`` of ``variables`` in one run."""
  variables = list(variables)
  return dict(zip([v.op.name for v in variables], sess.run(variables)))
