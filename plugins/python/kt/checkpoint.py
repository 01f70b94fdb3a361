"""Hugging Face checkpoint directories, packed caches and PEFT adapters
(the kt_ckpt_* and packed-cache calls); no torch needed.

``Checkpoint(dir)`` opens a checkpoint read-only (memory-mapped, validated),
describes its MoE layers and loads a layer's routed experts straight from the
mapped files into a ``kt.MoE``: the weights never pass through Python.
``write_experts``, ``write_adapter``, ``read_adapter_config`` and
``read_adapter`` are kt's writers and readers of expert checkpoints and PEFT
adapters; every writer publishes its directory atomically.
"""
import ctypes
import json
import os

from . import _capi
from .core import PROJECTIONS, _Handle, _args, check, lib

LAYOUTS = {"none": _capi.CKPT_LAYOUT_NONE, "per_expert": _capi.CKPT_LAYOUT_PER_EXPERT,
           "mixtral": _capi.CKPT_LAYOUT_MIXTRAL, "fused": _capi.CKPT_LAYOUT_FUSED,
           "fused_in_out": _capi.CKPT_LAYOUT_FUSED_IN_OUT, "gpt_oss": _capi.CKPT_LAYOUT_GPT_OSS}
_LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "F32": "F32", "F16": "F16",
           "BF16": "BF16"}

_WEIGHT_ARGS = (("gate", "W_GATE"), ("up", "W_UP"), ("down", "W_DOWN"), ("bias_gate", "B_GATE"),
                ("bias_up", "B_UP"), ("bias_down", "B_DOWN"))
_LORA_ARGS = tuple(("lora_%s_%s" % (ab, p), "LORA_%s_%s" % (ab, p.upper()))
                   for p in ("gate", "up", "down") for ab in ("A", "B"))


def _path(p, what):
    if not isinstance(p, (str, bytes, os.PathLike)):
        raise TypeError("kt: %s must be a path, not %s" % (what, type(p).__name__))
    return os.fsencode(p)


def _ckpt_dtype(name, what):
    key = _DTYPES.get(str(name).replace("torch.", ""))
    if key is None:
        raise ValueError("kt: %s must be float32, bfloat16 or float16, not %r" % (what, name))
    return _capi.CKPT_DTYPES[key]


def _named_args(table, tensors, call):
    known = dict(table)
    pairs = []
    for name, t in tensors.items():
        if name not in known:
            raise ValueError("kt: %s takes %s, not %r" % (call, ", ".join(known), name))
        if t is not None:
            pairs.append((known[name], t))
    return pairs


