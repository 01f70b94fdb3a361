#!/bin/sh
# go test of the cgo package plugins/go against the built libkt, offline: the
# build cache and GOPATH live in the work dir, no module proxy, no toolchain download.
#   go_test.sh <plugins/go> <work dir> <libkt dir> <kt include dir> <dlpack include dir>
set -eu
src=$1 work=$2 libdir=$3 include=$4 dlpack=$5
go=$(command -v go || true)
[ -n "$go" ] || { [ -x /usr/lib/go/bin/go ] && go=/usr/lib/go/bin/go; } || true
if [ -z "$go" ]; then
  echo "skipped: no Go toolchain (Debian: apt-get install golang-go)"
  exit 77
fi
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
  echo "skipped: cgo needs a C compiler"
  exit 77
fi
mkdir -p "$work"
export GOCACHE="$work/cache" GOPATH="$work/gopath" GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
  GOPROXY=off GOSUMDB=off GO111MODULE=on CGO_ENABLED=1
export CGO_CFLAGS="-I$include -I$dlpack"
export CGO_LDFLAGS="-L$libdir -Wl,-rpath,$libdir"
"$go" version
cd "$src"
"$go" vet .
# cgocheck=2 also checks every pointer the package stores or passes to C.
GODEBUG=cgocheck=2 "$go" test -count=1 -v .
