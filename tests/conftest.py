import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()
tf.logging.set_verbosity(tf.logging.ERROR)


# ---- sharing the machine between parallel test processes (pytest-xdist) ------------------
# The suite runs in a few pytest-xdist processes (the README's command): most tests wait on
# worker processes, launchers and deadlines, so the 2 cores stay busy. A test marked
# ``alone`` -- a soak that must run at full speed, hosts made of network namespaces, a test
# that looks for training processes by name -- runs with no other test beside it: every test
# holds a shared lock while it runs (set-up and tear-down included), an ``alone`` one the
# exclusive lock, and a gate in front gives it precedence over tests that have not started.
import contextlib  # noqa: E402
import fcntl  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "alone: runs with no other test beside it when the suite runs in parallel")


@contextlib.contextmanager
def _machine_share(alone):
  run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if not run:                                 # one pytest process: every test is alone
    yield
    return
  base = os.path.join(tempfile.gettempdir(), "epl-tests-%s" % run)
  os.makedirs(base, exist_ok=True)
  with open(os.path.join(base, "gate"), "a") as gate, \
      open(os.path.join(base, "share"), "a") as share:
    fcntl.flock(gate, fcntl.LOCK_EX)
    if alone:
      fcntl.flock(share, fcntl.LOCK_EX)     # waits for the running tests; the gate holds
    else:                                   # back the ones that have not started
      fcntl.flock(share, fcntl.LOCK_SH)
      fcntl.flock(gate, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(share, fcntl.LOCK_UN)
      if alone:
        fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  with _machine_share(item.get_closest_marker("alone") is not None):
    yield
