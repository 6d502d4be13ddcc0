#!/usr/bin/env bash
# The test suite on a GPU, kernels compiled for real, in two parts; each part is sized for one 10-minute call and
# ends in one line: VERDICT <part> transformers <version>: PASS|FAIL (N passed, N failed, N skipped).
#
#   bash scripts/gpu-check.sh               # PART=suite: every test, on the machine's transformers
#   bash scripts/gpu-check.sh top           # PART=top: tests/patching (the TRL head among them), the TRL step
#                                           #   benchmark's, the demo's and the examples' tests on the release
#                                           #   whose wheels are in .whl-top/ (the newest one)
#   TESTS="tests/ops -k rms" bash scripts/gpu-check.sh    # another selection, in either part
#   TESTS=none BENCH=all bash scripts/gpu-check.sh        # the benchmark harness only (BENCH="rms_norm jsd": some ops)
#
# Wheels in .whl/ (git-ignored: trl, datasets, peft, liger-kernel and what they need) and .whl-bnb/ (bitsandbytes,
# for the QLoRA tests) go to $SITE (/tmp/site), after src/ on PYTHONPATH, so the image's packages stay untouched
# (each folder is optional: the tests of a missing peer skip). PART=top installs .whl-top/ (transformers and
# each requirement of it newer than the machine's or missing there: for 5.25 huggingface_hub 2.4 and its httpx2,
# httpcore2, truststore, idna, anyio, click and hf-xet, then regex, accelerate and kernels, which from_pretrained
# loads on a CUDA device) to $SITE-top, ahead of $SITE: the suite part tests the
# machine's own transformers.
#
# Time: kernel compilation dominates a fresh machine, so the tests not marked bigmem run on WORKERS xdist
# workers (3/4 of the cores), spread a test at a time (--dist loadgroup; a file whose tests share a module
# fixture stays on one worker, see tests/conftest.py). Tests marked bigmem (>2**31-element tensors, 1B-parameter
# models) run one at a time in one process, alongside the parallel part. The card's memory is shared through a
# ledger (tests/gpu_share.py, $OUT/gpu-ledger.json): each bigmem test, and each test of the parallel part that
# tests/gpu_memory.txt lists (3 GiB or more), holds its share from before it starts until its memory is given
# back, within the card's memory less 3 GiB a process (a CUDA context and the cache a worker keeps), so that the
# large tests wait for each other instead of running out of memory (BIGMEM=after|none|only: the bigmem tests
# after the parallel part, left out, or alone). Each worker compiles torch.compile's kernels in its own process
# (TORCHINDUCTOR_COMPILE_THREADS=1: the workers already fill the cores, a compile pool each would oversubscribe
# them). pytest-timeout stops any one test after TEST_TIMEOUT s (240: the torchrun launches of the distributed
# tests, under the interpreter, take a minute or two), and every pytest stops BUDGET_S s (540) after the script
# started, leaving the summary within the call's 600 s.
#
# $OUT (./gpu-check-out unless set) gets env.txt, tests-{parallel,bigmem}.log, junit-{parallel,bigmem}.xml,
# results-{parallel,bigmem}.txt (one "outcome nodeid" line per test, written as each ends, so a run stopped by
# the budget still counts), collected-{parallel,bigmem}.txt (how many tests each pytest collected: a part the
# budget stops after its last test, in pytest's shutdown, still passes), memory-{parallel,bigmem}.txt (each
# test's peak reserved GPU memory above 1 GiB: tests/gpu_memory.txt's form), gpu-ledger.json (the memory ledger's
# shares) and ledger-waits.txt (each wait for a share over 1 s), gpu-durations.txt (the tests that took 8 s or more:
# tests/gpu_durations.txt's form, which orders a GPU run) and, with BENCH, bench.log and
# bench/<device>-<date>.{json,md,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-${PART:-suite}}
case $PART in
  suite) DEFAULT_TESTS=tests ;;
  top) DEFAULT_TESTS="tests/patching tests/bench/test_trl_steps.py tests/test_demo.py tests/test_examples.py" ;;
  *) echo "PART is suite or top, not '$PART'" >&2; exit 2 ;;
