"""Puts kt under the routed experts of HF-shaped MoE models.

Blocks are recognised by their module structure, never by importing
transformers:

* per-expert lists: ``<block>.experts[e].{gate_proj, up_proj, down_proj}``
  (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, ...) or
  ``<block>.experts[e].{w1, w3, w2}`` (Mixtral), routed by ``<block>.gate``.
  The gate either returns router logits (softmax, top-k, optional
  ``norm_topk_prob`` renormalisation, as Qwen/Mixtral do; the block then
  returns ``(hidden, router_logits)``) or the routing itself as
  ``(topk_idx, topk_weight, ...)`` (DeepSeek; the block returns ``hidden``).
  Shared experts (``shared_expert`` + ``shared_expert_gate``, or
  ``shared_experts``) stay torch modules.
* fused experts modules: ``<block>.experts.gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I] called as ``experts(hidden, top_k_index,
  top_k_weights)`` (transformers v5), and the gpt-oss form ([E, H, 2I]
  interleaved, biases, clamped swiglu, dense [N, E] routing weights).

Routers, shared experts, attention and everything else stay in torch.
"""
import json
import math
import os
import re
import warnings

import torch
from torch import nn
import torch.nn.functional as F

from . import _hf_names, _safetensors
from ._progress import LoadProgress
from .checkpoint import Checkpoint, read_packed_manifest
from .torch import MoEExperts

