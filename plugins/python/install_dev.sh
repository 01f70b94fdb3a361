#!/bin/sh
# Makes `import kt` work for the system python3 from this checkout, with no
# environment variables: a .pth file in the interpreter's site-packages puts
# plugins/python on sys.path, and kt/_libpath.py (git-ignored) names the
# libkt.so.<abi> that BUILD_DIR holds.
#   plugins/python/install_dev.sh BUILD_DIR
set -eu
if [ $# -ne 1 ]; then
  echo "usage: $0 BUILD_DIR" >&2
  exit 2
fi
python="${KT_PYTHON:-/usr/bin/python3}"
[ -x "$python" ] || python=python3
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
abi=$(sed -n 's/^#define KT_ABI_VERSION \([0-9][0-9]*\).*/\1/p' "$here/../../include/kt_c_api.h")
lib="$build/libkt.so.$abi"
if [ ! -e "$lib" ]; then
  echo "install_dev.sh: $lib not found; build kt first" >&2
  exit 1
fi
"$python" - "$here" "$lib" <<'PY'
import os, site, sys
pkg_root, lib = sys.argv[1], sys.argv[2]
with open(os.path.join(pkg_root, "kt", "_libpath.py"), "w") as f:
    f.write("# Written by install_dev.sh: the libkt of this checkout's build.\n")
    f.write("LIBRARY = %r\n" % lib)
candidates = [d for d in site.getsitepackages() if "dist-packages" in d or "site-packages" in d]
for d in candidates + [site.getusersitepackages()]:
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "kt-dev.pth"), "w") as f:
            f.write(pkg_root + "\n")
    except OSError:
        continue
    print("kt: %s -> %s (library %s)" % (os.path.join(d, "kt-dev.pth"), pkg_root, lib))
    break
else:
    sys.exit("install_dev.sh: no writable site-packages directory")
PY
