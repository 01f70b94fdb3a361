#!/bin/sh
# cargo test of plugins/rust (kt-sys + kt) against the built libkt, offline:
# no crates.io (the crates have no dependencies), CARGO_HOME and the target
# dir in the work dir, sources copied there so nothing is written into the tree.
#   rust_test.sh <plugins/rust> <work dir> <libkt dir> <kt include dir> <dlpack include dir>
set -eu
src=$1 work=$2 libdir=$3 include=$4 dlpack=$5
# Debian's cargo and rustc first: they are the ones the packages are built with.
cargo=""
for c in /usr/bin/cargo "$(command -v cargo || true)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then cargo=$c; break; fi
done
if [ -z "$cargo" ]; then
  echo "skipped: no cargo (Debian: apt-get install cargo rustc)"
  exit 77
fi
if [ "$cargo" = /usr/bin/cargo ] && [ -x /usr/bin/rustc ]; then
  export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
fi
mkdir -p "$work"
rm -rf "$work/src" && mkdir -p "$work/src"
cp -R "$src/." "$work/src/"
rm -rf "$work/src/target" "$work/src/Cargo.lock"
export CARGO_HOME="$work/cargo-home" CARGO_TARGET_DIR="$work/target" CARGO_NET_OFFLINE=true
export KT_LIB_DIR="$libdir" KT_INCLUDE_DIR="$include" KT_DLPACK_INCLUDE_DIR="$dlpack"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$cargo" --version
"${RUSTC:-rustc}" --version
cd "$work/src"
"$cargo" test --offline --workspace -- --nocapture --test-threads=1
