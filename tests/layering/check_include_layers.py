"""Includes point down the layers, checked on the sources: every
`#include "..."` of a file under src/ or tools/ names a header of its own
layer or of one below it (docs/architecture.md, "Layers"). A folder of src/
is a layer; folders on one line of LAYERS are one layer and may include each
other.

Usage: check_include_layers.py <repository root>
"""
import pathlib
import re
import sys

# Top to bottom.
LAYERS = [
    ["api"],                 # the door: every exported function
    ["tools"],               # programs over the C ABI
    ["dist"],                # distributed layer and checkpoints, over moe
    ["moe", "optim"],        # the layer and its optimizer
    ["io"],                  # checkpoints, packed caches, publishing
    ["runtime"],             # engine, worker pool, jobs, handles
    ["kernels"],             # per-ISA micro-kernels over the panel layout
    ["formats"],             # weight formats and the panel layout
    ["core"],                # dtypes, tensors, errors, names
]

# Includes allowed to go up (source file -> set of included headers), each
# with its reason; none today. The check fails on any other, and notes an
# entry no longer needed.
ALLOWED = {}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cpp", ".inc", ".cc", ".c")


def rank_of(folder):
    for i, names in enumerate(LAYERS):
        if folder in names:
            return i
    return None


def layer_of_file(rel):
    """The layer folder of a repository path: src/<folder>/... or tools/."""
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] == "tools":
        return "tools"
    return None


def main():
    root = pathlib.Path(sys.argv[1])
    problems, edges = [], 0
    files = [p for d in ("src", "tools") for p in sorted((root / d).rglob("*")) if p.suffix in SOURCES]
    used = {k: set() for k in ALLOWED}
    for path in files:
        rel = path.relative_to(root).as_posix()
        here = layer_of_file(rel)
        if here is None:
            continue
        if rank_of(here) is None:
            problems.append(f"{rel}: folder '{here}' is in no layer of LAYERS: place it")
            continue
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            there = inc.split("/")[0] if "/" in inc else None
            if there is None or rank_of(there) is None:
                continue  # the public header, generated headers, files beside it
            edges += 1
            if rank_of(there) >= rank_of(here):
                continue
            if inc in ALLOWED.get(rel, set()):
                used[rel].add(inc)
                continue
            problems.append(f"{rel} includes {inc}: {here} is below {there}; move what it needs down, "
                            f"or give {here} an interface that {there} fills")
    notes = [f"note: {rel} no longer includes {inc}: drop it from ALLOWED"
             for rel, incs in ALLOWED.items() for inc in sorted(incs - used[rel])]
    if edges == 0:
        problems.append("no include between layers found: wrong root?")
    print("\n".join(notes + problems) or
          f"{len(files)} files, {edges} includes between layer folders: none goes up a layer "
          f"(besides the {sum(map(len, ALLOWED.values()))} listed in ALLOWED)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
