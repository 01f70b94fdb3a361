"""torch autograd and nn.Module front end of kt's MoE layer.

``MoEExperts`` holds one layer's routed experts in kt. Its trainable tensors
(LoRA factors, or the stacked weights and biases in full mode) are torch
Parameters on the CPU that kt reads in place; kt writes their ``.grad``
during backward, following torch's own accumulation rule:

* a parameter whose ``.grad`` is None gets a fresh gradient (kt overwrites a
  buffer, which then becomes ``.grad``): the first micro-batch of an
  accumulation window after ``zero_grad(set_to_none=True)``;
* a parameter that already has a ``.grad`` gets the new gradient added.

Every parameter gradient is multiplied by ``grad_scale`` (e.g. 1/world_size or
an inverse loss scale); dx and the routing-weight gradient are not. kt
re-reads parameters whenever torch's version counter says they were changed
in place (the optimizer step) or they were replaced.

Inputs on an accelerator are copied to the CPU for kt and the result copied
back; the parameters stay on the CPU even when the model is moved.
"""
import copy
import itertools
import math
import os
import tempfile
import weakref

import torch
from torch import nn
import torch.nn.functional as F

from . import _hf_names, core

_PROJ_NAMES = ("gate", "up", "down")


class _SavedContexts(bytearray):
    """The kt contexts one forward saved for its backward. Autograd carries
    them as a saved tensor (``tensor()``: 8 bytes viewing this object, which
    holds the contexts), so they follow autograd's saved-tensor rules: they
    are released when no tensor views these bytes any more (the graph was
    freed), and activation checkpointing, which drops what the first forward
    saved and gives backward what the recompute saved, drops and replaces
    them like any activation."""

    _keys = itertools.count(1)
    _live = weakref.WeakValueDictionary()

    def __init__(self, contexts):
        key = next(self._keys)
        super().__init__(key.to_bytes(8, "little"))
        self.contexts = contexts
        self._live[key] = self

    def tensor(self):
        return torch.frombuffer(self, dtype=torch.int64)

    @classmethod
    def of(cls, tensor):
        found = cls._live.get(int(tensor[0]))
        if found is None:
            raise RuntimeError("kt: the experts' saved activations are gone: a saved-tensor hook "
                               "copied the tensor that holds them instead of keeping it")
        return found.contexts


class _Call:
    """What one MoEExperts.forward tells _MoEFunction and learns from it."""

    def __init__(self, grad_enabled, save_without_grad):
        # Inside forward grad mode is off and needs_input_grad follows
        # requires_grad alone, also under no_grad.
        self.grad_enabled = grad_enabled
        self.save_without_grad = save_without_grad
        self.computed = None  # contexts this call computed (not taken from retained ones)
        self.saved = None     # weakref to the _SavedContexts given to autograd


class _Retained:
    """A checkpointed forward's contexts and output, kept for its recompute
    (activation_policy="retain"), with what identifies that recompute."""

    def __init__(self, contexts, x, ids, weights, y):
        self.contexts = contexts
        self.key = _recompute_key(x, ids, weights)
        self.y = y.detach()
        self.y_version = y._version

    def release(self):
        for c in self.contexts:
            c.release()
        self.contexts = []


def _recompute_key(x, ids, weights):
    # A recompute sees the same bits as the first forward (checkpointing
    # restores the RNG state): exact routing plus sums of x identify it.
    # Computed outside autograd: x.abs() would save x for a backward, which
    # torch 2's non-reentrant checkpointing counts (the first forward makes
    # the key with grad enabled, the recompute inside _MoEFunction.forward
    # without), refusing the recompute for saving fewer tensors.
    with torch.no_grad():
        x, ids, weights = x.detach(), ids.detach(), weights.detach()
        return (tuple(x.shape), x.dtype, ids.clone(), weights.clone(),
                float(torch.sum(x, dtype=torch.float64)), float(torch.sum(x.abs(), dtype=torch.float64)))


def _same_key(a, b):
    return (a[0] == b[0] and a[1] == b[1] and a[2].shape == b[2].shape and torch.equal(a[2], b[2])
            and a[3].shape == b[3].shape and a[3].dtype == b[3].dtype and torch.equal(a[3], b[3])
            and a[4:] == b[4:])


