"""The Python binding's copies of include/kt_c_api.h (plugins/python/kt/_capi.py)
are the header's, so the binding cannot drift from the C ABI.

Structs: every ctypes.Structure in _capi mirrors a header struct (EngineOptions
is kt_engine_options, CkptLayerInfo kt_ckpt_layer_info; DLTensor, DLDevice and
DLDataType are dlpack.h's), with the header's field names in the header's
order, each field of the ctypes type the C type crosses as, and the C layout:
sizeof and alignment of the struct, offsetof and sizeof of every field, as the
system C compiler lays them out (a small program generated from the parsed
header, compiled here). Every struct the header defines is mirrored or listed
in EXCLUDED_STRUCTS, with the reason.

Values: every KT_ enumerator (explicit or implicit value) and every integer
#define KT_ belongs to a family (an enum type, or a #define prefix); each
family is mirrored (FAMILIES says how: attributes named as in the header without
KT_, or a dict keyed by the names) or listed in EXCLUDED_FAMILIES, with the
reason. A mirrored family must have every header value, with the header's value,
and nothing else; every integer constant of _capi must be a header value. The
values the parser reads are checked against the compiler's.

The self-tests at the end run the same checks on altered headers and bindings
(a field dropped, a type changed, an enumerator added, a value changed, a new
struct or family) and require each difference to be reported.

Needs a C compiler ($CC, else cc) and dlpack.h; neither torch nor libkt.
"""
import ast
import ctypes
import importlib.util
import os
import re
import sys
import tempfile
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "abi"))
from kt_header import HEADER, Header, compile_layouts, read  # noqa: E402
from kt_header import dlpack_path as _dlpack_path, merged as _merged  # noqa: E402
CAPI_PY = os.path.join(ROOT, "plugins", "python", "kt", "_capi.py")
CORE_PY = os.path.join(ROOT, "plugins", "python", "kt", "core.py")

# ------------------------------------------------------------ what is mirrored

# Python classes whose header struct name is not "kt_" + the class name in
# snake_case (EngineOptions -> kt_engine_options): dlpack.h's.
DLPACK_STRUCTS = {"DLTensor": "DLTensor", "DLDevice": "DLDevice", "DLDataType": "DLDataType"}

# Header structs the Python binding does not mirror, and why. Empty today:
# every struct of kt_c_api.h crosses from Python.
EXCLUDED_STRUCTS = {}


class Names:
    """Each value is a module attribute named as in the header without KT_
    (KT_ISA_AMX -> ISA_AMX)."""

    def __init__(self, where="_capi"):
        self.where = where

    def expected(self, values):
        return {name[3:]: v for name, v in values}

    def actual(self, ns, values):
        obj = ns[self.where]
        return {name[3:]: getattr(obj, name[3:]) for name, _ in values if hasattr(obj, name[3:])}

    def describe(self):
        return "%s attributes named without KT_" % self.where


class Keyed:
    """A dict whose keys are the names after prefix (lowercased if lower)."""

    def __init__(self, attr, prefix, lower=False, where="_capi"):
        self.attr, self.prefix, self.lower, self.where = attr, prefix, lower, where

    def key(self, name):
        if not name.startswith(self.prefix):
            return name  # reported as a key the dict lacks
        k = name[len(self.prefix):]
        return k.lower() if self.lower else k

    def expected(self, values):
        return {self.key(n): v for n, v in values}

    def actual(self, ns, values):
        return dict(getattr(ns[self.where], self.attr, {}))

    def describe(self):
        return "%s.%s" % (self.where, self.attr)


class ByValue:
    """A dict from each value to its full header name (STATUS_NAMES)."""

    def __init__(self, attr, where="_capi"):
        self.attr, self.where = attr, where

    def expected(self, values):
        return {v: n for n, v in values}

    def actual(self, ns, values):
        return dict(getattr(ns[self.where], self.attr, {}))

    def describe(self):
        return "%s.%s" % (self.where, self.attr)


