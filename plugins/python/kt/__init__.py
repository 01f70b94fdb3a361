"""kt: the routed experts of Mixture-of-Experts layers on the CPU.

``kt.MoE`` and ``kt.Engine`` work on numpy arrays, raw buffers
(``kt.RawTensor``) or torch tensors; ``kt.torch`` adds autograd and
``nn.Module``s, ``kt.hf`` swaps the routed experts of HF-shaped models.
The library is found through $KT_LIBRARY, the build tree registered by
install_dev.sh, a copy next to this package (where the wheel puts it), or the
system loader.
"""
from . import _capi
from .core import WEIGHT_FORMATS, Context, Engine, Job, MoE, check, default_engine, lib, library_path, packed_info
from ._tensor import DLView, RawTensor
from .errors import *  # noqa: F401,F403  (the exception classes are public)
from .errors import KtError
from . import checkpoint  # noqa: E402  (kt.checkpoint: checkpoints, packed caches, adapters)
from .checkpoint import Checkpoint

ABI_VERSION = _capi.ABI_VERSION

_loaded_abi = lib().kt_abi_version()
if _loaded_abi != ABI_VERSION:
    raise ImportError("kt: %s has ABI %d but this package speaks ABI %d" %
                      (library_path(), _loaded_abi, ABI_VERSION))


def version():
    """The loaded library's version string, e.g. "1.0.0"."""
    return lib().kt_version().decode()


# The loaded library's version (kt_version()), e.g. "1.0.0".
__version__ = version()


def build_info():
    return lib().kt_build_info().decode()


def cpu_isa():
    """Best ISA this CPU runs: "ref", "avx2", "avx512bf16" or "amx"."""
    return lib().kt_isa_name(lib().kt_cpu_isa()).decode()


__all__ = ["ABI_VERSION", "__version__", "Checkpoint", "Context", "DLView", "Engine", "Job", "KtError", "MoE", "RawTensor",
           "WEIGHT_FORMATS", "build_info", "check", "cpu_isa", "default_engine", "library_path", "packed_info", "version"]
