"""Tensor and expert parallelism for ``epl.split`` scopes: sharded values and the rule table."""
