#!/bin/sh
# Sets up a fresh Debian machine for kt (apt packages), builds, and runs
#   tools/bootstrap.sh demo   the main job: a synthetic Qwen3-30B-A3B layer,
#                             inference + a LoRA training step, checked
#                             against the reference, with timings
#   tools/bootstrap.sh test   the whole test suite: ctest (C/C++, the
#                             bindings, the Python suite with Debian's
#                             torch 1.13), then the Python suite again in a
#                             venv with torch 2.x, transformers, PEFT and the
#                             benchmark's peers from the package index and
#                             kt installed by pip, vLLM serving through kt
#                             in a venv of its own, and a LlamaFactory LoRA
#                             SFT run with kt's experts in a third one
#                             (tools/python_env.sh)
#   tools/bootstrap.sh sanitize
#                             the whole suite built with ASan+UBSan (leak
#                             detection on, halt on the first finding) in
#                             build-asan/, then a TSan build in build-tsan/
#                             running the threading tests (label threads).
#                             Tests that cannot run sanitized (python, go,
#                             rust, consumers built outside the tree) are
#                             skipped by label sanitizer_skip; the reason
#                             for each is printed. Run it before landing
#                             changes to lifetimes, threading or I/O.
# Build directory: $KT_BUILD_DIR (default build/; for sanitize
# $KT_ASAN_BUILD_DIR and $KT_TSAN_BUILD_DIR, default build-asan/ and
# build-tsan/). Parallelism: $KT_JOBS.
set -eu
cd "$(dirname "$0")/.."
what="${1:-demo}"
build="${KT_BUILD_DIR:-build}"
jobs="${KT_JOBS:-$(nproc 2>/dev/null || echo 2)}"
case "$what" in
  demo|test|sanitize) ;;
  *) echo "usage: $0 demo|test|sanitize" >&2; exit 2 ;;
esac

# libdnnl-dev only recommends ocl-icd-opencl-dev, but its CMake config needs
# it; `file` is what cpack's Debian generator runs (the package test);
# python3-dev: Python.h for DeepSpeed's CPU Adam op, which the benchmark's
# peer check builds (tools/python_env.sh peers).
packages="build-essential cmake ccache pkg-config file libdlpack-dev libgtest-dev libbenchmark-dev \
nlohmann-json3-dev libnuma-dev python3 python3-numpy python3-pytest python3-venv python3-dev python3-torch libtorch-dev \
libdnnl-dev ocl-icd-opencl-dev libgloo-dev clang libclang-rt-14-dev abigail-tools golang-go cargo rustc"

missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "kt: installing Debian packages:$missing"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends $missing
fi

if [ "$what" = sanitize ]; then
  asan="${KT_ASAN_BUILD_DIR:-build-asan}"
  tsan="${KT_TSAN_BUILD_DIR:-build-tsan}"
  cmake -S . -B "$asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DKT_SANITIZE=address;undefined"
  cmake --build "$asan" -j "$jobs"
  echo "kt sanitize: not run in the ASan+UBSan build (label sanitizer_skip):"
  sed 's/^/  /' "$asan/sanitizer_skips.txt"
  ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:check_initialization_order=1" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
    ctest --test-dir "$asan" --output-on-failure -j "$jobs" -LE sanitizer_skip --timeout 3000
  # oneDNN's OpenMP runtime is not built for TSan (its reports would be
  # about libgomp, not kt): the thread build leaves the oneDNN backend out.
  cmake -S . -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKT_SANITIZE=thread -DKT_WITH_ONEDNN=OFF
  cmake --build "$tsan" -j "$jobs" --target kt_test_lifecycle kt_test_handles kt_test_threads
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    ctest --test-dir "$tsan" --output-on-failure -j "$jobs" -L threads --timeout 3000
  echo "kt sanitize: ASan+UBSan suite and TSan threading tests passed"
  exit 0
fi

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
if [ "$what" = demo ]; then
  cmake --build "$build" -j "$jobs" --target kt_qwen3_layer  # just what the demo runs
else
  cmake --build "$build" -j "$jobs"
fi
# Makes `import kt` work for the system python3 without environment variables.
if [ -x plugins/python/install_dev.sh ]; then plugins/python/install_dev.sh "$build"; fi

case "$what" in
  demo) "$build/examples/qwen3_layer/kt_qwen3_layer" ;;
  test)
    # The pip route's venv first (kt installed by pip, torch 2.x, the real
    # hosts and the benchmark's peers from the package index): ctest's peer
    # checks run kt-moe bench with it.
    KT_JOBS="$jobs" tools/python_env.sh create
    tools/python_env.sh hosts
    tools/python_env.sh peers
    KT_JOBS="$jobs" tools/python_env.sh serve
    KT_JOBS="$jobs" tools/python_env.sh llamafactory
    # Every part runs even when one fails, and each failure is named.
    failed=""
    ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 1500 || failed="$failed ctest"
    # The Python suite again, with the venv's torch 2.x and the real hosts.
    tools/python_env.sh test || failed="$failed python-torch2"
    # The real hosts again with transformers 4 (experts as per-expert
    # modules, where 5 fuses gate_up_proj), which `hosts` put beside 5.
    PYTHONPATH="${KT_VENV:-$(pwd)/build-venv}/transformers4" tools/python_env.sh test \
      tests/python/test_real_transformers.py tests/python/test_real_peft.py tests/python/test_real_trainer.py ||
      failed="$failed transformers4"
    # vLLM serving through kt, in its own venv (its torch pin differs): the
    # fp32 token checks (dense and an int4 checkpoint), the HTTP server and
    # the refusals (each engine start costs half a minute on 2 cores; the
    # bf16, compiled-mode and int8 cases run with:
    # KT_VENV=$(pwd)/build-serve tools/python_env.sh test tests/python/test_serve_vllm.py).
    # Then the whole-model path at test size (bench/whole_model.py's code):
    # gpt-oss MXFP4 and Qwen3 int4 2-layer models served through vLLM + kt.
    # Then a minute of load on the HTTP server (bench/serve_load.py: 8
    # clients, cancellations, refusals, greedy answers, memory; ~2 minutes).
    KT_VENV="$(pwd)/build-serve" tools/python_env.sh test tests/python/test_serve_vllm.py \
      tests/python/test_whole_model.py tests/python/test_serve_load.py \
      -k "fp32_greedy or int4 or http or refused or whole_model or serve_load" ||
      failed="$failed vllm"
    # LlamaFactory's CLI with a YAML config, with kt's experts and without,
    # in its own venv (llamafactory pins older transformers and PEFT): the
    # fp32 loss curves, peak memory and the saved adapter (about 3 minutes).
    KT_VENV="${KT_LLAMAFACTORY_VENV:-$(pwd)/build-llamafactory}" tools/python_env.sh test \
      tests/python/test_real_llamafactory.py || failed="$failed llamafactory"
    if [ -n "$failed" ]; then
      echo "kt test: FAILED:$failed" >&2
      exit 1
    fi
    echo "kt test: all parts passed (ctest, python-torch2, transformers4, vllm, llamafactory)"
    ;;
esac
