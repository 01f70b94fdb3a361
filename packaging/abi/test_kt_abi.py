#!/usr/bin/env python3
"""Tests the ABI gate itself on scratch copies of the header: compatible edits
(appending functions, enum constants, arg ids, option-struct fields) must pass,
incompatible ones (changed value, reordered fields, changed signature, removed
function, grown plain struct) must fail and name what changed."""
import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "kt_abi.py")


def gate(args, header, baseline):
    cmd = [sys.executable, TOOL, "check", "--header", header, "--baseline", baseline,
           "--clang", args.clang, "--cc", args.cc] + sum((["--include", d] for d in args.include or []), [])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout


def sub(text, pattern, replacement):
    new, n = re.subn(pattern, replacement, text, count=1, flags=re.S)
    if n != 1:
        raise SystemExit("test_kt_abi: pattern %r not found in the header" % pattern)
    return new


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--header", required=True)
    p.add_argument("--include", action="append")
    p.add_argument("--clang", default="clang")
    p.add_argument("--cc", default="cc")
    p.add_argument("--work", required=True)
    args = p.parse_args()

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    with open(args.header) as f:
        original = f.read()
    baseline = os.path.join(args.work, "baseline.json")
    subprocess.run([sys.executable, TOOL, "dump", "--header", args.header, "-o", baseline,
                    "--clang", args.clang, "--cc", args.cc]
                   + sum((["--include", d] for d in args.include or []), []), check=True)

    tail = r"(#ifdef __cplusplus\s*\}\s*#endif\s*#endif /\* KT_C_API_H_ \*/\s*)$"
    cases = [
        # (name, edit, expect_pass, text the report must contain)
        ("append a function", lambda h: sub(h, tail, "KT_API int kt_selftest_added(void);\n\\1"),
         True, "function kt_selftest_added was added"),
        ("append an arg id", lambda h: sub(h, r"(KT_ARG_GRAD_B_DOWN = 69)", "\\1,\n  KT_ARG_SELFTEST = 200"),
         True, "KT_ARG_SELFTEST = 200 was added"),
        ("append an option field", lambda h: sub(h, r"(\n\} kt_moe_options;)", "\n  int64_t selftest_field;\\1"),
         True, "struct kt_moe_options grew"),
        ("change a status value", lambda h: sub(h, r"KT_ERR_SHAPE = 5", "KT_ERR_SHAPE = 50"),
         False, "KT_ERR_SHAPE changed value 5 -> 50"),
        ("reorder option fields", lambda h: sub(h, r"(int64_t top_k;[^\n]*\n)(\s*int64_t hidden;[^\n]*\n)", "\\2\\1"),
         False, "struct kt_moe_options: field hidden moved"),
        ("change a parameter type", lambda h: sub(h, r"kt_moe_forward\(kt_moe\* moe, const kt_arg\* args, size_t num_args",
                                                  "kt_moe_forward(kt_moe* moe, const kt_arg* args, int num_args"),
         False, "function kt_moe_forward changed type"),
        ("remove a function", lambda h: sub(h, r"KT_API void kt_clear_error\(void\);", ""),
         False, "function kt_clear_error was removed"),
        ("grow a plain struct", lambda h: sub(h, r"(const DLTensor\* tensor;\n)", "\\1  int flags;\n"),
         False, "struct kt_arg changed size"),
        ("change a flag macro", lambda h: sub(h, r"#define KT_PROJ_DOWN 4u", "#define KT_PROJ_DOWN 8u"),
         False, "macro KT_PROJ_DOWN changed value 4 -> 8"),
        ("incompatible with the ABI major raised",
         lambda h: sub(sub(h, r"KT_ERR_SHAPE = 5", "KT_ERR_SHAPE = 50"),
                       r"#define KT_ABI_VERSION (\d+)", lambda m: "#define KT_ABI_VERSION %d" % (int(m.group(1)) + 1)),
         True, "changed:      enum kt_status: KT_ERR_SHAPE changed value"),
    ]
    failures = 0
    for i, (name, edit, expect_pass, expect_text) in enumerate(cases):
        d = os.path.join(args.work, "case%d" % i)
        os.makedirs(d)
        header = os.path.join(d, os.path.basename(args.header))
        with open(header, "w") as f:
            f.write(edit(original))
        rc, out = gate(args, header, baseline)
        ok = (rc == 0) == expect_pass and expect_text in out
        print("%-5s %s (gate exit %d)" % ("ok" if ok else "FAIL", name, rc))
        if not ok:
            failures += 1
            print("  expected %s and %r in:\n%s" % ("pass" if expect_pass else "failure", expect_text,
                                                     "".join("    " + l + "\n" for l in out.splitlines())))
    print("%d of %d gate cases behaved as expected" % (len(cases) - failures, len(cases)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
