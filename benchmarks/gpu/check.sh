#!/usr/bin/env bash
# GPU check for shm-cuda, for a lent GPU machine (cupy-cuda13x preinstalled, no network).
#
# Builds and installs shm-core (scikit-build-core, cmake and ninja are on that
# machine; there is no network, hence no build isolation and no dependencies),
# puts the pure-Python packages on PYTHONPATH (their build backend, hatchling,
# is not there; the machine's cupy-cuda13x stands in for the declared
# cupy-cuda12x), runs the shm-cuda tests (the GPU ones and the CPU ones, which
# check the platform: memfd, /proc, pidfd) and the transfer benchmark, and
# writes everything to $OUT when set. Budget: under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/packages/shm-cuda/src:$PWD/packages/shm-manager/src:$PWD/packages/mp-reductions/src${PYTHONPATH:+:$PYTHONPATH}"

echo "== environment"
nvidia-smi || true
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"

echo "== install shm-core (no deps, no build isolation)"
timeout 240 "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall packages/shm-core \
    || { echo "install failed: shm-core needs scikit-build-core, cmake and a C compiler"; exit 2; }

echo "== shm-cuda tests"
timeout 330 "$PY" -m pytest -p no:cacheprovider -q -ra --junitxml="$OUT/tests.xml" packages/shm-cuda/tests
tests_rc=$?

echo "== transfer benchmark"
timeout 150 "$PY" benchmarks/gpu/transfer.py --json "$OUT/transfer.json"
bench_rc=$?

echo "tests rc=$tests_rc bench rc=$bench_rc; results in $OUT"
exit $(( tests_rc != 0 ? tests_rc : bench_rc ))
