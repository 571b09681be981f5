"""``epl-launch``: parse -> settings -> per-worker (argv, env) -> exec."""
