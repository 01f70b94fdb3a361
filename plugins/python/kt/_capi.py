"""The ctypes layer of include/kt_c_api.h (_abi, generated from the ABI record)
and the library loader.

The growable option structs carry their own ``struct_size`` and are always
filled first by the library's ``*_defaults(struct, sizeof(struct))`` functions
(what the header's inline ``*_init`` do), so the library writes only the bytes
these classes have and fields it appends later keep their defaults.
"""
import ctypes
import ctypes.util
import os

from ._abi import *  # noqa: F401,F403  constants, structs and callbacks, named as in the header without KT_/kt_
from ._abi import ABI_VERSION, ENUMS, PROTOTYPES, WEIGHT_FORMAT_NAMES
from ._abi import COMM_STORE_GET_FN, COMM_STORE_SET_FN, DIST_CKPT_ADAPTER, DIST_CKPT_OPTIMIZER, DIST_CKPT_WEIGHTS


def _by_suffix(enum, prefix):
    return {name[len(prefix):]: value for name, value in ENUMS[enum].items()}


# kt_status value -> its name ("KT_ERR_SHAPE").
STATUS_NAMES = {value: name for name, value in ENUMS["kt_status"].items()}
# kt_arg_id without KT_ARG_ ("W_GATE") -> value.
ARG = _by_suffix("kt_arg_id", "KT_ARG_")
# kt_compute and kt_weight_format by kt's names ("int8", "int4_g32").
COMPUTES = {name.lower(): value for name, value in _by_suffix("kt_compute", "KT_COMPUTE_").items()}
WEIGHT_FORMATS = WEIGHT_FORMAT_NAMES
# kt_ckpt_dtype without KT_CKPT_DTYPE_ ("BF16") -> value.
CKPT_DTYPES = _by_suffix("kt_ckpt_dtype", "KT_CKPT_DTYPE_")
# KT_DIST_CKPT_* parts by name.
DIST_CKPT_PARTS = {"weights": DIST_CKPT_WEIGHTS, "adapter": DIST_CKPT_ADAPTER, "optimizer": DIST_CKPT_OPTIMIZER}
STORE_SET_FN, STORE_GET_FN = COMM_STORE_SET_FN, COMM_STORE_GET_FN


def _candidates():
    """Where libkt is looked for, in order: $KT_LIBRARY, the build tree
    recorded by install_dev.sh, next to this package, the system loader."""
    env = os.environ.get("KT_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from . import _libpath  # written by install_dev.sh; not in version control
        yield _libpath.LIBRARY
    except ImportError:
        pass
    for name in ("libkt.so.%d" % ABI_VERSION, "libkt.so"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            yield path
    yield "libkt.so.%d" % ABI_VERSION
    found = ctypes.util.find_library("kt")
    if found:
        yield found


def load_library():
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append("%s: %s" % (path, e))
            continue
        for name, (restype, argtypes) in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        return lib, path
    raise ImportError("kt: cannot load libkt (set KT_LIBRARY to its path); tried:\n  " +
                      "\n  ".join(errors))
