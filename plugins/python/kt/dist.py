"""kt's exchange between ranks (kt_comm_*, kt_dist_*) on a host's process group.

``Communicator.from_process_group(group)`` builds kt's communicator on a
trainer's existing ``torch.distributed`` group: its ranks, its size, and its
store for the rendezvous (kt's Gloo then connects the ranks itself).
``DistMoE`` is one MoE layer over those ranks, in owner-rank mode (one rank
holds the experts and computes every rank's tokens) or expert-parallel mode
(experts sharded over the ranks). Every forward and backward is a collective:
all ranks call it, in the same order; an error on any rank is raised on every
rank with that rank's message.

``LayerOptimizer`` is kt's AdamW/SGD over a rank's local layer, and
``save_checkpoint`` / ``load_checkpoint`` write and read a distributed
checkpoint: each rank's experts, LoRA factors and optimizer state in one
directory published atomically, loadable by another world size or expert map.
"""
import ctypes
import datetime
import threading

from . import _capi
from .core import Context, MoE, _args, _backward_args, _Handle, check, default_engine, lib

DIST_MODES = {"owner": _capi.DIST_OWNER, "expert_parallel": _capi.DIST_EXPERT_PARALLEL}
GRAD_AVERAGES = {"sum": _capi.DIST_GRAD_SUM, "mean": _capi.DIST_GRAD_MEAN}


class _StoreCallbacks:
    """A key-value store (torch.distributed.Store: set(key, bytes), get(key))
    as kt_comm_store callbacks. A get that fails is 'not there yet'; kt asks
    again until its timeout."""

    def __init__(self, store):
        self._store = store

        def set_fn(key, value, size, user):
            try:
                self._store.set(key.decode(), ctypes.string_at(value, size))
                return 0
            except Exception:  # noqa: BLE001 (a callback must not raise into C)
                return -1

        def get_fn(key, buffer, capacity, size, user):
            try:
                value = self._store.get(key.decode())
            except Exception:  # noqa: BLE001
                return 1
            size[0] = len(value)
            ctypes.memmove(buffer, value, min(len(value), capacity))
            return 0

        self._set = _capi.STORE_SET_FN(set_fn)
        self._get = _capi.STORE_GET_FN(get_fn)
        self.struct = _capi.CommStore(self._set, self._get, None)


_group_counts = {}
_group_lock = threading.Lock()


