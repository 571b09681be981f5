#!/usr/bin/env bash
# Builds Horovod 0.28.1 (TensorFlow + Gloo, no MPI) into a virtualenv, as a benchmark peer for
# bench/dp_scaling.py. Not needed by epl.
#
#   bash bench/build_horovod.sh [VENV]        # default: .venv of this checkout
#
# Horovod 0.28.1 predates TF 2.21: it builds against it once MPI is off and the XLA MPI op
# source (which uses TF's removed XLA custom-call registry) is left out of the TF target.
# Needs a C++17 compiler (CMake 3 comes from pip); about 5-10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$VENV/bin/pip" download -q horovod==0.28.1 --no-deps --no-binary :all: -d "$work"
tar -xzf "$work/horovod-0.28.1.tar.gz" -C "$work"
src="$work/horovod-0.28.1"
sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
# CMake 4 refuses Gloo's CMakeLists (cmake_minimum_required below 3.5): take a CMake 3
"$VENV/bin/pip" install -q "cmake>=3.13,<4"
export PATH="$VENV/bin:$PATH"
export CMAKE_POLICY_VERSION_MINIMUM=3.5        # in case a CMake 4 is found first anyway
HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
  MAKEFLAGS="-j$(nproc)" \
  "$VENV/bin/pip" install --no-build-isolation --no-cache-dir "$src"
"$VENV/bin/python" -c "import horovod.tensorflow as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else 'ok')"