class Checkpoint(_Handle):
    """An open checkpoint directory (kt_ckpt). Tensor data stays mapped until
    ``close()``; the handle is read-only and may be used from any thread."""

    def __init__(self, directory):
        handle = ctypes.c_void_p()
        check(lib().kt_ckpt_open(_path(directory, "directory"), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        self.directory = os.fspath(directory)
        info = _capi.CkptInfo()
        info.struct_size = ctypes.sizeof(info)
        check(self._lib.kt_ckpt_get_info(handle, ctypes.byref(info)))
        self.info = {"architecture": info.architecture.decode(), "model_type": info.model_type.decode(),
                     "layout": _LAYOUT_NAMES.get(info.layout, "unknown"),
                     "num_moe_layers": info.num_moe_layers, "num_tensors": info.num_tensors,
                     "num_files": info.num_files, "total_bytes": info.total_bytes,
                     "top_k": info.top_k}
        self.layers = {}
        for i in range(info.num_moe_layers):
            li = _capi.CkptLayerInfo()
            li.struct_size = ctypes.sizeof(li)
            check(self._lib.kt_ckpt_get_layer_info(handle, i, ctypes.byref(li)))
            self.layers[li.layer] = {
                "layer": li.layer, "num_experts": li.num_experts, "hidden": li.hidden,
                "intermediate": li.intermediate, "bias": bool(li.has_bias),
                "layout": _LAYOUT_NAMES.get(li.layout, "unknown"),
                "format": self._lib.kt_ckpt_format_name(li.format).decode(),
                "weight_dtype": self._lib.kt_ckpt_dtype_name(li.weight_dtype).decode(),
                "loadable": bool(li.loadable), "bytes": li.bytes,
                "weight_format": self._lib.kt_weight_format_name(li.weight_format).decode(),
                "group_size": li.group_size, "num_tensors": li.num_tensors}

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the checkpoint was closed")
        return self._handle

    def close(self):
        if self._handle:
            self._lib.kt_ckpt_close(self._handle)
            self._handle = None

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kt_ckpt_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def moe_options(self, layer):
        """kt.MoE keyword arguments for layer L (shapes, bias, activation, top_k,
        and the weight_format that holds the experts as stored)."""
        o = _capi.MoeOptions()
        self._lib.kt_moe_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        check(self._lib.kt_ckpt_moe_options(self.handle, int(layer), ctypes.byref(o)))
        return dict(num_experts=o.num_experts, top_k=o.top_k, hidden=o.hidden,
                    intermediate=o.intermediate, bias=bool(o.has_bias),
                    activation="swiglu_oai" if o.activation == _capi.ACT_SWIGLU_OAI else "silu",
                    act_alpha=o.act_alpha, act_limit=o.act_limit,
                    weight_format=self._lib.kt_weight_format_name(o.weight_format).decode())

    def load_layer(self, layer, moe, progress=None, *, dequantize=False, experts=None, intermediate=None,
                   zero_down_bias=False):
        """Loads layer L's routed experts into moe (a kt.MoE) from the mapped
        files; progress(done, total) is called between batches of experts.
        Source pages are dropped from memory once packed.

        A quantized layer (fp8 blocks, int4 groups, mxfp4) loads as stored
        into a layer of its own format (``moe_options(L)["weight_format"]``).
        ``dequantize=True`` also lets it load into a "bf16" layer, each
        weight dequantized and rounded to bf16 once; without it that load
        raises kt.UnsupportedError. A quantized layer is never re-quantized:
        a layer of another quantized format is refused either way. Dense
        layers ignore the flag.

        A share of the layer, for a rank of an expert- or tensor-parallel
        group (moe is made with the share's expert count and intermediate
        size; only the share's bytes are read):
          experts         checkpoint expert ids, moe's expert i being
                          experts[i] (default: all, in order)
          intermediate    (begin, end): the slice of the intermediate
                          dimension moe holds (gate/up rows, down columns);
                          a quantized layer loaded as stored needs both ends
                          on whole scale groups
          zero_down_bias  the down biases load as zeros (every rank of a
                          tensor-parallel group but one: their outputs are
                          summed)"""
        callback = (_capi.CKPT_PROGRESS_FN(lambda done, total, user: progress(done, total))
                    if progress else ctypes.cast(None, _capi.CKPT_PROGRESS_FN))
        o = _capi.CkptLoadOptions()
        self._lib.kt_ckpt_load_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.dequantize = 1 if dequantize else 0
        ids = None
        if experts is not None:
            ids = (ctypes.c_int64 * len(experts))(*[int(e) for e in experts])
            o.experts = ctypes.cast(ids, ctypes.POINTER(ctypes.c_int64))
            o.num_experts = len(experts)
        if intermediate is not None:
            o.intermediate_begin, o.intermediate_end = (int(v) for v in intermediate)
        o.zero_down_bias = 1 if zero_down_bias else 0
        check(self._lib.kt_ckpt_load_layer_with(self.handle, int(layer), moe.handle, ctypes.byref(o), callback,
                                                None))
        del ids
        share = experts is not None or intermediate is not None or zero_down_bias
        moe.weights_source = ("checkpoint", self.directory, int(layer)) + (
            (dict(experts=None if experts is None else [int(e) for e in experts],
                  intermediate=None if intermediate is None else tuple(int(v) for v in intermediate),
                  zero_down_bias=bool(zero_down_bias)),) if share else ())

    def read_layer(self, layer, **tensors):
        """Copies layer L's weights into host tensors: gate, up [E,I,H],
        down [E,H,I], bias_gate, bias_up [E,I], bias_down [E,H] (any subset;
        fp32/bf16/fp16)."""
        pairs = _named_args(_WEIGHT_ARGS, tensors, "Checkpoint.read_layer")
        arr, views = _args(pairs)
        check(self._lib.kt_ckpt_read_layer(self.handle, int(layer), arr, len(pairs)))
        del views

    def tensor(self, name):
        """A tensor's description: name, file, dtype, shape, nbytes and the
        address of its mapped, read-only data (valid until close())."""
        t = _capi.CkptTensor()
        t.struct_size = ctypes.sizeof(t)
        check(self._lib.kt_ckpt_find_tensor(self.handle, name.encode(), ctypes.byref(t)))
        return self._describe(t)

    def layer_tensor_names(self, layer):
        """The names of the checkpoint tensors of layer L's routed experts
        (weights, scales, zero points, biases), in name order: what
        load_layer reads, so a host that loads the experts through kt can
        skip them when it loads the rest of the model."""
        names = []
        t = _capi.CkptTensor()
        info = self.layers.get(int(layer))
        # Unknown layers: kt's own error names them.
        for i in range(info["num_tensors"] if info is not None else 1):
            t.struct_size = ctypes.sizeof(t)
            check(self._lib.kt_ckpt_layer_tensor_at(self.handle, int(layer), i, ctypes.byref(t)))
            names.append(t.name.decode())
        return names

    def tensor_names(self):
        names = []
        t = _capi.CkptTensor()
        for i in range(self.info["num_tensors"]):
            t.struct_size = ctypes.sizeof(t)
            check(self._lib.kt_ckpt_tensor_at(self.handle, i, ctypes.byref(t)))
            names.append(t.name.decode())
        return names

    def _describe(self, t):
        return {"name": t.name.decode(), "file": t.file.decode(),
                "dtype": self._lib.kt_ckpt_dtype_name(t.dtype).decode(),
                "shape": tuple(t.shape[i] for i in range(t.ndim)), "nbytes": t.nbytes,
                "data": t.data or 0}


def _layer_args(layers, table, call):
    """{layer number: {name: tensor}} -> kt_ckpt_layer_args array + views."""
    if not isinstance(layers, dict) or not layers:
        raise ValueError("kt: %s needs a non-empty {layer number: {name: tensor}} dict" % call)
    arr = (_capi.CkptLayerArgs * len(layers))()
    keep = []
    for i, (layer, tensors) in enumerate(sorted(layers.items())):
        pairs = _named_args(table, tensors, call)
        args, views = _args(pairs)
        keep.append((args, views))
        arr[i].layer = int(layer)
        arr[i].args = ctypes.cast(args, ctypes.POINTER(_capi.Arg))
        arr[i].num_args = len(pairs)
    return arr, keep


def write_experts(directory, layers, *, naming="per_expert", dtype="bfloat16",
                  max_shard_bytes=4 << 30, config=None):
    """Writes a full-expert checkpoint with HF key names. layers: {L: {gate,
    up [E,I,H], down [E,H,I], optional bias_gate, bias_up, bias_down}};
    naming "per_expert" (model.layers.L.mlp.experts.e.*_proj) or "mixtral";
    config: a dict or JSON text written as config.json."""
    o = _capi.CkptWriteOptions()
    lib().kt_ckpt_write_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
    if naming not in ("per_expert", "mixtral"):
        raise ValueError("kt: naming must be 'per_expert' or 'mixtral'")
    o.layout = LAYOUTS[naming]
    o.dtype = _ckpt_dtype(dtype, "dtype")
    o.max_shard_bytes = int(max_shard_bytes)
    if config is not None:
        o.config_json = (config if isinstance(config, str) else json.dumps(config)).encode()
    arr, keep = _layer_args(layers, _WEIGHT_ARGS, "write_experts")
    check(lib().kt_ckpt_write_experts(_path(directory, "directory"), ctypes.byref(o), arr, len(arr)))
    del keep


def _targets_bits(targets):
    bits = 0
    for p in targets:
        if p not in PROJECTIONS:
            raise ValueError("kt: LoRA target %r is not one of gate, up, down" % (p,))
        bits |= PROJECTIONS[p]
    return bits


def write_adapter(directory, layers, *, rank, alpha, use_rslora=False,
                  targets=("gate", "up", "down"), naming="per_expert", dtype="float32",
                  base_model=None):
    """Writes a per-expert PEFT adapter (adapter_config.json +
    adapter_model.safetensors). layers: {L: {lora_A_gate [E,r,in],
    lora_B_gate [E,out,r], ...}} for every target."""
    c = _capi.CkptAdapterConfig()
    lib().kt_ckpt_adapter_config_defaults(ctypes.byref(c), ctypes.sizeof(c))
    c.rank, c.alpha, c.use_rslora = int(rank), float(alpha), 1 if use_rslora else 0
    c.targets = _targets_bits(targets)
    if naming not in ("per_expert", "mixtral"):
        raise ValueError("kt: naming must be 'per_expert' or 'mixtral'")
    c.layout = LAYOUTS[naming]
    c.dtype = _ckpt_dtype(dtype, "dtype")
    if base_model is not None:
        c.base_model = base_model.encode()
    arr, keep = _layer_args(layers, _LORA_ARGS, "write_adapter")
    check(lib().kt_ckpt_adapter_write(_path(directory, "directory"), ctypes.byref(c), arr, len(arr)))
    del keep


def read_adapter_config(directory):
    """rank, alpha, use_rslora, targets, naming and stored dtype of a
    per-expert adapter."""
    c = _capi.CkptAdapterConfig()
    lib().kt_ckpt_adapter_config_defaults(ctypes.byref(c), ctypes.sizeof(c))
    check(lib().kt_ckpt_adapter_read_config(_path(directory, "directory"), ctypes.byref(c)))
    return {"rank": c.rank, "alpha": c.alpha, "use_rslora": bool(c.use_rslora),
            "targets": tuple(p for p, bit in PROJECTIONS.items() if c.targets & bit),
            "naming": _LAYOUT_NAMES.get(c.layout, "unknown"),
            "dtype": lib().kt_ckpt_dtype_name(c.dtype).decode()}


def read_adapter(directory, layer, **tensors):
    """Copies layer L's LoRA factors into host tensors lora_A_<p> [E,r,in],
    lora_B_<p> [E,out,r] (fp32/bf16)."""
    pairs = _named_args(_LORA_ARGS, tensors, "read_adapter")
    arr, views = _args(pairs)
    check(lib().kt_ckpt_adapter_read(_path(directory, "directory"), int(layer), arr, len(pairs)))
    del views


def read_packed_manifest(directory):
    """{layer number: path of its .ktpack} from the manifest.json that `kt
    convert` writes."""
    path = os.path.join(os.fspath(directory), "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != "kt-packed-cache":
        raise ValueError("kt: %s is not a kt packed-cache manifest" % path)
    return {int(e["layer"]): os.path.join(os.fspath(directory), e["file"])
            for e in manifest.get("layers", [])}


__all__ = ["Checkpoint", "LAYOUTS", "read_adapter", "read_adapter_config",
           "read_packed_manifest", "write_adapter", "write_experts"]
