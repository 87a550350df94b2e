#!/usr/bin/env bash
# GPU check for shm-cuda, for a lent GPU machine (cupy-cuda13x preinstalled, no network).
#
# Installs shm-core and shm-cuda without dependencies (cupy-cuda12x is declared,
# but the machine's cupy is used), runs the `gpu` tests and the transfer
# benchmark, and writes everything to $OUT when set. Budget: under 8 minutes.
#
# shm-core is a C extension built by scikit-build-core + CMake; --no-build-isolation
# uses the build tools already installed (pip install scikit-build-core cmake ninja
# beforehand where they are missing; there is no network on the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
PY="${PYTHON:-python3}"

echo "== environment"
nvidia-smi || true
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"

echo "== install (no deps, no build isolation)"
timeout 240 "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall packages/shm-core packages/shm-cuda \
    || { echo "install failed: shm-core needs scikit-build-core, cmake and a C compiler"; exit 2; }

echo "== gpu tests"
timeout 300 "$PY" -m pytest -m gpu -p no:cacheprovider -q --junitxml="$OUT/gpu-tests.xml" packages/shm-cuda/tests
tests_rc=$?

echo "== transfer benchmark"
timeout 120 "$PY" benchmarks/gpu/transfer.py --json "$OUT/transfer.json"
bench_rc=$?

echo "tests rc=$tests_rc bench rc=$bench_rc; results in $OUT"
exit $(( tests_rc != 0 ? tests_rc : bench_rc ))
