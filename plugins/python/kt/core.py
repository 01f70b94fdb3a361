"""Engine and MoE layer handles over the C ABI; no torch needed.

Tensors are numpy arrays, torch tensors, kt.RawTensor descriptions or plain
buffers; all are borrowed for the call unless a call says it retains them.
"""
import ctypes
import os
import threading

from . import _capi
from ._tensor import DLView
from .errors import ERROR_CLASSES, KtError

_lib = None
_lib_path = None


def lib():
    global _lib, _lib_path
    if _lib is None:
        _lib, _lib_path = _capi.load_library()
    return _lib


def library_path():
    lib()
    return _lib_path


def check(status):
    """Raises the exception of a non-zero kt_status with kt_last_error()."""
    if status == 0:
        return
    message = lib().kt_last_error().decode("utf-8", "replace")
    name = _capi.STATUS_NAMES.get(status, "KT_ERR_%d" % status)
    raise ERROR_CLASSES.get(status, KtError)(status, name, message)


ACTIVATIONS = {"silu": _capi.ACT_SILU, "swiglu_oai": _capi.ACT_SWIGLU_OAI}
MODES = {"inference": _capi.MODE_INFERENCE, "lora": _capi.MODE_LORA, "full": _capi.MODE_FULL}
PROJECTIONS = {"gate": _capi.PROJ_GATE, "up": _capi.PROJ_UP, "down": _capi.PROJ_DOWN}
# Storage formats of the frozen base (kt_weight_format): "bf16", or
# quantized by kt at load, "int8_channel" (int8 per output row), "int4_g32"
# and "int4_g128" (int4 per group of 32 or 128 inputs); kt_c_api.h states
# their error. Checkpoint formats, held as stored (kt.Checkpoint.moe_options
# picks them): "fp8_b128", "mxfp4", "int4_g128", and asymmetric int4 with
# zero points "int4_g32_zp" and "int4_g128_zp".
WEIGHT_FORMATS = dict(_capi.WEIGHT_FORMATS)
_FORMAT_NAMES = {v: k for k, v in WEIGHT_FORMATS.items()}


def weight_format_code(name):
    if name not in WEIGHT_FORMATS:
        raise ValueError("kt: weight_format must be one of %s, got %r" % (", ".join(WEIGHT_FORMATS), name))
    return WEIGHT_FORMATS[name]


def packed_info(path):
    """What the packed cache at path holds (kt_packed_read_info): its
    weight_format, experts, loaded experts, shape, bias and bytes."""
    i = _capi.PackedInfo()
    i.struct_size = ctypes.sizeof(i)
    check(lib().kt_packed_read_info(os.fsencode(path), ctypes.byref(i)))
    return {"weight_format": _FORMAT_NAMES.get(i.weight_format, str(i.weight_format)),
            "num_experts": i.num_experts, "num_loaded": i.num_loaded, "hidden": i.hidden,
            "intermediate": i.intermediate, "bias": bool(i.has_bias), "weight_bytes": i.weight_bytes,
            "file_bytes": i.file_bytes, "format_version": i.format_version}
ISAS = {"auto": _capi.ISA_AUTO, "ref": _capi.ISA_REF, "avx2": _capi.ISA_AVX2,
        "avx512bf16": _capi.ISA_AVX512BF16, "amx": _capi.ISA_AMX}


class _Handle:
    """Owns a kt handle: copying or pickling would free it twice."""

    def __copy__(self):
        raise TypeError("kt: a %s owns a kt handle and cannot be copied" % type(self).__name__)

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError("kt: a %s owns a kt handle and cannot be pickled" % type(self).__name__)


