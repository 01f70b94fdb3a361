#!/bin/sh
# A CMake project finds an installed kt with find_package(kt 1), builds, runs.
#   cmake_consumer.sh <install prefix> <work dir> <cmake> <c compiler>
set -eu
prefix=$1 work=$2 cmake=$3 cc=$4
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$cmake" -S "$here/cmake" -B "$work" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
"$cmake" --build "$work"
# CMake puts the imported library's directory into the build RPATH.
"$work/consumer"