class Communicator(_Handle):
    """A rank's kt communicator (kt_comm). ``store_path`` is a directory every
    rank reaches (Gloo's file store), ``store`` a torch.distributed.Store;
    give one. ``timeout`` (seconds) bounds the rendezvous and every
    collective."""

    def __init__(self, rank, world_size, *, backend="gloo", store_path=None, store=None, prefix="kt",
                 hostname="127.0.0.1", timeout=30.0):
        opts = _capi.CommOptions()
        lib().kt_comm_options_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.backend = backend.encode()
        opts.rank = int(rank)
        opts.world_size = int(world_size)
        opts.store_prefix = prefix.encode()
        opts.hostname = hostname.encode()
        opts.timeout_ms = max(1, int(timeout * 1000))
        callbacks = None
        if store_path is not None:
            opts.store_path = str(store_path).encode()
        if store is not None:
            callbacks = _StoreCallbacks(store)
            opts.store = ctypes.pointer(callbacks.struct)
        handle = ctypes.c_void_p()
        check(lib().kt_comm_create(ctypes.byref(opts), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        self.rank, self.world_size = int(rank), int(world_size)

    @classmethod
    def from_process_group(cls, group=None, *, timeout=30.0):
        """kt's communicator over the ranks of a torch.distributed group (the
        default group when None), meeting through the group's store. Every
        rank of the group calls it, in the same order as its other
        from_process_group calls on that group."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if group is None or group is c10d.GroupMember.WORLD:
            name = "world"
        else:
            name = "-".join(str(r) for r in sorted(c10d._pg_group_ranks[group]))
        with _group_lock:
            n = _group_counts.get(name, 0)
            _group_counts[name] = n + 1
        store = c10d._get_default_store()
        # kt polls the store: a short wait per get, the host's own restored after.
        previous = store.timeout
        store.set_timeout(datetime.timedelta(milliseconds=20))
        try:
            return cls(rank, world, store=store, prefix="kt/%s/%d" % (name, n), timeout=timeout)
        finally:
            store.set_timeout(previous)

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the communicator was closed")
        return self._handle

    def info(self):
        info = _capi.CommInfo()
        info.struct_size = ctypes.sizeof(info)
        check(lib().kt_comm_get_info(self.handle, ctypes.byref(info)))
        return {"rank": info.rank, "world_size": info.world_size, "timeout_ms": info.timeout_ms,
                "usable": bool(info.usable), "device": "cuda" if info.backends.device == _capi.KDL_CUDA else "cpu"}

    def barrier(self):
        check(lib().kt_comm_barrier(self.handle))

    def close(self):
        if self._handle:
            self._lib.kt_comm_destroy(self._handle)
            self._handle = None

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kt_comm_destroy(self._handle)
            self._handle = None


def parse_backend(backend):
    """What a backend string selects: {"cpu": ..., "cuda": ..., "device": ...}."""
    b = _capi.CommBackends()
    b.struct_size = ctypes.sizeof(b)
    check(lib().kt_comm_parse_backend(backend.encode(), ctypes.byref(b)))
    names = {_capi.COMM_BACKEND_NONE: None, _capi.COMM_BACKEND_GLOO: "gloo", _capi.COMM_BACKEND_NCCL: "nccl"}
    return {"cpu": names[b.cpu], "cuda": names[b.cuda], "device": "cuda" if b.device == _capi.KDL_CUDA else "cpu"}


class _LocalLayer(MoE):
    """The layer a DistMoE computes with on this rank; owned by the DistMoE."""

    def __init__(self, handle, owner, **shape):
        self._handle = handle
        self._lib = lib()
        self._owner = owner
        self._bound = {}
        for k, v in shape.items():
            setattr(self, k, v)

    def close(self):
        self._handle = None
        self._bound.clear()

    def __del__(self):
        self._handle = None


class DistContext(Context):
    """What a DistMoE forward saved for its backward (kt_dist_context)."""

    _RELEASE = "kt_dist_context_release"


class DistMoE(_Handle):
    """One MoE layer over a Communicator's ranks (kt_dist_moe). Shapes and
    layer options are MoE's (max_tokens per rank); every rank passes the
    same. mode "owner": rank owner_rank holds the layer (``.layer``; other
    ranks have None and never load weights); "expert_parallel": each rank
    holds its experts (``local_experts()``, global ids in local order; an
    even split, or expert_ranks[e] = rank of expert e). grad_average "mean"
    multiplies parameter gradients by 1/world_size (DDP's average)."""

    def __init__(self, comm, num_experts, top_k, hidden, intermediate, *, max_tokens=1024, mode="owner",
                 owner_rank=0, grad_average="sum", expert_ranks=None, engine=None, activation="silu",
                 act_alpha=1.702, act_limit=0.0, bias=False, layer_mode="inference", lora_rank=16,
                 lora_alpha=32.0, use_rslora=False, lora_targets=("gate", "up", "down"), weight_format="bf16"):
        from .core import ACTIVATIONS, MODES, PROJECTIONS, weight_format_code
        if mode not in DIST_MODES:
            raise ValueError("kt: mode must be one of %s" % ", ".join(DIST_MODES))
        if grad_average not in GRAD_AVERAGES:
            raise ValueError("kt: grad_average must be one of %s" % ", ".join(GRAD_AVERAGES))
        if activation not in ACTIVATIONS or layer_mode not in MODES:
            raise ValueError("kt: activation or layer_mode unknown")
        lo = _capi.MoeOptions()
        lib().kt_moe_options_defaults(ctypes.byref(lo), ctypes.sizeof(lo))
        lo.num_experts, lo.top_k, lo.hidden, lo.intermediate = num_experts, top_k, hidden, intermediate
        lo.max_tokens = max_tokens
        lo.activation = ACTIVATIONS[activation]
        lo.act_alpha, lo.act_limit = act_alpha, act_limit
        lo.has_bias = 1 if bias else 0
        lo.mode = MODES[layer_mode]
        lo.weight_format = weight_format_code(weight_format)
        if layer_mode == "lora":
            lo.lora_rank, lo.lora_alpha, lo.use_rslora = lora_rank, lora_alpha, 1 if use_rslora else 0
            lo.lora_targets = sum(PROJECTIONS[p] for p in lora_targets)
        do = _capi.DistMoeOptions()
        lib().kt_dist_moe_options_defaults(ctypes.byref(do), ctypes.sizeof(do))
        do.mode = DIST_MODES[mode]
        do.owner_rank = owner_rank
        do.grad_average = GRAD_AVERAGES[grad_average]
        ranks = None
        if expert_ranks is not None:
            ranks = (ctypes.c_int32 * num_experts)(*[int(r) for r in expert_ranks])
            do.expert_ranks = ctypes.cast(ranks, ctypes.POINTER(ctypes.c_int32))
        computes = mode == "expert_parallel" or comm.rank == owner_rank
        self.engine = (engine or default_engine()) if computes else None
        handle = ctypes.c_void_p()
        check(lib().kt_dist_moe_create(comm.handle, self.engine.handle if self.engine else None,
                                       ctypes.byref(lo), ctypes.byref(do), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        self.live_contexts = 0  # DistContexts not yet released
        self.comm = comm  # kt retains it too; this keeps the Python object
        self.mode = mode
        local = ctypes.c_void_p()
        check(lib().kt_dist_moe_layer(handle, ctypes.byref(local)))
        experts = self.local_experts()
        self.layer = None
        if local.value:
            self.layer = _LocalLayer(local, self, num_experts=len(experts), hidden=hidden,
                                     intermediate=intermediate, mode=layer_mode, bias=bool(bias),
                                     top_k=top_k if mode == "owner" else 1,
                                     max_tokens=max_tokens * comm.world_size * (1 if mode == "owner" else top_k),
                                     lora_targets=tuple(lora_targets) if layer_mode == "lora" else ())

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the distributed layer was closed")
        return self._handle

    def local_experts(self):
        count = ctypes.c_int64()
        check(lib().kt_dist_moe_local_experts(self.handle, None, 0, ctypes.byref(count)))
        arr = (ctypes.c_int64 * max(count.value, 1))()
        check(lib().kt_dist_moe_local_experts(self.handle, arr, count.value, ctypes.byref(count)))
        return list(arr[:count.value])

    def forward(self, x, ids, weights, y, save=False):
        """y = experts(x) for this rank's tokens (collective); a DistContext when save."""
        arr, views = _args([("X", x), ("IDS", ids), ("ROUTE_WEIGHTS", weights), ("Y", y)])
        saved = ctypes.c_void_p()
        check(lib().kt_dist_moe_forward(self.handle, arr, 4, ctypes.byref(saved) if save else None))
        del views
        return DistContext(self, saved) if save else None

    def backward(self, ctx, dy, dx=None, droute_weights=None, *, grad_scale=1.0, accumulate=False,
                 param_grads=True):
        """Backward of ctx's forward (collective; every rank passes its context of the same forward)."""
        opts, arr, views, pairs = _backward_args(dy, dx, droute_weights, grad_scale, accumulate, param_grads)
        check(lib().kt_dist_moe_backward(self.handle, ctx.handle, ctypes.byref(opts), arr, len(pairs)))
        del views

    def close(self):
        if self._handle:
            if self.layer is not None:
                self.layer.close()
            self._lib.kt_dist_moe_destroy(self._handle)
            self._handle = None
            self.live_contexts = 0  # destroying the layer freed them

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kt_dist_moe_destroy(self._handle)
            self._handle = None


class LayerOptimizer(_Handle):
    """kt's fused AdamW or SGD over a layer's bound trainable parameters
    (kt_optimizer_create_for_layer): a DistMoE's ``.layer`` or a kt.MoE.
    Options are kt_optimizer_options' fields (lr, weight_decay, betas,
    eps, amsgrad, momentum, dampening, nesterov, and arithmetic: "torch1"
    or "torch2", whose AdamW operation order the steps reproduce)."""

    def __init__(self, layer, algorithm="adamw", *, lr=1e-3, weight_decay=None, betas=(0.9, 0.999), eps=1e-8,
                 amsgrad=False, momentum=0.0, dampening=0.0, nesterov=False, arithmetic="torch1"):
        if algorithm not in ("adamw", "sgd"):
            raise ValueError("kt: algorithm must be 'adamw' or 'sgd'")
        if arithmetic not in ("torch1", "torch2"):
            raise ValueError("kt: arithmetic must be 'torch1' or 'torch2'")
        o = _capi.OptimizerOptions()
        lib().kt_optimizer_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.algorithm = _capi.OPTIM_ADAMW if algorithm == "adamw" else _capi.OPTIM_SGD
        o.lr, o.eps, o.momentum, o.dampening = lr, eps, momentum, dampening
        o.beta1, o.beta2 = betas
        o.amsgrad, o.nesterov = int(bool(amsgrad)), int(bool(nesterov))
        o.arithmetic = _capi.OPTIM_TORCH2 if arithmetic == "torch2" else _capi.OPTIM_TORCH1
        if weight_decay is not None:
            o.weight_decay = weight_decay
        elif algorithm == "sgd":
            o.weight_decay = 0.0
        handle = ctypes.c_void_p()
        check(lib().kt_optimizer_create_for_layer(layer.handle, ctypes.byref(o), ctypes.byref(handle)))
        self._handle = handle
        self._lib = lib()
        self.layer = layer  # the layer must outlive its optimizer

    @property
    def handle(self):
        if not self._handle:
            raise ValueError("kt: the optimizer was closed")
        return self._handle

    def step(self):
        check(lib().kt_optimizer_step(self.handle, None))

    @property
    def steps(self):
        n = ctypes.c_int64()
        check(lib().kt_optimizer_get_step(self.handle, ctypes.byref(n)))
        return n.value

    def close(self):
        if self._handle:
            self._lib.kt_optimizer_destroy(self._handle)
            self._handle = None

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kt_optimizer_destroy(self._handle)
            self._handle = None


def _checkpoint_call(fn, comm, path, layers, parts, progress):
    entries = []
    for number, entry in sorted(layers.items()):
        layer, opt = entry if isinstance(entry, tuple) else (entry, None)
        entries.append(_capi.DistCkptLayer(int(number), layer.handle.value,
                                           opt.handle.value if opt is not None else None))
    arr = (_capi.DistCkptLayer * max(len(entries), 1))(*entries)
    o = _capi.DistCkptOptions()
    lib().kt_dist_ckpt_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
    if parts is not None:
        unknown = set(parts) - set(_capi.DIST_CKPT_PARTS)
        if unknown or not parts:
            raise ValueError("kt: parts must be a non-empty set of %s" % ", ".join(_capi.DIST_CKPT_PARTS))
        o.parts = sum(_capi.DIST_CKPT_PARTS[p] for p in set(parts))
    callback = None
    if progress is not None:
        callback = _capi.CKPT_PROGRESS_FN(lambda done, total, user: progress(done, total))
        o.progress = callback
    check(fn(comm.handle, str(path).encode(), arr, len(entries), ctypes.byref(o)))


def save_checkpoint(comm, path, layers, *, parts=None, progress=None):
    """Saves a distributed checkpoint (collective: every rank of comm calls
    it with the same path and layer numbers). layers maps each layer number
    to this rank's DistMoE, or to (DistMoE, LayerOptimizer or None). parts:
    None (what the layers have) or a set of "weights", "adapter",
    "optimizer". progress(done_bytes, total_bytes) is called on this rank."""
    _checkpoint_call(lib().kt_dist_ckpt_save, comm, path, layers, parts, progress)


def load_checkpoint(comm, path, layers, *, parts=None, progress=None):
    """Loads a distributed checkpoint into layers (collective, as
    save_checkpoint); the world size and expert map may differ from the
    saving ranks'. LoRA factors go into the tensors bound to each local
    layer; optimizer state into the given LayerOptimizers."""
    _checkpoint_call(lib().kt_dist_ckpt_load, comm, path, layers, parts, progress)
