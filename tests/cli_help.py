"""A console script's ``--help`` answers at once: it never imports TensorFlow (what would
make it slow; a wall-clock bound on a shared machine would test the machine)."""
import os
import subprocess
import sys


def assert_help_is_instant(script, module, expected):
  """``script`` (console script name) or ``python -m module`` prints ``expected``, and
  ``module.main(['--help'])`` loads no tensorflow module."""
  path = os.path.join(os.path.dirname(sys.executable), script)
  command = [path] if os.path.exists(path) else [sys.executable, "-m", module]
  result = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0 and expected in result.stdout, result.stderr
  code = ("import sys, %s as cli\n"
          "try:\n  cli.main(['--help'])\nexcept SystemExit:\n  pass\n"
          "assert not [m for m in sys.modules if m.startswith('tensorflow')], 'TF imported'\n"
          % module)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 0, result.stderr
