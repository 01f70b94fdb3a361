#!/usr/bin/env python3
"""Records and checks the ABI of kt: the public header plus the exported symbols of libkt.

    kt_abi.py dump  --header include/kt_c_api.h --library build/libkt.so.1 -o packaging/abi/kt_abi.json
    kt_abi.py check --header include/kt_c_api.h --library build/libkt.so.1 --baseline packaging/abi/kt_abi.json

What is recorded:
  functions   every exported kt_* function with its C type (return and parameter types)
              and its parameters' names
  inline_functions  every static inline kt_* function of the header (not exported)
  enums       every kt_* enum: its size and the value of each constant
  macros      every KT_* integer macro (bits, flags, versions)
  typedefs    every kt_* typedef with the type it names (function pointer callbacks)
  structs     every complete kt_* struct: size, alignment, each field's type and offset,
              measured by compiling and running a probe against the header
  exports     the dynamic symbols libkt defines

`check` compares the current header and library with the baseline and exits 1 when an
incompatible change was made while KT_ABI_VERSION stayed the same. Compatible changes
(new functions, enum constants, macros, typedefs, structs, and new trailing fields of
option structs that start with `struct_size`) are listed and accepted.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PREFIXES = ("kt_", "KT_")
# Version parts that change without breaking the ABI (the ABI major is KT_ABI_VERSION).
VERSION_MACROS = {"KT_VERSION_MAJOR", "KT_VERSION_MINOR", "KT_VERSION_PATCH"}


def run(cmd, **kw):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit("kt_abi: command failed: %s\n%s" % (" ".join(cmd), proc.stderr))
    return proc.stdout


def include_flags(args):
    flags = ["-I", os.path.dirname(os.path.abspath(args.header))]
    for d in args.include or []:
        flags += ["-I", d]
    return flags


def parse_ast(args):
    """Declarations of the header, from clang's JSON syntax tree."""
    out = run([args.clang, "-Xclang", "-ast-dump=json", "-fsyntax-only", "-x", "c", "-std=c99"]
              + include_flags(args) + [args.header])
    tree = json.loads(out)
    functions, inline, enums, typedefs, records = {}, {}, {}, {}, {}
    for node in tree.get("inner", []):
        name = node.get("name", "")
        if not name.startswith(PREFIXES) or node.get("isImplicit"):
            continue
        kind = node["kind"]
        if kind == "FunctionDecl" and node.get("storageClass") == "static":
            # header-only (static inline): part of the source contract, not exported
            inline[name] = {
                "type": node["type"]["qualType"],
                "params": [p["type"]["qualType"] for p in node.get("inner", [])
                           if p["kind"] == "ParmVarDecl"],
            }
        elif kind == "FunctionDecl":
            params = [p for p in node.get("inner", []) if p["kind"] == "ParmVarDecl"]
            functions[name] = {
                "type": node["type"]["qualType"],
                "params": [p["type"]["qualType"] for p in params],
                # Names are no part of the ABI (compare ignores them); the
                # generated bindings (gen_bindings.py) spell their parameters so.
                "names": [p.get("name", "arg%d" % i) for i, p in enumerate(params)],
            }
        elif kind == "EnumDecl":
            constants = {}
            for c in node.get("inner", []):
                if c["kind"] != "EnumConstantDecl":
                    continue
                constants[c["name"]] = enum_value(c, constants)
            enums[name] = {"constants": constants}
        elif kind == "TypedefDecl":
            t = node["type"]
            typedefs[name] = t.get("desugaredQualType", t["qualType"])
        elif kind == "RecordDecl" and node.get("completeDefinition"):
            fields = [{"name": f["name"], "type": f["type"]["qualType"]}
                      for f in node.get("inner", []) if f["kind"] == "FieldDecl"]
            records[name] = {"tag": node.get("tagUsed", "struct"), "fields": fields}
    return functions, inline, enums, typedefs, records


def enum_value(constant, previous):
    for sub in constant.get("inner", []):
        if "value" in sub:
            return int(sub["value"])
    # No initializer: one past the previous constant (C rule).
    return (list(previous.values())[-1] + 1) if previous else 0


def parse_macros(args):
    out = run([args.clang, "-dM", "-E", "-x", "c", "-std=c99"] + include_flags(args) + [args.header])
    macros = {}
    for line in out.splitlines():
        m = re.match(r"#define (KT_\w+) \(?([0-9]+|0x[0-9a-fA-F]+)[uUlL]*\)?$", line)
        if m:
            macros[m.group(1)] = int(m.group(2), 0)
    return macros


