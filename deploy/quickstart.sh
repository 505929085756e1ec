#!/usr/bin/env bash
# quickstart: installs what is missing, builds stria, starts a coordinator and
# 4 workers on this machine (loopback, CPU kernels, no GPU needed), runs a real
# causal striped attention job through them (forward + backward), checks it
# against the in-process computation, prints a short report, and stops every
# process it started (also when interrupted).
#
#   ./deploy/quickstart.sh                  # S=32768, 8 heads, head_dim 128, bf16, 4 workers
#   SEQ=8192 WORKERS=2 ./deploy/quickstart.sh
#   HEAD_GROUPS=2 ./deploy/quickstart.sh    # the session as 2 head groups x rings of 2
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seq=${SEQ:-32768}
heads=${HEADS:-8}
kv_heads=${KV_HEADS:-8}
head_dim=${HEAD_DIM:-128}
workers=${WORKERS:-4}
head_groups=${HEAD_GROUPS:-1}
case $head_groups in
''|*[!0-9]*|0) echo "quickstart: HEAD_GROUPS must be a number >= 1 (got '$head_groups')" >&2; exit 2 ;;
esac
if (( workers % head_groups != 0 || 4 % head_groups != 0 )); then
  echo "quickstart: HEAD_GROUPS=$head_groups must divide the workers ($workers) and the" \
    "session's 4 K/V heads" >&2
  exit 2
fi
jobs=$(nproc 2>/dev/null || echo 2)

work=$(mktemp -d "${TMPDIR:-/tmp}/stria-quickstart.XXXXXX")
pids=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do
      alive=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ $alive -eq 0 ] && break
      sleep 0.2
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  if [ $rc -ne 0 ] && [ -d "$work" ]; then
    echo "quickstart failed (exit $rc); daemon logs:" >&2
    tail -n 5 "$work"/*.log >&2 2>/dev/null || true
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== 1/5 dependencies"
"$root/deploy/install-deps.sh"

echo "== 2/5 build (Release, $root/build)"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build" -j "$jobs" >/dev/null
bin="$root/build/bin"

# Waits for a line starting with $2 in file $1 and prints it.
wait_line() {
  for _ in $(seq 1 100); do
    if grep -m1 "^$2" "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "timed out waiting for '$2' in $1" >&2
  return 1
}

echo "== 3/5 a ring on this machine: 1 coordinator, $workers workers (loopback, UCX)"
export UCX_HANDLE_ERRORS=none
"$bin/stria-coordinator" --listen 127.0.0.1:0 --heartbeat-period 0.5 \
  >"$work/coordinator.out" 2>"$work/coordinator.log" &
pids+=($!)
coord=$(wait_line "$work/coordinator.out" "stria-coordinator listening on " | awk '{print $4}')
threads=$(( jobs / workers > 1 ? jobs / workers : 1 ))
for i in $(seq 0 $((workers - 1))); do
  "$bin/stria-worker" --coordinator "$coord" --threads "$threads" --log-level warn \
    >"$work/worker$i.out" 2>"$work/worker$i.log" &
  pids+=($!)
done
for i in $(seq 0 $((workers - 1))); do
  wait_line "$work/worker$i.out" "stria-worker listening" >/dev/null
done
for _ in $(seq 1 100); do
  "$bin/striactl" --coordinator "$coord" status 2>/dev/null | grep -q "workers: $workers healthy" && break
  sleep 0.1
done
"$bin/striactl" --coordinator "$coord" status

echo
echo "== 4/5 causal striped attention, forward + backward, through the service"
echo "   1 x $seq tokens x $heads heads ($kv_heads K/V heads) x $head_dim, bf16; checked in-process"
"$bin/stria-run" random --shape "1,$seq,$heads,$head_dim" --seed 1 --out "$work/q.npy"
"$bin/stria-run" random --shape "1,$seq,$kv_heads,$head_dim" --seed 2 --out "$work/k.npy"
"$bin/stria-run" random --shape "1,$seq,$kv_heads,$head_dim" --seed 3 --out "$work/v.npy"
"$bin/stria-run" random --shape "1,$seq,$heads,$head_dim" --seed 4 --out "$work/do.npy"
"$bin/stria-run" submit --coordinator "$coord" --q "$work/q.npy" --k "$work/k.npy" \
  --v "$work/v.npy" --do "$work/do.npy" --dtype bf16 --causal --layout striped \
  --label quickstart --check --out "$work/out"
echo
if (( head_groups > 1 )); then
  echo "== 5/5 a session of $head_groups head groups x rings of $((workers / head_groups)):" \
    "opened once, then 64 calls of 1 x 256 x 4 x 64 (bf16)"
else
  echo "== 5/5 a session: the ring opened once, then 64 calls of 1 x 256 x 4 x 64 (bf16)"
fi
echo "   the same calls first as a job each, then on the session; per call, beside the job's"
"$bin/stria-run" random --shape "1,256,4,64" --seed 5 --out "$work/sq.npy"
"$bin/stria-run" random --shape "1,256,4,64" --seed 6 --out "$work/sk.npy"
"$bin/stria-run" random --shape "1,256,4,64" --seed 7 --out "$work/sv.npy"
"$bin/stria-run" random --shape "1,256,4,64" --seed 8 --out "$work/sdo.npy"
"$bin/stria-run" submit --coordinator "$coord" --q "$work/sq.npy" --k "$work/sk.npy" \
  --v "$work/sv.npy" --do "$work/sdo.npy" --dtype bf16 --causal --layout striped \
  --label quickstart-session --session-calls 64 --head-groups "$head_groups" --out "$work/sout" |
  tee "$work/session.txt"
if (( head_groups > 1 )); then # the grid of its rings, as the coordinator placed them
  sid=$(sed -n 's/.*session \([0-9][0-9]*\) (opened.*/\1/p' "$work/session.txt" | head -n 1)
  if [[ -n $sid ]]; then
    echo
    "$bin/striactl" --coordinator "$coord" session "$sid" | sed -n '/^head groups:/,/^timings/p' |
      grep -v '^timings'
  fi
fi
echo
"$bin/striactl" --coordinator "$coord" jobs --all
echo
"$bin/striactl" --coordinator "$coord" sessions --all
echo
echo "Done: every process started here is being stopped. Next: ./tests/run.sh, and"
echo "README.md for stria-run, striactl and running the service on several hosts."