esac
TESTS=${TESTS:-$DEFAULT_TESTS}
BENCH=${BENCH:-none}
BUDGET_S=${BUDGET_S:-540}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
OUT=${OUT:-$PWD/gpu-check-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT/bench"
rm -f "$OUT"/results-*.txt "$OUT"/memory-*.txt "$OUT"/junit-*.xml "$OUT"/tests-*.log "$OUT"/collected-*.txt \
  "$OUT"/ledger-waits.txt
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# transformers 5.25's from_pretrained on a CUDA device swaps layers for kernels it downloads from the Hugging Face
# Hub (its `use_kernels` defaults to on); the GPU machine has no network, so the tests run with the Hub kernels off,
# as an offline user's job does.
export USE_HUB_KERNELS=0

setup_rc=0
install() {  # wheel folder, target folder
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}
for wheels in .whl .whl-bnb; do
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    install "$wheels" "$SITE" || setup_rc=1
  fi
done
[ -d "$SITE" ] && PYTHONPATH=$PYTHONPATH:$SITE
if [ "$PART" = top ]; then
  if ls .whl-top/*.whl >/dev/null 2>&1; then
    install .whl-top "$SITE-top" || setup_rc=1
    PYTHONPATH=$PWD/src:$SITE-top${PYTHONPATH#"$PWD/src"}
  else
    echo "PART=top needs the release's wheels in .whl-top/" >&2
    setup_rc=1
  fi
fi
TRANSFORMERS=$(python3 -c "import transformers; print(transformers.__version__)" 2>/dev/null || echo "(import failed)")

python3 -m tigon.cli env 2>&1 | tee "$OUT/env.txt"
python3 - >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as metadata

for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "peft", "trl",
             "datasets", "pyarrow", "deepspeed", "liger_kernel", "pytest", "pytest-xdist", "pytest-timeout"):
    try:
        print(f"{name:16} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:16} not installed")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >>"$OUT/env.txt" 2>&1

if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  gpu_gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  WORKERS=${WORKERS:-$(( $(nproc) * 3 / 4 ))}
  BIGMEM=${BIGMEM:-along}
  export TIGON_GPU_LEDGER="$OUT/gpu-ledger.json" TIGON_TEST_WAITS="$OUT/ledger-waits.txt"
  export TIGON_GPU_SHARE_GIB=$(( gpu_gib - 3 * (WORKERS + 1) ))
  [ "$TIGON_GPU_SHARE_GIB" -ge 8 ] || TIGON_GPU_SHARE_GIB=8
  rm -f "$TIGON_GPU_LEDGER"
fi
WORKERS=${WORKERS:-0}  # no GPU: one process (the interpreter's CPU run, as CI's but without its -n 2)
BIGMEM=${BIGMEM:-after}
python3 -c "import xdist" 2>/dev/null || WORKERS=0
# A test past TEST_TIMEOUT: on a worker, a thread dumps the stacks and ends the worker, which pytest-xdist
# replaces (a hang inside a CUDA call never returns to Python); in the bigmem process, SIGALRM fails the test
# and the next one runs.
limits="" bigmem_limits=""
if python3 -c "import pytest_timeout" 2>/dev/null; then
  limits="--timeout $TEST_TIMEOUT --timeout-method thread"
  bigmem_limits="--timeout $TEST_TIMEOUT --timeout-method signal"
fi

pytest_part() {  # name, then pytest's arguments: stops at the budget's end; the record is kept per test
  local name=$1 left=$(( BUDGET_S - SECONDS ))
  shift
  if [ $left -le 0 ]; then echo "no time left in the ${BUDGET_S} s budget" >"$OUT/tests-$name.log"; return 124; fi
  TIGON_TEST_RECORD="$OUT/results-$name.txt" TIGON_TEST_MEMORY="$OUT/memory-$name.txt" \
    TIGON_TEST_COLLECTED="$OUT/collected-$name.txt" \
    timeout -k 15 -s INT "$left" python3 -m pytest "$@" -q --tb=short --junitxml="$OUT/junit-$name.xml" \
    >"$OUT/tests-$name.log" 2>&1
}

ran_every_test() {  # name: its pytest collected a count of tests, and its record holds an outcome for each
  local collected outcomes
  collected=$(cat "$OUT/collected-$1.txt" 2>/dev/null) || return 1
  # the id is the rest of the line: a parametrized id may hold spaces ("[one chunk-mean]", "[one chunk-none]")
  outcomes=$(grep -v '^$' "$OUT/results-$1.txt" 2>/dev/null | cut -d ' ' -f 2- | sort -u | wc -l)
  [ -n "$collected" ] && [ "$collected" -gt 0 ] && [ "$outcomes" -ge "$collected" ]
}

parallel_rc=0 bigmem_rc=0 bigmem_pid=""
if [ "$TESTS" != none ] && [ $setup_rc -eq 0 ]; then
  parallel=""
  [ "$WORKERS" -gt 0 ] && parallel="-n $WORKERS --dist loadgroup"
  if [ "$BIGMEM" = along ]; then
    # shellcheck disable=SC2086
    pytest_part bigmem $TESTS -m bigmem -p no:xdist $bigmem_limits --durations=10 &
    bigmem_pid=$!
  fi
  if [ "$BIGMEM" != only ]; then
    # shellcheck disable=SC2086
    TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1} \
      pytest_part parallel $TESTS -m "not bigmem" $parallel $limits --durations=30
    parallel_rc=$?
  fi
  if [ -n "$bigmem_pid" ]; then
    wait "$bigmem_pid"
    bigmem_rc=$?
  elif [ "$BIGMEM" = after ] || [ "$BIGMEM" = only ]; then
    # shellcheck disable=SC2086
    pytest_part bigmem $TESTS -m bigmem -p no:xdist $bigmem_limits --durations=10
    bigmem_rc=$?
  fi
  [ $parallel_rc -eq 5 ] && parallel_rc=0  # 5: no test selected (a selection of bigmem tests only)
  [ $bigmem_rc -eq 5 ] && bigmem_rc=0      # no bigmem test among $TESTS
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
head -n 5 "$OUT/env.txt"
verdict_rc=0
if [ $setup_rc -ne 0 ]; then
  echo "VERDICT $PART transformers $TRANSFORMERS: FAIL (the wheels did not install: see above)"
  verdict_rc=1
elif [ "$TESTS" != none ]; then
  cat "$OUT"/results-*.txt 2>/dev/null >"$OUT/results.txt"
  if [ ! -s "$OUT/results.txt" ]; then  # no record (a tests/conftest.py without the hook): the junit files
    python3 - "$OUT"/junit-*.xml >"$OUT/results.txt" 2>/dev/null <<'PY'
import sys
import xml.etree.ElementTree as ElementTree

for path in sys.argv[1:]:
    for case in ElementTree.parse(path).iter("testcase"):
        if case.get("name") is None:  # an interrupted session's entry
            continue
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        print(outcome, f"{case.get('classname')}::{case.get('name')}")
PY
  fi
  read -r passed failed skipped <<<"$(awk '
    $1 == "passed" || $1 == "xpassed" { p++ } $1 == "failed" || $1 == "error" { f++ }
    $1 == "skipped" || $1 == "xfailed" { s++ } END { print p + 0, f + 0, s + 0 }' "$OUT/results.txt")"
  grep -hE "^(FAILED|ERROR) " "$OUT"/tests-*.log | head -40
  grep -h "^SKIPPED " "$OUT"/tests-*.log | sort | uniq | head -15
  # the tests that took 8 s or more, in tests/gpu_durations.txt's form (which a GPU run starts first)
  python3 - "$OUT"/junit-*.xml >"$OUT/gpu-durations.txt" 2>/dev/null <<'PY'
import sys
import xml.etree.ElementTree as ElementTree

rows = []
for path in sys.argv[1:]:
    for case in ElementTree.parse(path).iter("testcase"):
        if case.get("name") and float(case.get("time") or 0) >= 8:
            nodeid = case.get("classname").replace(".", "/") + ".py::" + case.get("name").split("@")[0]
            rows.append((float(case.get("time")), nodeid))
for seconds, nodeid in sorted(rows, reverse=True):
    print(f"{seconds:.1f} {nodeid}")
PY
  if [ -s "$OUT/ledger-waits.txt" ]; then
    echo "waits for a share of the GPU's memory: $(wc -l <"$OUT/ledger-waits.txt"), $(awk '{ s += $1 } END { printf "%.0f", s }' "$OUT/ledger-waits.txt") s in all; the longest (s, GiB):"
    sort -rn "$OUT/ledger-waits.txt" | head -5
  fi
  if ls "$OUT"/memory-*.txt >/dev/null 2>&1; then
    echo "the most GPU memory a test reserved (GiB):"
    sort -rn "$OUT"/memory-*.txt | head -8
  fi
  for name in parallel bigmem; do
    [ -f "$OUT/tests-$name.log" ] && echo "  $name: $(tail -n 1 "$OUT/tests-$name.log")"
  done
  note=""
  case $BIGMEM in
    none) note="; bigmem tests left out: BIGMEM=none" ;;
    only) note="; bigmem tests only: BIGMEM=only" ;;
  esac
  stopped=""
  for part in "parallel $parallel_rc" "bigmem $bigmem_rc"; do
    read -r name rc <<<"$part"
    case $rc in
      0) ;;
      1) [ "$failed" -eq 0 ] && stopped="${stopped:-; a pytest process ended early: see tests-*.log}" ;;
      124|137)
        if ran_every_test "$name"; then  # the budget ended pytest's shutdown (its workers' teardown), not a test
          note="$note; $name: every test ran, the ${BUDGET_S} s budget stopped pytest's shutdown"
          eval "${name}_rc=0"
        else
          stopped="; stopped by the ${BUDGET_S} s budget: tests left unrun"
        fi ;;
      *) stopped="${stopped:-; pytest exited with $rc}" ;;
    esac
  done
  note=$note$stopped
  if [ "$failed" -eq 0 ] && [ "$passed" -gt 0 ] && [ -z "$stopped" ] \
    && [ $parallel_rc -eq 0 ] && [ $bigmem_rc -eq 0 ]; then
    result=PASS
  else
    result=FAIL; verdict_rc=1
  fi
  echo "VERDICT $PART transformers $TRANSFORMERS: $result ($passed passed, $failed failed, $skipped skipped$note)"
fi
if [ "$BENCH" != none ]; then
  echo "bench (rc=$bench_rc):"
  cat "$OUT"/bench/*.md 2>/dev/null || tail -n 20 "$OUT/bench.log"
fi
exit $(( verdict_rc != 0 || bench_rc != 0 ))
