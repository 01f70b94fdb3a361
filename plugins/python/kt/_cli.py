"""The `kt` console command of the wheel: runs the kt tool shipped inside the
package (kt/bin/kt, which finds kt/libkt.so.<abi> through its RUNPATH), in
place of this Python process.
"""
import os
import sys


def tool_path():
    """The kt tool inside this package, or None (a source checkout has it in
    the CMake build tree, build*/tools/kt, instead)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "kt")
    return path if os.access(path, os.X_OK) else None


def main():
    path = tool_path()
    if path is None:
        sys.stderr.write("kt: the kt tool is not in this installation of the package (%s); "
                         "install kt with pip (pip install .) or run build*/tools/kt\n"
                         % os.path.dirname(os.path.abspath(__file__)))
        return 127
    try:
        os.execv(path, [path] + sys.argv[1:])
    except OSError as e:
        sys.stderr.write("kt: cannot run %s: %s\n" % (path, e))
        return 126


if __name__ == "__main__":
    sys.exit(main())