class Engine(_Handle):
    """A kt engine: a pinned worker pool plus the chosen kernels."""

    # kt_gemm_backend: who computes the weight GEMMs.
    GEMM_BACKENDS = {"auto": 0, "native": 1, "onednn": 2}
    # kt_precision: "fp32" keeps fp32 activations fp32 in the weight GEMMs
    # (by default the avx512bf16 kernels round them to bf16, ~2e-3 relative).
    PRECISIONS = {"default": _capi.PRECISION_DEFAULT, "fp32": _capi.PRECISION_FP32}
    # kt_numa_mode: "auto" splits workers and experts over the NUMA nodes of
    # the affinity mask (the same bits as "off").
    NUMA = {"off": _capi.NUMA_OFF, "auto": _capi.NUMA_AUTO}

    def __init__(self, num_threads=0, pin_threads=True, max_isa="auto", verbosity=-1, gemm_backend="auto",
                 precision="default", host_openmp=False, numa="off"):
        """host_openmp=True: compute on the OpenMP threads of the calling
        thread (torch's intra-op threads, in a torch host) instead of kt's
        own pinned workers (kt_engine_options.host_openmp). numa="auto":
        workers and experts per NUMA node; info() says the nodes in use."""
        opts = _capi.EngineOptions()
        lib().kt_engine_options_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.num_threads = int(num_threads)
        opts.pin_threads = 1 if pin_threads else 0
        opts.host_openmp = 1 if host_openmp else 0
        if max_isa not in ISAS:
            raise ValueError("kt: max_isa must be one of %s" % ", ".join(ISAS))
        opts.max_isa = ISAS[max_isa]
        opts.verbosity = int(verbosity)
        if precision not in self.PRECISIONS:
            raise ValueError("kt: precision must be one of %s" % ", ".join(self.PRECISIONS))
        opts.precision = self.PRECISIONS[precision]
        if numa not in self.NUMA:
            raise ValueError("kt: numa must be one of %s" % ", ".join(self.NUMA))
        opts.numa = self.NUMA[numa]
        if gemm_backend not in self.GEMM_BACKENDS:
            raise ValueError("kt: gemm_backend must be one of %s" % ", ".join(self.GEMM_BACKENDS))
        handle = ctypes.c_void_p()
        check(lib().kt_engine_create(ctypes.byref(opts), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        if gemm_backend != "auto":
            try:
                check(lib().kt_engine_set_gemm_backend(handle, self.GEMM_BACKENDS[gemm_backend]))
            except Exception:
                self.close()
                raise

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the engine was closed")
        return self._handle

    def info(self):
        info = _capi.EngineInfo()
        info.struct_size = ctypes.sizeof(info)
        check(lib().kt_engine_get_info(self.handle, ctypes.byref(info)))
        names = {v: k for k, v in ISAS.items()}
        return {"num_threads": info.num_threads, "isa": names.get(info.isa, "unknown"),
                "cpu_isa": names.get(info.cpu_isa, "unknown"),
                "kernel_name": info.kernel_name.decode(),
                "gemm_backend": {v: k for k, v in self.GEMM_BACKENDS.items()}.get(info.gemm_backend, "unknown"),
                "precision": {v: k for k, v in self.PRECISIONS.items()}.get(info.precision, "unknown"),
                "numa_node_workers": [info.numa_node_workers[i] for i in range(info.numa_nodes)]}

    def close(self):
        if self._handle:
            check(self._lib.kt_engine_destroy(self._handle))
            self._handle = None

    def __del__(self):
        # Layers keep their engine alive, so at collection time none is left.
        if getattr(self, "_handle", None):
            self._lib.kt_engine_destroy(self._handle)
            self._handle = None


_default_engine = None
_default_lock = threading.Lock()


def default_engine():
    """The process-wide engine that layers use unless given one. A process
    forked from one that had it (DataLoader workers, multiprocessing's "fork")
    gets its own on first use: kt refuses the parent's there."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = Engine()
        return _default_engine


def _forget_default_engine_in_child():
    # The parent's engine and everything made on it are refused in the child
    # (KT_ERR_INVALID_HANDLE, "made before this process was forked"); the
    # Python objects stay, their close/__del__ get that error and free nothing.
    global _default_engine, _default_lock
    _default_engine = None
    _default_lock = threading.Lock()  # another thread may have held it at fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_default_engine_in_child)


def _args(pairs):
    """Builds a kt_arg array from (id name, tensor) pairs; returns the array
    and the views that keep the DLTensors alive."""
    views = []
    arr = (_capi.Arg * max(len(pairs), 1))()
    for i, (name, obj) in enumerate(pairs):
        view = obj if isinstance(obj, DLView) else DLView(obj)
        views.append(view)
        arr[i].id = _capi.ARG[name]
        arr[i].tensor = view.ptr
    return arr, views


def _backward_args(dy, dx, droute_weights, grad_scale, accumulate, param_grads):
    """kt_backward_options and the kt_arg array of a backward call (plain
    or distributed): (options, args, views to keep alive, pairs)."""
    opts = _capi.BackwardOptions()
    lib().kt_backward_options_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
    opts.grad_scale = grad_scale
    opts.accumulate = _capi.GRAD_ACCUMULATE if accumulate else _capi.GRAD_OVERWRITE
    opts.param_grads = 1 if param_grads else 0
    pairs = [("DY", dy)]
    if dx is not None:
        pairs.append(("DX", dx))
    if droute_weights is not None:
        pairs.append(("DROUTE_WEIGHTS", droute_weights))
    arr, views = _args(pairs)
    return opts, arr, views, pairs


class Context(_Handle):
    """What a training forward saved for its backward. Released once: after
    the backward has run and this object is dropped, or by ``release()``."""

    _RELEASE = "kt_context_release"  # the C call that frees the handle

    def __init__(self, layer, handle):
        self._layer = layer  # the layer must outlive its contexts
        self._handle = handle
        layer.live_contexts += 1

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: this context was released")
        return self._handle

    def release(self):
        if self._handle:
            getattr(self._layer._lib, self._RELEASE)(self._handle)
            self._handle = None
            if self._layer._handle:
                self._layer.live_contexts -= 1

    def __del__(self):
        if getattr(self, "_handle", None) and self._layer._handle:
            self.release()


class Job(_Handle):
    """A submitted kt job (kt_job). ``wait()`` returns when it ended and
    raises its error; dropping the Job waits for it and frees it."""

    def __init__(self, layer, handle, borrowed):
        self._layer = layer      # the layer must outlive its jobs
        self._handle = handle
        self._borrowed = borrowed  # what kt reads and writes until the job ends

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: this job was destroyed")
        return self._handle

    def run(self):
        """Runs a deferred job on the calling thread."""
        self._layer._lib.kt_job_run(self.handle)

    def done(self):
        return bool(self._layer._lib.kt_job_done(self.handle))

    def wait(self):
        status = self._layer._lib.kt_job_wait(self.handle)
        try:
            check(status)
        finally:
            self.close()

    def close(self):
        if self._handle:
            self._layer._lib.kt_job_destroy(self._handle)
            self._handle = None
            self._borrowed = None

    def __del__(self):
        if getattr(self, "_handle", None):
            self.close()


class MoE(_Handle):
    """One MoE layer's routed experts (kt_moe). Shapes follow DESIGN §2:
    x [T,H], ids [T,k], route weights [T,k]; stacked weights [E, out, in]."""

    def __init__(self, num_experts, top_k, hidden, intermediate, *, max_tokens=1024,
                 activation="silu", act_alpha=1.702, act_limit=0.0, bias=False,
                 mode="inference", lora_rank=16, lora_alpha=32.0, use_rslora=False,
                 lora_targets=("gate", "up", "down"), weight_format="bf16", compute="bf16", engine=None):
        """compute="int8" (KT_COMPUTE_INT8): an inference layer on an
        integer base ("int8_channel", "int4_g32", "int4_g128", "int4_g32_zp",
        "int4_g128_zp", "mxfp4") multiplies int8
        activations (x and the activation quantized per row): faster prefill
        where the CPU has AVX512-VNNI, about 1-2.5 % relative error in y against
        bf16 activations (kt_c_api.h states it); forwards without a saved
        context only."""
        if activation not in ACTIVATIONS:
            raise ValueError("kt: activation must be one of %s" % ", ".join(ACTIVATIONS))
        if mode not in MODES:
            raise ValueError("kt: mode must be one of %s" % ", ".join(MODES))
        if compute not in _capi.COMPUTES:
            raise ValueError("kt: compute must be one of %s, got %r" % (", ".join(_capi.COMPUTES), compute))
        self.engine = engine or default_engine()
        opts = _capi.MoeOptions()
        lib().kt_moe_options_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.num_experts = num_experts
        opts.top_k = top_k
        opts.hidden = hidden
        opts.intermediate = intermediate
        opts.max_tokens = max_tokens
        opts.activation = ACTIVATIONS[activation]
        opts.act_alpha = act_alpha
        opts.act_limit = act_limit
        opts.has_bias = 1 if bias else 0
        opts.mode = MODES[mode]
        opts.weight_format = weight_format_code(weight_format)
        opts.compute = _capi.COMPUTES[compute]
        if mode == "lora":
            opts.lora_rank = lora_rank
            opts.lora_alpha = lora_alpha
            opts.use_rslora = 1 if use_rslora else 0
            bits = 0
            for p in lora_targets:
                if p not in PROJECTIONS:
                    raise ValueError("kt: LoRA target %r is not one of gate, up, down" % (p,))
                bits |= PROJECTIONS[p]
            opts.lora_targets = bits
        handle = ctypes.c_void_p()
        check(lib().kt_moe_create(self.engine.handle, ctypes.byref(opts), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.max_tokens = max_tokens
        self.mode = mode
        self.bias = bool(bias)
        self.lora_targets = tuple(lora_targets) if mode == "lora" else ()
        self.weight_format = weight_format
        self.compute = compute
        self._bound = {}  # id name -> DLView kt retains
        self.live_contexts = 0  # Contexts of this layer not yet released
        # Where the base weights came from when they were not passed as
        # tensors: ("packed", path) or ("checkpoint", directory, layer).
        self.weights_source = None

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the layer was closed")
        return self._handle

    def close(self):
        if self._handle:
            self._lib.kt_moe_destroy(self._handle)
            self._handle = None
            self._bound.clear()
            self.live_contexts = 0  # destroying the layer freed them

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kt_moe_destroy(self._handle)
            self._handle = None

    def info(self):
        """The layer's settings as kt reports them (kt_moe_get_info):
        weight_format, weight_bytes (the stored base, scales included),
        num_weights, num_loaded, shapes and mode."""
        i = _capi.MoeInfo()
        i.struct_size = ctypes.sizeof(i)
        check(lib().kt_moe_get_info(self.handle, ctypes.byref(i)))
        return {"num_experts": i.num_experts, "top_k": i.top_k, "hidden": i.hidden,
                "intermediate": i.intermediate, "max_tokens": i.max_tokens,
                "mode": {v: k for k, v in MODES.items()}.get(i.mode, str(i.mode)),
                "weight_format": _FORMAT_NAMES.get(i.weight_format, str(i.weight_format)),
                "weight_bytes": i.weight_bytes, "num_weights": i.num_weights, "num_loaded": i.num_loaded,
                "compute": {v: k for k, v in _capi.COMPUTES.items()}.get(i.compute, str(i.compute))}

    def lora_scale(self):
        s = ctypes.c_float()
        check(lib().kt_moe_lora_scale(self.handle, ctypes.byref(s)))
        return s.value

    def load_weights(self, *, gate=None, up=None, down=None, gate_up=None, bias_gate=None,
                     bias_up=None, bias_down=None, bias_gate_up=None, expert_map=None,
                     orientation="out_in", interleaved=False):
        """Packs stacked expert weights ([E or P, out, in], or [.., in, out]
        with orientation="in_out"); tensors are borrowed for the call."""
        pairs = [(n, t) for n, t in (
            ("W_GATE", gate), ("W_UP", up), ("W_DOWN", down), ("W_GATE_UP", gate_up),
            ("B_GATE", bias_gate), ("B_UP", bias_up), ("B_DOWN", bias_down),
            ("B_GATE_UP", bias_gate_up), ("EXPERT_MAP", expert_map)) if t is not None]
        arr, views = _args(pairs)
        check(lib().kt_moe_load_weights(self.handle, ctypes.byref(self._load_options(
            orientation, interleaved)), arr, len(pairs)))
        del views
        self.weights_source = None

    def load_expert(self, expert, *, gate=None, up=None, down=None, gate_up=None,
                    bias_gate=None, bias_up=None, bias_down=None, bias_gate_up=None,
                    orientation="out_in", interleaved=False):
        pairs = [(n, t) for n, t in (
            ("W_GATE", gate), ("W_UP", up), ("W_DOWN", down), ("W_GATE_UP", gate_up),
            ("B_GATE", bias_gate), ("B_UP", bias_up), ("B_DOWN", bias_down),
            ("B_GATE_UP", bias_gate_up)) if t is not None]
        arr, views = _args(pairs)
        check(lib().kt_moe_load_expert(self.handle, int(expert), ctypes.byref(self._load_options(
            orientation, interleaved)), arr, len(pairs)))
        del views
        self.weights_source = None

    @staticmethod
    def _load_options(orientation, interleaved):
        lo = _capi.LoadOptions()
        lib().kt_load_options_defaults(ctypes.byref(lo), ctypes.sizeof(lo))
        if orientation not in ("out_in", "in_out"):
            raise ValueError("kt: orientation must be 'out_in' or 'in_out'")
        lo.orientation = _capi.ORIENT_IN_OUT if orientation == "in_out" else _capi.ORIENT_OUT_IN
        lo.gate_up_order = _capi.GATE_UP_INTERLEAVED if interleaved else _capi.GATE_UP_CONCAT
        return lo

    def read_weights(self, *, gate=None, up=None, down=None, bias_gate=None, bias_up=None,
                     bias_down=None):
        """Copies the base weights as kt computes with them into host tensors:
        gate, up [E,I,H], down [E,H,I], bias_* [E,out] (fp32/bf16/fp16); a
        bf16 destination gets the stored bits exactly."""
        pairs = [(n, t) for n, t in (("W_GATE", gate), ("W_UP", up), ("W_DOWN", down),
                                     ("B_GATE", bias_gate), ("B_UP", bias_up),
                                     ("B_DOWN", bias_down)) if t is not None]
        arr, views = _args(pairs)
        check(lib().kt_moe_read_weights(self.handle, arr, len(pairs)))
        del views

    def save_packed(self, path):
        """Writes the packed weights to one file (atomically replaced)."""
        check(lib().kt_moe_save_packed(self.handle, os.fsencode(path)))

    def load_packed(self, path, verify_checksums=True):
        """Replaces the weights with a packed cache's. In inference and LoRA
        mode the layer reads them from a read-only mapping of the file (no
        copy); in full mode they are copied."""
        flags = 0 if verify_checksums else _capi.PACKED_SKIP_CHECKSUMS
        check(lib().kt_moe_load_packed(self.handle, os.fsencode(path), flags))
        self.weights_source = ("packed", os.path.abspath(os.fspath(path)))

    def set_skipped(self, mask):
        view = DLView(mask)
        check(lib().kt_moe_set_skipped(self.handle, view.ptr))

    def num_loaded(self):
        n = ctypes.c_int64()
        check(lib().kt_moe_num_loaded(self.handle, ctypes.byref(n)))
        return n.value

    def bind(self, **tensors):
        """Binds parameters / gradient buffers by argument name (LORA_A_GATE,
        GRAD_W_DOWN, ...). kt retains them: the memory must stay alive and in
        place until rebound or the layer is closed; this object keeps a
        reference to each bound tensor for that reason."""
        pairs = list(tensors.items())
        arr, views = _args(pairs)
        check(lib().kt_moe_bind(self.handle, arr, len(pairs)))
        for (name, _), view in zip(pairs, views):
            self._bound[name] = view

    def params_changed(self):
        check(lib().kt_moe_params_changed(self.handle))

    def forward(self, x, ids, weights, y, save=False):
        """y = experts(x); returns a Context when save, else None."""
        arr, views = _args([("X", x), ("IDS", ids), ("ROUTE_WEIGHTS", weights), ("Y", y)])
        saved = ctypes.c_void_p()
        check(lib().kt_moe_forward(self.handle, arr, 4, ctypes.byref(saved) if save else None))
        del views
        if not save:
            return None
        return Context(self, saved)

    def forward_submit(self, x, ids, weights, y, deferred=False):
        """Starts y = experts(x) on the engine's job thread and returns at
        once with a Job (inference: nothing saved). The tensors are borrowed
        until the job ends: the Job keeps them alive; do not change x, ids or
        weights, nor read y, before ``wait()``. ``deferred``: the job does
        not start until ``run()`` or ``wait()`` (KT_SUBMIT_DEFERRED)."""
        arr, views = _args([("X", x), ("IDS", ids), ("ROUTE_WEIGHTS", weights), ("Y", y)])
        job = ctypes.c_void_p()
        check(lib().kt_moe_forward_submit(self.handle, arr, 4, None,
                                          _capi.SUBMIT_DEFERRED if deferred else 0, ctypes.byref(job)))
        return Job(self, job, (arr, views, x, ids, weights, y))

    def backward(self, ctx, dy, dx=None, droute_weights=None, *, grad_scale=1.0,
                 accumulate=False, param_grads=True):
        opts, arr, views, pairs = _backward_args(dy, dx, droute_weights, grad_scale, accumulate, param_grads)
        handle = ctx.handle if isinstance(ctx, Context) else ctx
        check(lib().kt_moe_backward(self.handle, handle, ctypes.byref(opts), arr, len(pairs)))
        del views
