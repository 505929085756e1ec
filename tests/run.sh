#!/usr/bin/env bash
# Builds stria and runs every test twice: in the Release build (build/) and in
# an AddressSanitizer + UndefinedBehaviorSanitizer build (build-asan/). Between
# the two, the fuzz targets (build-fuzz/, clang + libFuzzer) replay their
# corpora and run a fixed number of executions with a fixed seed.
# Installs missing dependencies first. Exits non-zero on the first failure; the
# output ends with ctest's summary.
#
# Every process the tests start carries STRIA_TEST_RUN=<this run's id> in its
# environment; at exit, also after a failure, any such process still alive is
# listed, killed, and fails the run (tests/reap.sh).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
jobs=$(nproc 2>/dev/null || echo 2)

run_id=$(date +%Y%m%d%H%M%S)-$$-$RANDOM
check_survivors() {
  local rc=$?
  if ! "$root/tests/reap.sh" --kill "$run_id"; then
    ((rc != 0)) || rc=1
  fi
  exit "$rc"
}
trap check_survivors EXIT

"$root/deploy/install-deps.sh"

export UCX_HANDLE_ERRORS=none
export STRIA_LOG_LEVEL=${STRIA_LOG_LEVEL:-error}

build_and_test() {
  local dir=$1
  shift
  echo "== configure $dir ($*)"
  cmake -S "$root" -B "$root/$dir" "$@" >/dev/null
  echo "== build $dir"
  cmake --build "$root/$dir" -j "$jobs"
  echo "== test $dir"
  # Only ctest and what it starts carry the id: nothing else of this script
  # should still run at exit.
  (cd "$root/$dir" && STRIA_TEST_RUN=$run_id ctest --output-on-failure --timeout 900 -j "$jobs")
}

build_and_test build -DCMAKE_BUILD_TYPE=Release -DSTRIA_SANITIZE=OFF
echo "== fuzz build-fuzz"
"$root/tests/fuzz/run.sh" --ci
# halt_on_error keeps a sanitizer report from being lost in a passing test;
# tests/lsan.supp silences leaks inside third-party libraries only.
ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:halt_on_error=1} \
LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp:print_suppressions=0} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  build_and_test build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRIA_SANITIZE=ON -DSTRIA_CUDA=OFF
