"""Test-only: make TensorFlow reject a chosen step as a duplicate request, for real.

TF rejects a step when the RunGraph request id its master drew repeats one a worker saw among
its last 100,000 (epl._tf_compat explains where the ids come from). The id of a step is the
first output of a thread-local mt19937_64 seeded by ``std::random_device`` on the new thread the
master starts for that step. A small C library, preloaded into a worker
(``LD_PRELOAD=shim_path()``), replaces ``std::random_device``'s draw; the worker's script
arms it:

  * ``Seeds().reject(k, times)`` before step k - 1: step k - 1 draws seed C (its id is
    f(C), accepted), then step k draws C again -- f(C) again, which the worker rejects with
    TF's own error -- ``times`` times in a row; the rerun after that draws a random seed.
  * ``EPL_TEST_SEED_BITS=b`` in the worker's environment keeps only b random bits per seed:
    rejections happen 2^(32 - b) times as often as with TF's 32 (bench/rejections.py measures
    the rate per step path this way).

Only TF's own ids depend on these seeds: with ``communication.unique_request_ids`` (epl's
default) no step is rejected whatever the shim does, which tests/test_rejections.py also shows.
Needs a C compiler (``cc``) at test time.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#include <stdlib.h>
#include <sys/random.h>

/* std::random_device::_M_getval(), which libstdc++'s random_device::operator() calls */
static volatile int armed = 0;
static volatile unsigned forced = 0;
static volatile unsigned long long draws = 0;
static int bits = -1;

unsigned int _ZNSt13random_device9_M_getvalEv(void *self) {
  (void)self;
  __sync_fetch_and_add(&draws, 1);
  for (;;) {
    int left = armed;
    if (left <= 0) break;
    if (__sync_bool_compare_and_swap(&armed, left, left - 1)) return forced;
  }
  unsigned value = 0;
  while (getrandom(&value, sizeof value, 0) != sizeof value) {}
  if (bits < 0) {
    const char *b = getenv("EPL_TEST_SEED_BITS");
    bits = b ? atoi(b) : 32;
  }
  if (bits < 32) value &= (1u << bits) - 1u;
  return value;
}

void epl_test_arm(unsigned value, int count) { forced = value; armed = count; }
unsigned long long epl_test_draws(void) { return draws; }
"""


def shim_path():
  """Builds (once per source, in a cache folder) and returns the preloadable library."""
  digest = hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]
  folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(
      tempfile.gettempdir(), "epl-cache"), "rejections")
  path = os.path.join(folder, "seeds_%s.so" % digest)
  if os.path.exists(path):
    return path
  compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
  if compiler is None:
    raise RuntimeError("epl.testing.rejections needs a C compiler (cc) to build its library")
  os.makedirs(folder, exist_ok=True)
  source = path[:-3] + ".c"
  with open(source, "w") as f:
    f.write(_SOURCE)
  scratch = "%s.%d" % (path, os.getpid())
  subprocess.run([compiler, "-O2", "-shared", "-fPIC", source, "-o", scratch], check=True,
                 capture_output=True)
  os.replace(scratch, path)
  return path


def preloaded(env, bits=None):
  """``env`` (a dict) for a worker process that loads the library."""
  env = dict(env, LD_PRELOAD=shim_path())
  if bits is not None:
    env["EPL_TEST_SEED_BITS"] = str(bits)
  return env


class Seeds:
  """In a worker started with ``preloaded``: arms the library (see the module docstring)."""

  def __init__(self):
    self._lib = ctypes.CDLL(os.environ["LD_PRELOAD"].split(":")[0])
    self._lib.epl_test_draws.restype = ctypes.c_ulonglong
    self._plan = {}

  def draws(self):
    """Seeds drawn so far in this process (one per new thread that made a request id)."""
    return self._lib.epl_test_draws()

  def plan(self, rejections):
    """``{step: times}``: TF rejects training step ``step`` (0-based) ``times`` times."""
    for step, times in rejections.items():
      self._plan[step - 1] = (1, 1000 + step)
      self._plan[step] = (times, 1000 + step)

  def before_step(self, step):
    """Call right before running training step ``step``."""
    if step in self._plan:
      count, seed = self._plan.pop(step)
      self._lib.epl_test_arm(seed, count)