def measure_layout(args, enums, records):
    """sizeof/alignment/offsets as the C compiler lays them out on this platform."""
    lines = ["#include <stddef.h>", "#include <stdio.h>",
             '#include "%s"' % os.path.basename(args.header),
             "#define KT_ALIGNOF(T) offsetof(struct { char c; T t; }, t)",
             "int main(void) {"]
    for name, rec in sorted(records.items()):
        t = "%s %s" % (rec["tag"], name)
        lines.append('  printf("record %s %%zu %%zu\\n", sizeof(%s), (size_t)KT_ALIGNOF(%s));'
                     % (name, t, t))
        for f in rec["fields"]:
            lines.append('  printf("field %s %s %%zu\\n", offsetof(%s, %s));'
                         % (name, f["name"], t, f["name"]))
    for name in sorted(enums):
        lines.append('  printf("enum %s %%zu\\n", sizeof(enum %s));' % (name, name))
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kt_abi_probe.c")
        exe = os.path.join(tmp, "kt_abi_probe")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        run([args.cc, "-std=c99", "-o", exe, src] + include_flags(args))
        out = run([exe])
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "record":
            records[parts[1]]["size"] = int(parts[2])
            records[parts[1]]["align"] = int(parts[3])
        elif parts[0] == "field":
            for f in records[parts[1]]["fields"]:
                if f["name"] == parts[2]:
                    f["offset"] = int(parts[3])
        elif parts[0] == "enum":
            enums[parts[1]]["size"] = int(parts[2])


def library_exports(args):
    if not args.library:
        return None
    out = run([args.nm, "-D", "--defined-only", args.library])
    return sorted({line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()})


def dump(args):
    functions, inline, enums, typedefs, records = parse_ast(args)
    macros = parse_macros(args)
    measure_layout(args, enums, records)
    abi_version = macros.pop("KT_ABI_VERSION", None)
    if abi_version is None:
        raise SystemExit("kt_abi: %s defines no KT_ABI_VERSION" % args.header)
    version = ".".join(str(macros.get(m, "?")) for m in
                       ("KT_VERSION_MAJOR", "KT_VERSION_MINOR", "KT_VERSION_PATCH"))
    for m in VERSION_MACROS:
        macros.pop(m, None)
    return {
        "abi_version": abi_version,
        "version": version,
        "functions": functions,
        "inline_functions": inline,
        "enums": enums,
        "macros": macros,
        "typedefs": typedefs,
        "structs": records,
        "exports": library_exports(args),
    }


def compare(old, new):
    """Returns (incompatible, compatible): two lists of sentences."""
    bad, good = [], []

    for name, f in sorted(old["functions"].items()):
        g = new["functions"].get(name)
        if g is None:
            bad.append("function %s was removed" % name)
        elif g["type"] != f["type"]:
            bad.append("function %s changed type: %s  ->  %s" % (name, f["type"], g["type"]))
    good += ["function %s was added" % n for n in sorted(set(new["functions"]) - set(old["functions"]))]

    old_inline, new_inline = old.get("inline_functions", {}), new.get("inline_functions", {})
    for name, f in sorted(old_inline.items()):
        g = new_inline.get(name)
        if g is None:
            bad.append("inline function %s was removed" % name)
        elif g["type"] != f["type"]:
            bad.append("inline function %s changed type: %s  ->  %s" % (name, f["type"], g["type"]))
    good += ["inline function %s was added" % n for n in sorted(set(new_inline) - set(old_inline))]

    for name, e in sorted(old["enums"].items()):
        n = new["enums"].get(name)
        if n is None:
            bad.append("enum %s was removed" % name)
            continue
        if n.get("size") != e.get("size"):
            bad.append("enum %s changed size: %s -> %s bytes" % (name, e.get("size"), n.get("size")))
        for c, v in sorted(e["constants"].items(), key=lambda kv: kv[1]):
            if c not in n["constants"]:
                bad.append("enum %s: constant %s (= %d) was removed" % (name, c, v))
            elif n["constants"][c] != v:
                bad.append("enum %s: %s changed value %d -> %d" % (name, c, v, n["constants"][c]))
        for c in sorted(set(n["constants"]) - set(e["constants"])):
            good.append("enum %s: constant %s = %d was added" % (name, c, n["constants"][c]))
    good += ["enum %s was added" % n for n in sorted(set(new["enums"]) - set(old["enums"]))]

    for name, v in sorted(old["macros"].items()):
        if name not in new["macros"]:
            bad.append("macro %s (= %d) was removed" % (name, v))
        elif new["macros"][name] != v:
            bad.append("macro %s changed value %d -> %d" % (name, v, new["macros"][name]))
    good += ["macro %s = %d was added" % (n, new["macros"][n])
             for n in sorted(set(new["macros"]) - set(old["macros"]))]

    for name, t in sorted(old["typedefs"].items()):
        if name not in new["typedefs"]:
            bad.append("typedef %s was removed" % name)
        elif new["typedefs"][name] != t:
            bad.append("typedef %s changed: %s  ->  %s" % (name, t, new["typedefs"][name]))
    good += ["typedef %s was added" % n for n in sorted(set(new["typedefs"]) - set(old["typedefs"]))]

    for name, s in sorted(old["structs"].items()):
        n = new["structs"].get(name)
        if n is None:
            bad.append("struct %s was removed or became opaque" % name)
            continue
        kept = True
        new_fields = {f["name"]: f for f in n["fields"]}
        for f in s["fields"]:
            g = new_fields.get(f["name"])
            if g is None:
                bad.append("struct %s: field %s was removed" % (name, f["name"]))
                kept = False
            elif g["type"] != f["type"]:
                bad.append("struct %s: field %s changed type: %s -> %s" % (name, f["name"], f["type"], g["type"]))
                kept = False
            elif g.get("offset") != f.get("offset"):
                bad.append("struct %s: field %s moved from offset %s to %s"
                           % (name, f["name"], f.get("offset"), g.get("offset")))
                kept = False
        if n.get("align") != s.get("align"):
            bad.append("struct %s changed alignment %s -> %s" % (name, s.get("align"), n.get("align")))
        if n.get("size") != s.get("size"):
            growable = bool(s["fields"]) and s["fields"][0]["name"] == "struct_size"
            added = [f["name"] for f in n["fields"] if f["name"] not in {x["name"] for x in s["fields"]}]
            if growable and kept and n["size"] > s["size"]:
                good.append("struct %s grew %d -> %d bytes by appending %s (callers pass struct_size)"
                            % (name, s["size"], n["size"], ", ".join(added)))
            elif growable and kept:
                bad.append("struct %s shrank %d -> %d bytes" % (name, s["size"], n["size"]))
            else:
                bad.append("struct %s changed size %d -> %d bytes%s"
                           % (name, s["size"], n["size"],
                              "" if growable else " (it has no struct_size, so callers' copies break)"))
        elif len(n["fields"]) != len(s["fields"]):
            added = [f["name"] for f in n["fields"] if f["name"] not in {x["name"] for x in s["fields"]}]
            if added and kept:
                good.append("struct %s: fields %s added in padding" % (name, ", ".join(added)))
    good += ["struct %s was added" % n for n in sorted(set(new["structs"]) - set(old["structs"]))]

    if old.get("exports") is not None and new.get("exports") is not None:
        for sym in sorted(set(old["exports"]) - set(new["exports"])):
            bad.append("libkt no longer exports %s" % sym)
        good += ["libkt exports new symbol %s" % s for s in sorted(set(new["exports"]) - set(old["exports"]))]
    return bad, good


