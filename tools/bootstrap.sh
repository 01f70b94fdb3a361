#!/bin/sh
# Sets up a fresh Debian machine for kt (apt packages), builds, and runs
#   tools/bootstrap.sh demo   the main job: a synthetic Qwen3-30B-A3B layer,
#                             inference + a LoRA training step, checked
#                             against the reference, with timings
#   tools/bootstrap.sh test   the whole test suite
# Build directory: $KT_BUILD_DIR (default build/). Parallelism: $KT_JOBS.
set -eu
cd "$(dirname "$0")/.."
what="${1:-demo}"
build="${KT_BUILD_DIR:-build}"
jobs="${KT_JOBS:-$(nproc 2>/dev/null || echo 2)}"
case "$what" in
  demo|test) ;;
  *) echo "usage: $0 demo|test" >&2; exit 2 ;;
esac

# libdnnl-dev only recommends ocl-icd-opencl-dev, but its CMake config needs
# it; `file` is what cpack's Debian generator runs (the package test).
packages="build-essential cmake ccache pkg-config file libdlpack-dev libgtest-dev libbenchmark-dev \
nlohmann-json3-dev libnuma-dev python3 python3-numpy python3-pytest python3-torch libtorch-dev \
libdnnl-dev ocl-icd-opencl-dev clang libclang-rt-14-dev abigail-tools golang-go cargo rustc"

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
  test) ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 1500 ;;
esac
