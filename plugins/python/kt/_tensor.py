"""Borrowed DLTensor views of numpy arrays, torch tensors and raw buffers.

Each view keeps the Python objects that own the memory, the shape and the
stride arrays alive for as long as the view lives; kt only borrows them.
"""
import ctypes

from . import _capi

# dtype name -> (DLPack code, bits, bytes per element)
DTYPES = {
    "float32": (_capi.KDL_FLOAT, 32, 4),
    "float16": (_capi.KDL_FLOAT, 16, 2),
    "float64": (_capi.KDL_FLOAT, 64, 8),
    "bfloat16": (_capi.KDL_BFLOAT, 16, 2),
    "int32": (_capi.KDL_INT, 32, 4),
    "int64": (_capi.KDL_INT, 64, 8),
    "int8": (_capi.KDL_INT, 8, 1),
    "uint8": (_capi.KDL_UINT, 8, 1),
    "bool": (_capi.KDL_BOOL, 8, 1),
}


class RawTensor:
    """A tensor described by hand: an address, a dtype name (see DTYPES), a
    shape and optional element strides. The memory stays the caller's; pass
    ``owner`` to keep the object that holds it alive with this description."""

    def __init__(self, address, dtype, shape, strides=None, device_type=_capi.KDL_CPU,
                 device_id=0, owner=None):
        if dtype not in DTYPES:
            raise TypeError("kt: unknown dtype %r; one of %s" % (dtype, ", ".join(DTYPES)))
        self.address = int(address)
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.strides = None if strides is None else tuple(int(s) for s in strides)
        self.device_type = device_type
        self.device_id = device_id
        self.owner = owner


class DLView:
    """A DLTensor over ``obj`` (borrowed); ``.ptr`` is what kt receives."""

    def __init__(self, obj, dtype=None):
        raw = _describe(obj, dtype)
        code, bits, _ = DTYPES[raw.dtype]
        ndim = len(raw.shape)
        self._owner = (obj, raw.owner)
        self._shape = (ctypes.c_int64 * max(ndim, 1))(*raw.shape)
        self._strides = None
        if raw.strides is not None:
            self._strides = (ctypes.c_int64 * max(ndim, 1))(*raw.strides)
        t = _capi.DLTensor()
        t.data = raw.address or None
        t.device = _capi.DLDevice(raw.device_type, raw.device_id)
        t.ndim = ndim
        t.dtype = _capi.DLDataType(code, bits, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = (ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                     if self._strides is not None else None)
        t.byte_offset = 0
        self.tensor = t
        self.ptr = ctypes.pointer(t)
        self.dtype = raw.dtype
        self.shape = raw.shape


def _describe(obj, dtype):
    if isinstance(obj, RawTensor):
        return obj
    if type(obj).__module__.startswith("numpy"):
        return _describe_numpy(obj, dtype)
    if type(obj).__name__ in ("Tensor", "Parameter") and hasattr(obj, "data_ptr"):
        return _describe_torch(obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError("kt: cannot pass a %s as a tensor (numpy array, torch tensor, "
                        "kt.RawTensor or a buffer)" % type(obj).__name__) from None
    import numpy  # a plain buffer goes through numpy's view of it
    return _describe_numpy(numpy.asarray(view), dtype)


def _describe_numpy(arr, dtype):
    name = dtype or arr.dtype.name
    if name == "bfloat16" and arr.dtype.itemsize != 2:
        raise TypeError("kt: bfloat16 data must be held in a 2-byte array (e.g. uint16)")
    if name not in DTYPES:
        raise TypeError("kt: numpy dtype %s has no kt equivalent" % arr.dtype)
    item = arr.dtype.itemsize
    for s in arr.strides:
        if s % item:
            raise ValueError("kt: array strides are not multiples of its element size")
    return RawTensor(arr.__array_interface__["data"][0], name, arr.shape,
                     [s // item for s in arr.strides], owner=arr)


_TORCH_NAMES = {
    "torch.float32": "float32", "torch.float16": "float16", "torch.float64": "float64",
    "torch.bfloat16": "bfloat16", "torch.int32": "int32", "torch.int64": "int64",
    "torch.int8": "int8", "torch.uint8": "uint8", "torch.bool": "bool",
}


def _describe_torch(t):
    name = _TORCH_NAMES.get(str(t.dtype))
    if name is None:
        raise TypeError("kt: torch dtype %s has no kt equivalent" % t.dtype)
    kind = t.device.type
    if kind == "cpu":
        device_type = _capi.KDL_CPU
    elif kind == "cuda":
        device_type = _capi.KDL_CUDA
    else:
        device_type = _capi.KDL_EXT_DEV
    address = t.data_ptr() if kind != "meta" else 0
    index = t.device.index or 0
    return RawTensor(address, name, t.shape, t.stride(), device_type, index, owner=t)
