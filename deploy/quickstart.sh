#!/usr/bin/env bash
# quickstart: installs what is missing, builds stria, and runs a real attention
# job on this machine (CPU kernels; no GPU needed).
#
#   ./deploy/quickstart.sh            # S=4096 tokens, 8 heads, head_dim 128, bf16
#   SEQ=8192 ./deploy/quickstart.sh   # a longer sequence
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seq=${SEQ:-4096}
heads=${HEADS:-8}
head_dim=${HEAD_DIM:-128}
jobs=$(nproc 2>/dev/null || echo 2)

work=$(mktemp -d "${TMPDIR:-/tmp}/stria-quickstart.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== 1/3 dependencies"
"$root/deploy/install-deps.sh"

echo "== 2/3 build (Release, $root/build)"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build" -j "$jobs" >/dev/null
bin="$root/build/bin"

echo "== 3/3 causal attention, forward + backward: 1 x $seq tokens x $heads heads x $head_dim, bf16"
for name in q k v do; do
  "$bin/stria-run" random --shape "1,$seq,$heads,$head_dim" --seed "$(( ${#name} + RANDOM ))" \
    --out "$work/$name.npy"
done
"$bin/stria-run" local --q "$work/q.npy" --k "$work/k.npy" --v "$work/v.npy" --do "$work/do.npy" \
  --dtype bf16 --causal --out "$work/out"
echo
echo "Outputs (o, lse, dq, dk, dv as .npy) were written to a temporary folder and removed."
echo "Run the tests with ./tests/run.sh; see README.md for stria-run and stria-bench."
