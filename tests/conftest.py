import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()
tf.logging.set_verbosity(tf.logging.ERROR)


# ---- the workers' fork server (tests/zygote.py) -----------------------------------------
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")


_ZYGOTE = pytest.StashKey()       # this pytest process's fork server and its address


def _start_zygote(config):
  """One fork server per pytest process that runs tests; every .py worker epl-launch starts
  from this process is forked from it (its client falls back to a fresh ``python`` where a
  fork cannot stand in for one). Set in the environment before the test modules are
  imported: their ENV dicts copy os.environ then. EPL_TEST_ZYGOTE=0 turns it off."""
  if os.environ.get("EPL_TEST_ZYGOTE") == "0":
    return
  if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
    return                                   # the xdist controller runs no test
  address = os.path.join(tempfile.gettempdir(), "epl-zygote-%d.sock" % os.getpid())
  root = os.path.dirname(os.path.dirname(ZYGOTE))
  env = dict(os.environ, PYTHONPATH=root)
  config.stash[_ZYGOTE] = (subprocess.Popen([sys.executable, ZYGOTE, "--serve", address],
                                            env=env, stdin=subprocess.DEVNULL,
                                            start_new_session=True), address)
  os.environ["EPL_TEST_ZYGOTE"] = address
  os.environ["EPL_LAUNCH_PYTHON"] = "%s %s" % (sys.executable, ZYGOTE)


def pytest_unconfigure(config):
  if _ZYGOTE not in config.stash:
    return
  server, address = config.stash[_ZYGOTE]
  server.kill()
  server.wait()
  for path in (address, address + ".new"):
    if os.path.exists(path):
      os.unlink(path)


# ---- sharing the machine between parallel test processes (pytest-xdist) ------------------
# The suite runs in a few pytest-xdist processes (the README's command): most tests wait on
# worker processes, launchers and deadlines, so the 2 cores stay busy. A test marked
# ``alone`` -- a soak that must run at full speed, a deadline measured in seconds, a test that
# looks for training processes by name -- runs with no other test beside it: every test holds
# a shared lock while it runs (set-up and tear-down included), an ``alone`` one the exclusive
# lock, and a gate in front gives it precedence over tests that have not started. Taking the
# exclusive lock drains the machine (the gate holds new tests back until the running ones
# end), so the ``alone`` tests are one xdist group, run one after another in one process
# (``--dist loadgroup`` in pyproject.toml), and the lock is kept from one to the next: the
# machine drains once per run, not once per test (23 drains left the cores ~28% idle).
import contextlib  # noqa: E402
import fcntl  # noqa: E402

ALONE_GROUP = "alone"


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "alone: runs with no other test beside it when the suite runs in parallel")
  _start_zygote(config)


@pytest.hookimpl(tryfirst=True)      # before xdist's loadgroup reads the groups
def pytest_collection_modifyitems(items):
  for item in items:
    if _alone(item):
      item.add_marker(pytest.mark.xdist_group(ALONE_GROUP))


def _alone(item):
  return item is not None and item.get_closest_marker("alone") is not None


class _MachineShare:
  """This pytest process's share of the machine: the lock files and whether it holds the
  exclusive lock (kept while ``alone`` tests follow each other)."""

  def __init__(self):
    self._files = None
    self.exclusive = False

  def _open(self):
    if self._files is None:
      base = os.path.join(tempfile.gettempdir(),
                          "epl-tests-%s" % os.environ["PYTEST_XDIST_TESTRUNUID"])
      os.makedirs(base, exist_ok=True)
      self._files = (open(os.path.join(base, "gate"), "a"),
                     open(os.path.join(base, "share"), "a"))
    return self._files

  @contextlib.contextmanager
  def held(self, alone, next_alone):
    if not os.environ.get("PYTEST_XDIST_TESTRUNUID"):  # one pytest process: all alone
      yield
      return
    gate, share = self._open()
    if not self.exclusive:
      fcntl.flock(gate, fcntl.LOCK_EX)
      if alone:
        fcntl.flock(share, fcntl.LOCK_EX)     # waits for the running tests; the gate holds
        self.exclusive = True                 # back the ones that have not started
      else:
        fcntl.flock(share, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
      yield
    finally:
      if not (self.exclusive and next_alone):
        fcntl.flock(share, fcntl.LOCK_UN)
        if self.exclusive:
          fcntl.flock(gate, fcntl.LOCK_UN)
          self.exclusive = False


_SHARE = _MachineShare()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  with _SHARE.held(_alone(item), _alone(nextitem)):
    yield
