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
import torch
from torch import nn
import torch.nn.functional as F

from .torch import MoEExperts

_PER_EXPERT_NAMES = {
    "qwen": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# PEFT target_modules names -> kt projections
_TARGET_ALIASES = {"gate_proj": "gate", "w1": "gate", "gate": "gate",
                   "up_proj": "up", "w3": "up", "up": "up",
                   "down_proj": "down", "w2": "down", "down": "down"}


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
    out = []
    for name in target_modules:
        if name not in _TARGET_ALIASES:
            raise ValueError("kt.hf: unknown target module %r; use gate_proj/up_proj/down_proj, "
                             "w1/w3/w2 or gate/up/down" % (name,))
        if _TARGET_ALIASES[name] not in out:
            out.append(_TARGET_ALIASES[name])
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


class KtFusedExperts(nn.Module):
    """Stands in for a fused experts module: experts(hidden [N,H], top_k_index
    [N,k], top_k_weights [N,k] or dense [N,E]) -> [N,H]."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

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
        return self.experts(h, ids, weights).reshape(shape)


def _make_experts(E, k, H, I, options, **layer_kw):
    kw = dict(options)
    kw.update(layer_kw)
    return MoEExperts(E, k, H, I, **kw)


def _replace_per_expert(block, naming, options, norm_default):
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
    for e, expert in enumerate(experts):
        g, u, d = (getattr(expert, n) for n in names)
        kw = dict(gate=g.weight, up=u.weight, down=d.weight)
        if bias:
            kw.update(bias_gate=g.bias, bias_up=u.bias, bias_down=d.bias)
        kt_experts.load_expert(e, **kw)
    norm = getattr(block, "norm_topk_prob", norm_default)
    return KtSparseMoeBlock(block, kt_experts, bool(norm), k)


def _replace_fused(block, options, orientation):
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
    kt_experts = _make_experts(E, k, H, I, options, **layer_kw)
    kw = dict(gate_up=gu.detach(), down=down.detach(), orientation=orientation, interleaved=oss)
    if layer_kw.get("bias"):
        kw.update(bias_gate_up=ex.gate_up_proj_bias.detach(), bias_down=ex.down_proj_bias.detach())
    kt_experts.load_weights(**kw)
    return KtFusedExperts(kt_experts)


def replace_moe_experts(model, *, mode="inference", lora_rank=16, lora_alpha=32.0,
                        lora_dropout=0.0, use_rslora=False, target_modules=None,
                        param_dtype=torch.float32, max_tokens=1024, engine=None,
                        fused_orientation=None):
    """Moves the routed experts of every recognised MoE block of ``model``
    into kt, in place. ``mode`` is "inference", "lora" (PEFT-style
    ``lora_rank``/``lora_alpha``/``use_rslora``/``target_modules``) or
    "full". Returns the qualified names of the replaced modules. The original
    expert weights are dropped once kt holds them."""
    options = dict(mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                   lora_dropout=lora_dropout, use_rslora=use_rslora,
                   lora_targets=_lora_targets(target_modules), param_dtype=param_dtype,
                   max_tokens=max_tokens, engine=engine)
    replaced = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(r + ".") for r in replaced):
            continue
        experts = getattr(module, "experts", None)
        if experts is None or isinstance(module, (KtSparseMoeBlock, KtFusedExperts)):
            continue
        naming = _per_expert_naming(experts)
        if naming is not None and isinstance(getattr(module, "gate", None), nn.Module):
            new = _replace_per_expert(module, naming, options, norm_default=(naming == "mixtral"))
            _set_child(model, name, new)
            replaced.append(name)
        elif _is_fused(experts):
            module.experts = _replace_fused(module, options, fused_orientation)
            replaced.append(name + ".experts" if name else "experts")
    return replaced


def kt_experts_modules(model):
    """Every MoEExperts inside model (e.g. to count or inspect them)."""
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def _set_child(model, qualified, new):
    if not qualified:
        raise ValueError("kt.hf: the model itself is an MoE block; wrap it in a module")
    parent_name, _, child = qualified.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