_PER_EXPERT_NAMES = {
    "qwen": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# PEFT target_modules names -> kt projections
_TARGET_ALIASES = {"gate_proj": ("gate",), "w1": ("gate",), "gate": ("gate",),
                   "up_proj": ("up",), "w3": ("up",), "up": ("up",),
                   "down_proj": ("down",), "w2": ("down",), "down": ("down",),
                   "gate_up_proj": ("gate", "up")}


def _is_silu(act):
    if act is F.silu or isinstance(act, nn.SiLU):
        return True
    return type(act).__name__ in ("SiLU", "SiLUActivation")


def _top_k(block):
    for owner in (block, getattr(block, "gate", None), getattr(block, "router", None),
                  getattr(block, "config", None)):
        for attr in ("top_k", "num_experts_per_tok"):
            v = getattr(owner, attr, None) if owner is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return None


def _lora_targets(target_modules):
    if target_modules is None:
        return ("gate", "up", "down")
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    out = []
    for name in target_modules:
        # PEFT's target_parameters form names a path ("mlp.experts.gate_up_proj").
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in _TARGET_ALIASES:
            raise ValueError("kt.hf: unknown target module %r; use gate_proj/up_proj/down_proj, "
                             "w1/w3/w2, gate_up_proj/down_proj (fused, gpt-oss) or gate/up/down"
                             % (name,))
        for p in _TARGET_ALIASES[leaf]:
            if p not in out:
                out.append(p)
    return tuple(p for p in ("gate", "up", "down") if p in out)


def _per_expert_naming(experts):
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        return None
    for naming, names in _PER_EXPERT_NAMES.items():
        if all(isinstance(getattr(experts[0], n, None), nn.Linear) for n in names):
            return naming
    return None


def _is_fused(experts):
    gu, d = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(d, torch.Tensor) and gu.dim() == 3 \
        and d.dim() == 3


class KtSparseMoeBlock(nn.Module):
    """A per-expert-list MoE block whose routed experts run in kt; router and
    shared experts are the original block's modules."""

    def __init__(self, block, experts, norm_topk_prob, top_k):
        super().__init__()
        self.gate = block.gate
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            setattr(self, name, getattr(block, name, None))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:
            h = h * torch.empty_like(h).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        routed = self.gate(h)
        logits = None
        if isinstance(routed, (tuple, list)):
            ids, weights = routed[0], routed[1]
            if ids.is_floating_point():
                ids, weights = weights, ids
        else:
            logits = routed
            probs = F.softmax(logits, dim=1, dtype=torch.float)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(h.dtype)
        y = self.experts(h, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(h)) * shared
            y = y + shared
        if self.shared_experts is not None:
            y = y + self.shared_experts(h)
        y = y.reshape(shape)
        return (y, logits) if logits is not None else y


class KtFusedExperts(MoEExperts):
    """Stands in for a fused experts module: experts(hidden [N,H], top_k_index
    [N,k], top_k_weights [N,k] or dense [N,E]) -> [N,H]. Its state_dict keeps
    the fused module's names (gate_up_proj, down_proj)."""

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
        ids = top_k_index if top_k_index is not None else kwargs.get("router_indices")
        weights = top_k_weights if top_k_weights is not None else kwargs.get("routing_weights")
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        ids = ids.reshape(h.shape[0], -1)
        weights = weights.reshape(h.shape[0], -1)
        if weights.shape[1] != ids.shape[1]:  # dense scores over all experts (gpt-oss)
            weights = weights.gather(1, ids.long())
        if weights.dtype not in (torch.float32, torch.bfloat16):
            weights = weights.float()
        return super().forward(h, ids, weights).reshape(shape)


def _make_experts(E, k, H, I, options, cls=MoEExperts, **layer_kw):
    kw = {k_: v for k_, v in options.items() if k_ != "placement"}
    kw.update(layer_kw)
    return cls(E, k, H, I, **kw)


def hottest_experts(counts, n):
    """The n experts with the largest routing counts (ties: lower id first),
    in increasing id order."""
    counts = torch.as_tensor(counts).detach().to("cpu", torch.float64).reshape(-1)
    if not 0 <= n <= counts.numel():
        raise ValueError("kt.hf: cannot pick %d of %d experts" % (n, counts.numel()))
    order = sorted(range(counts.numel()), key=lambda e: (-float(counts[e]), e))
    return tuple(sorted(order[:n]))


class _Placement:
    """Which experts of each block torch computes (hybrid placement)."""

    def __init__(self, torch_experts, counts, device):
        if counts is not None and not isinstance(torch_experts, int):
            raise ValueError("kt.hf: torch_expert_counts picks the torch_experts=N hottest experts; "
                             "give N as an int")
        if torch_experts is not None and not isinstance(torch_experts, int):
            torch_experts = tuple(int(e) for e in torch_experts)
        elif isinstance(torch_experts, int) and torch_experts < 0:
            raise ValueError("kt.hf: torch_experts must be >= 0")
        self.spec, self.counts, self.device = torch_experts, counts, device

    def ids(self, E, layer, block_name):
        if not self.spec:
            return ()
        if not isinstance(self.spec, int):
            if any(e < 0 or e >= E for e in self.spec):
                raise ValueError("kt.hf: %s: torch_experts %s are not all in [0, %d)"
                                 % (block_name, list(self.spec), E))
            return self.spec
        if self.spec > E:
            raise ValueError("kt.hf: %s: torch_experts=%d but the block has %d experts"
                             % (block_name, self.spec, E))
        if self.counts is None:
            return tuple(range(self.spec))
        return hottest_experts(self._counts_of(E, layer, block_name), self.spec)

    def _counts_of(self, E, layer, block_name):
        counts = self.counts
        if isinstance(counts, dict):
            for key in (block_name, layer):
                if key in counts:
                    counts = counts[key]
                    break
            else:
                raise ValueError("kt.hf: torch_expert_counts has no entry for %s (layer %s)"
                                 % (block_name, layer))
        counts = torch.as_tensor(counts)
        if counts.dim() == 2:
            if layer is None or layer >= counts.shape[0]:
                raise ValueError("kt.hf: %s: torch_expert_counts [%d, %d] has no row for layer %s"
                                 % (block_name, counts.shape[0], counts.shape[1], layer))
            counts = counts[layer]
        if counts.dim() != 1 or counts.shape[0] != E:
            raise ValueError("kt.hf: %s: torch_expert_counts must be [E=%d] or [layers, E], not %s"
                             % (block_name, E, tuple(counts.shape)))
        return counts

    def apply(self, experts, block, block_name, dtype):
        ids = self.ids(experts.num_experts, _layer_number(block_name), block_name)
        if ids:
            device = self.device if self.device is not None else _router_device(block)
            experts.set_torch_experts(ids, device=device,
                                      dtype=dtype if dtype in (torch.float32, torch.bfloat16,
                                                               torch.float16) else torch.float32)


def _router_device(block):
    """Where the block's own (non-expert) parameters live: the host's device."""
    for name, p in block.named_parameters():
        if not name.startswith("experts.") and p.device.type != "meta":
            return p.device
    return torch.device("cpu")


class _WeightSource:
    """Where replaced blocks get their expert weights when the model holds
    none (built on the meta device): a checkpoint directory (or an open
    kt.Checkpoint) or a packed cache written by `kt-moe convert`."""

    def __init__(self, checkpoint, packed, dequantize=False, progress=None):
        if checkpoint is not None and packed is not None:
            raise ValueError("kt.hf: give checkpoint= or packed=, not both")
        if dequantize and checkpoint is None:
            raise ValueError("kt.hf: dequantize=True applies to the layers loaded from checkpoint= (a packed "
                             "cache holds its own weight_format)")
        self.ckpt, self.owned, self.packed = None, False, None
        self.dequantize = bool(dequantize)
        if isinstance(checkpoint, Checkpoint):
            self.ckpt = checkpoint
        elif checkpoint is not None:
            self.ckpt, self.owned = Checkpoint(checkpoint), True
        if packed is not None:
            self.packed = read_packed_manifest(packed)
            self.packed_dir = os.fspath(packed)
        self.show_progress, self._progress = progress, None

    def __bool__(self):
        return self.ckpt is not None or self.packed is not None

    @property
    def progress(self):
        """The load's progress line, made at the first layer loaded."""
        if self._progress is None:
            if self.ckpt is not None:
                where, layers = self.ckpt.directory, len(self.ckpt.layers)
                total = sum(info["bytes"] for info in self.ckpt.layers.values())
            else:
                where, layers = self.packed_dir, len(self.packed)
                total = sum(os.path.getsize(p) for p in self.packed.values())
            self._progress = LoadProgress("kt.hf: experts from %s" % where, layers, total, enabled=self.show_progress)
        return self._progress

    def close(self):
        if self._progress is not None:
            self._progress.close()
        if self.owned:
            self.ckpt.close()

    def fill(self, experts, layer, block_name):
        if layer is None:
            raise ValueError("kt.hf: %s: no layer number in the module name (layers.<L>.), so "
                             "its checkpoint tensors are unknown" % block_name)
        if self.packed is not None:
            if layer not in self.packed:
                raise ValueError("kt.hf: %s: the packed cache %s has no layer %d" %
                                 (block_name, self.packed_dir, layer))
            if experts.mode == "full":
                raise ValueError("kt.hf: full mode trains torch copies of the weights; load them "
                                 "from the checkpoint directory (checkpoint=) instead of packed=")
            experts.kt_layer.load_packed(self.packed[layer])
            self.progress.layer_done(os.path.getsize(self.packed[layer]))
            return
        if layer not in self.ckpt.layers:
            raise ValueError("kt.hf: %s: checkpoint %s has no MoE layer %d (it has %s)" % (
                block_name, self.ckpt.directory, layer, sorted(self.ckpt.layers)))
        if experts.mode == "full":
            with torch.no_grad():
                kw = dict(gate=experts.w_gate, up=experts.w_up, down=experts.w_down)
                if experts.has_bias:
                    kw.update(bias_gate=experts.b_gate, bias_up=experts.b_up, bias_down=experts.b_down)
                self.ckpt.read_layer(layer, **{k: v.data for k, v in kw.items()})
            experts._needs_reload = True
        else:
            self.ckpt.load_layer(layer, experts.kt_layer, dequantize=self.dequantize,
                                 progress=(lambda done, total: self.progress.update(done / max(total, 1)))
                                 if self.progress.shown else None)
        self.progress.layer_done(self.ckpt.layers[layer]["bytes"])


def _layer_number(name):
    found = re.findall(r"(?:^|\.)layers\.(\d+)(?=\.|$)", name)
    return int(found[-1]) if found else None


def _on_meta(*tensors):
    return any(t is not None and t.device.type == "meta" for t in tensors)


def _replace_per_expert(block, naming, options, norm_default, source=None, block_name=""):
    names = _PER_EXPERT_NAMES[naming]
    experts = block.experts
    first = experts[0]
    act = getattr(first, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise ValueError("kt.hf: expert activation %s is not SiLU" % type(act).__name__)
    gate0 = getattr(first, names[0])
    I, H = gate0.weight.shape
    k = _top_k(block)
    if k is None:
        raise ValueError("kt.hf: cannot find the block's top_k")
    bias = gate0.bias is not None
    kt_experts = _make_experts(len(experts), k, H, I, options, bias=bias)
    kt_experts.hf_naming = naming
    if source:
        source.fill(kt_experts, _layer_number(block_name), block_name)
        options["placement"].apply(kt_experts, block, block_name, gate0.weight.dtype)
        return KtSparseMoeBlock(block, kt_experts, bool(getattr(block, "norm_topk_prob", norm_default)), k)
    if _on_meta(gate0.weight):
        raise ValueError("kt.hf: %s: the experts are on the meta device; pass checkpoint= or "
                         "packed= to load them" % block_name)
    for e, expert in enumerate(experts):
        g, u, d = (getattr(expert, n) for n in names)
        kw = dict(gate=g.weight, up=u.weight, down=d.weight)
        if bias:
            kw.update(bias_gate=g.bias, bias_up=u.bias, bias_down=d.bias)
        kt_experts.load_expert(e, **kw)
    options["placement"].apply(kt_experts, block, block_name, gate0.weight.dtype)
    norm = getattr(block, "norm_topk_prob", norm_default)
    return KtSparseMoeBlock(block, kt_experts, bool(norm), k)


def _replace_fused(block, options, orientation, source=None, block_name=""):
    ex = block.experts
    gu, down = ex.gate_up_proj, ex.down_proj
    E = gu.shape[0]
    oss = hasattr(ex, "gate_up_proj_bias") or hasattr(ex, "limit")
    if orientation is None:
        # out_in: gate_up [E, 2I, H], down [E, H, I]; in_out: [E, H, 2I], [E, I, H]
        if gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]:
            orientation = "out_in"
        elif gu.shape[2] == 2 * down.shape[1] and gu.shape[1] == down.shape[2]:
            orientation = "in_out"
        else:
            raise ValueError("kt.hf: fused expert shapes %s / %s do not fit together"
                             % (tuple(gu.shape), tuple(down.shape)))
    if orientation == "out_in":
        I, H = gu.shape[1] // 2, gu.shape[2]
    else:
        H, I = gu.shape[1], gu.shape[2] // 2
    k = _top_k(block)
    if k is None:
        raise ValueError("kt.hf: cannot find the block's top_k")
    layer_kw = {}
    if oss:
        layer_kw = dict(activation="swiglu_oai", act_alpha=float(getattr(ex, "alpha", 1.702)),
                        act_limit=float(getattr(ex, "limit", 7.0)),
                        bias=hasattr(ex, "gate_up_proj_bias"))
    else:
        act = getattr(ex, "act_fn", None)
        if act is not None and not _is_silu(act):
            raise ValueError("kt.hf: expert activation %s is not SiLU" % type(act).__name__)
    kt_experts = _make_experts(E, k, H, I, options, cls=KtFusedExperts, **layer_kw)
    kt_experts.hf_naming = ("gpt_oss" if oss else "fused") + ("_in_out" if orientation == "in_out" else "")
    # How PEFT reads the fused parameters of this module (see kt._hf_names).
    kt_experts.peft_in_out = bool(getattr(ex, "is_transposed", False))
    if source:
        source.fill(kt_experts, _layer_number(block_name), block_name)
        options["placement"].apply(kt_experts, block, block_name, gu.dtype)
        return kt_experts
    if _on_meta(gu, down):
        raise ValueError("kt.hf: %s: the experts are on the meta device; pass checkpoint= or "
                         "packed= to load them" % block_name)
    kw = dict(gate_up=gu.detach(), down=down.detach(), orientation=orientation, interleaved=oss)
    if layer_kw.get("bias"):
        kw.update(bias_gate_up=ex.gate_up_proj_bias.detach(), bias_down=ex.down_proj_bias.detach())
    kt_experts.load_weights(**kw)
    options["placement"].apply(kt_experts, block, block_name, gu.dtype)
    return kt_experts


def replace_moe_experts(model, *, mode="inference", lora_rank=16, lora_alpha=32.0,
                        lora_dropout=0.0, use_rslora=False, target_modules=None,
                        param_dtype=torch.float32, max_tokens=1024, engine=None,
                        fused_orientation=None, checkpoint=None, packed=None, strict=False,
                        bias="none", activation_policy="recompute", torch_experts=None,
                        torch_expert_counts=None, torch_experts_device=None, weight_format="bf16",
                        compute="bf16", dequantize=False, progress=None):
    """Moves the routed experts of every recognised MoE block of ``model``
    into kt, in place. ``mode`` is "inference", "lora" (PEFT-style
    ``lora_rank``/``lora_alpha``/``use_rslora``/``target_modules``) or
    "full". Returns the qualified names of the replaced modules. The original
    expert weights are dropped once kt holds them.

    With ``checkpoint`` (a checkpoint directory or a kt.Checkpoint) or
    ``packed`` (a directory written by `kt-moe convert`), each block's weights
    come from layer L of that source, L being the number in the block's name
    (``...layers.<L>...``), and never pass through torch: build the model
    with its routed experts on the meta device (``with torch.device("meta")``
    or accelerate's ``init_empty_weights``). Full mode reads them into its
    torch Parameters, so it needs the checkpoint directory.

    A module that looks like an MoE block (it has ``experts``) but is not
    recognised is reported with a warning, or raises ValueError with
    ``strict=True``.

    ``bias`` is PEFT's LoRA bias setting; kt's LoRA mode keeps expert biases
    frozen, so only "none" is accepted there.

    ``activation_policy="retain"`` makes gradient checkpointing keep the
    experts' activations of the first forward for the recompute instead of
    computing the experts twice (see kt.torch.MoEExperts).

    Hybrid placement (the leading engine's ``kt_num_gpu_experts``):
    ``torch_experts`` keeps some experts of every block in torch on
    ``torch_experts_device`` (default: where the block's router is, i.e. the
    host's GPU) and the rest in kt: an int N takes the first N experts, or
    with ``torch_expert_counts`` (routing counts [E], [layers, E] indexed by
    the layer number, or a dict by layer number or block name) the N most
    routed ones (see ``hottest_experts``); a sequence gives the ids. See
    MoEExperts.set_torch_experts for how the two parts share parameters
    and gradients.

    ``weight_format`` is how kt stores the frozen base: "bf16", or quantized
    at load, "int8_channel", "int4_g32" or "int4_g128" (inference and LoRA
    mode; the error is stated in kt_c_api.h). A ``packed`` cache must hold
    that format (``kt-moe convert --format``); the checkpoint formats
    ("fp8_b128", "mxfp4", asymmetric "int4_g32_zp", "int4_g128_zp") come
    only from such a cache of a quantized checkpoint. ``compute="int8"``
    serves an integer base ("int8_channel", "int4_g32", "int4_g128", or with
    zero points "int4_g32_zp", "int4_g128_zp", or "mxfp4") with int8
    activations (inference mode under torch.no_grad(); faster prefill on
    AVX512-VNNI, about 1-2.5 % relative error in y, stated in kt_c_api.h).

    A quantized ``checkpoint`` (fp8 blocks, int4 groups, mxfp4; see
    ``kt.Checkpoint(dir).layers[L]["weight_format"]``) loads as stored when
    ``weight_format`` is its format. Into the default "bf16" it loads only
    with ``dequantize=True`` (each weight dequantized and rounded to bf16
    once; kt.Checkpoint.load_layer); without it the load raises
    kt.UnsupportedError. It is never re-quantized into another quantized
    format. Full mode reads the weights dequantized into its torch
    Parameters whatever ``dequantize`` says. ``dequantize`` needs
    ``checkpoint``.

    ``progress``: a line on stderr while the experts load from ``checkpoint``
    or ``packed`` (layers and bytes done, the rate, the time left); None
    (default) shows it when stderr is a terminal and $KT_PROGRESS is not 0,
    True always, False never."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError("kt.hf: bias must be 'none', 'all' or 'lora_only' (PEFT's values)")
    if bias != "none" and mode == "lora":
        raise ValueError("kt.hf: bias=%r (training the expert biases) is not supported in LoRA mode: "
                         "kt keeps base weights and biases frozen there. Use mode='full' to train the "
                         "expert biases (with the weights), or bias='none'" % (bias,))
    options = dict(mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                   lora_dropout=lora_dropout, use_rslora=use_rslora,
                   lora_targets=_lora_targets(target_modules), param_dtype=param_dtype,
                   max_tokens=max_tokens, engine=engine, activation_policy=activation_policy,
                   placement=_Placement(torch_experts, torch_expert_counts, torch_experts_device),
                   weight_format=weight_format, compute=compute)
    source = _WeightSource(checkpoint, packed, dequantize, progress)
    replaced, unrecognised = [], []
    try:
        for name, module in list(model.named_modules()):
            if any(name.startswith(r + ".") or name == r for r in replaced):
                continue
            experts = getattr(module, "experts", None)
            if experts is None or isinstance(module, (KtSparseMoeBlock, MoEExperts)) \
                    or isinstance(experts, MoEExperts):
                continue
            naming = _per_expert_naming(experts)
            if naming is not None and isinstance(getattr(module, "gate", None), nn.Module):
                new = _replace_per_expert(module, naming, options, norm_default=(naming == "mixtral"),
                                          source=source, block_name=name)
                _set_child(model, name, new)
                replaced.append(name)
            elif _is_fused(experts):
                module.experts = _replace_fused(module, options, fused_orientation, source=source,
                                                block_name=name)
                replaced.append(name + ".experts" if name else "experts")
            else:
                reason = _why_not_recognised(module, experts)
                if reason:
                    unrecognised.append("%s: %s" % (name or type(module).__name__, reason))
    finally:
        source.close()
    if unrecognised:
        text = ("kt.hf: %d MoE-looking block(s) not replaced (their experts stay in torch):\n  %s"
                % (len(unrecognised), "\n  ".join(unrecognised)))
        if strict:
            raise ValueError(text)
        warnings.warn(text, UnrecognisedMoEWarning, stacklevel=2)
    return replaced


class UnrecognisedMoEWarning(UserWarning):
    """A module with routed experts that kt.hf does not know how to replace."""


def _why_not_recognised(module, experts):
    """Why a module with an ``experts`` attribute was not replaced, or None
    when it does not look like an MoE block at all."""
    if isinstance(experts, nn.ModuleList):
        if len(experts) == 0:
            return None
        children = sorted(n for n, _ in experts[0].named_children())
        if _per_expert_naming(experts) is not None:
            return "experts match %s but the block has no gate module" % (
                "/".join(_PER_EXPERT_NAMES[_per_expert_naming(experts)]))
        return ("experts[0] has %s, not gate_proj/up_proj/down_proj or w1/w3/w2 (nn.Linear)"
                % (", ".join(children) or "no submodules"))
    if isinstance(experts, nn.Module):
        stacked = sorted(n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3)
        if stacked:
            return ("experts hold stacked %s, not gate_up_proj [E,2I,H] + down_proj [E,H,I]"
                    % ", ".join(stacked))
    return None


def kt_experts_modules(model):
    """Every MoEExperts inside model (e.g. to count or inspect them)."""
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def _set_child(model, qualified, new):
    if not qualified:
        raise ValueError("kt.hf: the model itself is an MoE block; wrap it in a module")
    parent_name, _, child = qualified.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _lora_layers(model):
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEExperts) and m.mode == "lora"]
    if not layers:
        raise ValueError("kt.hf: the model has no kt experts in LoRA mode")
    first = layers[0][1]
    for name, m in layers:
        if (m.lora_rank, m._init_kwargs["lora_alpha"], m._init_kwargs["use_rslora"], m.lora_targets) != (
                first.lora_rank, first._init_kwargs["lora_alpha"], first._init_kwargs["use_rslora"],
                first.lora_targets):
            raise ValueError("kt.hf: %s has other LoRA settings than %s; one adapter has one r, alpha "
                             "and target set" % (name, layers[0][0]))
    if len({_hf_names.is_fused(m.hf_naming) for _, m in layers}) > 1:
        raise ValueError("kt.hf: the model mixes per-expert and fused expert blocks; PEFT's config "
                         "gives them one rank, which kt's factors of the two do not share")
    return layers


def _peft_parts(model):
    """(the model PEFT wraps, or model itself; PEFT's LoraConfig of the
    active adapter or None; that adapter's name)."""
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict) and configs and hasattr(model, "get_base_model"):
        name = getattr(model, "active_adapter", None)
        if isinstance(name, (list, tuple)):
            name = name[0]
        name = name if name in configs else next(iter(configs))
        return model.get_base_model(), configs[name], name
    return model, None, None


def get_peft_model(model, peft_config, **kwargs):
    """``peft.get_peft_model`` over a model whose routed experts are kt LoRA
    blocks (e.g. PEFT's LoRA on attention, kt's on the experts). PEFT
    freezes every parameter that is not one of its own adapter layers,
    kt's LoRA factors among them; they are made trainable again, so one
    optimizer over the PEFT model's trainable parameters trains both."""
    import peft
    wrapped = peft.get_peft_model(model, peft_config, **kwargs)
    for block in kt_experts_modules(wrapped):
        if block.mode != "inference":
            for _, p in block.trainable_parameters():
                p.requires_grad_(True)
    _carry_experts_lora(wrapped)
    return wrapped


EXPERTS_LORA_FILE = "kt_experts_lora.safetensors"


def _experts_lora_tensors(model):
    """{qualified name: parameter} of every kt LoRA factor of model (PEFT's
    wrapper or not), named as in the model PEFT wraps."""
    inner = _peft_parts(model)[0]
    if not any(isinstance(m, MoEExperts) and m.mode == "lora" for m in inner.modules()):
        return {}  # PEFT's LoRA only (kt's experts frozen or in full mode): nothing of kt's to carry
    return {"%s.%s" % (name, attr): getattr(m, attr) for name, m in _lora_layers(inner) for _, attr in m._arg_names}


def save_experts_lora(model, directory):
    """Writes kt's experts' LoRA factors of ``model`` as they are (their
    dtype, kt's layout) into ``directory``/kt_experts_lora.safetensors,
    atomically: the exact bits a resumed training run continues from, where
    ``save_adapter`` writes PEFT's layout for other programs."""
    tensors = _experts_lora_tensors(model)
    if not tensors:
        return
    os.makedirs(directory, exist_ok=True)
    _safetensors.save(os.path.join(directory, EXPERTS_LORA_FILE), tensors)


def load_experts_lora(model, directory):
    """Copies the factors ``save_experts_lora`` wrote into ``model``'s kt
    experts, in place (kt.optim keeps following the parameters). The file must
    hold exactly the model's factors with their shapes and dtypes."""
    params = _experts_lora_tensors(model)
    if not params:
        return
    path = os.path.join(os.fspath(directory), EXPERTS_LORA_FILE)
    if not os.path.isfile(path):
        raise ValueError("kt.hf: %s does not exist: the kt experts' LoRA factors were not saved there (a model "
                         "from kt.hf.get_peft_model saves them with its adapter)" % path)
    saved = _safetensors.load(path)
    if sorted(saved) != sorted(params):
        raise ValueError("kt.hf: %s holds the factors %s; the model has %s" % (
            path, ", ".join(sorted(set(saved) - set(params))) or "(none other)",
            ", ".join(sorted(set(params) - set(saved))) or "(no others)"))
    for name, p in params.items():
        if saved[name].shape != p.shape or saved[name].dtype != p.dtype:
            raise ValueError("kt.hf: %s: %s is %s %s; the model's is %s %s" % (
                path, name, saved[name].dtype, tuple(saved[name].shape), p.dtype, tuple(p.shape)))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def _carry_experts_lora(wrapped):
    """PEFT's save_pretrained and load_adapter of ``wrapped`` save and load
    kt's experts' factors too: PEFT's own state dict leaves them out, so a
    transformers.Trainer checkpoint would lack them and a resumed run would go
    on from the factors the model happened to hold."""
    save_pretrained, load_adapter = wrapped.save_pretrained, wrapped.load_adapter

    def save_with_experts(save_directory, *args, **kwargs):
        out = save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            save_experts_lora(wrapped, save_directory)
        return out

    def load_with_experts(model_id, *args, **kwargs):
        out = load_adapter(model_id, *args, **kwargs)
        load_experts_lora(wrapped, model_id)
        return out

    wrapped.save_pretrained, wrapped.load_adapter = save_with_experts, load_with_experts


def _legacy_per_expert_names(model):
    """(gate, up, down) module names of the per-expert checkpoints a fused
    transformers v5 block is converted from, read from transformers' own
    conversion table (Qwen, DeepSeek: gate_proj/up_proj/down_proj; Mixtral:
    w1/w3/w2); None where the model has no such table (gpt-oss)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError):
        return None
    found = {}
    for t in transforms:
        if isinstance(t, WeightRenaming) or len(t.target_patterns) != 1:
            continue
        names = [m.group(1) for src in t.source_patterns
                 for m in [re.search(r"experts\.\*\.([^.]+)\.weight$", src)] if m]
        if t.target_patterns[0].endswith("experts.gate_up_proj") and len(names) == 2:
            found["gate"], found["up"] = names
        elif t.target_patterns[0].endswith("experts.down_proj") and len(names) == 1:
            found["down"] = names[0]
    return tuple(found[p] for p in _hf_names.PROJ) if len(found) == 3 else None


def save_adapter(model, directory, *, base_model=None, dtype=torch.float32, layout=None):
    """Writes the LoRA factors of every kt block of ``model`` as a PEFT adapter
    (adapter_config.json + adapter_model.safetensors) that PEFT and vLLM load.

    ``layout``: "per_expert" writes PEFT's LoRA on each expert's modules
    (``...experts.<e>.gate_proj.lora_A.weight``; for fused transformers v5
    blocks with the names of the per-expert checkpoints they come from, which
    PEFT fuses when it loads the adapter onto a v5 model); "fused" writes
    PEFT's parameter-targeting form (``target_parameters``; kt's separate
    gate and up factors become one factor pair of gate_up_proj with twice the
    rank, see kt._hf_names); None takes the blocks' own form (fused for v5
    and gpt-oss blocks). Keys are ``base_model.model.<module path>``, as
    PeftModel.save_pretrained writes.

    When ``model`` is a PEFT model (``peft.get_peft_model`` over the model
    with kt blocks, e.g. LoRA on attention), its active adapter is written to
    the same directory: one adapter whose config targets both, with PEFT's
    own r and lora_alpha kept in rank_pattern/alpha_pattern where they
    differ from the experts'."""
    inner, peft_config, adapter_name = _peft_parts(model)
    layers = _lora_layers(inner)
    first = layers[0][1]
    tensors, target_modules, target_parameters, multiplier = {}, set(), [], 1
    fused = _hf_names.is_fused(first.hf_naming)
    legacy = None
    if layout == "per_expert" and fused:
        legacy = _legacy_per_expert_names(inner)
        if legacy is None or first.hf_naming.startswith("gpt_oss"):
            raise ValueError("kt.hf: %s blocks have no per-expert form; save them with layout='fused'"
                             % first.hf_naming)
        fused = False
    elif layout == "fused" and not fused:
        raise ValueError("kt.hf: per-expert blocks (transformers v4 modules) are saved per expert; "
                         "layout='fused' needs fused experts modules")
    elif layout not in (None, "per_expert", "fused"):
        raise ValueError("kt.hf: layout must be 'per_expert', 'fused' or None, not %r" % (layout,))
    for name, m in layers:
        lora = {attr: getattr(m, attr).detach().to(dtype) for _, attr in m._arg_names}
        rel, mult = _hf_names.lora_to_peft(m.hf_naming, lora, m.lora_targets, per_expert_names=legacy,
                                           peft_in_out=getattr(m, "peft_in_out", False))
        multiplier = max([multiplier] + list(mult.values()))
        for k, t in rel.items():
            tensors["base_model.model.%s.%s" % (name, k)] = t
        parent = name.rsplit(".", 1)[0].rsplit(".", 1)[-1] if "." in name else ""
        if fused:
            for p in mult:
                key = "%s.experts.%s" % (parent, p) if parent else "experts." + p
                if key not in target_parameters:
                    target_parameters.append(key)
        else:
            names = legacy or _hf_names.PER_EXPERT.get(m.hf_naming, _hf_names.PER_EXPERT["qwen"])
            wanted = [n for p, n in zip(_hf_names.PROJ, names) if p in m.lora_targets]
            # The expert index is optional: PEFT resolves a regex for a
            # transformers v5 model by probing <block>.experts.<name>.
            target_modules.add(r".*\.%s\.experts\.(?:\d+\.)?(%s)" % (re.escape(parent), "|".join(wanted)))
    # gate_up_proj first: PEFT nests the first listed parameter innermost.
    target_parameters.sort(key=lambda k: not k.endswith("gate_up_proj"))
    r = first.lora_rank * multiplier
    alpha = float(first._init_kwargs["lora_alpha"])
    use_rslora = bool(first._init_kwargs["use_rslora"])
    alpha *= (multiplier ** 0.5 if use_rslora else multiplier)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
              "use_rslora": use_rslora, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": base_model or "",
              "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
              "target_modules": ("|".join(sorted(target_modules)) if target_modules else None)}
    if fused:
        config["target_parameters"] = target_parameters
    if peft_config is not None:
        _merge_peft_adapter(model, inner, peft_config, adapter_name, layers, config, tensors, dtype)
    os.makedirs(directory, exist_ok=True)
    _safetensors.save(os.path.join(directory, "adapter_model.safetensors"), tensors, {"format": "pt"})
    _safetensors.write_atomic(os.path.join(directory, "adapter_config.json"),
                              [(json.dumps(config, indent=2) + "\n").encode()])
    return config


