#!/bin/sh
# Builds the Debian packages with CPack, unpacks them with dpkg -x into an
# empty root (what dpkg -i would lay down), checks their contents and control
# fields, then compiles and runs a consumer against that root only.
#   deb_consumer.sh <build dir> <work dir> <c compiler> <runtime package> <version> <abi>
set -eu
build=$1 work=$2 cc=$3 runtime_pkg=$4 version=$5 abi=$6
here=$(cd "$(dirname "$0")" && pwd)
for tool in cpack dpkg-deb dpkg pkg-config; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "skipped: $tool is not installed"
    exit 77
  fi
done
fail() { echo "FAIL: $*"; exit 1; }

rm -rf "$work" && mkdir -p "$work/root"
cpack --config "$build/CPackConfig.cmake" -G DEB -B "$work/packages" >"$work/cpack.log" 2>&1 ||
  { cat "$work/cpack.log"; fail "cpack -G DEB failed"; }
runtime_deb=$(ls "$work/packages/${runtime_pkg}_${version}_"*.deb 2>/dev/null | head -n 1)
dev_deb=$(ls "$work/packages/libkt-dev_${version}_"*.deb 2>/dev/null | head -n 1)
[ -n "$runtime_deb" ] || fail "no ${runtime_pkg}_${version}_*.deb in $work/packages: $(ls "$work/packages")"
[ -n "$dev_deb" ] || fail "no libkt-dev_${version}_*.deb in $work/packages"
echo "packages: $(cd "$work/packages" && ls ./*.deb | tr '\n' ' ')"

field() { dpkg-deb -f "$1" "$2"; }
depends=$(field "$runtime_deb" Depends)
echo "$runtime_pkg Depends: $depends"
case "$depends" in *libc6*) ;; *) fail "$runtime_pkg does not depend on libc6" ;; esac
case "$depends" in *libstdc++6*) ;; *) fail "$runtime_pkg does not depend on libstdc++6" ;; esac
dev_depends=$(field "$dev_deb" Depends)
echo "libkt-dev Depends: $dev_depends"
case "$dev_depends" in *"$runtime_pkg (= $version)"*) ;; *) fail "libkt-dev does not pin $runtime_pkg (= $version)" ;; esac
case "$dev_depends" in *libdlpack-dev*) ;; *) fail "libkt-dev does not depend on libdlpack-dev" ;; esac
dpkg-deb --ctrl-tarfile "$runtime_deb" | tar -t | grep -q shlibs || fail "$runtime_pkg has no shlibs file"

# The runtime package holds the versioned object and its SONAME link only; the
# development package holds the rest.
dpkg-deb -c "$runtime_deb" | grep -q "/usr/include/" && fail "$runtime_pkg ships headers"
dpkg-deb -c "$runtime_deb" | grep -q "libkt\.so -> " && fail "$runtime_pkg ships the libkt.so link"
for deb in "$work/packages"/*.deb; do dpkg -x "$deb" "$work/root"; done

root="$work/root"
lib=$(find "$root" -name "libkt.so.$abi" | head -n 1)
[ -n "$lib" ] || fail "no libkt.so.$abi in the packages"
libdir=$(dirname "$lib")
[ -L "$lib" ] || fail "libkt.so.$abi is not a link to the versioned file"
[ -f "$libdir/libkt.so.$version" ] || fail "no libkt.so.$version"
[ -L "$libdir/libkt.so" ] || fail "no libkt.so development link"
soname=$(LC_ALL=C readelf -d "$libdir/libkt.so.$version" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
[ "$soname" = "libkt.so.$abi" ] || fail "SONAME is '$soname', expected libkt.so.$abi"
for f in usr/include/kt_c_api.h; do [ -f "$root/$f" ] || fail "missing /$f"; done
pc=$(find "$root" -name kt.pc | head -n 1)
[ -n "$pc" ] || fail "no kt.pc in libkt-dev"
[ -n "$(find "$root" -name ktConfig.cmake)" ] || fail "no ktConfig.cmake in libkt-dev"
[ -n "$(find "$root" -name ktConfigVersion.cmake)" ] || fail "no ktConfigVersion.cmake in libkt-dev"

# Compile and run against the unpacked root (kt.pc locates itself).
export PKG_CONFIG_PATH="$(dirname "$pc")"
cflags=$(pkg-config --cflags kt)
libs=$(pkg-config --libs kt)
case "$cflags" in *"$root"*) ;; *) fail "kt.pc cflags '$cflags' do not point into the unpacked root" ;; esac
# shellcheck disable=SC2086  # the flags are lists
"$cc" -std=c99 -Wall -Wextra -Werror $cflags "$here/consumer.c" -o "$work/consumer" $libs -lm
LD_LIBRARY_PATH="$libdir" "$work/consumer"
ldd_out=$(LD_LIBRARY_PATH="$libdir" ldd "$work/consumer")
echo "$ldd_out" | grep -q "libkt.so.$abi => $libdir/" || fail "consumer did not load libkt from the package: $ldd_out"

# The other packages, when the build made them: the kt command and the Python package.
tools_deb=$(ls "$work/packages/kt-tools_${version}_"*.deb 2>/dev/null | head -n 1)
if [ -n "$tools_deb" ]; then
  # kt's command is kt-moe (`kt` is kt-kernel's), with kt bench's scripts beside its program.
  for f in usr/bin/kt-moe usr/libexec/kt/kt_bench usr/libexec/kt/peers_baseline.py; do
    dpkg-deb -c "$tools_deb" | grep -q " \./$f\$" || fail "kt-tools lacks /$f"
  done
fi
if [ -x "$root/usr/bin/kt-moe" ]; then
  LD_LIBRARY_PATH="$libdir" "$root/usr/bin/kt-moe" demo >"$work/kt-demo.log" 2>&1 ||
    { cat "$work/kt-demo.log"; fail "kt-moe demo from kt-tools failed"; }
  echo "kt-tools: kt-moe demo passed"
fi
pydir=$(find "$root" -type d -path "*/dist-packages/kt" | head -n 1)
if [ -n "$pydir" ] && command -v python3 >/dev/null 2>&1; then
  [ -e "$pydir/_libpath.py" ] && fail "python3-kt ships the development-only _libpath.py"
  # Run outside the source tree so the in-tree package cannot be imported instead.
  got=$(cd "$work" && PYTHONPATH="$(dirname "$pydir")" LD_LIBRARY_PATH="$libdir" python3 -c \
    'import kt, sys; sys.stdout.write("%s %s" % (kt.__file__, kt.version()))') ||
    fail "python3-kt does not import"
  case "$got" in "$pydir/"*" $version") ;; *) fail "python3-kt imported as '$got'" ;; esac
  echo "python3-kt: imports kt $version from the package"
fi
echo "the packages unpack, and a consumer builds and runs against them"
