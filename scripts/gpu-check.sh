#!/usr/bin/env bash
# One command for the GPU: the whole test suite compiled for real, then the benchmark harness.
#
#   bash scripts/gpu-check.sh                 # tests, then every benchmark
#   TESTS="tests/ops -k rms" BENCH="rms_norm" bash scripts/gpu-check.sh
#   BENCH=none bash scripts/gpu-check.sh      # tests only;   TESTS=none: benchmarks only
#
# Everything goes into $OUT (the device tool's output folder; ./gpu-check-out elsewhere): env.txt,
# tests.log (tests-rerun.log), junit.xml, bench/<device>-<date>.{json,md,png}. A short summary is printed last.
# Wheels in .whl/ (git-ignored: liger-kernel, pytest, ...) are installed to /tmp/site first, so the
# image's packages stay untouched.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT/bench"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
TESTS=${TESTS:-tests}
BENCH=${BENCH:-all}

python3 -m tigon.cli env 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >>"$OUT/env.txt" 2>&1

test_rc=0
if [ "$TESTS" != none ]; then
  # Kernel compilation dominates a fresh machine's run: four workers when pytest-xdist is there
  # (one test file per worker, so a file's >2**31-element tests do not run side by side).
  parallel=""
  python3 -c "import xdist" 2>/dev/null && parallel="-n 4 --dist loadfile"
  # shellcheck disable=SC2086
  python3 -m pytest $TESTS -q $parallel -rf --tb=short --durations=15 --junitxml="$OUT/junit.xml" \
    >"$OUT/tests.log" 2>&1
  test_rc=$?
  if [ $test_rc -ne 0 ] && [ -n "$parallel" ]; then
    # Four workers share one card: a large test can run out of memory only because another worker's
    # large test holds the rest. Run what failed again, alone, and report both runs.
    python3 -m pytest --lf -q -rf --tb=short >"$OUT/tests-rerun.log" 2>&1
    test_rc=$?
  fi
fi

bench_rc=0
if [ "$BENCH" != none ]; then
  ops=""; [ "$BENCH" != all ] && ops=$BENCH
  # shellcheck disable=SC2086
  python3 -m tigon.cli bench $ops --out "$OUT/bench" >"$OUT/bench.log" 2>&1
  bench_rc=$?
  tail -n 5 "$OUT/bench.log"
fi

echo
echo "================================ summary ================================"
head -n 8 "$OUT/env.txt"
if [ "$TESTS" != none ]; then
  echo "tests (rc=$test_rc):"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  tail -n 1 "$OUT/tests.log"
  [ -f "$OUT/tests-rerun.log" ] && { echo "failures re-run alone:"; tail -n 3 "$OUT/tests-rerun.log"; }
fi
if [ "$BENCH" != none ]; then
  echo "bench (rc=$bench_rc):"
  cat "$OUT"/bench/*.md 2>/dev/null || tail -n 20 "$OUT/bench.log"
fi
exit $(( test_rc != 0 || bench_rc != 0 ))
