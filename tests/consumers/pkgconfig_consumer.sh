#!/bin/sh
# A Makefile-style build finds an installed kt through pkg-config, builds, runs.
#   pkgconfig_consumer.sh <install prefix> <work dir> <c compiler>
set -eu
prefix=$1 work=$2 cc=$3
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v pkg-config >/dev/null 2>&1; then
  echo "skipped: pkg-config is not installed"
  exit 77
fi
pc=$(find "$prefix" -name kt.pc | head -n 1)
[ -n "$pc" ] || { echo "no kt.pc under $prefix"; exit 1; }
export PKG_CONFIG_PATH="$(dirname "$pc")"
version=$(pkg-config --modversion kt)
cflags=$(pkg-config --cflags kt)
libs=$(pkg-config --libs kt)
libdir=$(pkg-config --variable=libdir kt)
echo "kt.pc: version $version; cflags $cflags; libs $libs"
pkg-config --atleast-version=1 kt
rm -rf "$work" && mkdir -p "$work"
# shellcheck disable=SC2086  # the flags are lists
"$cc" -std=c99 -Wall -Wextra -Werror $cflags "$here/consumer.c" -o "$work/consumer" $libs -lm
LD_LIBRARY_PATH="$libdir" "$work/consumer"
