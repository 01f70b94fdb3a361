#!/usr/bin/env bash
# The checks of kt's AMX path in one run, for a CPU with AMX-BF16 (they
# cannot run anywhere else): the tests of the amx kernels (tiles on the
# hardware, the self-test, every layer case on the amx table and on oneDNN
# over it), then the measurements that place them: the kernel bench (tile
# peak, the 16-row threshold, cold against +pf), and the layer side by side
# with the AVX-512 table, oneDNN's backend and torch (forward, dx and LoRA
# training at T = 1, 32, 512, 2048, with the per-stage profile; the
# quantized bases at decode and prefill), and which oneDNN implementations
# the oneDNN backend ran.
#
#   tools/amx_check.sh [OUT_DIR]      (default amx-check/; build dir $KT_BUILD_DIR or build/)
#
# Each step's output goes to OUT_DIR/<step>.txt; a failing test step is
# reported at the end and the measurements still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-amx-check}
build=${KT_BUILD_DIR:-build}
mkdir -p "$out"

if ! grep -qw amx_bf16 /proc/cpuinfo; then
  echo "amx_check: this CPU has no AMX-BF16 (grep -w amx_bf16 /proc/cpuinfo): the amx kernels cannot run here" >&2
  exit 2
fi
grep -m1 'model name' /proc/cpuinfo | tee "$out/cpu.txt"
grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$out/cpu.txt"
echo

if [ ! -x "$build/bench/kt_bench" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$out/configure.txt" 2>&1 &&
    cmake --build "$build" -j"$(nproc)" >"$out/build.txt" 2>&1 || {
    echo "amx_check: the build failed; see $out/build.txt" >&2
    exit 1
  }
fi

failed=()
step() {  # step NAME COMMAND...: runs it, output to $out/NAME.txt
  local name=$1
  shift
  echo "== $name: $*"
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    failed+=("$name")
    echo "   failed (rc $rc): $out/$name.txt"
  fi
  tail -n 3 "$out/$name.txt" | sed 's/^/   /'
}

# Tests: kt's tiles on the hardware (the kernel tests include the amx
# self-test and the measured GEMM choice), every layer case on the amx table.
step test_kernels "$build/tests/kt_test_kernels"
step test_moe_amx "$build/tests/kt_test_moe" --gtest_filter='*amx*:*Amx*'
step test_io_amx "$build/tests/io/kt_test_io" --gtest_filter='*amx*:*Amx*:PackedCache*:PackedStored*'
KT_VERBOSE=1 "$build/tests/kt_test_kernels" --gtest_filter='AutoGemm.*:AmxKernels.*' >"$out/gemm_choice.txt" 2>&1

# Measurements.
step kernel_bench "$build/bench/kt_kernel_bench"
step bench_bf16 "$build/bench/kt_bench" --tokens 1,32,512,2048 --cases forward,train_dx,train_lora --reps 5 --profile
step bench_bf16_avx512 "$build/bench/kt_bench" --isa avx512bf16 --tokens 1,32,512,2048 \
  --cases forward,train_dx,train_lora --reps 5 --no-torch --no-onednn
step bench_bf16_onednn_backend "$build/bench/kt_bench" --backend onednn --tokens 512,2048 \
  --cases forward,train_dx,train_lora --reps 5 --no-torch --no-onednn --profile
step bench_quant "$build/bench/kt_bench" --tokens 1,512 --cases forward,train_lora \
  --format fp8_b128,int4_g32,int4_g128,mxfp4,int4_g32/int8,int8_channel/int8 --reps 5 --no-torch --no-onednn

# The oneDNN implementations the backend's plans got, with counts of calls
# (brg:avx512_core_amx expected; never ref: kt's kernel runs those shapes).
DNNL_VERBOSE=1 "$build/bench/kt_bench" --backend onednn --tokens 1,512 --cases forward,train_dx \
  --format int8_channel --reps 1 --warmup 0 --no-torch --no-onednn 2>/dev/null |
  awk -F, '/^onednn_verbose,exec/ { n[$4 "," $5]++ } END { for (k in n) print n[k], k }' |
  sort -rn >"$out/onednn_impls.txt"
echo "== onednn_impls: $(head -n 3 "$out/onednn_impls.txt" | tr '\n' ' ')"
if grep -q ',ref' "$out/onednn_impls.txt"; then
  failed+=(onednn_impls)
  echo "   failed: the oneDNN backend ran a reference implementation ($out/onednn_impls.txt)"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "amx_check: failed: ${failed[*]} (outputs in $out/)"
  exit 1
fi
echo "amx_check: every step ran; outputs in $out/"
