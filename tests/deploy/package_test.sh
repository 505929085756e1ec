#!/usr/bin/env bash
# The Debian packages, checked without touching the live system: built with
# CPack from this build, their contents and computed dependencies, lintian
# with no error, unpacked into a scratch root, the units accepted by
# systemd-analyze (pointed at the unpacked programs), and the daemons started
# from the unpacked paths with the packaged example configurations (listen
# addresses overridden to loopback port 0) running a real job.
# Usage: package_test.sh BUILD_DIR [CPACK]
set -euo pipefail
build=$1
cpack=${2:-cpack}
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "package_test: $*" >&2; exit 1; }
step() { echo "-- $*"; }

step "cpack"
"$cpack" --config "$build/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1 ||
  { cat "$tmp/cpack.log"; fail "cpack failed"; }
rt=$(ls "$tmp"/pkg/stria_*.deb) || fail "no stria package"
dev=$(ls "$tmp"/pkg/libstria-dev_*.deb) || fail "no libstria-dev package"

step "contents"
dpkg-deb --contents "$rt" | awk '{print $6}' | sed 's|^\./|/|' >"$tmp/rt.list"
dpkg-deb --contents "$dev" | awk '{print $6}' | sed 's|^\./|/|' >"$tmp/dev.list"
for f in /usr/bin/stria-coordinator /usr/bin/stria-worker /usr/bin/striactl /usr/bin/stria-run \
  /usr/bin/stria-bench /usr/lib/libstria.so.1 /usr/lib/systemd/system/stria-coordinator.service \
  /usr/lib/systemd/system/stria-worker@.service /usr/lib/systemd/system/stria.target \
  /usr/lib/sysusers.d/stria.conf /usr/share/stria/examples/coordinator.conf \
  /usr/share/stria/examples/worker.conf /usr/share/doc/stria/DEPLOY.md \
  /usr/share/doc/stria/copyright; do
  grep -qx "$f" "$tmp/rt.list" || fail "stria lacks $f"
done
for f in /usr/include/stria/stria_client.h /usr/include/stria/stria_types.h \
  /usr/lib/pkgconfig/stria.pc /usr/lib/libstria.so /usr/share/doc/libstria-dev/copyright; do
  grep -qx "$f" "$tmp/dev.list" || fail "libstria-dev lacks $f"
done
# /etc/stria and the credentials are the operator's; nothing outside /usr.
if grep -v '^/usr' "$tmp/rt.list" "$tmp/dev.list" | grep -v ':/$'; then
  fail "files outside /usr"
fi
depends=$(dpkg-deb -f "$rt" Depends)
for d in libucx0 libuv1 libprotobuf-c1 libssl3 libc6; do
  [[ $depends == *"$d"* ]] || fail "Depends lacks $d: $depends"
done
echo "Depends: $depends"

step "lintian"
lintian --no-tag-display-limit "$rt" "$dev" >"$tmp/lintian.log" 2>&1 || true
if grep -q '^E:' "$tmp/lintian.log"; then
  cat "$tmp/lintian.log"
  fail "lintian reports errors"
fi
grep '^[WE]:' "$tmp/lintian.log" || true

step "unpack"
root=$tmp/root
mkdir -p "$root"
dpkg-deb -x "$rt" "$root"
dpkg-deb -x "$dev" "$root"
grep -q '^ExecStart=/usr/bin/stria-worker --config /etc/stria/worker.conf' \
  "$root/usr/lib/systemd/system/stria-worker@.service" || fail "worker unit: unexpected ExecStart"

step "a trainer's program against the unpacked libstria-dev (pkg-config)"
grep -qx 'prefix=/usr' "$root/usr/lib/pkgconfig/stria.pc" || fail "stria.pc: $(head -1 "$root/usr/lib/pkgconfig/stria.pc")"
flags=$(PKG_CONFIG_SYSROOT_DIR=$root PKG_CONFIG_PATH=$root/usr/lib/pkgconfig \
  pkg-config --cflags --libs stria)
printf '#include <stria_client.h>\nint main(void) { return stria_client_abi_version() != STRIA_CLIENT_ABI_VERSION; }\n' \
  >"$tmp/abi.c"
# shellcheck disable=SC2086 # the flags are words
cc -std=c11 -Wall -Werror "$tmp/abi.c" -o "$tmp/abi" $flags -Wl,-rpath,"$root/usr/lib" ||
  fail "cannot build against the unpacked package with: $flags"
"$tmp/abi" || fail "the unpacked libstria speaks another ABI than its header"

