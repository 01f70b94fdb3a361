"""The exported symbols of libkt are exactly the functions the public header
declares, all named kt_*, and each is referenced from a C test program."""
import pathlib
import re
import subprocess
import sys

lib, header, tests_dir = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True).stdout
exported = {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[1] in "TtWw"}
declared = set(re.findall(r"KT_API[^;(]*?\b(kt_\w+)\s*\(", header.read_text()))
c_sources = "\n".join(p.read_text() for p in tests_dir.rglob("*.c"))
problems = []
for name in sorted(exported - declared):
    problems.append(f"exported but not declared in the header: {name}")
for name in sorted(declared - exported):
    problems.append(f"declared in the header but not exported: {name}")
for name in sorted(n for n in exported if not n.startswith("kt_")):
    problems.append(f"exported symbol without the kt_ prefix: {name}")
for name in sorted(declared):
    if not re.search(r"\b" + name + r"\b", c_sources):
        problems.append(f"not referenced from any C test under {tests_dir}: {name}")
if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"{len(exported)} exported symbols, all kt_*, all declared, all referenced from C tests")
