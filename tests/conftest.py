import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()
tf.logging.set_verbosity(tf.logging.ERROR)


# ---- the workers' fork server (tests/zygote.py) -----------------------------------------
import shutil  # noqa: E402
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
  if _RUN in config.stash:
    shutil.rmtree(config.stash[_RUN], ignore_errors=True)
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
# end), so the ``alone`` tests are one unit of xdist's work, run one after another in one
# process, and the lock is kept from one to the next: the machine drains once per run, not
# once per test (23 drains left the cores ~28% idle). xdist's own ``xdist_group`` cannot do
# the grouping with pytest 9.2 (it renames the item through ``_nodeid``, which pytest no longer
# reads), so the controller's scheduler groups them (``pytest_xdist_make_scheduler``) from the
# list each test process writes when it has collected.
import contextlib  # noqa: E402
import fcntl  # noqa: E402

ALONE_GROUP = "alone"
_RUN_DIR = "EPL_TESTS_RUN_DIR"       # this run's lock files and the alone tests' list
_RUN = pytest.StashKey()


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "alone: runs with no other test beside it when the suite runs in parallel")
  if not hasattr(config, "workerinput"):      # the controller: its test processes inherit it
    config.stash[_RUN] = os.environ[_RUN_DIR] = tempfile.mkdtemp(prefix="epl-tests-")
  _start_zygote(config)


def pytest_collection_modifyitems(config, items):
  if hasattr(config, "workerinput") and os.environ.get(_RUN_DIR):
    path = os.path.join(os.environ[_RUN_DIR], "alone.%s" % config.workerinput["workerid"])
    with open(path + ".new", "w") as f:
      f.write("\n".join(item.nodeid for item in items if _alone(item)))
    os.replace(path + ".new", path)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadGroupScheduling

  class AloneGroup(LoadGroupScheduling):
    """xdist's loadgroup, with the ``alone`` tests one group (read from the first list a test
    process wrote: every process collects the same tests, which xdist checks)."""
    _alone_ids = None

    def _split_scope(self, nodeid):
      if self._alone_ids is None:
        base = os.environ[_RUN_DIR]
        name = next(n for n in sorted(os.listdir(base))
                    if n.startswith("alone.gw") and not n.endswith(".new"))
        with open(os.path.join(base, name)) as f:
          self._alone_ids = set(f.read().split("\n"))
      return ALONE_GROUP if nodeid in self._alone_ids else super()._split_scope(nodeid)
  return AloneGroup(config, log)


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
      base = os.environ[_RUN_DIR]
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


# ---- each test starts as a fresh script would -------------------------------------------
@pytest.fixture(autouse=True)
def _no_annotations_left_behind():
  """A test that annotated a graph and built no model in it (a refused annotation) leaves
  epl's state as a script would that went on after the error: a later plain-TF session in the
  same process is then refused for those annotations (epl.runtime.hooks, unmanaged_run), and
  tests share processes in any order. epl starts again on an empty graph after such a test."""
  yield
  env = sys.modules.get("epl.env")
  current = env.Env._current if env else None  # pylint: disable=protected-access
  state = current._state if current is not None else None  # pylint: disable=protected-access
  if state is not None and state.recorder.specs and state.untouched:
    import epl
    with tf.Graph().as_default():
      epl.init()
