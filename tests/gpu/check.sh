#!/usr/bin/env bash
# One verification run of the CUDA kernels on a GPU machine:
#
#   tests/gpu/check.sh REPORT_FILE
#
# 1. records the GPU and driver (nvidia-smi);
# 2. configures a Release tree with CUDA (build-gpu/ or $BUILD_DIR) and builds
#    what the check runs (stria_kernels, the gpu-labelled tests, stria-bench;
#    -j16 or $JOBS);
# 3. runs the gpu label (ctest -L gpu): the gpu suite (every CUDA kernel
#    against the portable CPU kernels and the fp64 reference, with and
#    without documents and windows) and the
#    host-only check of the fragment layouts (the slow host emulation of the
#    kernels, test_kernel_emu, needs no GPU and runs with the other tests);
# 4. runs stria-bench kernels --device cuda (causal, bf16, S=16384, H=16,
#    D=128, forward and backward) with the cuBLAS bf16 GEMM rate of the same
#    run;
# 5. if torch imports, runs PyTorch's scaled_dot_product_attention forward and
#    forward+backward on the same shapes (bench/torch_sdpa_cuda.py);
# 6. writes every figure, the ratios and pass/fail of each target to
#    REPORT_FILE (and prints it).
#
# Every step has a time limit and a failed step does not stop the others; the
# limits add up to 8 minutes at most (configure 40, build 130, tests 150,
# bench 45, torch probe 30 and run 50, nvidia-smi 10 s, 5 s of grace each); on a
# 16-core H200 machine the run should take about 3. Exit status: 0
# when the suite passed and every measured target was met, 1 otherwise.
set -u

