"""What a person sees of the workers' output (pure functions; epl-launch uses them).

Every line a worker writes goes to its log file. On the console it is prefixed with the
worker's rank, ``[1] ...``, like horovodrun -- except TensorFlow's start-up noise on a machine
without GPUs (absl's pre-init banner, oneDNN and CPU-feature notices, ``failed call to
cuInit``, connection retries while the peers start, deprecation warnings and the code line
Python prints under them), which reaches the console only with ``--debug``.
"""
import re
import signal

NOISE = tuple(re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"^[IW]\d{4} ",                                     # TF C++ info / warning lines
    r"^E\d{4} .*(cuInit|cuda_platform|cuda_dnn|cuda_blas|cuda_fft)",
    r"^E\d{4} .*(Connection refused|failed to connect to all addresses)",
    r"^Additional GRPC error information from remote target .*(GetStepSequence|GetStatus|"
    r"CreateWorkerSession)",
    r"^:UNKNOWN:Error received from peer .*(Connection refused|failed to connect)",
    r"oneDNN custom operations are on",
    r"This TensorFlow binary is optimized",
    r"To enable the following instructions",
    r"Could not find cuda drivers",
    r"^WARNING:tensorflow:From ",
    r"^Instructions for updating:",
    r"^This is a deprecated API that should only be used in TF 1 graph mode",
    r"^non-resource variables are not supported in the long term",
    r"^Colocations handled automatically by placer\.",
    r"^Use tf\.(gfile|compat|keras|data|identity|cast|where)",
    r"^Use standard file (utilities|APIs) ",
    r"^Prefer Variable\.assign which has equivalent behavior",
    r"Warning: `tf\.layers\.[a-z_0-9]+` is deprecated",
    r"^[A-Za-z]*Warning: ",
))


class NoiseFilter:
  """Drops noise lines, and the indented source line Python prints under a warning."""

  def __init__(self, debug=False):
    self.debug = debug
    self._after_warning = False

  def keep(self, line):
    if self.debug:
      return True
    text = line.rstrip("\n")
    if self._after_warning and text.startswith("  "):
      self._after_warning = False
      return False
    self._after_warning = False
    for pattern in NOISE:
      if pattern.search(text):
        self._after_warning = "Warning" in text or text.startswith("Instructions")
        return False
    return True


def prefixed(rank, line):
  return "[%d] %s" % (rank, line if line.endswith("\n") else line + "\n")


def describe_exit(code):
  """'exit code 3' or 'killed by SIGKILL'."""
  if code is not None and code < 0:
    try:
      return "killed by %s" % signal.Signals(-code).name
    except ValueError:
      return "killed by signal %d" % -code
  return "exit code %s" % code


def last_traceback(text, fallback_lines=20, limit=60):
  """The first traceback of a log's last error (chained ones included) to its end, without
  noise; or the log's last lines when there is none."""
  noise = NoiseFilter()
  lines = [line for line in text.splitlines() if noise.keep(line)]
  starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
  if not starts:
    return "\n".join(lines[-fallback_lines:])
  first = starts[-1]
  while first > 0 and any(lines[j].startswith(("During handling", "The above exception"))
                          for j in range(max(0, first - 2), first)):
    earlier = [i for i in starts if i < first]          # the chained one before it
    if not earlier:
      break
    first = earlier[-1]
  block = lines[first:]
  return "\n".join(block if len(block) <= limit else block[:limit // 2] + ["    ..."] +
                   block[-limit // 2:])
