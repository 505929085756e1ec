#!/usr/bin/env bash
# The fuzz targets of tests/fuzz (docs/SECURITY.md, "Fuzzing").
#
#   tests/fuzz/run.sh TARGET SECONDS [RUNS]
#                                      one long run of a target by hand (at
#                                      most RUNS executions when given): new
#                                      inputs go to BUILD/corpus/TARGET (the
#                                      checked-in seeds are read, never
#                                      written), findings to BUILD/findings/
#   tests/fuzz/run.sh --ci             every target: replays its checked-in
#                                      corpus, then a fixed number of
#                                      executions with a fixed seed (what
#                                      tests/run.sh runs; a few minutes)
#   tests/fuzz/run.sh --seeds          rewrites the seeds (corpus/*/seed-*,
#                                      gen_seeds.c), then checks them
#   tests/fuzz/run.sh --check-seeds    checks that the rpc_stream seeds get
#                                      past the hello and the job proofs
#                                      (part of --ci)
#   tests/fuzz/run.sh --list           the targets
#
# Builds the fuzz build first (BUILD: $STRIA_FUZZ_BUILD, default build-fuzz):
# clang with libFuzzer, ASan and UBSan, Release, and a random generator that
# is a fixed sequence (STRIA_FUZZ_UNSAFE_RANDOM, common/auth.c: never deploy
# anything of that build). A finding prints the input's
# path; copy it to tests/fuzz/corpus/TARGET/crash-<what> as a regression
# input once fixed (every build's ctest replays the corpora).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${STRIA_FUZZ_BUILD:-$root/build-fuzz}
corpus=$root/tests/fuzz/corpus
targets=(rpc_stream proto ucx_ctrl npy config http addr)
jobs=$(nproc 2>/dev/null || echo 2)

# Executions of each target in --ci (a minute in all on an idle 2-core machine).
declare -A ci_runs=([rpc_stream]=50000 [proto]=300000 [ucx_ctrl]=300000 [npy]=200000
                    [config]=200000 [http]=300000 [addr]=300000)

# Options of one target: the RPC stream target keeps the coordinator's state
# between inputs by design, so leak checks after each input would only scan
# it (the coordinator's leaks are checked by tests/coordinator).
declare -A extra_opts=([rpc_stream]="-detect_leaks=0")

usage() {
  echo "usage: $0 TARGET SECONDS [RUNS] | --ci | --seeds | --check-seeds | --list" >&2
  echo "targets: ${targets[*]}" >&2
  exit 2
}

build_fuzzers() {
  if ! command -v clang >/dev/null 2>&1; then
    echo "fuzz: clang not found (deploy/install-deps.sh installs it)" >&2
    exit 1
  fi
  CC=clang cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRIA_FUZZ=ON >/dev/null
  cmake --build "$build" -j "$jobs" --target stria_fuzz_all >/dev/null
}

# libFuzzer's options common to every run. The targets log errors only.
common_opts() {
  local t=$1
  echo "-artifact_prefix=$build/findings/$t- -print_final_stats=1 -timeout=30 -rss_limit_mb=4096" \
    "${extra_opts[$t]:-}"
}

# Each rpc_stream seed gets past the hello, unless its name says it must not
# (wrong-token, no-proof, clear-token, no-hello), and past every job proof,
# unless its name has bad-proof: a seed written for another random sequence
# or protocol fails here (then run --seeds).
check_seeds() {
  local bin=$build/fuzz/fuzz_rpc_stream failed=0 f name out
  for f in "$corpus"/rpc_stream/seed-*; do
    name=${f##*/seed-}
    out=$(STRIA_FUZZ_VERBOSE=1 STRIA_LOG_LEVEL=error "$bin" -detect_leaks=0 "$f" 2>&1 | grep '^  reply' || true)
    if [[ $name =~ wrong-token|no-proof|clear-token|no-hello ]]; then
      if grep -q 'hello, status 0, final' <<<"$out"; then
        echo "fuzz seed rpc_stream/seed-$name: passed a hello it must not pass" >&2
        failed=1
      fi
    elif ! grep -q 'hello, status 0, final' <<<"$out"; then
      echo "fuzz seed rpc_stream/seed-$name: did not get past the hello:" >&2
      echo "$out" >&2
      failed=1
    fi
    if [[ $name != *bad-proof* ]] && grep -q 'job secret' <<<"$out"; then
      echo "fuzz seed rpc_stream/seed-$name: a job proof was refused:" >&2
      echo "$out" >&2
      failed=1
    fi
  done
  if ((failed == 0)); then
    echo "fuzz rpc_stream seeds: $(ls "$corpus"/rpc_stream/seed-* | wc -l) pass the hello and the job proofs as their names say"
  fi
  return $failed
}

gen_seeds() {
  cmake --build "$build" -j "$jobs" --target fuzz_gen_seeds >/dev/null
  rm -f "$corpus"/*/seed-*
  "$build/fuzz/fuzz_gen_seeds" "$corpus"
}

ci() {
  local failed=0
  mkdir -p "$build/findings"
  for t in "${targets[@]}"; do
    local bin=$build/fuzz/fuzz_$t work
    work=$(mktemp -d)
    echo "== fuzz $t: replay corpus/$t ($(ls "$corpus/$t" | wc -l) inputs), then ${ci_runs[$t]} executions, seed 1"
    # shellcheck disable=SC2046
    if ! STRIA_LOG_LEVEL=error "$bin" $(common_opts "$t") -runs=0 "$corpus/$t" >"$work/replay.log" 2>&1 ||
       ! STRIA_LOG_LEVEL=error "$bin" $(common_opts "$t") -seed=1 -runs="${ci_runs[$t]}" \
           "$work" "$corpus/$t" >"$work/run.log" 2>&1; then
      echo "fuzz $t: FAILED" >&2
      tail -n 40 "$work"/*.log >&2
      failed=1
    else
      grep -h "stat::number_of_executed_units\|Done [0-9]* runs" "$work/run.log" | tr '\n' ' '
      echo
    fi
    rm -rf "$work"
  done
  return $failed
}

long_run() {
  local t=$1 secs=$2 runs=${3:--1} bin=$build/fuzz/fuzz_$1
  mkdir -p "$build/corpus/$t" "$build/findings"
  echo "fuzz $t for $secs s; new inputs in $build/corpus/$t, findings in $build/findings"
  # shellcheck disable=SC2046
  STRIA_LOG_LEVEL=error "$bin" $(common_opts "$t") -max_total_time="$secs" -runs="$runs" \
    "$build/corpus/$t" "$corpus/$t"
}

case ${1:-} in
--list)
  printf '%s\n' "${targets[@]}"
  ;;
--ci)
  build_fuzzers
  check_seeds
  ci
  ;;
--seeds)
  build_fuzzers
  gen_seeds
  check_seeds
  ;;
--check-seeds)
  build_fuzzers
  check_seeds
  ;;
"" | -*)
  usage
  ;;
*)
  [[ " ${targets[*]} " == *" $1 "* ]] || usage
  [[ ${2:-} =~ ^[0-9]+$ ]] || usage
  [[ -z ${3:-} || ${3:-} =~ ^[0-9]+$ ]] || usage
  build_fuzzers
  long_run "$1" "$2" "${3:-}"
  ;;
esac
