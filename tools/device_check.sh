#!/usr/bin/env bash
# kt on a machine with a GPU (and maybe AMX), in one time-boxed run: what the
# machine is, the AMX checks where the CPU has AMX, the CUDA-stream example,
# hybrid placement on the GPU, the product's setting measured (attention on
# the GPU, routed experts in kt), the NCCL communicator, and kt's thread
# scaling. Every step has its own timeout and the whole run a deadline; a
# failing step never stops the others. Output: OUT_DIR/device.log (all of
# it) and OUT_DIR/amx.log (the AMX steps), a summary at the end of each.
#
#   tools/device_check.sh OUT_DIR [STEP...]
#     steps: env amx cuda_stream hybrid nccl real scaling amx_bench (default: all, in that order)
#
#   tools/device_check.sh --prepare   (here, before the device run)
#     builds the committed sources (HEAD, copied to build-dsrc/, so edits in
#     the work tree stay out) in build-dev/ (Release, oneDNN, Gloo, NCCL, the
#     CUDA example) and packs what the run needs into build-dcarry/ (about
#     20 MB; the device run names it in `carry`): libkt.so.1, kt_bench,
#     kt_kernel_bench, the test programs, kt_cuda_stream, the Python plugin
#     of the same sources, and the Debian libraries they link (libs.tar.xz;
#     the GPU machine has none). --pack BUILD_DIR SRC_DIR packs only.
# The binaries come from $KT_CARRY (default build-dcarry/).
# $KT_DEVICE_BUDGET (seconds, default 480) bounds the whole run.
# KT_CHECK_DEVICE=cpu runs the Python steps on the CPU with a small model
# (a check of the scripts on a machine without a GPU, not a measurement).
# On a CPU with AMX-BF16 and no GPU, the AMX checks alone:
#   tools/device_check.sh --prepare && tools/device_check.sh OUT_DIR env amx amx_bench
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --prepare ]; then
  src=build-dsrc
  build=build-dev
  tmp=$(mktemp -d)
  git archive HEAD | tar -x -C "$tmp" || exit 1
  mkdir -p "$src"
  # Only files that changed are rewritten, so a second --prepare rebuilds
  # only what changed.
  (cd "$tmp" && find . -type f) | while read -r f; do
    cmp -s "$tmp/$f" "$src/$f" || { mkdir -p "$(dirname "$src/$f")" && cp "$tmp/$f" "$src/$f"; }
  done
  (cd "$src" && find . -type f ! -name COMMIT) | while read -r f; do [ -e "$tmp/$f" ] || rm -f "$src/$f"; done
  rm -rf "$tmp"
  git rev-parse HEAD >"$src/COMMIT"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST \
    >/dev/null &&
    cmake --build "$build" -j "${KT_JOBS:-2}" --target kt kt_bench kt_kernel_bench kt_cuda_stream \
      kt_test_kernels kt_test_moe kt_test_io kt_test_dist || exit 1
  exec bash tools/device_check.sh --pack "$build" "$src"
fi