# How the binding mirrors each family (read from _capi.py; core.Engine is the
# class body of kt/core.py's Engine).
FAMILIES = {
    "kt_status": ByValue("STATUS_NAMES"),
    "kt_isa": Names(),
    "kt_gemm_backend": Keyed("GEMM_BACKENDS", "KT_GEMM_", lower=True, where="core.Engine"),
    "kt_precision": Names(),
    "kt_activation": Names(),
    "kt_mode": Names(),
    "#define KT_PROJ_*": Names(),
    "kt_weight_format": Keyed("WEIGHT_FORMATS", "KT_FORMAT_", lower=True),
    "kt_compute": Keyed("COMPUTES", "KT_COMPUTE_", lower=True),
    "kt_arg_id": Keyed("ARG", "KT_ARG_"),
    "kt_weight_orientation": Names(),
    "kt_gate_up_order": Names(),
    "kt_grad_accumulate": Names(),
    "#define KT_SUBMIT_*": Names(),
    "#define KT_PACKED_*": Names(),
    "kt_ckpt_dtype": Keyed("CKPT_DTYPES", "KT_CKPT_DTYPE_"),
    "kt_ckpt_layout": Names(),
    "kt_optim_algorithm": Names(),
    "kt_optim_arithmetic": Names(),
    "kt_optim_state": Names(),
    "kt_comm_backend": Names(),
    "kt_dist_mode": Names(),
    "kt_dist_grad_average": Names(),
    "#define KT_DIST_CKPT_*": Keyed("DIST_CKPT_PARTS", "KT_DIST_CKPT_", lower=True),
    "#define KT_ABI_VERSION": Names(),
}

# Header families the binding does not mirror, and why.
EXCLUDED_FAMILIES = {
    # The package's version is the loaded library's (kt_version); the ABI
    # major is what it pins (ABI_VERSION, mirrored).
    "#define KT_VERSION_*": "version read from the library at run time",
    # Python never reads stage numbers (no per-stage profile API); a host
    # iterates kt_stage_name from 0 until NULL.
    "kt_stage": "not used by the Python binding",
    # Checkpoint layer formats reach Python as names (kt_ckpt_format_name).
    "kt_ckpt_format": "reported by name, never by value",
    # Python does not call kt_comm_nccl_unique_id (nccl_unique_id stays NULL).
    "#define KT_NCCL_UNIQUE_ID_BYTES": "kt_comm_nccl_unique_id is not bound",
}

# _capi's DLPack codes and dlpack.h's names for them. kDLBool came with
# DLPack 0.8 (value 6); an older dlpack.h lacks it.
DLPACK_CODES = {"KDL_CPU": "kDLCPU", "KDL_CUDA": "kDLCUDA", "KDL_CUDA_HOST": "kDLCUDAHost",
                "KDL_EXT_DEV": "kDLExtDev", "KDL_INT": "kDLInt", "KDL_UINT": "kDLUInt",
                "KDL_FLOAT": "kDLFloat", "KDL_BFLOAT": "kDLBfloat", "KDL_BOOL": "kDLBool"}
DLPACK_LATER = {"kDLBool": 6}

# The parser and the compiler probe are tests/abi/kt_header.py's.

# ------------------------------------------------------------------ the checks

def snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def mirrored_classes(capi):
    """{Python class name: (class, C type name)} of _capi's ctypes records."""
    out = {}
    for name, obj in vars(capi).items():
        if (isinstance(obj, type) and issubclass(obj, (ctypes.Structure, ctypes.Union))
                and obj.__module__ == capi.__name__):
            out[name] = (obj, DLPACK_STRUCTS.get(name, "kt_" + snake(name)))
    return out


_SCALARS = {
    "size_t": ctypes.c_size_t, "int": ctypes.c_int, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint,
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16, "uint16_t": ctypes.c_uint16,
    "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
    "float": ctypes.c_float, "double": ctypes.c_double, "char": ctypes.c_char, "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
}


def _type_name(t):
    return getattr(t, "__name__", repr(t))


def _fn_problem(sig, t):
    if not (isinstance(t, type) and issubclass(t, ctypes._CFuncPtr)):
        return "a function pointer, not %s" % _type_name(t)
    ret_void, nargs = sig
    if len(t._argtypes_) != nargs:
        return "a function of %d arguments, not %d" % (nargs, len(t._argtypes_))
    if ret_void != (t._restype_ is None):
        return "a function returning %s" % ("void" if ret_void else "a value")
    return None