class _MoEFunction(torch.autograd.Function):
    """y = experts(x, ids, weights); extra inputs are the layer's trainable
    parameters so that autograd runs backward even when x needs no grad.
    Their gradients are written by kt into ``.grad`` (returned as None)."""

    @staticmethod
    def forward(ctx, module, call, x, ids, weights, *params):
        layer = module.kt_layer
        save = (call.grad_enabled and any(ctx.needs_input_grad[2:])) or call.save_without_grad
        retained = module._take_retained(x, ids, weights) if save else None
        if retained is not None:
            contexts, y = retained.contexts, retained.y
        else:
            y = torch.empty(x.shape, dtype=x.dtype)
            contexts = []
            step = layer.max_tokens
            for start in range(0, max(x.shape[0], 1), step):
                end = min(start + step, x.shape[0])
                c = layer.forward(x[start:end], ids[start:end], weights[start:end], y[start:end],
                                  save=save)
                if save:
                    contexts.append(c)
            call.computed = contexts if save else None
        if save:
            saved = _SavedContexts(contexts)
            call.saved = weakref.ref(saved)
            ctx.save_for_backward(saved.tensor())
        ctx.module = module
        ctx.x_meta = (x.shape, x.dtype)
        ctx.w_meta = (weights.shape, weights.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        module = ctx.module
        layer = module.kt_layer
        contexts = _SavedContexts.of(ctx.saved_tensors[0])
        if dy.stride(-1) != 1 or dy.dtype not in (torch.float32, torch.bfloat16):
            dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        dx = torch.empty(ctx.x_meta[0], dtype=ctx.x_meta[1]) if need_dx else None
        w_dtype = ctx.w_meta[1] if ctx.w_meta[1] in (torch.float32, torch.bfloat16) else torch.float32
        dw = torch.empty(ctx.w_meta[0], dtype=w_dtype) if need_dw else None
        plan = module._prepare_param_grads() if any(ctx.needs_input_grad[5:]) else None
        accumulate = plan[0] if plan else False
        step = layer.max_tokens
        for i, c in enumerate(contexts):
            s, e = i * step, min((i + 1) * step, ctx.x_meta[0][0])
            layer.backward(c, dy[s:e], None if dx is None else dx[s:e],
                           None if dw is None else dw[s:e], grad_scale=module.grad_scale,
                           accumulate=accumulate or i > 0, param_grads=plan is not None)
        if plan:
            for p, buf in plan[1]:
                p.grad = buf
            if module._grads_ready is not None:
                module._grads_ready()
        if dw is not None and dw.dtype != ctx.w_meta[1]:
            dw = dw.to(ctx.w_meta[1])
        return (None, None, dx, None, dw) + (None,) * (len(ctx.needs_input_grad) - 5)


class MoEExperts(nn.Module):
    """The routed experts of one MoE layer, computed by kt.

    forward(x [..., H], ids [..., k], weights [..., k]) -> y [..., H]

    mode "inference": frozen weights (backward still gives dx and routing
    grads); "lora": frozen base + LoRA factors ``lora_A_<proj>`` [E, r, in]
    and ``lora_B_<proj>`` [E, out, r]; "full": ``w_gate``/``w_up`` [E, I, H],
    ``w_down`` [E, H, I] (and ``b_*`` with bias) are Parameters.

    Activation checkpointing (torch.utils.checkpoint, reentrant or not; HF's
    ``gradient_checkpointing_enable()``) works as for torch layers: what kt
    saved in the first forward is released with the other activations, and
    backward uses what the recompute saved, so the experts run twice.
    ``activation_policy="retain"`` keeps the first forward's saved
    activations (and its output) for the recompute instead, which then
    returns them without computing the experts again: memory for time, one
    forward's activations per layer from the forward to its backward. While
    training with "retain", a forward that saves nothing for autograd (the
    first forward of reentrant checkpointing runs without grad, and so does
    any ``torch.no_grad()`` forward) keeps its activations; at most
    ``retain_limit`` per layer are kept (the oldest go first), and all are
    released when used, at ``eval()``, when the parameters change (an
    optimizer step) or by ``release_retained()``. A recompute is recognised
    by its inputs (routing exactly, x by shape, dtype and sums); one that
    matches nothing is computed.

    Hybrid placement: ``set_torch_experts(ids, device)`` has torch compute
    the routes to experts ``ids`` on ``device`` (the host's accelerator) and
    kt the others (kt_moe_set_skipped); the two outputs are added. Gradients
    reach x, the routing weights and the trainable parameters from both
    parts: the torch experts use the same LoRA factors (rows ``ids``) or, in
    full mode, the same weight Parameters, read in place on the CPU and
    moved to ``device`` for each forward; their rows of ``.grad`` come from
    torch's autograd (multiplied by grad_scale as kt's are), the others from
    kt. The frozen base weights of the torch experts are copied to
    ``device`` (non-persistent buffers, read from kt's stored weights);
    kt keeps its own copy too, which state_dict, copies and packed caches
    read.
    """

    def __init__(self, num_experts, top_k, hidden, intermediate, *, activation="silu",
                 act_alpha=1.702, act_limit=0.0, bias=False, mode="inference", lora_rank=16,
                 lora_alpha=32.0, use_rslora=False, lora_targets=("gate", "up", "down"),
                 lora_dropout=0.0, param_dtype=torch.float32, max_tokens=1024, engine=None,
                 grad_scale=1.0, activation_policy="recompute", retain_limit=4, weight_format="bf16",
                 compute="bf16"):
        super().__init__()
        self._init_kwargs = dict(
            num_experts=num_experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
            activation=activation, act_alpha=act_alpha, act_limit=act_limit, bias=bias, mode=mode,
            lora_rank=lora_rank, lora_alpha=lora_alpha, use_rslora=use_rslora,
            lora_targets=lora_targets, lora_dropout=lora_dropout, param_dtype=param_dtype,
            max_tokens=max_tokens, engine=engine, grad_scale=grad_scale,
            activation_policy=activation_policy, retain_limit=retain_limit, weight_format=weight_format,
            compute=compute)
        # Key names of state_dict (see _hf_names); kt.hf sets the original
        # module's, otherwise kt's own (w_gate, b_gate, lora_A_gate, ...).
        self.hf_naming = None
        if lora_dropout:
            raise ValueError("kt: lora_dropout must be 0: kt feeds the LoRA path the same input "
                             "as the base projection")
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError("kt: param_dtype must be torch.float32 or torch.bfloat16")
        if activation_policy not in ("recompute", "retain"):
            raise ValueError("kt: activation_policy must be 'recompute' or 'retain', not %r"
                             % (activation_policy,))
        if int(retain_limit) < 1:
            raise ValueError("kt: retain_limit must be at least 1")
        self.activation_policy = activation_policy
        self.retain_limit = int(retain_limit)
        self._retained = []  # _Retained, oldest first
        self.torch_expert_ids = ()  # experts torch computes (hybrid placement)
        self._torch_base_stale = False
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.activation, self.act_alpha, self.act_limit = activation, act_alpha, act_limit
        self.mode = mode
        self.grad_scale = float(grad_scale)
        self.kt_layer = core.MoE(num_experts, top_k, hidden, intermediate, max_tokens=max_tokens,
                                 activation=activation, act_alpha=act_alpha, act_limit=act_limit,
                                 bias=bias, mode=mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                 use_rslora=use_rslora, lora_targets=lora_targets, engine=engine,
                                 weight_format=weight_format, compute=compute)
        self.weight_format = weight_format
        self.compute = compute
        self.has_bias = bool(bias)
        self.lora_rank = lora_rank if mode == "lora" else 0
        self.lora_targets = tuple(lora_targets) if mode == "lora" else ()
        self.lora_scale = self.kt_layer.lora_scale()
        E, H, I = num_experts, hidden, intermediate
        self._arg_names = []  # (kt argument name, parameter attribute)
        if mode == "lora":
            for p in self.lora_targets:
                fan_in, fan_out = (I, H) if p == "down" else (H, I)
                a = torch.empty(E, lora_rank, fan_in, dtype=param_dtype)
                # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) i.e. U(+-1/sqrt(in)), B = 0.
                nn.init.uniform_(a, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
                setattr(self, "lora_A_" + p, nn.Parameter(a))
                setattr(self, "lora_B_" + p,
                        nn.Parameter(torch.zeros(E, fan_out, lora_rank, dtype=param_dtype)))
                self._arg_names += [("LORA_A_" + p.upper(), "lora_A_" + p),
                                    ("LORA_B_" + p.upper(), "lora_B_" + p)]
        elif mode == "full":
            self.w_gate = nn.Parameter(torch.zeros(E, I, H, dtype=param_dtype))
            self.w_up = nn.Parameter(torch.zeros(E, I, H, dtype=param_dtype))
            self.w_down = nn.Parameter(torch.zeros(E, H, I, dtype=param_dtype))
            self._arg_names += [("W_GATE", "w_gate"), ("W_UP", "w_up"), ("W_DOWN", "w_down")]
            if bias:
                self.b_gate = nn.Parameter(torch.zeros(E, I, dtype=param_dtype))
                self.b_up = nn.Parameter(torch.zeros(E, I, dtype=param_dtype))
                self.b_down = nn.Parameter(torch.zeros(E, H, dtype=param_dtype))
                self._arg_names += [("B_GATE", "b_gate"), ("B_UP", "b_up"), ("B_DOWN", "b_down")]
        self._claim_parameters()
        self._grads_ready = None  # kt.optim's overlap(): called once this layer's gradients are written
        self._bound_keys = {}      # kt arg name -> (data_ptr, shape, strides, dtype) bound
        self._bound_versions = {}  # parameter attribute -> version counter kt has read
        self._grad_buffers = {}    # parameter attribute -> tensor kt writes when .grad is None
        self._needs_reload = mode == "full"  # full mode: kt packs nothing until params are read

    def extra_repr(self):
        s = "experts=%d, top_k=%d, hidden=%d, intermediate=%d, activation=%s, mode=%s" % (
            self.num_experts, self.top_k, self.hidden, self.intermediate, self.activation,
            self.mode)
        if self.weight_format != "bf16":
            s += ", weight_format=%s" % self.weight_format
        if self.compute != "bf16":
            s += ", compute=%s" % self.compute
        if self.mode == "lora":
            s += ", lora_rank=%d, lora_scale=%g, targets=%s" % (
                self.lora_rank, self.lora_scale, ",".join(self.lora_targets))
        return s

    def trainable_parameters(self):
        """(kt argument name, Parameter) of every tensor kt trains."""
        return [(arg, getattr(self, attr)) for arg, attr in self._arg_names]

    def _claim_parameters(self):
        # kt.optim finds the layer of a parameter through this.
        for _, attr in self._arg_names:
            getattr(self, attr)._kt_owner = weakref.ref(self)

    def _bind_grads_for_step(self):
        """Binds every parameter's current ``.grad`` as the gradient kt's
        layer optimizer reads (a trainer may have replaced a .grad)."""
        binds = {}
        for arg, p in self.trainable_parameters():
            g = p.grad
            if g.device.type != "cpu" or g.shape != p.shape or g.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError("kt: %s.grad must be a CPU float32/bfloat16 tensor of the parameter's shape" % arg)
            if not g.is_contiguous():
                p.grad = g = g.contiguous()
            key = (g.data_ptr(), tuple(g.shape), g.stride(), g.dtype)
            if self._bound_keys.get("GRAD_" + arg) != key:
                binds["GRAD_" + arg] = (g, key)
        if binds:
            self.kt_layer.bind(**{a: t for a, (t, _) in binds.items()})
            for a, (_, key) in binds.items():
                self._bound_keys[a] = key

    def _versions_read(self):
        """Records the parameters' version counters as read by kt: kt's own
        optimizer writes them in place without moving the counters."""
        self.release_retained()
        for arg, p in self.trainable_parameters():
            self._bound_versions[arg] = p._version

    # ------------------------------------------- retained activations

    def release_retained(self):
        """Releases the activations kept for recomputes (activation_policy
        "retain") that have not come."""
        retained, self._retained = self._retained, []
        for r in retained:
            r.release()

    def _take_retained(self, x, ids, weights):
        """The retained forward that this call recomputes, removed from the
        list, or None."""
        if not self._retained:
            return None
        key = _recompute_key(x, ids, weights)
        for i in range(len(self._retained) - 1, -1, -1):
            r = self._retained[i]
            if r.y_version == r.y._version and _same_key(r.key, key):
                del self._retained[i]
                return r
        return None

    def _retain(self, contexts, x, ids, weights, y):
        self._retained.append(_Retained(contexts, x, ids, weights, y))
        while len(self._retained) > self.retain_limit:
            self._retained.pop(0).release()

    def train(self, mode=True):
        if not mode:
            self.release_retained()
        return super().train(mode)

    # ---------------------------------------------------------------- loading

    def load_weights(self, *, gate=None, up=None, down=None, gate_up=None, bias_gate=None,
                     bias_up=None, bias_down=None, bias_gate_up=None, orientation="out_in",
                     interleaved=False):
        """Stacked expert weights [E, out, in] (or [E, in, out] with
        orientation="in_out"); gate_up holds gate rows first, or interleaved
        (even gate, odd up) with interleaved=True."""
        with torch.no_grad():
            if self.mode == "full":
                if gate_up is not None:
                    gate, up = _split_gate_up(gate_up, orientation, interleaved)
                if bias_gate_up is not None:
                    bias_gate, bias_up = _split_gate_up(bias_gate_up, "out_in", interleaved)
                for name, src in (("w_gate", gate), ("w_up", up), ("w_down", down)):
                    if src is None:
                        raise ValueError("kt: gate, up and down weights are required")
                    getattr(self, name).copy_(src.transpose(1, 2) if orientation == "in_out" else src)
                if self.has_bias:
                    for name, src in (("b_gate", bias_gate), ("b_up", bias_up), ("b_down", bias_down)):
                        if src is None:
                            raise ValueError("kt: the layer has biases; all three are required")
                        getattr(self, name).copy_(src)
                self._needs_reload = True
                return
            cpu = _cpu_args(gate=gate, up=up, down=down, gate_up=gate_up, bias_gate=bias_gate,
                            bias_up=bias_up, bias_down=bias_down, bias_gate_up=bias_gate_up)
            self.kt_layer.load_weights(orientation=orientation, interleaved=interleaved, **cpu)
            self._torch_base_stale = bool(self.torch_expert_ids)

    def load_expert(self, expert, *, gate=None, up=None, down=None, gate_up=None, bias_gate=None,
                    bias_up=None, bias_down=None, orientation="out_in", interleaved=False):
        """One expert's 2-D weights (e.g. straight from its nn.Linear modules)."""
        with torch.no_grad():
            if self.mode == "full":
                if gate_up is not None:
                    gate, up = _split_gate_up(gate_up[None], orientation, interleaved)
                    gate, up = gate[0], up[0]
                t = (lambda w: w.t()) if orientation == "in_out" else (lambda w: w)
                self.w_gate[expert].copy_(t(gate))
                self.w_up[expert].copy_(t(up))
                self.w_down[expert].copy_(t(down))
                if self.has_bias:
                    self.b_gate[expert].copy_(bias_gate)
                    self.b_up[expert].copy_(bias_up)
                    self.b_down[expert].copy_(bias_down)
                self._needs_reload = True
                return
            cpu = _cpu_args(gate=gate, up=up, down=down, gate_up=gate_up, bias_gate=bias_gate,
                            bias_up=bias_up, bias_down=bias_down)
            self.kt_layer.load_expert(expert, orientation=orientation, interleaved=interleaved, **cpu)
            self._torch_base_stale = bool(self.torch_expert_ids)

    # ------------------------------------------------------------- parameters

    def _apply(self, fn, *args, **kwargs):
        # kt reads the parameters in place, so they stay in CPU memory even when
        # the rest of the model moves to an accelerator; dtype casts still apply.
        # The torch experts' base weights go where the model goes.
        def keep_on_cpu(t):
            out = fn(t)
            return out if out.device.type == "cpu" else out.to("cpu")
        torch_part = self._modules.pop("torch_experts", None)
        try:
            super()._apply(keep_on_cpu, *args, **kwargs)
        finally:
            if torch_part is not None:
                self._modules["torch_experts"] = torch_part
        if torch_part is not None:
            torch_part._apply(fn, *args, **kwargs)
        return self

    # ------------------------------------------------------ hybrid placement

    def set_torch_experts(self, ids, device=None, dtype=torch.float32):
        """Has torch compute experts ``ids`` on ``device`` and kt the rest
        (see the class doc); ``ids=()`` gives every expert back to kt. The
        base weights of inference and LoRA mode are copied from kt's stored
        ones as ``dtype`` at the next forward (load the weights first)."""
        ids = tuple(sorted(set(int(e) for e in ids)))
        if any(e < 0 or e >= self.num_experts for e in ids):
            raise ValueError("kt: torch expert ids must be in [0, %d), got %s"
                             % (self.num_experts, list(ids)))
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError("kt: the torch experts' dtype must be float32, bfloat16 or float16")
        mask = torch.zeros(self.num_experts, dtype=torch.uint8)
        mask[list(ids)] = 1
        self.kt_layer.set_skipped(mask)
        self.torch_expert_ids = ids
        self.torch_experts = None
        if ids:
            part = nn.Module()
            part.device = torch.device(device) if device is not None else torch.device("cpu")
            part.dtype = dtype
            part.register_buffer("ids", torch.tensor(ids, dtype=torch.long, device=part.device),
                                 persistent=False)
            self.torch_experts = part
        self._torch_base_stale = self.mode != "full" and bool(ids)

    def _skip_torch_experts_in_kt(self):
        mask = torch.zeros(self.num_experts, dtype=torch.uint8)
        mask[list(self.torch_expert_ids)] = 1
        self.kt_layer.set_skipped(mask)

    def _refresh_torch_base(self):
        """Copies the torch experts' frozen base weights from kt."""
        part = self.torch_experts
        w = self.read_weights(dtype=part.dtype if part.dtype != torch.float16 else torch.float32)
        idx = torch.tensor(self.torch_expert_ids, dtype=torch.long)
        for name, t in w.items():
            part.register_buffer(name, t.index_select(0, idx).to(device=part.ids.device, dtype=part.dtype),
                                 persistent=False)
        self._torch_base_stale = False

    def _torch_experts_forward(self, x, ids, weights):
        """The routes to the torch experts, computed by torch on their device
        (x [T,H], ids/weights [T,k] on any device); returns [T,H] there."""
        part = self.torch_experts
        if self._torch_base_stale:
            self._refresh_torch_base()
        dev, dt = part.ids.device, x.dtype
        xd, idsd, wd = x.to(dev), ids.to(dev), weights.to(dev)
        out = torch.zeros(xd.shape, dtype=dt, device=dev)
        scale_grads = self.grad_scale != 1.0

        def param_rows(attr):
            p = getattr(self, attr)
            if scale_grads and p.requires_grad:
                p = _ScaleGrad.apply(p, self.grad_scale)
            return p.index_select(0, part.ids.to(p.device)).to(device=dev, dtype=dt)

        if self.mode == "full":
            base = {k: param_rows(a) for k, a in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down"))}
            if self.has_bias:
                base.update({k: param_rows(a) for k, a in (("bias_gate", "b_gate"), ("bias_up", "b_up"),
                                                           ("bias_down", "b_down"))})
        else:
            base = {k: getattr(part, k).to(dt) for k in ("gate", "up", "down")}
            if self.has_bias:
                base.update({k: getattr(part, k).to(dt) for k in ("bias_gate", "bias_up", "bias_down")})
        lora = {}
        for p in self.lora_targets:
            lora[p] = (param_rows("lora_A_" + p), param_rows("lora_B_" + p))

        def project(p, j, h):
            z = F.linear(h, base[p][j], base["bias_" + p][j] if self.has_bias else None)
            if p in lora:
                a, b = lora[p]
                z = z + self.lora_scale * F.linear(F.linear(h, a[j]), b[j])
            return z

        for j, e in enumerate(self.torch_expert_ids):
            tok, slot = torch.nonzero(idsd == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = xd.index_select(0, tok)
            g, u = project("gate", j, h), project("up", j, h)
            a = _activation(g, u, self.activation, self.act_alpha, self.act_limit)
            o = project("down", j, a) * wd[tok, slot].to(dt).unsqueeze(1)
            out = out.index_add(0, tok, o)
        return out

    def sync_parameters(self):
        """Makes kt see the current parameter values: rebinds tensors that were
        replaced and re-reads the ones changed in place. forward calls it."""
        params = self.trainable_parameters()
        if not params:
            return
        rebind = {}
        for arg, p in params:
            if p.device.type != "cpu":
                raise ValueError("kt: parameter %s must stay in CPU memory (kt reads it in place)"
                                 % arg)
            key = (p.data_ptr(), tuple(p.shape), p.stride(), p.dtype)
            if self._bound_keys.get(arg) != key:
                rebind[arg] = (p.detach(), key)
        changed = any(self._bound_versions.get(arg) != p._version for arg, p in params)
        if changed:
            self.release_retained()  # computed with the old values
        if rebind:
            self.kt_layer.bind(**{arg: t for arg, (t, _) in rebind.items()})
            for arg, (_, key) in rebind.items():
                self._bound_keys[arg] = key
        if self.mode == "full":
            # Binding only records the tensors; kt packs them at params_changed.
            if rebind or changed or self._needs_reload:
                self.kt_layer.params_changed()
        elif (changed or self._needs_reload) and not rebind:
            # A LoRA bind already read every factor (all are bound together).
            self.kt_layer.params_changed()
        self._needs_reload = False
        for arg, p in params:
            self._bound_versions[arg] = p._version

    def _prepare_param_grads(self):
        """Binds the gradient buffers kt writes next; returns (accumulate,
        [(param, buffer)] to install as .grad after backward) or None when no
        parameter needs a gradient."""
        params = self.trainable_parameters()
        wanted = [p.requires_grad for _, p in params]
        if not any(wanted):
            return None
        have = [p.grad is not None for (_, p), w in zip(params, wanted) if w]
        accumulate = any(have)
        install, binds = [], {}
        for (arg, p), want in zip(params, wanted):
            target = p.grad if want else None
            if target is not None and (target.device.type != "cpu" or target.shape != p.shape
                                       or target.dtype not in (torch.float32, torch.bfloat16)):
                raise ValueError("kt: %s.grad must be a CPU float32/bfloat16 tensor of the "
                                 "parameter's shape" % arg)
            if target is None:
                target = self._grad_buffers.get(arg)
                if target is None or target.shape != p.shape or target.dtype != p.dtype:
                    target = torch.empty(p.shape, dtype=p.dtype)
                    self._grad_buffers[arg] = target
                if accumulate:
                    target.zero_()
                elif self.torch_expert_ids:
                    # kt never writes the torch experts' rows; torch adds to them.
                    target.index_fill_(0, torch.tensor(self.torch_expert_ids), 0)
                if want:
                    install.append((p, target))
            grad_arg = "GRAD_" + arg
            key = (target.data_ptr(), tuple(target.shape), target.stride(), target.dtype)
            if self._bound_keys.get(grad_arg) != key:
                binds[grad_arg] = (target, key)
        if binds:
            self.kt_layer.bind(**{a: t for a, (t, _) in binds.items()})
            for a, (_, key) in binds.items():
                self._bound_keys[a] = key
        return accumulate, install

    # ------------------------------------------------- copies and state_dict

    def read_weights(self, dtype=torch.bfloat16):
        """The base weights as kt computes with them (stored as bf16, so a
        bf16 copy is exact): gate, up [E,I,H], down [E,H,I], and fp32 bias_*
        [E,out] for a layer with biases."""
        if self.mode == "full":
            w = {"gate": self.w_gate, "up": self.w_up, "down": self.w_down}
            if self.has_bias:
                w.update(bias_gate=self.b_gate, bias_up=self.b_up, bias_down=self.b_down)
            return {k: v.detach().to(dtype if not k.startswith("bias") else torch.float32).clone()
                    for k, v in w.items()}
        E, H, I = self.num_experts, self.hidden, self.intermediate
        w = {"gate": torch.empty(E, I, H, dtype=dtype), "up": torch.empty(E, I, H, dtype=dtype),
             "down": torch.empty(E, H, I, dtype=dtype)}
        if self.has_bias:
            w.update(bias_gate=torch.empty(E, I), bias_up=torch.empty(E, I), bias_down=torch.empty(E, H))
        self.kt_layer.read_weights(**w)
        return w

    def _state_tensors(self, keep_vars):
        """{relative key: tensor} this module contributes to a state_dict."""
        naming = self.hf_naming
        if self.mode == "lora":
            lora = {attr: (p if keep_vars else p.detach()) for _, attr in self._arg_names
                    for p in (getattr(self, attr),)}
            if naming is None:
                return lora
            return _hf_names.lora_to_peft(naming, lora, self.lora_targets,
                                          peft_in_out=getattr(self, "peft_in_out", False))[0]
        if self.mode == "full":
            w = {"gate": self.w_gate, "up": self.w_up, "down": self.w_down}
            if self.has_bias:
                w.update(bias_gate=self.b_gate, bias_up=self.b_up, bias_down=self.b_down)
            w = {k: (v if keep_vars else v.detach()) for k, v in w.items()}
        else:
            w = self.read_weights()
        return _hf_names.weights_to_hf(naming, w)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, t in self._state_tensors(keep_vars).items():
            destination[prefix + key] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.mode == "lora":
            wanted = list(self._state_tensors(keep_vars=False).keys())
        else:
            wanted = _hf_names.hf_weight_keys(self.hf_naming, self.num_experts, self.has_bias)
        found = {k: state_dict[prefix + k] for k in wanted if prefix + k in state_dict}
        missing = [prefix + k for k in wanted if k not in found]
        missing_keys.extend(missing)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in wanted)
        if missing:
            return
        try:
            self._load_state_tensors(found)
        except (ValueError, RuntimeError, KeyError) as e:
            error_msgs.append("%s: %s" % (prefix.rstrip(".") or type(self).__name__, e))

    def _load_state_tensors(self, tensors):
        naming = self.hf_naming
        with torch.no_grad():
            if self.mode == "lora":
                if naming is None:
                    lora = tensors
                else:
                    lora = _hf_names.lora_from_peft(naming, tensors, self.lora_targets, self.num_experts,
                                                    self.lora_rank,
                                                    peft_in_out=getattr(self, "peft_in_out", False))
                for attr, t in lora.items():
                    getattr(self, attr).copy_(t)
                return
            w = _hf_names.weights_from_hf(naming, tensors, self.num_experts, self.has_bias)
            if self.mode == "full":
                for k, attr in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down"), ("bias_gate", "b_gate"),
                                ("bias_up", "b_up"), ("bias_down", "b_down")):
                    if k in w:
                        getattr(self, attr).copy_(w[k])
                self._needs_reload = True
                return
            self.load_weights(**w)

    def __deepcopy__(self, memo):
        """A new kt layer with the same options and engine (the engine, a
        worker pool, is shared). Trainable tensors (LoRA factors; full-mode
        weights) are deep-copied like any Parameter. Frozen base weights of
        inference and LoRA mode are shared read-only: the copy maps the packed
        cache its source was loaded from, or a packed snapshot written to a
        temporary file (removed at once; the mapping keeps it), so a copy does
        not add the experts to the process's private memory a second time."""
        new = type(self)(**self._init_kwargs)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name in ("_parameters", "_buffers", "_modules", "kt_layer", "_init_kwargs", "_bound_keys",
                        "_bound_versions", "_grad_buffers", "_needs_reload", "_retained", "_grads_ready"):
                continue
            new.__dict__[name] = copy.deepcopy(value, memo)
        for name, p in self._parameters.items():
            new._parameters[name] = copy.deepcopy(p, memo)
        for name, b in self._buffers.items():
            new._buffers[name] = copy.deepcopy(b, memo)
        for name, m in self._modules.items():
            new._modules[name] = copy.deepcopy(m, memo)
        new._claim_parameters()
        new._needs_reload = self.mode == "full"
        if self.torch_expert_ids:
            new._skip_torch_experts_in_kt()
        if self.mode != "full" and self.kt_layer.num_loaded():
            source = self.kt_layer.weights_source
            if source is not None and source[0] == "packed":
                new.kt_layer.load_packed(source[1], verify_checksums=False)
            else:
                fd, path = tempfile.mkstemp(prefix="kt-copy-", suffix=".ktpack")
                os.close(fd)
                try:
                    self.kt_layer.save_packed(path)
                    new.kt_layer.load_packed(path, verify_checksums=False)
                finally:
                    os.unlink(path)
                new.kt_layer.weights_source = source
        return new

    # ---------------------------------------------------------------- forward

    def forward(self, x, ids, weights):
        shape, device = x.shape, x.device
        x2 = x.reshape(-1, self.hidden)
        ids2 = ids.reshape(-1, self.top_k)
        w2 = weights.reshape(-1, self.top_k)
        from_torch = (self._torch_experts_forward(x2, ids2, w2) if self.torch_expert_ids
                      and device.type != "meta" else None)
        moved = device.type not in ("cpu", "meta")
        if moved:
            x2, ids2, w2 = x2.to("cpu"), ids2.to("cpu"), w2.to("cpu")
        if x2.shape[0] and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        self.sync_parameters()
        params = [p for _, p in self.trainable_parameters()]
        retain = self.activation_policy == "retain" and self.training
        grad_enabled = torch.is_grad_enabled()
        call = _Call(grad_enabled, save_without_grad=retain and not grad_enabled
                     and not torch.is_inference_mode_enabled())
        y = _MoEFunction.apply(self, call, x2, ids2, w2, *params)
        if retain and call.computed and (call.saved is None or call.saved() is None):
            # Autograd did not keep what this forward saved (checkpointing's
            # first forward): keep it for the recompute.
            self._retain(call.computed, x2, ids2, w2, y)
        if moved:
            y = y.to(device)
        if from_torch is not None:
            y = y + from_torch.to(device)
        return y.reshape(shape)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient (grad_scale for the
    torch experts' parameter rows, as kt scales its own)."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _activation(g, u, activation, alpha, limit):
    """The activations of docs/math.md ("Activations"), in torch."""
    if activation == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def _split_gate_up(gate_up, orientation, interleaved):
    # [E, 2I, ...] (out_in) or [E, H, 2I] (in_out) -> gate, up in the same orientation
    axis = 2 if orientation == "in_out" and gate_up.dim() == 3 else 1
    n = gate_up.shape[axis] // 2
    if interleaved:
        idx_g = torch.arange(0, 2 * n, 2)
        return gate_up.index_select(axis, idx_g), gate_up.index_select(axis, idx_g + 1)
    return gate_up.narrow(axis, 0, n), gate_up.narrow(axis, n, n)


def _cpu_args(**tensors):
    out = {}
    for k, t in tensors.items():
        if t is None:
            continue
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        out[k] = t
    return out
