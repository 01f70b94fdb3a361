"""The public header's structs, enums and integer #defines as data, for the
checks that hold the bindings to it (tests/python/test_binding_matches_header.py
for Python, tests/abi/check_rust_go_bindings.py for Rust and Go).

Header(text) parses a C header: records (struct/union name -> kind and
fields), enums (name -> [(enumerator, value)]), integer KT_ #defines, opaque
typedefs, function-pointer typedefs and the KT_API function declarations.
compile_layouts() asks the system C compiler for sizeof/_Alignof of records,
offsetof/sizeof of their fields and the values of constants, so the parser's
reading can be checked against the compiler's.
"""
import os
import re
import shlex
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INCLUDE = os.path.join(ROOT, "include")
HEADER = os.path.join(INCLUDE, "kt_c_api.h")

# #define families, by name prefix (the longest prefix wins).
DEFINE_FAMILIES = {
    "KT_VERSION_": "#define KT_VERSION_*",
    "KT_ABI_VERSION": "#define KT_ABI_VERSION",
    "KT_PROJ_": "#define KT_PROJ_*",
    "KT_SUBMIT_": "#define KT_SUBMIT_*",
    "KT_PACKED_": "#define KT_PACKED_*",
    "KT_NCCL_UNIQUE_ID_BYTES": "#define KT_NCCL_UNIQUE_ID_BYTES",
    "KT_DIST_CKPT_": "#define KT_DIST_CKPT_*",
}
# KT_ macros that are not integer constants.
NON_INTEGER_DEFINES = {"KT_C_API_H_", "KT_API"}

# ---------------------------------------------------------------- the parser

_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)


def strip_comments(text):
    return _COMMENT_OR_STRING.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)


def c_value(expr, known):
    """The value of an integer constant expression (literals with u/l
    suffixes, known names, arithmetic and bit operators), or None."""
    out = []
    for tok in re.findall(r"0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*|\w+|<<|>>|\S", expr):
        if re.fullmatch(r"0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*", tok):
            out.append(str(int(tok.rstrip("uUlL"), 0)))
        elif re.fullmatch(r"\w+", tok):
            if tok not in known:
                return None
            out.append(str(known[tok]))
        elif tok in ("<<", ">>", "(", ")", "+", "-", "*", "%", "|", "&", "~", "^"):
            out.append(tok)
        elif tok == "/":
            out.append("//")
        else:
            return None
    if not out:
        return None
    try:
        value = eval(" ".join(out), {"__builtins__": {}}, {})  # only digits and operators
    except Exception:
        return None
    return value if isinstance(value, int) else None


def split_top(text, sep, brackets="([{)]}"):
    """Splits text at sep outside the brackets (the opening half of the
    string, then the closing half)."""
    half = len(brackets) // 2
    opening, closing = brackets[:half], brackets[half:]
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _matching_brace(text, open_pos):
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced braces")


_QUALIFIERS = {"const", "volatile", "restrict", "struct", "enum", "union", "signed"}


class Field:
    """One declarator of a record: base type, pointer levels, array extents,
    function-pointer signature (returns void, nargs), and consts: whether
    each level (0 = the base type, i = the i-th pointer) is const."""

    def __init__(self, name, base, ptr=0, dims=(), fn=None, consts=None):
        self.name, self.base, self.ptr, self.dims, self.fn = name, base, ptr, tuple(dims), fn
        self.consts = list(consts) if consts is not None else [False] * (ptr + 1)

    def __repr__(self):
        return "Field(%s: %s%s%s%s)" % (self.name, self.base, "*" * self.ptr,
                                         "".join("[%d]" % d for d in self.dims),
                                         " fn%r" % (self.fn,) if self.fn else "")


def _fn_signature(ret_text, params_text):
    params = split_top(params_text, ",")
    nargs = 0 if params in ([], ["void"]) else len(params)
    ret_void = re.sub(r"\b(const|volatile)\b", "", ret_text).split() == ["void"]
    return (ret_void, nargs)


