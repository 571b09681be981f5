"""A fork server for the tests' worker processes (test infrastructure, not part of epl).

Every worker a test starts imports TensorFlow: ~3.8 s of CPU per process, ~290 processes a
run -- over half of the suite's CPU on these 2-core machines. The zygote imports TensorFlow,
numpy and epl once per pytest process; a worker started through it is a fork of that process
running its script as ``python script args`` would.

It is plugged in through epl-launch's own key: conftest.py sets
``EPL_LAUNCH_PYTHON="<python> tests/zygote.py"`` for the session, so a .py worker that
epl-launch starts runs ``zygote.py script args`` -- the client. The client (no TensorFlow:
~40 ms) hands the zygote its argv, environment, working directory, limits and standard
streams; the zygote forks; the client relays signals to the child and ends as the child
ended (its exit code, or killed by the same signal), so epl-launch sees the worker it started.
If the client dies (SIGKILL, a killed process group), the zygote kills the child (also a
stopped one); if the zygote is gone too, the child notices its pipe close and kills itself.

A fork stands in for a fresh process only where nothing read at start-up differs: the client
runs the script itself (``exec python script args``) when no zygote is ready, when its
environment differs from the zygote's in a variable read when Python or TensorFlow starts
(PYTHON*, LD_*, TF_CPP_*, ...), or when it is in another namespace (a test's network
namespace "host").
"""
import json
import os
import signal
import socket
import sys

ADDRESS = "EPL_TEST_ZYGOTE"          # the zygote's socket, in the environment
ZYGOTE_PYTHONPATH = os.environ.get("PYTHONPATH", "")     # the zygote's own, at its start
# read when Python, TensorFlow or the allocator start: a fork keeps the zygote's
STARTUP = ("PYTHON", "LD_", "TF_CPP_", "TF_ENABLE_", "TF_USE_LEGACY_KERAS", "TF_XLA", "XLA_",
           "MALLOC", "OMP_", "KMP_", "CUDA_", "TF2_BEHAVIOR")
NAMESPACES = ("net", "mnt", "pid", "uts", "ipc", "user")
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE", "RLIMIT_STACK")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)


def _startup_env(env):
  """The variables read at start-up; PYTHONPATH apart (the child sets its own sys.path)."""
  return {k: v for k, v in env.items() if k.startswith(STARTUP) and k != "PYTHONPATH"}


def _python_path(env):
  return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _namespaces():
  seen = {}
  for name in NAMESPACES:
    try:
      seen[name] = os.readlink("/proc/self/ns/%s" % name)
    except OSError:
      seen[name] = None
  return seen


def _limits():
  import resource
  return {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}


def python():
  """The argv prefix that runs a script as ``python script`` would: through this pytest
  process's zygote when it has one (for tests that start workers without epl-launch)."""
  if os.environ.get(ADDRESS) and os.environ.get(ADDRESS) != "0":
    return [sys.executable, os.path.abspath(__file__)]
  return [sys.executable]


# ---- the client: what epl-launch starts -------------------------------------------------