def _merge_peft_adapter(model, inner, peft_config, adapter_name, layers, config, tensors, dtype):
    """Adds PEFT's own adapter (its LoRA layers outside kt) to kt's config and
    tensors."""
    from peft import get_peft_model_state_dict
    if str(getattr(peft_config, "peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        raise ValueError("kt.hf: the PEFT adapter is %s; kt saves LoRA adapters" % peft_config.peft_type)
    if bool(peft_config.use_rslora) != config["use_rslora"]:
        raise ValueError("kt.hf: PEFT's adapter and kt's experts differ in use_rslora; one adapter has one")
    if getattr(peft_config, "target_parameters", None):
        raise ValueError("kt.hf: the PEFT adapter targets parameters %s; kt holds the routed experts' LoRA"
                         % sorted(peft_config.target_parameters))
    kt_prefixes = tuple("base_model.model.%s." % name for name, _ in layers)
    own = {k: v.detach().to(dtype) for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name).items()
           if not k.startswith(kt_prefixes)}
    modules = sorted({re.sub(r"\.lora_(A|B|embedding_A|embedding_B)(\.weight)?$", "", k)[len("base_model.model."):]
                      for k in own if ".lora_" in k})
    if not modules:
        return
    # The modules by their full names (PEFT fullmatches a string
    # target_modules), so a leaf name such as a shared expert's gate_proj
    # never reaches the routed experts' modules of the plain model.
    pattern = "|".join(re.escape(m) for m in modules)
    config["target_modules"] = "|".join(p for p in (config["target_modules"], pattern) if p)
    if peft_config.r != config["r"] or float(peft_config.lora_alpha) != config["lora_alpha"]:
        for module in modules:
            config["rank_pattern"][re.escape(module)] = int(peft_config.r)
            config["alpha_pattern"][re.escape(module)] = float(peft_config.lora_alpha)
    for key, value in (getattr(peft_config, "rank_pattern", None) or {}).items():
        config["rank_pattern"][key] = value
    for key, value in (getattr(peft_config, "alpha_pattern", None) or {}).items():
        config["alpha_pattern"][key] = value
    tensors.update(own)


def _pattern_value(patterns, module, default):
    for key, value in (patterns or {}).items():
        if re.match(r"(.*\.)?(%s)$" % key, module):
            return value
    return default


def _check_adapter_targets(directory, config, name, block, rel, per_expert):
    """Raises ValueError naming what the adapter trains in block ``name``
    that the kt block holds no LoRA factors for."""
    if _hf_names.is_fused(block.hf_naming) and per_expert is None:
        held = (["gate_up_proj"] if {"gate", "up"} & set(block.lora_targets) else []) + \
            (["down_proj"] if "down" in block.lora_targets else [])
        targeted = [t.rsplit(".", 1)[-1] for t in config.get("target_parameters") or []]
        extra = [t for t in targeted if t not in held]
        if not targeted and rel:
            extra = sorted({re.sub(r"\.lora_(A|B)\.weight$", "", k) for k in rel})
    else:
        own = {attr: getattr(block, attr).detach() for _, attr in block._arg_names}
        expected = _hf_names.lora_to_peft(block.hf_naming, own, block.lora_targets,
                                          per_expert_names=per_expert)[0]
        extra = sorted({re.sub(r"\.lora_(A|B)\.weight$", "", k) for k in rel if k not in expected})
    if extra:
        raise ValueError("kt.hf: %s targets %s, which the model's kt block does not hold LoRA factors for "
                         "(it trains %s)" % (directory, ", ".join("%s.%s" % (name, e) for e in extra),
                                             "/".join(block.lora_targets)))


def load_adapter(model, directory, *, adapter_name="default"):
    """Loads a PEFT LoRA adapter (written by save_adapter, or by PEFT on the
    plain transformers model) into ``model``: the factors of the routed
    experts into its kt blocks (per-expert or fused form; a fused
    gate_up_proj factor of PEFT's own, one A for gate and up, loads exactly
    into kt's separate gate and up factors of the same rank), and the LoRA
    of every other module through PEFT, which wraps ``model`` if it is not
    a PEFT model yet. Returns the model to use (the PEFT model where PEFT
    holds part of the adapter). The adapter's r and lora_alpha (or its
    rank_pattern/alpha_pattern) must give the blocks' rank and scale; an
    adapter whose tensors name modules the model does not hold raises
    ValueError naming them."""
    inner, peft_config, _ = _peft_parts(model)
    layers = _lora_layers(inner)
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = _safetensors.load(os.path.join(directory, "adapter_model.safetensors"))
    if config.get("peft_type") != "LORA":
        raise ValueError("kt.hf: %s is not a LoRA adapter" % directory)
    kt_prefixes = tuple("base_model.model.%s." % name for name, _ in layers)
    rest = {k: v for k, v in tensors.items() if not k.startswith(kt_prefixes)}
    held = dict(inner.named_modules())
    rest_modules = sorted({re.sub(r"\.lora_(A|B|embedding_A|embedding_B)(\.weight)?$", "", k)
                           [len("base_model.model."):] for k in rest})
    unknown = [m for m in rest_modules if m not in held]
    if unknown or any(not k.startswith("base_model.model.") for k in rest):
        raise ValueError("kt.hf: %s targets modules the model does not hold (neither kt's routed experts "
                         "nor a torch module): %s" % (directory, ", ".join(unknown or sorted(rest))))
    legacy = _legacy_per_expert_names(inner)
    with torch.no_grad():
        for name, m in layers:
            prefix = "base_model.model.%s." % name
            rel = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if not rel:
                raise ValueError("kt.hf: %s holds no LoRA tensors of %s" % (directory, name))
            module = name + (".gate_up_proj" if _hf_names.is_fused(m.hf_naming) else "")
            r = _pattern_value(config.get("rank_pattern"), module, config["r"])
            alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
            if not math.isclose(alpha / (r ** 0.5 if config.get("use_rslora") else r), m.lora_scale,
                                rel_tol=1e-6):
                raise ValueError("kt.hf: the adapter's scale of %s (lora_alpha %g, r %d) differs from the "
                                 "model's %g" % (name, alpha, r, m.lora_scale))
            per_expert = None
            if _hf_names.is_fused(m.hf_naming) and any(re.match(r"\d+\.", k) for k in rel):
                per_expert = legacy
                if per_expert is None:
                    raise ValueError("kt.hf: %s holds per-expert LoRA of %s, whose experts are fused"
                                     % (directory, name))
            _check_adapter_targets(directory, config, name, m, rel, per_expert)
            try:
                lora = _hf_names.lora_from_peft(m.hf_naming, rel, m.lora_targets, m.num_experts, m.lora_rank,
                                                per_expert_names=per_expert,
                                                peft_in_out=getattr(m, "peft_in_out", False))
            except KeyError as e:
                raise ValueError("kt.hf: %s: tensor %s%s is missing" % (directory, prefix, e.args[0])) from None
            for attr, t in lora.items():
                target = getattr(m, attr)
                if tuple(t.shape) != tuple(target.shape):
                    raise ValueError("kt.hf: %s: %s has shape %s, the model's %s" % (
                        name, attr, tuple(t.shape), tuple(target.shape)))
                target.copy_(t)
    if not rest:
        return model
    import peft
    if peft_config is None:
        lora_config = peft.LoraConfig(
            r=config["r"], lora_alpha=config["lora_alpha"], use_rslora=bool(config.get("use_rslora")),
            target_modules=rest_modules, rank_pattern=config.get("rank_pattern") or {},
            alpha_pattern=config.get("alpha_pattern") or {}, lora_dropout=0.0, bias="none",
            task_type=config.get("task_type"))
        model = get_peft_model(inner, lora_config, adapter_name=adapter_name)
    result = peft.set_peft_model_state_dict(model, rest, adapter_name=adapter_name)
    missing = [k for k in getattr(result, "unexpected_keys", []) if ".lora_" in k]
    if missing:
        raise ValueError("kt.hf: PEFT did not take %s from %s" % (", ".join(missing), directory))
    return model


# ------------------------------------------------------------ from_pretrained


class _ParametersOnMeta:
    """Within it, every nn.Module parameter is created on the meta device
    while buffers stay real, so buffers that checkpoints do not hold (rotary
    inv_freq and other non-persistent ones) keep the values __init__ gave
    them."""

    def __enter__(self):
        self._register = nn.Module.register_parameter

        def register_on_meta(module, name, param):
            if param is not None and param.device.type != "meta":
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            self._register(module, name, param)

        nn.Module.register_parameter = register_on_meta
        return self

    def __exit__(self, *exc):
        nn.Module.register_parameter = self._register


def _checkpoint_files(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
    single = os.path.join(directory, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError("kt.hf: %s holds neither model.safetensors nor its index" % directory)
    return [single]


def _key_renamer(model):
    """Checkpoint key -> model key, by transformers' own conversion table
    (v5 renames legacy keys, e.g. Mixtral's block_sparse_moe -> mlp); v4
    checkpoints use the model's names."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: key
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, renamings, converters)[0]


def _set_tensor(model, name, value):
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)
    else:
        old = owner._buffers[leaf]
        owner._buffers[leaf] = value.to(old.dtype)


def from_pretrained(directory, *, model_class=None, dtype=None, **options):
    """A transformers model from a checkpoint directory with its routed
    experts in kt, read by kt straight from the checkpoint's files: the
    model is built with its parameters on the meta device, the MoE blocks are
    replaced (``replace_moe_experts(model, checkpoint=directory,
    **options)``), and only the tensors the model still holds (attention,
    routers, shared experts, embeddings, norms) are read into torch, so the
    expert weights never exist as torch tensors. ``model_class`` defaults to
    AutoModelForCausalLM; ``dtype`` is the torch dtype of the non-expert
    parameters (default: the config's). The experts of a quantized
    checkpoint stay in its stored format unless ``weight_format`` or
    ``dequantize=True`` says otherwise. Needs transformers and safetensors.
    Returns the model in eval mode, as transformers' from_pretrained does."""
    import transformers
    from safetensors import safe_open

    directory = os.fspath(directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    model_class = model_class or transformers.AutoModelForCausalLM
    kw = {} if dtype is None else {"dtype": dtype}
    with _ParametersOnMeta():
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, **kw)
        else:
            model = model_class(config, **kw)
    if "weight_format" not in options and not options.get("dequantize"):
        with Checkpoint(directory) as ck:
            stored = {info["weight_format"] for info in ck.layers.values()}
        if len(stored) == 1:
            options["weight_format"] = stored.pop()
    replace_moe_experts(model, checkpoint=directory, strict=True, **options)
    wanted = {n for n, p in model.named_parameters() if p.device.type == "meta"}
    wanted |= {n for n, b in model.named_buffers() if b.device.type == "meta"}
    rename = _key_renamer(model)
    persistent = {n for n, _ in model.named_buffers()}
    with torch.no_grad():
        for path in _checkpoint_files(directory):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    name = rename(key)
                    if name in wanted or (name in persistent and name not in wanted):
                        _set_tensor(model, name, f.get_tensor(key))
                        wanted.discard(name)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    left = sorted(n for n, p in list(model.named_parameters()) + list(model.named_buffers())
                  if p.device.type == "meta")
    if left:
        raise ValueError("kt.hf: %s holds no tensor for %s" % (directory, ", ".join(left)))
    model.eval()
    return model