def parse_fields(body, known):
    fields = []
    for decl in split_top(body, ";"):
        if "{" in decl:  # an anonymous nested struct or union: no rule for it
            names = re.findall(r"\w+", decl[decl.rindex("}") + 1:])
            fields += [Field(n, "<nested record>") for n in names]
            continue
        m = re.fullmatch(r"(.*?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)", decl, re.S)
        if m:  # function pointer
            fields.append(Field(m.group(2), "<function>", fn=_fn_signature(m.group(1), m.group(3))))
            continue
        base = None
        for part in split_top(decl, ","):
            part = re.sub(r":\s*\w+\s*$", "", part)  # bit-field width
            m = re.fullmatch(r"(.*?)(\w+)\s*((?:\[[^\]]*\]\s*)*)", part, re.S)
            if not m:
                raise ValueError("cannot parse declaration %r" % decl)
            prefix, name, arrays = m.groups()
            words = [w for w in re.findall(r"\w+", prefix) if w not in _QUALIFIERS]
            _, consts, _ = split_declaration(prefix)
            if base is None:
                base, base_const = " ".join(words), consts[0]
            consts[0] = base_const  # "const char *p, *q": q's base is const too
            dims = [c_value(d, known) for d in re.findall(r"\[([^\]]*)\]", arrays)]
            fields.append(Field(name, base, prefix.count("*"), dims, consts=consts))
    return fields


class Header:
    """Structs, enums and integer #defines of a C header text."""

    def __init__(self, text):
        self.records = {}      # C type name -> (kind, [Field])
        self.enums = {}        # enum type name -> [(enumerator, value)]
        self.defines = {}      # KT_ name -> value
        self.bad_defines = []  # KT_ macros that are not integer constants
        self.opaque = set()    # typedef struct X X; without a body
        self.fn_typedefs = {}  # typedef R (*name)(...) -> (returns void, nargs)
        self.functions = {}    # KT_API function name -> (return type text, [parameter declarations])
        code = strip_comments(text.replace("\\\n", " "))
        known = {}
        for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?:[ \t]+(.*?))?[ \t]*$", code, re.M):
            name, value = m.group(1), (m.group(2) or "").strip()
            if not name.startswith("KT_") or name in NON_INTEGER_DEFINES:
                continue
            v = c_value(value, known)
            if v is None:
                self.bad_defines.append(name)
            else:
                self.defines[name] = known[name] = v
        code = re.sub(r"^[ \t]*#[^\n]*$", " ", code, flags=re.M)
        for m in re.finditer(r"\btypedef\s+struct\s+(\w+)\s+(\w+)\s*;", code):
            self.opaque.add(m.group(2))
        for m in re.finditer(r"\btypedef\s+([^;{}()]*?)\(\s*\*\s*(\w+)\s*\)\s*\(([^;]*?)\)\s*;", code):
            self.fn_typedefs[m.group(2)] = _fn_signature(m.group(1), m.group(3))
        for m in re.finditer(r"\bKT_API\s+([^;{}()]*?)\b(kt_\w+)\s*\(([^;{}]*?)\)\s*;", code):
            params = split_top(m.group(3), ",")
            self.functions[m.group(2)] = (" ".join(m.group(1).split()),
                                          [] if params == ["void"] else [" ".join(p.split()) for p in params])
        pos = 0
        head = re.compile(r"\b(typedef\s+)?(struct|union|enum)\s*(\w*)\s*\{")
        while True:
            m = head.search(code, pos)
            if not m:
                break
            end = _matching_brace(code, m.end() - 1)
            body = code[m.end():end]
            name = m.group(3)
            if m.group(1):
                t = re.match(r"\s*(\w+)\s*;", code[end + 1:])
                if t:
                    name = t.group(1)
            elif name:
                name = "%s %s" % (m.group(2), name)
            pos = end + 1
            if not name:
                continue
            if m.group(2) == "enum":
                values, nxt = [], 0
                for item in split_top(body, ","):
                    e = re.fullmatch(r"(\w+)\s*(?:=\s*(.+))?", item, re.S)
                    v = nxt if e.group(2) is None else c_value(e.group(2), known)
                    values.append((e.group(1), v))
                    known[e.group(1)] = v
                    nxt = (v if v is not None else 0) + 1
                self.enums[name] = values
            else:
                self.records[name] = (m.group(2), parse_fields(body, known))

    def constants(self):
        out = dict(self.defines)
        for values in self.enums.values():
            out.update(values)
        return out

    def families(self):
        """Family name -> [(KT_ name, value)] of every KT_ value."""
        fams = {}
        for enum, values in self.enums.items():
            kt = [(n, v) for n, v in values if n.startswith("KT_")]
            if kt:
                fams[enum] = kt
        for name, v in self.defines.items():
            prefixes = [p for p in DEFINE_FAMILIES if name.startswith(p)]
            fam = DEFINE_FAMILIES[max(prefixes, key=len)] if prefixes else "#define " + name
            fams.setdefault(fam, []).append((name, v))
        return fams