def client(argv):
  """Runs ``argv`` (a script and its arguments) in a fork of the zygote; never returns."""
  address = os.environ.get(ADDRESS)
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    if not address:
      raise OSError("no zygote")
    sock.connect(address)
  except OSError:
    _exec(argv)
  life_r, life_w = os.pipe()
  socket.send_fds(sock, [b"f"], [0, 1, 2, life_r])
  os.close(life_r)
  sock.sendall(json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                           "ns": _namespaces(), "limits": _limits()}).encode() + b"\n")
  answers = sock.makefile("rb")
  first = json.loads(answers.readline() or b'{"refused": "the zygote is gone"}')
  if "refused" in first:
    sock.close()
    os.close(life_w)
    _exec(argv)
  pid = first["pid"]
  for sig in FORWARDED:
    signal.signal(sig, lambda number, _frame: _forward(pid, number))
  line = answers.readline()
  if not line:                      # the zygote died: wait for the child by its pid
    import time
    while os.path.exists("/proc/%d" % pid):
      time.sleep(0.2)
    sys.exit(1)
  ended = json.loads(line)
  if ended.get("signal"):                       # end as the child did: by the same signal
    for sig in FORWARDED:
      signal.signal(sig, signal.SIG_DFL)
    if ended["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
      signal.signal(ended["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), ended["signal"])
    sys.exit(128 + ended["signal"])
  sys.exit(ended["code"])


def _forward(pid, number):
  try:
    os.kill(pid, number)
  except ProcessLookupError:
    pass


def _exec(argv):
  os.execv(sys.executable, [sys.executable] + list(argv))


# ---- the zygote --------------------------------------------------------------------------

def serve(address):
  """Imports what the workers import, then forks a child per client until its parent (the
  pytest process) is gone."""
  import numpy  # noqa: F401
  import tensorflow.compat.v1  # noqa: F401
  import epl  # noqa: F401
  import epl.runtime.hooks  # noqa: F401
  import epl.testing  # noqa: F401
  import tf_keras  # noqa: F401
  import select
  parent = os.getppid()
  wake_r, wake_w = os.pipe()                    # a child's exit wakes the loop at once: the
  os.set_blocking(wake_w, False)                # launcher names the worker that ended first
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  mine = (_startup_env(os.environ), _namespaces())
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(address + ".new")
  os.rename(address + ".new", address)          # clients connect once everything imported
  listener.listen(64)
  children = {}                                 # pid -> the client's connection
  killed = set()                                # children whose client is gone
  while os.getppid() == parent:
    watched = [c for p, c in children.items() if p not in killed]
    ready, _, _ = select.select([listener, wake_r] + watched, [], [], 0.2)
    for conn in ready:
      if conn is wake_r:
        os.read(wake_r, 4096)
      elif conn is listener:
        _accept(listener, children, mine, (wake_r, wake_w))
      else:                                     # a client is gone: so is its worker
        pid = {c: p for p, c in children.items()}[conn]
        killed.add(pid)
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError:
          pass
    while children:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if not pid:
        break
      conn = children.pop(pid, None)
      killed.discard(pid)
      if conn is not None:
        ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                 else {"code": os.waitstatus_to_exitcode(status)})
        try:
          conn.sendall(json.dumps(ended).encode() + b"\n")
        except OSError:
          pass
        conn.close()
  try:
    os.unlink(address)
  except OSError:
    pass


def _accept(listener, children, mine, private):
  conn, _ = listener.accept()
  conn.settimeout(10)
  try:
    _, fds, _, _ = socket.recv_fds(conn, 1, 8)
    data = b""
    while not data.endswith(b"\n"):
      chunk = conn.recv(1 << 16)
      if not chunk:
        raise OSError("the client left")
      data += chunk
  except OSError:
    conn.close()
    return
  request = json.loads(data)
  why = _refusal(request, mine)
  if os.environ.get("EPL_TEST_ZYGOTE_LOG"):
    with open(os.environ["EPL_TEST_ZYGOTE_LOG"], "a") as f:
      f.write("%s %s\n" % ("refused: " + why if why else "forked:", " ".join(request["argv"])))
  if why:
    conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
    conn.close()
    for fd in fds:
      os.close(fd)
    return
  pid = os.fork()
  if pid == 0:
    try:
      listener.close()
      conn.close()
      for other in children.values():
        other.close()
      for fd in private:
        os.close(fd)
      _run_child(request, fds)
    finally:
      os._exit(70)
  for fd in fds:
    os.close(fd)
  conn.settimeout(None)
  children[pid] = conn
  try:
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
  except OSError:               # the client left before its answer (a killed launcher):
    os.kill(pid, signal.SIGKILL)  # its worker goes too; the loop reaps it


def _refusal(request, mine):
  env, ns = mine
  theirs = _startup_env(request["env"])
  if theirs != env:
    keys = sorted(k for k in set(theirs) | set(env) if theirs.get(k) != env.get(k))
    return "start-up environment differs: %s" % ",".join(keys)
  if request["ns"] != ns:
    return "another namespace"
  return ""


def _run_child(request, fds):
  """In the fork: become ``python script args`` started by the client, run it, exit."""
  _become(request, fds)
  _run_script(request["argv"][0])


def _become(request, fds):
  """The client's process state: its streams, signals, limits, directory, environment,
  argv and sys.path; fresh random seeds; a watch that ends the child with its client."""
  import io
  import random
  import resource
  import threading
  import numpy
  signal.set_wakeup_fd(-1)
  os.setsid()
  for target, fd in zip((0, 1, 2), fds[:3]):
    os.dup2(fd, target)
    os.close(fd)
  life = fds[3]
  for sig in FORWARDED + (signal.SIGCHLD,):
    signal.signal(sig, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  for name, value in request["limits"].items():
    try:
      resource.setrlimit(getattr(resource, name), tuple(value))
    except (ValueError, OSError):
      pass
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  script = request["argv"][0]
  sys.argv = list(request["argv"])
  zygotes = set(_python_path({"PYTHONPATH": ZYGOTE_PYTHONPATH}))
  sys.path[:] = ([os.path.dirname(os.path.abspath(script))] + _python_path(os.environ) +
                 [p for p in sys.path[1:] if os.path.abspath(p) not in zygotes])
  random.seed()
  numpy.random.seed()
  unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
  sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
  sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
  sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                write_through=unbuffered)

  def watch_client():
    while os.read(life, 1):
      pass
    os.kill(os.getpid(), signal.SIGKILL)        # the client and the zygote are gone
  threading.Thread(target=watch_client, name="zygote-client-watch", daemon=True).start()


def _run_script(script):
  """Runs ``script`` as ``__main__`` and exits as the interpreter would after it."""
  import atexit
  import runpy
  import threading
  code = 0
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    code = _exit_code(e.code)
  except BaseException as e:  # noqa: B902 -- as the interpreter reports an uncaught one
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
      tb = tb.tb_next
    sys.excepthook(type(e), e, tb)
    code = 1
    if isinstance(e, KeyboardInterrupt):
      code = -signal.SIGINT
  threading._shutdown()                         # as at a normal exit: non-daemon threads
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  os._exit(code & 0xFF)


def _exit_code(value):
  if value is None:
    return 0
  if isinstance(value, int):
    return value
  print(value, file=sys.stderr)
  return 1


if __name__ == "__main__":
  if sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
  else:
    client(sys.argv[1:])