def field_type_problem(field, t, hdr, by_ctype):
    """Why ctypes type t cannot be the C field, or None."""
    if field.fn:
        return _fn_problem(field.fn, t)
    for n in field.dims:
        if not (isinstance(t, type) and issubclass(t, ctypes.Array)) or t._length_ != n:
            return "an array of %s, not %s" % (n, _type_name(t))
        t = t._type_
    base = field.base
    if field.ptr == 0:
        if base in hdr.fn_typedefs:
            return _fn_problem(hdr.fn_typedefs[base], t)
        if base in _SCALARS:
            want = _SCALARS[base]
        elif base in hdr.enums:
            want = ctypes.c_int  # enums cross as int
        elif base in by_ctype:
            want = by_ctype[base]
        else:
            return "of C type %r, which has no Python rule here" % base
        return None if t is want else "%s, not %s" % (_type_name(want), _type_name(t))
    if field.ptr == 1:
        if base == "char":
            want = ctypes.c_char_p
        elif base == "void" or base in hdr.opaque:
            want = ctypes.c_void_p
        elif base in _SCALARS:
            want = ctypes.POINTER(_SCALARS[base])
        elif base in hdr.enums:
            want = ctypes.POINTER(ctypes.c_int)
        elif base in by_ctype:
            want = ctypes.POINTER(by_ctype[base])
        else:
            return "a pointer to C type %r, which has no Python rule here" % base
        return None if t is want else "%s, not %s" % (_type_name(want), _type_name(t))
    return "a pointer of %d levels, which has no Python rule here" % field.ptr


def struct_problems(cls, ctype, hdr, by_ctype, layout=None):
    """Differences between ctypes class cls and the header's record ctype."""
    name = "%s (%s)" % (cls.__name__, ctype)
    kind, fields = hdr.records[ctype]
    if issubclass(cls, ctypes.Union) != (kind == "union"):
        return ["%s: a C %s mirrored by a %s" % (name, kind, cls.__bases__[0].__name__)]
    py_fields = cls._fields_
    problems = []
    c_names, py_names = [f.name for f in fields], [f[0] for f in py_fields]
    if c_names != py_names:
        problems.append("%s: fields %s in the header, %s in Python (missing %s, extra %s)"
                        % (name, c_names, py_names, [n for n in c_names if n not in py_names],
                           [n for n in py_names if n not in c_names]))
    py = {f[0]: f[1] for f in py_fields}
    for f in fields:
        if f.name in py:
            why = field_type_problem(f, py[f.name], hdr, by_ctype)
            if why:
                problems.append("%s.%s: must be %s" % (name, f.name, why))
    if layout is not None:
        if ctypes.sizeof(cls) != layout["size"]:
            problems.append("%s: sizeof %d in C, %d in Python" % (name, layout["size"], ctypes.sizeof(cls)))
        if ctypes.alignment(cls) != layout["align"]:
            problems.append("%s: alignment %d in C, %d in Python" % (name, layout["align"], ctypes.alignment(cls)))
        for fname, (off, size) in layout["fields"].items():
            if fname not in py:
                continue
            py_off, py_size = getattr(cls, fname).offset, ctypes.sizeof(py[fname])
            if (off, size) != (py_off, py_size):
                problems.append("%s.%s: offset %d size %d in C, offset %d size %d in Python"
                                % (name, fname, off, size, py_off, py_size))
    return problems


def struct_coverage_problems(hdr, capi, excluded=None):
    excluded = EXCLUDED_STRUCTS if excluded is None else excluded
    mirrored = {ctype: pyname for pyname, (_, ctype) in mirrored_classes(capi).items()}
    problems = []
    for pyname, (_, ctype) in mirrored_classes(capi).items():
        if ctype.startswith("kt_") and ctype not in hdr.records:
            problems.append("Python class %s mirrors %s, which the header does not define" % (pyname, ctype))
    for ctype in hdr.records:
        if ctype in mirrored and ctype in excluded:
            problems.append("%s is mirrored by %s and also listed in EXCLUDED_STRUCTS" % (ctype, mirrored[ctype]))
        elif ctype not in mirrored and ctype not in excluded:
            problems.append("header struct %s has no Python mirror (add it to _capi.py, or to "
                            "EXCLUDED_STRUCTS saying why)" % ctype)
    for ctype in excluded:
        if ctype not in hdr.records:
            problems.append("EXCLUDED_STRUCTS names %s, which the header does not define" % ctype)
    return problems