if [ "${1:-}" = --pack ]; then
  # Packs what a device run needs from BUILD_DIR (built from SRC_DIR) into
  # $KT_CARRY: stripped programs, the plugin, the torch baseline scripts and
  # the non-system libraries libkt and the programs link.
  build=${2:?usage: $0 --pack BUILD_DIR SRC_DIR}
  src=${3:?usage: $0 --pack BUILD_DIR SRC_DIR}
  carry=${KT_CARRY:-build-dcarry}
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib" "$carry/python" "$carry/bench"
  for p in bench/kt_bench bench/kt_kernel_bench examples/cuda-stream/kt_cuda_stream tests/kt_test_kernels \
    tests/kt_test_moe tests/io/kt_test_io tests/dist/kt_test_dist; do
    [ -x "$build/$p" ] && strip -o "$carry/bin/$(basename "$p")" "$build/$p"
  done
  strip -o "$carry/lib/libkt.so.1" "$build/libkt.so.1"
  cp -r "$src/plugins/python/kt" "$carry/python/"
  find "$carry/python" -name __pycache__ -prune -exec rm -rf {} +
  cp "$src/bench/torch_baseline.py" "$src/bench/torch_optim_baseline.py" "$carry/bench/"
  [ -f "$src/COMMIT" ] && cp "$src/COMMIT" "$carry/"
  # Libraries outside glibc, libstdc++ and CUDA (Debian's oneDNN, Gloo, OpenMP...).
  libs=$(for f in "$carry"/bin/* "$carry/lib/libkt.so.1"; do ldd "$f" 2>/dev/null; done |
    awk '$3 ~ /^\// { print $3 }' | sort -u |
    grep -Ev '/(libkt|libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*|libcudart)\.so' || true)
  mkdir -p "$carry/libs"
  for l in $libs; do cp -L "$l" "$carry/libs/"; done
  tar -C "$carry/libs" -cJf "$carry/libs.tar.xz" . && rm -rf "$carry/libs"
  du -sh "$carry"
  exit 0
fi

out=${1:?usage: $0 OUT_DIR [STEP...]}
shift
steps=${*:-env amx cuda_stream hybrid nccl real scaling amx_bench}
mkdir -p "$out"
log=$out/device.log
amxlog=$out/amx.log
carry=${KT_CARRY:-build-dcarry}
budget=${KT_DEVICE_BUDGET:-480}
start=$(date +%s)
deadline=$((start + budget))
export PYTHONUNBUFFERED=1
summary=()
gpu=${KT_CHECK_DEVICE:-cuda}
small=""
[ "$gpu" = cpu ] && small=--small

say() { echo "$*" | tee -a "$log"; }

# The carried libraries, libkt and the plugin.
carry=$(cd "$carry" && pwd)
mkdir -p /tmp/kt-libs && tar -C /tmp/kt-libs -xJf "$carry/libs.tar.xz"
export KT_LIBRARY=$carry/lib/libkt.so.1
export PYTHONPATH=$carry/python${PYTHONPATH:+:$PYTHONPATH}
# NCCL and the CUDA runtime for kt's NCCL backend (opened at run time): the
# CUDA toolkit's, else the ones of the Python packages torch uses.
py=${KT_PYTHON:-$(command -v python3)}
extra=$("$py" - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
for base in site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]:
    for pat in ("libnccl.so.2", "libcudart.so.1[0-9]*"):
        for f in (glob.glob(os.path.join(base, "nvidia", "**", pat), recursive=True) if "-packages" in base
                  else glob.glob(os.path.join(base, pat))):
            d = os.path.dirname(f)
            if d not in dirs:
                dirs.append(d)
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH=$carry/lib:/tmp/kt-libs${extra:+:$extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$carry/bin

# step NAME TIMEOUT COMMAND...: runs it with a timeout (cut to the deadline),
# output into the log; records passed / failed (rc) / timed out / not run.
step() {
  local name=$1 limit=$2
  shift 2
  local now left rc t0
  now=$(date +%s)
  left=$((deadline - now))
  if [ "$left" -lt 15 ]; then
    say "== $name: not run (the run's deadline is ${left}s away)"
    summary+=("$name: not run (deadline)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "== $name (timeout ${limit}s, at +$((now - start))s): $*"
  t0=$(date +%s)
  timeout -k 5 "$limit" $linebuf "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - t0))
  case $rc in
    0) summary+=("$name: passed (${took}s)") ;;
    124 | 137) summary+=("$name: timed out after ${took}s") ;;
    77) summary+=("$name: skipped (77: no usable CUDA device)") ;;
    *) summary+=("$name: failed rc $rc (${took}s)") ;;
  esac
  say "== $name: rc $rc, ${took}s"
}

# Line-buffered stdout, so a step cut by its timeout still leaves what it printed.
linebuf=""
command -v stdbuf >/dev/null && linebuf="stdbuf -oL -eL"
has_amx=0
grep -qw amx_bf16 /proc/cpuinfo && has_amx=1

for s in $steps; do
  case $s in
    env)
      say "== env: $(date -u +%Y-%m-%dT%H:%M:%SZ); kt $(cat "$carry/COMMIT" 2>/dev/null); LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
      { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
        lscpu | grep -v "^Vulnerability"; echo "amx flags: $(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
        echo "nproc: $(nproc)"; numactl -H 2>&1 || echo "numactl: not installed"
        free -g; uname -r
        "$py" -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
        "$py" -c "import kt; e = kt.Engine(); print('kt engine', e.info())"
      } 2>&1 | tee -a "$log"
      summary+=("env: done")
      ;;
    amx)
      # The tests of the amx kernels, time-boxed, on the carried build: kt's
      # tiles on the hardware (the kernel tests hold the amx self-test and the
      # measured GEMM choice), every layer case on the amx table.
      if [ $has_amx = 0 ]; then
        say "== amx: not run: this CPU shows no amx_bf16 flag (kt's engine info above says what kt detected)"
        summary+=("amx: not run (no AMX)")
        continue
      fi
      step amx.test_kernels 75 "$bin/kt_test_kernels"
      step amx.test_moe 45 "$bin/kt_test_moe" --gtest_filter='*amx*:*Amx*'
      step amx.test_io 25 "$bin/kt_test_io" --gtest_filter='*amx*:*Amx*:PackedCache*:PackedStored*'
      step amx.gemm_choice 15 env KT_VERBOSE=1 "$bin/kt_test_kernels" --gtest_filter='AutoGemm.*:AmxKernels.*'
      ;;
    amx_bench)
      # The measurements that place the amx table: the tile GEMM alone (one
      # thread), the layer on 16 threads against kt's avx512bf16 table and
      # oneDNN's backend (the amx side at T=1,32,512 is scaling.threads16),
      # the quantized bases at decode and prefill, and which oneDNN
      # implementations the backend's plans got (brg:avx512_core_amx
      # expected; a ref one fails the step: kt's kernel runs those shapes).
      [ $has_amx = 0 ] && continue
      step amx.kernel_bench 45 "$bin/kt_kernel_bench" --isa amx
      step amx.bench_amx 50 "$bin/kt_bench" --tokens 512,2048 --cases forward,train_dx,train_lora --reps 3 \
        --profile --no-torch --no-onednn
      step amx.bench_avx512 60 "$bin/kt_bench" --isa avx512bf16 --tokens 512,2048 \
        --cases forward,train_dx,train_lora --reps 3 --no-torch --no-onednn
      step amx.bench_onednn_backend 45 "$bin/kt_bench" --backend onednn --tokens 512,2048 \
        --cases forward,train_lora --reps 3 --no-torch --no-onednn
      step amx.bench_quant 45 "$bin/kt_bench" --tokens 1,512 --cases forward,train_lora \
        --format fp8_b128,int4_g32,int4_g128,mxfp4,int4_g32/int8,int8_channel/int8 --reps 3 --no-torch --no-onednn
      step amx.onednn_impls 30 bash -c 'impls=$(DNNL_VERBOSE=1 "$1" --backend onednn --tokens 1,512 \
        --cases forward,train_dx --format int8_channel --reps 1 --warmup 0 --no-torch --no-onednn 2>/dev/null |
        awk -F, "/^onednn_verbose,exec/ { n[\$4 \",\" \$5]++ } END { for (k in n) print n[k], k }" | sort -rn)
        echo "$impls"
        case $impls in *,ref*) echo "the oneDNN backend ran a reference implementation"; exit 1 ;; esac' _ "$bin/kt_bench"
      ;;
    cuda_stream)
      for t in 1 48 256; do step cuda_stream.T$t 30 "$bin/kt_cuda_stream" $t; done
      ;;
    hybrid)
      step hybrid 120 "$py" tools/device_check.py hybrid --device "$gpu"
      ;;
    real)
      step real 200 "$py" tools/device_check.py real --layers 2 --device "$gpu" $small
      ;;
    nccl)
      step nccl.c_tests 40 "$bin/kt_test_dist" --gtest_filter='Comm.*'
      step nccl.python 60 "$py" tools/device_check.py nccl --device "$gpu"
      ;;
    scaling)
      # kt alone at 1..16 threads (16: every core), bf16 Qwen3-30B-A3B layer;
      # each run also measures the machine's DRAM bandwidth at that thread count.
      step scaling.threads1 80 "$bin/kt_bench" --threads 1 --tokens 1,32,512 --cases forward,train_lora \
        --reps 2 --no-torch --no-onednn
      for n in 2 4 8 16; do
        step scaling.threads$n 55 "$bin/kt_bench" --threads $n --tokens 1,32,512 --cases forward,train_lora \
          --reps 3 --no-torch --no-onednn
      done
      ;;
    *) say "unknown step $s" ;;
  esac
done

say "== summary (+$(($(date +%s) - start))s)"
for l in "${summary[@]}"; do say "STEP $l"; done
if [ $has_amx = 1 ]; then
  # The AMX record: the amx steps' output and the 16-thread scaling run (the amx table at T=1,32,512).
  awk '/^== (amx|scaling.threads16)[. ]/ { on = 1 } /^== / && !/^== (amx|scaling.threads16)[. ]/ { on = 0 } on' "$log" >"$amxlog"
  for l in "${summary[@]}"; do case $l in amx* | scaling.threads16*) echo "STEP $l" >>"$amxlog" ;; esac; done
fi
exit 0