if command -v systemd-analyze >/dev/null; then
  step "systemd-analyze verify"
  mkdir -p "$tmp/units"
  for u in stria-coordinator.service stria-worker@.service stria.target; do
    sed "s|/usr/bin/|$root/usr/bin/|g" "$root/usr/lib/systemd/system/$u" >"$tmp/units/$u"
  done
  cp "$tmp/units/stria-worker@.service" "$tmp/units/stria-worker@0.service"
  out=$(systemd-analyze verify --man=no "$tmp/units/stria-coordinator.service" \
    "$tmp/units/stria-worker@0.service" "$tmp/units/stria.target" 2>&1) ||
    { echo "$out"; fail "systemd-analyze verify failed"; }
  if grep -q stria <<<"$out"; then echo "$out"; fail "systemd-analyze complains"; fi
fi

step "daemons from the unpacked root, a job through them"
bin=$root/usr/bin
ex=$root/usr/share/stria/examples
# key = value lines of the example, with the given keys replaced (or added).
conf() {
  local src=$1 dst=$2
  shift 2
  cp "$src" "$dst"
  while (($#)); do
    local k=${1%%=*} v=${1#*=}
    sed -i "/^[[:space:]]*$k[[:space:]]*=/d" "$dst"
    echo "$k = $v" >>"$dst"
    shift
  done
}
wait_line() { # file prefix seconds
  for _ in $(seq $(($3 * 10))); do
    if grep -q "^$2" "$1" 2>/dev/null; then grep -m1 "^$2" "$1"; return 0; fi
    sleep 0.1
  done
  return 1
}
export UCX_HANDLE_ERRORS=none UCX_TLS=tcp,sm,self
# The credentials the operator makes (the package never does), as docs/DEPLOY.md
# says, where the examples name them.
"$bin/stria-coordinator" --gen-credentials "$tmp/credentials" >/dev/null ||
  fail "--gen-credentials failed"
cred=$tmp/credentials
conf "$ex/coordinator.conf" "$tmp/coordinator.conf" listen=127.0.0.1:0 metrics-listen=127.0.0.1:0 \
  heartbeat-period=0.2 client-token-file="$cred/client-token" \
  worker-token-file="$cred/worker-token" admin-token-file="$cred/admin-token"
"$bin/stria-coordinator" --config "$tmp/coordinator.conf" >"$tmp/coord.out" 2>"$tmp/coord.log" &
pids+=($!)
line=$(wait_line "$tmp/coord.out" "stria-coordinator listening on " 10) ||
  { cat "$tmp/coord.log"; fail "the coordinator did not start"; }
addr=${line#stria-coordinator listening on }
for i in 0 1; do
  conf "$ex/worker.conf" "$tmp/worker$i.conf" coordinator="$addr" listen=127.0.0.1:0 \
    ucx-listen=127.0.0.1:0 metrics-listen=127.0.0.1:0 threads=1 memory=1G \
    client-token-file="$cred/client-token" worker-token-file="$cred/worker-token"
  "$bin/stria-worker" --config "$tmp/worker$i.conf" >"$tmp/worker$i.out" 2>"$tmp/worker$i.log" &
  pids+=($!)
  wait_line "$tmp/worker$i.out" "stria-worker listening rpc=" 10 >/dev/null ||
    { cat "$tmp/worker$i.log"; fail "worker $i did not start"; }
done
for _ in $(seq 100); do
  "$bin/striactl" --coordinator "$addr" --token-file "$cred/client-token" --json status \
    >"$tmp/status.json" 2>/dev/null || true
  grep -q '"workers_healthy": *2' "$tmp/status.json" && break
  sleep 0.1
done
grep -q '"workers_healthy": *2' "$tmp/status.json" || { cat "$tmp/status.json"; fail "no ring of 2"; }
cd "$tmp"
"$bin/stria-run" random --shape 1,256,4,64 --seed 1 --out q.npy >/dev/null
"$bin/stria-run" random --shape 1,256,2,64 --seed 2 --out k.npy >/dev/null
"$bin/stria-run" random --shape 1,256,2,64 --seed 3 --out v.npy >/dev/null
"$bin/stria-run" random --shape 1,256,4,64 --seed 4 --out do.npy >/dev/null
"$bin/stria-run" submit --coordinator "$addr" --token-file "$cred/client-token" --q q.npy --k k.npy --v v.npy --do do.npy \
  --out out --check >"$tmp/submit.log" 2>&1 || { cat "$tmp/submit.log"; fail "the job failed"; }
grep -i "check" "$tmp/submit.log" | head -3
# Without the credential the service refuses.
if "$bin/striactl" --coordinator "$addr" status >/dev/null 2>&1; then
  fail "the coordinator answered a client without its token"
fi
echo "package_test: ok ($(basename "$rt"), $(stat -c %s "$rt") bytes; $(basename "$dev"))"