def family_coverage_problems(hdr, families=None, excluded=None):
    families = FAMILIES if families is None else families
    excluded = EXCLUDED_FAMILIES if excluded is None else excluded
    problems = ["#define %s is not an integer constant (add it to NON_INTEGER_DEFINES if it should not be)" % n
                for n in hdr.bad_defines]
    fams = hdr.families()
    for fam in fams:
        if fam in families and fam in excluded:
            problems.append("%s is both mirrored and in EXCLUDED_FAMILIES" % fam)
        elif fam not in families and fam not in excluded:
            problems.append("header family %s (%s) is not mirrored in Python (mirror it in _capi.py and "
                            "FAMILIES, or add it to EXCLUDED_FAMILIES saying why)"
                            % (fam, ", ".join(n for n, _ in fams[fam])))
    for fam in list(families) + list(excluded):
        if fam not in fams:
            problems.append("%s is listed here but the header has no such family" % fam)
    return problems


def family_problems(fam, values, spec, ns):
    want, have = spec.expected(values), spec.actual(ns, values)
    problems = []
    for k, v in want.items():
        if k not in have:
            problems.append("%s: %r (%s) missing from %s" % (fam, k, v, spec.describe()))
        elif have[k] != v:
            problems.append("%s: %r is %r in the header, %r in %s" % (fam, k, v, have[k], spec.describe()))
    for k in have:
        if k not in want:
            problems.append("%s: %r in %s is not in the header" % (fam, k, spec.describe()))
    return problems


def _public_values(capi):
    return {n: v for n, v in vars(capi).items() if not n.startswith("_") and n.isupper()}


def reverse_problems(hdr, capi, families=None):
    """Every integer constant of _capi is a header value; every public int
    dict of _capi is a mirrored family."""
    families = FAMILIES if families is None else families
    consts = hdr.constants()
    dicts = {s.attr for s in families.values() if isinstance(s, (Keyed, ByValue)) and s.where == "_capi"}
    problems = []
    for n, v in _public_values(capi).items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if n.startswith("KDL_"):
                continue  # dlpack.h's, checked by test_dlpack_codes
            if "KT_" + n not in consts:
                problems.append("_capi.%s = %r has no KT_%s in the header" % (n, v, n))
            elif consts["KT_" + n] != v:
                problems.append("_capi.%s = %r, but KT_%s = %r" % (n, v, n, consts["KT_" + n]))
        elif isinstance(v, dict) and n not in dicts:
            problems.append("_capi.%s is a dict of header values that FAMILIES does not know" % n)
    return problems


# ------------------------------------------------------------------- fixtures