def hygiene(cur):
    """Problems of the current build alone, whatever the baseline says."""
    problems = []
    exports = cur.get("exports")
    if exports is None:
        return problems
    for sym in exports:
        if not sym.startswith("kt_"):
            problems.append("libkt exports %s, which is not a kt_ symbol (version script?)" % sym)
    for fn in sorted(set(cur["functions"]) - set(exports)):
        problems.append("the header declares %s but libkt does not export it" % fn)
    for sym in sorted(s for s in exports if s.startswith("kt_") and s not in cur["functions"]):
        problems.append("libkt exports %s, which the header does not declare" % sym)
    return problems


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["dump", "check"])
    p.add_argument("--header", required=True)
    p.add_argument("--library", help="libkt.so.N whose exports are recorded/checked")
    p.add_argument("--include", action="append", help="extra include dir (dlpack)")
    p.add_argument("--baseline", help="recorded ABI (check)")
    p.add_argument("-o", "--output", help="where dump writes (default stdout)")
    p.add_argument("--clang", default=shutil.which("clang") or "clang")
    p.add_argument("--cc", default=os.environ.get("CC") or shutil.which("cc") or "cc")
    p.add_argument("--nm", default=shutil.which("nm") or "nm")
    args = p.parse_args()

    cur = dump(args)
    if args.command == "dump":
        text = json.dumps(cur, indent=1, sort_keys=True) + "\n"
        if args.output:
            with open(args.output, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return 0

    with open(args.baseline) as f:
        old = json.load(f)
    bad, good = compare(old, cur)
    problems = hygiene(cur)
    for line in good:
        print("compatible:   " + line)
    for line in problems:
        print("error:        " + line)
    raised = cur["abi_version"] > old["abi_version"]
    for line in bad:
        print(("changed:      " if raised else "INCOMPATIBLE: ") + line)
    print("kt ABI: header %s (abi %d) against the baseline %s (abi %d): %d incompatible, %d compatible change(s)"
          % (cur["version"], cur["abi_version"], old["version"], old["abi_version"], len(bad), len(good)))
    if cur["abi_version"] < old["abi_version"]:
        print("kt ABI: KT_ABI_VERSION went down (%d -> %d)" % (old["abi_version"], cur["abi_version"]))
        return 1
    if bad and not raised:
        print("kt ABI: incompatible change(s) while KT_ABI_VERSION stays %d. Either keep the old\n"
              "declarations as they were (append instead of changing), or raise KT_ABI_VERSION in\n"
              "include/kt_c_api.h and re-record the baseline:\n"
              "    cmake --build <build> --target kt_abi_record" % cur["abi_version"])
        return 1
    if raised:
        print("kt ABI: accepted (KT_ABI_VERSION raised); re-record the baseline:\n"
              "    cmake --build <build> --target kt_abi_record")
    elif good:
        print("kt ABI: accepted; to pin the additions too, re-record the baseline:\n"
              "    cmake --build <build> --target kt_abi_record")
    if problems:
        print("kt ABI: libkt and its header disagree (the error: lines above); rebuild, or export/declare them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