if [ $# -ne 1 ]; then
  echo "usage: $0 REPORT_FILE" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
report=$(realpath -m "$1")
build=${BUILD_DIR:-"$root/build-gpu"}
logs="$build/check-logs"
jobs=${JOBS:-16}
S=16384 H=16 D=128 REPS=10
rm -rf "$logs"
mkdir -p "$logs" "$(dirname "$report")"
: >"$report"

say() { echo "$*" | tee -a "$report"; }
# step NAME SECONDS CMD...: runs CMD with a time limit, logs to $logs/NAME.log,
# records the outcome; never fails the script.
step() {
  local name=$1 secs=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout --kill-after=5 "$secs" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  local verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT after ${secs}s"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
  say "step $name: $verdict, $(($(date +%s) - t0)) s (log: $logs/$name.log)"
  return $rc
}

say "# stria GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
  gpu_line=$(timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -1)
  say "gpu: ${gpu_line:-nvidia-smi gave no answer}"
else
  say "gpu: nvidia-smi not found"
fi
say "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"

suite="not run"
cfg_ok=0
targets="test_gpu test_mma_layout stria-bench"
if step configure 40 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRIA_CUDA=ON; then
  cfg_ok=1
else
  # e.g. Criterion missing on this machine: at least the benchmark
  say "configure failed: trying again without the test suites (log: $logs/configure.log)"
  cp "$logs/configure.log" "$logs/configure-first.log"
  step configure 40 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRIA_CUDA=ON \
    -DSTRIA_BUILD_TESTS=OFF && cfg_ok=1 && targets=stria-bench
fi
[ $cfg_ok -eq 1 ] && ! grep -q "cuda=ON" "$logs/configure.log" &&
  say "warning: the configure step did not find CUDA (cuda=ON missing)"
build_ok=0
# only what the check runs (the library, the gpu-labelled tests, stria-bench): quicker,
# and a broken unrelated target cannot stop the check
# shellcheck disable=SC2086
if [ $cfg_ok -eq 1 ] && step build 130 cmake --build "$build" -j "$jobs" --target $targets; then
  build_ok=1
fi

if [ $build_ok -eq 1 ]; then
  if [ "$targets" = stria-bench ]; then
    suite=failed
    say "gpu suite: not built (no test suites in this configuration)"
  elif step ctest-gpu 150 ctest --test-dir "$build" -L gpu -j 3 --output-on-failure; then
    suite=passed
  else
    suite=failed
  fi
  if [ -f "$logs/ctest-gpu.log" ]; then
    grep -E "tests passed|Skipped|Failed|Passed|\*\*\*" "$logs/ctest-gpu.log" | tail -8 | sed 's/^/  /' | tee -a "$report"
    grep -q "Skipped" "$logs/ctest-gpu.log" && suite="skipped (no GPU visible to the suite)"
  fi
  step bench 45 "$build/bin/stria-bench" kernels --device cuda --seq $S --heads $H --head-dim $D \
    --dtype bf16 --causal --reps $REPS --json
  sed 's/^/  /' "$logs/bench.log" | tee -a "$report" >/dev/null
else
  say "build failed: no suite, no benchmark"
fi

if timeout 30 python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1; then
  step torch 50 python3 "$root/bench/torch_sdpa_cuda.py" --seq $S --heads $H --head-dim $D \
    --dtype bf16 --reps $REPS --json
  sed 's/^/  /' "$logs/torch.log" | tee -a "$report" >/dev/null
else
  say "torch: not importable or no GPU for torch: no SDPA comparison"
  : >"$logs/torch.log"
fi

# figures, ratios and targets
if ! command -v python3 >/dev/null; then
  say "python3 not found: no summary; the raw figures are above"
  exit 1
fi
python3 - "$logs/bench.log" "$logs/torch.log" "$suite" <<'PY' | tee -a "$report"
import json, sys
bench, torch_log, suite = sys.argv[1], sys.argv[2], sys.argv[3]
def rows(path):
    out = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out
b, t = rows(bench), rows(torch_log)
gemm = next((r for r in b if r.get("name") == "cublas_gemm"), None)
fwd = next((r for r in b if r.get("pass") == "fwd"), None)
bwd = next((r for r in b if r.get("pass") == "bwd"), None)
tf = next((r for r in t if r.get("pass") == "fwd"), None)
tfb = next((r for r in t if r.get("pass") == "fwd+bwd"), None)
ok = suite == "passed"
print(f"gpu suite: {suite}")
if gemm:
    print(f"cuBLAS bf16 GEMM {gemm['n']}^3: {gemm['seconds']*1e3:.3f} ms, {gemm['tflops']:.1f} TFLOP/s")
def target(label, value, goal, fmt):
    global ok
    if value is None:
        print(f"target {label}: NOT MEASURED")
        ok = False
        return
    good = value >= goal
    ok = ok and good
    print(f"target {label}: {fmt(value)} (goal {fmt(goal)}): {'PASS' if good else 'FAIL'}")
pct = lambda x: f"{100*x:.1f}%"
for name, r in (("forward", fwd), ("backward", bwd)):
    if r:
        print(f"stria {name}: {r['seconds']*1e3:.3f} ms, {r['tflops']:.1f} TFLOP/s, "
              f"{100*r['fraction_of_cublas']:.1f}% of cuBLAS bf16")
target("forward >= 40% of cuBLAS bf16", fwd["fraction_of_cublas"] if fwd and gemm else None, 0.40, pct)
target("backward >= 25% of cuBLAS bf16", bwd["fraction_of_cublas"] if bwd and gemm else None, 0.25, pct)
if tf and tfb:
    print(f"torch sdpa forward: {tf['seconds']*1e3:.3f} ms, {tf['tflops']:.1f} TFLOP/s (torch {tf['torch']})")
    print(f"torch sdpa forward+backward: {tfb['seconds']*1e3:.3f} ms, {tfb['tflops']:.1f} TFLOP/s")
    if fwd:
        print(f"forward time stria/torch: {fwd['seconds']/tf['seconds']:.2f}")
    if fwd and bwd:
        ratio = (fwd["seconds"] + bwd["seconds"]) / tfb["seconds"]
        print(f"forward+backward time stria/torch: {ratio:.2f}")
        # within 1.5x of torch: torch time / stria time >= 1/1.5
        target("forward+backward within 1.5x of torch SDPA (torch/stria time)",
               tfb["seconds"] / (fwd["seconds"] + bwd["seconds"]), 1 / 1.5, lambda x: f"{x:.2f}")
else:
    print("target forward+backward within 1.5x of torch SDPA: NOT MEASURED (no torch)")
print("overall: " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
PY
rc=${PIPESTATUS[0]}
echo "report: $report"
exit "$rc"
