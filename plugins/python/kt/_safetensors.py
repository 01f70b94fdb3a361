"""A small safetensors reader and writer for the adapters kt.hf saves
(8-byte little-endian header length, JSON header, then the tensors' bytes).
Files are written to a temporary name in the same directory, fsync'ed and
renamed over the target."""
import json
import os
import struct
import tempfile

import torch

_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_TYPES = {v: k for k, v in _NAMES.items()}


def write_atomic(path, data):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            # A full disk reports ENOSPC with no name: say which file it was.
            raise OSError(e.errno, e.strerror, path) from e
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise TypeError("kt: %s has dtype %s; adapters hold float32, bfloat16 or float16" % (name, t.dtype))
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    write_atomic(path, [struct.pack("<Q", len(text)), text] + blobs)


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("kt: %s is not a safetensors file (too short)" % path)
    n = struct.unpack("<Q", data[:8])[0]
    if 8 + n > len(data):
        raise ValueError("kt: %s: header length %d runs past the file" % (path, n))
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        if h["dtype"] not in _TYPES or not 0 <= begin <= end <= len(data) - 8 - n:
            raise ValueError("kt: %s: tensor %s has dtype %s or offsets outside the file" % (path, name, h["dtype"]))
        buf = bytearray(data[8 + n + begin:8 + n + end])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(_TYPES[h["dtype"]]).reshape(h["shape"])
    return out
