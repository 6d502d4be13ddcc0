#!/usr/bin/env bash
# One command for the GPU: the whole test suite compiled for real, then the benchmark harness.
#
#   bash scripts/gpu-check.sh                 # tests, then every benchmark
#   TESTS="tests/ops -k rms" BENCH="rms_norm" bash scripts/gpu-check.sh
#   BENCH=none bash scripts/gpu-check.sh      # tests only;   TESTS=none: benchmarks only
#
# Everything goes into $OUT (./gpu-check-out unless set): env.txt, tests.log and tests-bigmem.log,
# junit.xml and junit-bigmem.xml, bench/<device>-<date>.{json,md,png}. A short summary is printed last.
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
  # Kernel compilation dominates a fresh machine's run: four workers when pytest-xdist is there (one
  # test file per worker). Tests marked bigmem (>2**31-element tensors, 1B-parameter models) need most
  # of the card, so they run afterwards, one at a time: one pass, one verdict, no re-run.
  parallel=""
  python3 -c "import xdist" 2>/dev/null && parallel="-n 4 --dist loadfile"
  # shellcheck disable=SC2086
  python3 -m pytest $TESTS -m "not bigmem" -q $parallel -rf --tb=short --durations=15 \
    --junitxml="$OUT/junit.xml" >"$OUT/tests.log" 2>&1
  parallel_rc=$?
  # shellcheck disable=SC2086
  python3 -m pytest $TESTS -m bigmem -q -rf --tb=short --durations=10 --junitxml="$OUT/junit-bigmem.xml" \
    >"$OUT/tests-bigmem.log" 2>&1
  bigmem_rc=$?
  [ $bigmem_rc -eq 5 ] && bigmem_rc=0  # no bigmem test among $TESTS
  test_rc=$(( parallel_rc != 0 || bigmem_rc != 0 ))
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
  echo "tests ($([ $test_rc -eq 0 ] && echo PASS || echo FAIL)):"
  grep -hE "^(FAILED|ERROR)" "$OUT/tests.log" "$OUT/tests-bigmem.log" | head -30
  echo "  parallel: $(tail -n 1 "$OUT/tests.log")"
  echo "  bigmem, one at a time: $(tail -n 1 "$OUT/tests-bigmem.log")"
fi
if [ "$BENCH" != none ]; then
  echo "bench (rc=$bench_rc):"
  cat "$OUT"/bench/*.md 2>/dev/null || tail -n 20 "$OUT/bench.log"
fi
exit $(( test_rc != 0 || bench_rc != 0 ))
