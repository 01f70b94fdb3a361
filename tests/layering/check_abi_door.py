"""One door for the ABI, checked on what the compiler built: every object of
the library that is not from src/api neither calls nor defines a function the
public header declares (KT_API), and was compiled without any header of
src/api (its dependency file, written by the compiler, lists every header it
read). Below src/api the library calls the C++ layer, never itself through
the ABI.

Usage: check_abi_door.py <kt_c_api.h> <object files of kt_objects...>
"""
import pathlib
import re
import subprocess
import sys

# Calls below src/api that are allowed (source file -> exported names): none.
ALLOWED = {}


def source_of(obj):
    """src/io/layout.cpp for .../kt_objects.dir/src/io/layout.cpp.o."""
    text = obj.as_posix()
    marker = "kt_objects.dir/"
    if marker not in text or not text.endswith(".o"):
        return None
    return text.split(marker, 1)[1][:-2]


def symbols(obj, *flags):
    out = subprocess.run(["nm", *flags, str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()}


def api_headers_read(obj):
    """The headers under src/api that the compiler read for obj (its .d file)."""
    dep = pathlib.Path(str(obj) + ".d")
    if not dep.exists():
        return None
    paths = dep.read_text().replace("\\\n", " ").split()
    return sorted({p for p in paths if re.search(r"(^|/)src/api/[^/]+\.h$", p)})


def main():
    header = pathlib.Path(sys.argv[1]).read_text()
    declared = set(re.findall(r"KT_API[^;(]*?\b(kt_\w+)\s*\(", header))
    objects = [pathlib.Path(p) for p in sys.argv[2:] if p]
    problems, notes = [], []
    below, api_defined = 0, set()
    for obj in objects:
        src = source_of(obj)
        if src is None:
            problems.append(f"{obj}: not an object of kt_objects")
            continue
        defined = symbols(obj, "--defined-only") & declared
        if src.startswith("src/api/"):
            api_defined |= defined
            continue
        below += 1
        called = symbols(obj, "-u") & declared
        allowed = ALLOWED.get(src, set())
        for name in sorted(called - allowed):
            problems.append(f"{src} calls the exported {name}: call the C++ layer instead")
        for name in sorted(allowed - called):
            notes.append(f"{src} no longer calls {name}: drop it from ALLOWED")
        for name in sorted(defined):
            problems.append(f"{src} defines the exported {name}: exported functions live in src/api")
        headers = api_headers_read(obj)
        if headers is None:
            problems.append(f"{src}: no dependency file {obj}.d to read its headers from")
        for h in headers or []:
            problems.append(f"{src} includes {h}: nothing below src/api includes it")
    # The check must have looked at something real.
    if below == 0 or not api_defined:
        problems.append(f"{below} objects below src/api, {len(api_defined)} exported functions defined in src/api: "
                        "wrong object list?")
    for name in sorted(declared - api_defined):
        problems.append(f"declared in the header, defined by no object of src/api: {name}")
    for n in notes:
        print("note:", n)
    if problems:
        print("\n".join(problems))
        return 1
    print(f"{below} objects below src/api: no exported kt_* defined or called (besides the "
          f"{sum(map(len, ALLOWED.values()))} calls listed in ALLOWED), no src/api header read; "
          f"{len(api_defined)} exported functions, all in src/api")
    return 0


if __name__ == "__main__":
    sys.exit(main())