def load_capi(path=CAPI_PY):
    """kt/_capi.py as its own module: it needs no libkt to import."""
    spec = importlib.util.spec_from_file_location("kt_capi_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_class_literals(path, cls_name):
    """The literal assignments of a class body (kt/core.py's Engine)."""
    tree = ast.parse(open(path).read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    try:
                        out[stmt.targets[0].id] = ast.literal_eval(stmt.value)
                    except ValueError:
                        pass
    return types.SimpleNamespace(**out)


CAPI = load_capi()
HDR = Header(read(HEADER))
DLPACK = Header(read(_dlpack_path()))


def _all_records():
    recs = dict(HDR.records)
    for c in DLPACK_STRUCTS.values():
        recs[c] = DLPACK.records[c]
    return recs



BOTH = _merged(HDR, DLPACK)


def _by_ctype(capi):
    return {ctype: cls for cls, ctype in mirrored_classes(capi).values()}


@pytest.fixture(scope="module")
def compiled():
    consts = list(HDR.constants()) + [n for _, n in sorted(DLPACK_CODES.items())
                                      if n in DLPACK.constants()]
    return compile_layouts(HEADER, _all_records(), consts)


@pytest.fixture(scope="module")
def namespaces():
    return {"_capi": CAPI, "core.Engine": load_class_literals(CORE_PY, "Engine")}


# ---------------------------------------------------------------- the tests

def test_parser_reads_what_the_compiler_reads(compiled):
    _, values = compiled
    parsed = HDR.constants()
    assert len(HDR.records) >= 20 and len(HDR.enums) >= 20, "the header parser found too little"
    assert parsed == {n: values[n] for n in parsed}
    for ctype, (_, fields) in HDR.records.items():
        assert fields, "%s: no fields parsed" % ctype


def test_every_header_struct_is_mirrored_or_excluded():
    problems = struct_coverage_problems(HDR, CAPI)
    for pyname, (_, ctype) in mirrored_classes(CAPI).items():
        if pyname in DLPACK_STRUCTS:
            assert ctype in DLPACK.records, "%s: dlpack.h has no %s" % (pyname, ctype)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("pyname", sorted(mirrored_classes(CAPI)))
def test_struct_layout(pyname, compiled):
    layouts, _ = compiled
    cls, ctype = mirrored_classes(CAPI)[pyname]
    if ctype not in BOTH.records:
        pytest.fail("%s mirrors %s, which neither header defines" % (pyname, ctype))
    problems = struct_problems(cls, ctype, BOTH, _by_ctype(CAPI), layouts[ctype])
    assert not problems, "\n".join(problems)


def test_every_header_family_is_mirrored_or_excluded():
    problems = family_coverage_problems(HDR)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_values(family, namespaces):
    values = HDR.families().get(family)
    assert values, "the header has no family %s" % family
    problems = family_problems(family, values, FAMILIES[family], namespaces)
    assert not problems, "\n".join(problems)


def test_every_python_constant_is_a_header_value():
    problems = reverse_problems(HDR, CAPI)
    assert not problems, "\n".join(problems)


def test_dlpack_codes(compiled):
    _, values = compiled
    have = {n: v for n, v in _public_values(CAPI).items() if n.startswith("KDL_")}
    assert set(have) == set(DLPACK_CODES), "KDL_ constants and DLPACK_CODES differ"
    for py, c in DLPACK_CODES.items():
        want = values[c] if c in values else DLPACK_LATER[c]
        assert have[py] == want, "_capi.%s = %r, dlpack's %s = %r" % (py, have[py], c, want)


# ------------------------------------------------------------ the self-tests
# The checks above must fail on a difference: each test below alters a copy
# of the header or of the binding and requires the difference to be reported.

def _ns_with(**changes):
    ns = types.SimpleNamespace(**vars(CAPI))
    for k, v in changes.items():
        if v is None:
            delattr(ns, k)
        else:
            setattr(ns, k, v)
    return ns


def _clone(cls, fields):
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": fields, "__module__": cls.__module__})


def test_self_parser_reads_every_declarator_form():
    hdr = Header("""
        #define KT_N 4
        #define KT_SHIFTED (1u << 5) /* a comment */
        typedef struct kt_thing kt_thing;
        typedef void (*kt_cb)(int a, void* user);
        typedef struct kt_demo {
          size_t struct_size;   // C++ comment
          int a, b;             /* two at once */
          const char* p, *q;
          int64_t shape[KT_N][2];
          int (*fn)(const char* key, void* value, size_t size);
          kt_cb cb;
          kt_thing* handle;
          kt_comm_backends nested;
          unsigned flags : 3;
          struct kt_other tagged;
        } kt_demo;
        typedef enum kt_e { KT_E_A, KT_E_B = 5, KT_E_C, KT_E_D = KT_E_B | 0x10, KT_E_E = KT_N } kt_e;
    """)
    fields = hdr.records["kt_demo"][1]
    assert [f.name for f in fields] == ["struct_size", "a", "b", "p", "q", "shape", "fn", "cb",
                                            "handle", "nested", "flags", "tagged"]
    by = {f.name: f for f in fields}
    assert (by["b"].base, by["q"].base, by["q"].ptr) == ("int", "char", 1)
    assert by["shape"].dims == (4, 2) and by["fn"].fn == (False, 3)
    assert by["tagged"].base == "kt_other" and by["flags"].base == "unsigned"
    assert hdr.fn_typedefs == {"kt_cb": (True, 2)} and hdr.opaque == {"kt_thing"}
    assert hdr.enums["kt_e"] == [("KT_E_A", 0), ("KT_E_B", 5), ("KT_E_C", 6), ("KT_E_D", 21), ("KT_E_E", 4)]
    assert hdr.defines == {"KT_N": 4, "KT_SHIFTED": 32}


def test_self_dropped_python_field_is_reported(compiled):
    layouts, _ = compiled
    cls = CAPI.MoeOptions
    fields = [f for f in cls._fields_ if f[0] != "lora_alpha"]
    problems = struct_problems(_clone(cls, fields), "kt_moe_options", BOTH, _by_ctype(CAPI),
                               layouts["kt_moe_options"])
    assert any("missing ['lora_alpha']" in p for p in problems), problems
    assert any("sizeof" in p for p in problems) or any("offset" in p for p in problems), problems


def test_self_reordered_and_retyped_fields_are_reported(compiled):
    layouts, _ = compiled
    by_ctype = _by_ctype(CAPI)
    f = list(CAPI.BackwardOptions._fields_)
    f[2], f[3] = f[3], f[2]  # accumulate <-> param_grads: same sizes
    problems = struct_problems(_clone(CAPI.BackwardOptions, f), "kt_backward_options", BOTH, by_ctype,
                               layouts["kt_backward_options"])
    assert any("fields" in p for p in problems) and any("offset" in p for p in problems), problems
    # The last int of kt_moe_info as int64: offsets and sizeof are unchanged
    # (padding), the field's size is not.
    f = [(n, ctypes.c_int64 if n == "compute" else t) for n, t in CAPI.MoeInfo._fields_]
    problems = struct_problems(_clone(CAPI.MoeInfo, f), "kt_moe_info", BOTH, by_ctype, layouts["kt_moe_info"])
    assert any("compute: offset 80 size 4 in C, offset 80 size 8 in Python" in p for p in problems), problems
    assert not any("sizeof" in p for p in problems), problems
    # A float read as an int: same size and offset, another type.
    f = [(n, ctypes.c_int if n == "grad_scale" else t) for n, t in CAPI.BackwardOptions._fields_]
    problems = struct_problems(_clone(CAPI.BackwardOptions, f), "kt_backward_options", BOTH, by_ctype,
                               layouts["kt_backward_options"])
    assert problems == ["BackwardOptions (kt_backward_options).grad_scale: must be c_float, not c_int"], problems
    # A callback of the wrong arity.
    f = [(n, ctypes.CFUNCTYPE(None, ctypes.c_int) if n == "log_fn" else t) for n, t in CAPI.EngineOptions._fields_]
    problems = struct_problems(_clone(CAPI.EngineOptions, f), "kt_engine_options", BOTH, by_ctype,
                               layouts["kt_engine_options"])
    assert any("log_fn: must be a function of 3 arguments, not 1" in p for p in problems), problems


def test_self_field_added_to_the_header_is_reported():
    # Compiles an altered copy of the header: a field inserted in the middle
    # of kt_moe_options moves every later offset and the size.
    text, n = re.subn(r"(typedef struct kt_moe_options \{\s*size_t struct_size;[^\n]*\n)",
                      r"\1  int new_knob;\n", read(HEADER))
    assert n == 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kt_c_api.h")
        with open(path, "w") as f:
            f.write(text)
        hdr = _merged(Header(text), DLPACK)
        layouts, _ = compile_layouts(path, {"kt_moe_options": hdr.records["kt_moe_options"]}, [],
                                     include_dirs=[tmp])
    problems = struct_problems(CAPI.MoeOptions, "kt_moe_options", hdr, _by_ctype(CAPI), layouts["kt_moe_options"])
    assert any("missing ['new_knob']" in p for p in problems), problems
    assert any("sizeof" in p for p in problems), problems
    assert any("num_experts: offset 16 size 8 in C, offset 8 size 8 in Python" in p for p in problems), problems


def test_self_new_or_changed_values_are_reported(namespaces):
    text = read(HEADER)
    for old, new in [(r"(KT_ISA_AMX\s*=\s*4)", r"\1, KT_ISA_AVX10"),
                     (r"(KT_ARG_GRAD_B_DOWN\s*=\s*69)", r"\1, KT_ARG_NEW"),
                     (r"(#define KT_PROJ_ALL 7u)", r"\1\n#define KT_PROJ_EXTRA 8u")]:
        text, n = re.subn(old, new, text)
        assert n == 1, old
    fams = Header(text).families()
    assert fams["kt_isa"][-1] == ("KT_ISA_AVX10", 5) and fams["kt_arg_id"][-1] == ("KT_ARG_NEW", 70)
    assert "ISA_AVX10" in " ".join(family_problems("kt_isa", fams["kt_isa"], FAMILIES["kt_isa"], namespaces))
    assert "'NEW' (70) missing" in " ".join(family_problems("kt_arg_id", fams["kt_arg_id"],
                                                             FAMILIES["kt_arg_id"], namespaces))
    assert "PROJ_EXTRA" in " ".join(family_problems("#define KT_PROJ_*", fams["#define KT_PROJ_*"],
                                                    FAMILIES["#define KT_PROJ_*"], namespaces))
    # The binding changed instead: a wrong value, a missing value, an extra key.
    statuses = dict(CAPI.STATUS_NAMES)
    del statuses[18]
    formats = dict(CAPI.WEIGHT_FORMATS, int2_g64=8)
    ns = dict(namespaces, _capi=_ns_with(ISA_AMX=5, STATUS_NAMES=statuses, WEIGHT_FORMATS=formats,
                                         DIST_GRAD_MEAN=None))
    fams = HDR.families()
    assert family_problems("kt_isa", fams["kt_isa"], FAMILIES["kt_isa"], ns) == \
        ["kt_isa: 'ISA_AMX' is 4 in the header, 5 in _capi attributes named without KT_"]
    assert family_problems("kt_status", fams["kt_status"], FAMILIES["kt_status"], ns) == \
        ["kt_status: 18 (KT_ERR_COMM) missing from _capi.STATUS_NAMES"]
    assert "'int2_g64' in _capi.WEIGHT_FORMATS is not in the header" in " ".join(
        family_problems("kt_weight_format", fams["kt_weight_format"], FAMILIES["kt_weight_format"], ns))
    assert "DIST_GRAD_MEAN" in " ".join(family_problems("kt_dist_grad_average", fams["kt_dist_grad_average"],
                                                        FAMILIES["kt_dist_grad_average"], ns))
    assert "ISA_AMX" in " ".join(reverse_problems(HDR, ns["_capi"]))


def test_self_unaccounted_struct_family_and_constant_are_reported():
    text = read(HEADER).replace("#endif /* KT_C_API_H_ */", """
typedef struct kt_new_options { size_t struct_size; int knob; } kt_new_options;
typedef enum kt_new_kind { KT_NEW_KIND_A = 0, KT_NEW_KIND_B = 1 } kt_new_kind;
#define KT_NEW_FLAG 8u
#define KT_BROKEN ((int)3)
#endif /* KT_C_API_H_ */""")
    assert "kt_new_options" in text
    hdr = Header(text)
    problems = " ".join(struct_coverage_problems(hdr, CAPI))
    assert "header struct kt_new_options has no Python mirror" in problems
    problems = " ".join(family_coverage_problems(hdr))
    assert "header family kt_new_kind" in problems and "#define KT_NEW_FLAG" in problems
    assert "KT_BROKEN is not an integer constant" in problems
    # A Python class or constant the header does not have.
    extra = _clone(CAPI.LoadOptions, [("struct_size", ctypes.c_size_t)])
    extra.__name__ = "GoneOptions"
    ns = _ns_with(GoneOptions=extra, ISA_AVX10=5, GEMM_NAMES={"auto": 0})
    ns.__name__ = CAPI.__name__
    assert "GoneOptions mirrors kt_gone_options" in " ".join(struct_coverage_problems(HDR, ns))
    problems = " ".join(reverse_problems(HDR, ns))
    assert "_capi.ISA_AVX10 = 5 has no KT_ISA_AVX10" in problems and "_capi.GEMM_NAMES" in problems