# --------------------------------------------------------------- the compiler

def compile_layouts(header_path, records, constants, include_dirs=()):
    """sizeof/alignof of each record, offsetof/sizeof of each field and the
    value of each constant, as the system C compiler sees header_path."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")]
    assert cc[0], "a C compiler is needed (set CC)"
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "%s"' % os.path.abspath(header_path),
             "int main(void) {"]
    for ctype, (_, fields) in records.items():
        lines.append('  printf("R %s %%zu %%zu\\n", sizeof(%s), (size_t)_Alignof(%s));'
                     % (ctype.replace(" ", "+"), ctype, ctype))
        for f in fields:
            lines.append('  printf("F %s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s*)0)->%s));'
                         % (ctype.replace(" ", "+"), f.name, ctype, f.name, ctype, f.name))
    for name in constants:
        lines.append('  printf("C %s %%lld\\n", (long long)(%s));' % (name, name))
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        cmd = cc + ["-std=gnu11", "-o", exe, src] + ["-I" + d for d in include_dirs] + ["-I" + INCLUDE]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, "compiling the layout program failed:\n%s\n%s" % (" ".join(cmd), r.stderr)
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    layouts, values = {}, {}
    for line in out.splitlines():
        kind, rest = line[0], line[2:].split()
        if kind == "R":
            layouts[rest[0].replace("+", " ")] = {"size": int(rest[1]), "align": int(rest[2]), "fields": {}}
        elif kind == "F":
            layouts[rest[0].replace("+", " ")]["fields"][rest[1]] = (int(rest[2]), int(rest[3]))
        else:
            values[rest[0]] = int(rest[1])
    return layouts, values


def read(path):
    with open(path) as f:
        return f.read()


def dlpack_path():
    for d in ["/usr/include", "/usr/local/include"]:
        p = os.path.join(d, "dlpack", "dlpack.h")
        if os.path.exists(p):
            return p
    raise AssertionError("dlpack/dlpack.h not found (libdlpack-dev)")



def merged(*headers):
    """One Header view of kt_c_api.h and dlpack.h, for field types."""
    h = Header("")
    for x in headers:
        h.records.update(x.records)
        h.enums.update(x.enums)
        h.opaque |= x.opaque
        h.fn_typedefs.update(x.fn_typedefs)
    return h


def split_declaration(decl):
    """A parameter or field declaration as (base type, [const of each level],
    name): level 0 is the base type, level i the i-th pointer. "const char*
    const* names" -> ("char", [True, True, False], "names"); a declaration
    without a name ("void*") has name None."""
    words = re.findall(r"\w+|\*", decl)
    name = None
    if len(words) > 1 and re.fullmatch(r"\w+", words[-1]) and words[-1] not in _QUALIFIERS \
            and words[-2] != "struct":
        name = words.pop()
    consts, base = [False], []
    for w in words:
        if w == "*":
            consts.append(False)
        elif w == "const":
            consts[-1] = True
        elif w not in _QUALIFIERS:
            base.append(w)
    return " ".join(base), consts, name
