#!/usr/bin/env bash
# Builds stria and runs every test twice: in the Release build (build/) and in
# an AddressSanitizer + UndefinedBehaviorSanitizer build (build-asan/); after
# the Release tests, the Python package's wheel (assembled from build/,
# installed and run outside the source tree) and its pytest suite
# (tests/python) against the Release build, in a virtual environment made once
# per python/requirements-test.txt and kept in ${XDG_CACHE_HOME:-~/.cache}/stria/;
# then the fuzz targets (build-fuzz/, clang + libFuzzer) replay their corpora
# and run a fixed number of executions with a fixed seed.
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
  (cd "$root/$dir" && STRIA_TEST_RUN=$run_id ctest --output-on-failure --timeout 900 -j "$jobs" \
    -LE chaos)
}

# The chaos test (label chaos: workers killed, stopped and restarted, the
# coordinator restarted, under load for a minute) runs last, alone, in the
# Release build, and gates the run like every other suite.
chaos_test() {
  echo "== test build (chaos)"
  (cd "$root/build" && STRIA_TEST_RUN=$run_id ctest --output-on-failure --timeout 900 -L chaos)
}

# The wheel (python/build_wheel.py): assembled from build/ (nothing
# compiled), installed into a fresh environment over the cached one (its
# torch, through a .pth file), and run from a scratch folder with no source
# tree on sys.path and no STRIA_LIB: stria.local with 2 workers from the wheel,
# one stria.attention checked against SDPA (tests/python/wheel_smoke.py).
python_wheel_test() {
  local venv=$1 tmp rc=0 t0=$SECONDS site
  echo "== test python wheel (assembled from build/, installed in a fresh environment)"
  tmp=$(mktemp -d)
  (
    set -e
    "$venv/bin/python" "$root/python/build_wheel.py" --build-dir "$root/build" --out "$tmp/dist"
    "$venv/bin/python" -m venv --without-pip "$tmp/venv"
    site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
      >"$site/_stria_ci_base.pth"
    "$tmp/venv/bin/python" -m pip install --quiet --no-deps --no-index "$tmp"/dist/stria-*.whl
    mkdir "$tmp/run"
    cp "$root/tests/python/wheel_smoke.py" "$tmp/run/"
    cd "$tmp/run"
    env -u STRIA_LIB -u STRIA_BIN_DIR -u PYTHONPATH STRIA_TEST_RUN="$run_id" \
      "$tmp/venv/bin/python" wheel_smoke.py
  ) || rc=$?
  rm -rf "$tmp"
  if ((rc != 0)); then
    echo "tests/run.sh: the wheel's check failed" >&2
    return "$rc"
  fi
  echo "== python wheel: ok in $((SECONDS - t0)) s"
}

# The Python suite: a virtual environment with the pinned torch and
# transformers (PyPI), made once per requirements file, Python version and
# machine (the key), then reused; the package is installed from python/ as pip
# does, into a scratch folder, and pytest runs it against build/.
python_tests() {
  local py=${STRIA_PYTHON:-python3} req="$root/python/requirements-test.txt"
  local key venv target rc=0
  key=$( (cat "$req" && "$py" -c 'import platform, sys; print(sys.version, platform.machine())') |
    sha256sum | cut -c1-16)
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/stria/venv-$key"
  mkdir -p "${venv%/*}"
  # one maker at a time: a second run waits for the first's environment
  local lock_fd
  exec {lock_fd}>"$venv.lock"
  flock "$lock_fd"
  if [[ ! -f $venv/.complete ]]; then
    echo "== python: creating $venv (pinned torch and transformers from PyPI; once per key)"
    local t0=$SECONDS
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --no-deps -r "$req"
    touch "$venv/.complete"
    echo "== python: environment ready in $((SECONDS - t0)) s"
  fi
  exec {lock_fd}>&-
  # the package's annotations (python/pyproject.toml's [tool.mypy]: torch and
  # transformers are not analysed); any error fails the run
  echo "== mypy --strict python/stria"
  local t1=$SECONDS
  (cd "$root/python" && "$venv/bin/python" -m mypy --strict --cache-dir=/dev/null stria) || return
  echo "== mypy: ok in $((SECONDS - t1)) s"
  python_wheel_test "$venv" || return
  # pip builds in the folder it is given: a copy, so the tree stays clean
  target=$(mktemp -d)
  cp -r "$root/python" "$target/src"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation \
    --target "$target/site" "$target/src"
  echo "== test python (tests/python against build/)"
  (cd "$root" && STRIA_TEST_RUN=$run_id STRIA_BUILD_DIR="$root/build" \
    STRIA_LIB="$root/build/lib/libstria.so.1" PYTHONPATH="$target/site" \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra --durations=5 tests/python) || rc=$?
  rm -rf "$target"
  if ((rc == 5)); then
    echo "tests/run.sh: pytest collected no test in tests/python" >&2
  fi
  return "$rc"
}

build_and_test build -DCMAKE_BUILD_TYPE=Release -DSTRIA_SANITIZE=OFF
python_tests
echo "== fuzz build-fuzz"
"$root/tests/fuzz/run.sh" --ci
# halt_on_error keeps a sanitizer report from being lost in a passing test;
# tests/lsan.supp silences leaks inside third-party libraries only.
ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:halt_on_error=1} \
LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp:print_suppressions=0} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  build_and_test build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRIA_SANITIZE=ON -DSTRIA_CUDA=OFF
chaos_test
