#!/usr/bin/env bash
# Finds the processes of one test run that are still alive: every process
# whose environment holds STRIA_TEST_RUN=<id> exactly. tests/run.sh gives ctest
# a fresh id, and the test helpers (tests/common/proc.c) pass it on to every
# child. Matching the environment, never the program's name, leaves a
# developer's own ring and an installed service alone.
#
#   tests/reap.sh --list ID   prints "PID COMMAND LINE" for each marked process;
#                             exits 1 if there is any, 0 if none
#   tests/reap.sh --kill ID   gives marked processes REAP_GRACE_S seconds
#                             (default 2) to finish exiting, then prints the
#                             survivors on stderr and SIGKILLs them; exits 1 if
#                             it killed any, 0 (and prints nothing) if none
set -euo pipefail

usage() {
  echo "usage: $0 --list|--kill RUN_ID" >&2
  exit 2
}
[[ $# -eq 2 && -n $2 ]] || usage
mode=$1
want="STRIA_TEST_RUN=$2"
grace_s=${REAP_GRACE_S:-2}
# The programs started here (sleep) must not carry the marker themselves.
unset STRIA_TEST_RUN

# This script and its callers may carry the marker (a test that checks its own
# run); they are not survivors.
declare -A skip=()
p=$$
while [[ $p =~ ^[0-9]+$ && $p -gt 1 && -z ${skip[$p]:-} ]]; do
  skip[$p]=1
  stat=
  read -r stat <"/proc/$p/stat" 2>/dev/null || break
  # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
  rest=${stat##*) }
  read -r _ p _ <<<"$rest"
done

# Bash builtins only while scanning: a forked subshell would carry this
# script's environment, and so maybe the marker.
marked() {
  local kv
  while IFS= read -r -d '' kv; do
    [[ $kv == "$want" ]] && return 0
  done <"/proc/$1/environ"
  return 1
}

# Sets `found` to the marked pids; a zombie's environment reads empty.
scan() {
  found=()
  local dir pid
  for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    [[ -n ${skip[$pid]:-} ]] && continue
    if marked "$pid" 2>/dev/null; then
      found+=("$pid")
    fi
  done
}

describe() {
  local pid cmd arg
  for pid in "$@"; do
    cmd=
    while IFS= read -r -d '' arg; do
      cmd+="${cmd:+ }$arg"
    done <"/proc/$pid/cmdline" 2>/dev/null || true
    echo "$pid ${cmd:-(exited)}"
  done
}

case $mode in
--list)
  scan
  ((${#found[@]} == 0)) && exit 0
  describe "${found[@]}"
  exit 1
  ;;
--kill)
  scan
  ((${#found[@]} == 0)) && exit 0
  # A process may be between its test's end and its own exit (a netns guard
  # cleaning up, a daemon flushing its log): only what outlives the grace
  # counts.
  printf -v tenths '%.0f' "${grace_s}e1"
  for ((i = 0; i < tenths && ${#found[@]} > 0; i++)); do
    sleep 0.1
    scan
  done
  ((${#found[@]} == 0)) && exit 0
  echo "tests/reap.sh: ${#found[@]} process(es) of test run ${want#*=} outlived the tests; killing:" >&2
  describe "${found[@]}" >&2
  kill -KILL "${found[@]}" 2>/dev/null || true
  exit 1
  ;;
*)
  usage
  ;;
esac
