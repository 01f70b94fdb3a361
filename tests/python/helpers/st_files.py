"""A safetensors writer and reader written from the format's public
description (8-byte little-endian header length, JSON header of
{name: {dtype, shape, data_offsets}}, then the data), independent of kt, so
the tests can make checkpoints kt's writers do not produce and check what
kt's writers wrote."""
import json
import struct

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.uint8: "U8"}
_TORCH = {v: k for k, v in _DTYPES.items()}


def write(path, tensors, metadata=None):
    """tensors: {name: tensor}, or {name: (dtype name, uint8 tensor)} for a
    stored type torch does not name (F8_E4M3, F8_E8M0), one byte an element."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t, dtype = tensors[name], None
        if isinstance(t, tuple):
            dtype, t = t
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": dtype or _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def read(path):
    """{name: tensor} and the metadata dict of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        dtype = _TORCH[h["dtype"]]
        raw = bytearray(data[base + begin:base + end])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(h["shape"]).clone()
    return out, metadata
