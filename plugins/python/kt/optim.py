"""torch optimizers that run kt's fused CPU step: ``kt.optim.AdamW`` and
``kt.optim.SGD``.

They are ``torch.optim.Optimizer`` subclasses with torch's hyperparameters,
``param_groups`` (read at every step, so LR schedulers work), ``state_dict``
/ ``load_state_dict`` (the keys of torch.optim.AdamW / SGD, so state moves
between them) and ``zero_grad``. Parameters must be CPU float32 tensors
(updated in place); gradients float32 or bfloat16. The arithmetic is
torch.optim's, in its operation order (see kt_c_api.h): the same bits as
the for-loop implementation of the torch they run with (1.x or 2.x, which
differ in how AdamW moves exp_avg) on AVX2/AVX-512 CPUs.

The parameters of a ``kt.torch.MoEExperts`` (LoRA factors, or full-mode
weights and biases) are stepped by one kt optimizer over the layer when all
of them are in the same parameter group with gradients: it reads the
gradients kt wrote, and in full mode writes the layer's packed weights in
the same pass (no repack at the next forward). Parameters may then be
float32 (updated in place, they are the masters) or bfloat16 (kt keeps
float32 masters, ``state[p]["master"]``, and writes the parameter back
rounded; an in-place change of the parameter by the host is taken into the
master before the next step). Any other parameter, float32 on the CPU, gets
a kt optimizer of its own.

A step first reads every gradient and is skipped, changing nothing, when
one is inf or NaN: one such gradient of any parameter skips the whole step
for every parameter, as torch's ``GradScaler`` does (under ``overlap()``
the layers already stepped during the backward check only their own
gradients). ``assume_finite=True`` (a keyword of both optimizers, or
the attribute of that name between steps) is for a host that has checked the
gradients itself, as torch's ``GradScaler`` does (its ``step`` calls
``step()`` only when ``unscale_`` found no inf/NaN): each step then reads
the gradients once, and a non-finite one goes into the parameter and state
as in torch.optim's step (kt_optimizer_options.assume_finite).

kt owns the state; ``state[p]`` holds views of it, and ``state_dict()``
returns copies. kt keeps the parameter's storage from its first step on:
replacing ``p.data`` with another tensor afterwards is not followed.
"""
import contextlib
import ctypes
import weakref

import torch

from . import _capi
from .core import _Handle, check, default_engine, lib
from ._tensor import DLView


def host_arithmetic():
    """kt_optim_arithmetic of the torch in this process: its optimizers'
    operation order is the one kt reproduces."""
    major = int(torch.__version__.split(".")[0])
    return _capi.OPTIM_TORCH2 if major >= 2 else _capi.OPTIM_TORCH1


def _state_view(handle, which, shape, index=0):
    """A torch tensor over kt's state buffer (no copy)."""
    t = _capi.DLTensor()
    check(lib().kt_optimizer_state(handle, index, which, ctypes.byref(t)))
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.zeros(shape, dtype=torch.float32)
    buf = (ctypes.c_float * numel).from_address(t.data)
    return torch.frombuffer(buf, dtype=torch.float32).view(shape)


class _OptimizerHandle(_Handle):
    """Owns one kt_optimizer handle."""

    def close(self):
        if getattr(self, "job", None):
            self._lib.kt_job_destroy(self.job)  # waits for it
            self.job = None
        if self.handle:
            self._lib.kt_optimizer_destroy(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _KtParamState(_OptimizerHandle):
    """The kt optimizer of one parameter."""

    def __init__(self, param, options, engine):
        self._lib = lib()
        # Until the first step gives a gradient, kt reads this zero tensor.
        self.placeholder_grad = torch.zeros_like(param)
        pv, gv = DLView(param), DLView(self.placeholder_grad)
        pair = _capi.OptimizerParam(pv.ptr, gv.ptr)
        handle = ctypes.c_void_p()
        check(self._lib.kt_optimizer_create(engine.handle if engine else None, ctypes.byref(options),
                                            ctypes.byref(pair), 1, ctypes.byref(handle)))
        self.handle = handle
        self.engine = engine  # kept alive while the optimizer exists
        self.grad = self.placeholder_grad

    def use_grad(self, grad):
        if grad is self.grad:
            return
        view = DLView(grad)
        check(self._lib.kt_optimizer_set_grad(self.handle, 0, view.ptr))
        self.grad = grad  # retained by kt: keep it alive



class _KtLayerState(_OptimizerHandle):
    """The kt optimizer over one MoEExperts layer's trainable parameters."""

    def __init__(self, module, options):
        self._lib = lib()
        module.sync_parameters()
        module._bind_grads_for_step()
        handle = ctypes.c_void_p()
        check(self._lib.kt_optimizer_create_for_layer(module.kt_layer.handle, ctypes.byref(options),
                                                      ctypes.byref(handle)))
        self.handle = handle
        self.layer = module.kt_layer  # the layer must outlive its optimizer
        self.module = weakref.ref(module)
        self.params = [p for _, p in module.trainable_parameters()]
        self.versions = [p._version for p in self.params]
        self.job = None         # a step submitted by overlap(), until step() waits for it
        self.job_grads = None   # the gradients that step reads, kept alive until it ends

    def take_host_writes(self):
        """A bf16 parameter the host changed in place since kt last wrote it
        goes into kt's fp32 master (an fp32 parameter is its own master)."""
        for i, p in enumerate(self.params):
            if p._version != self.versions[i] and p.dtype != torch.float32:
                _state_view(self.handle, _capi.OPTIM_STATE_MASTER, tuple(p.shape), i).copy_(p.detach())



def _layer_of(p):
    """The MoEExperts whose trainable parameter p is, or None."""
    ref = getattr(p, "_kt_owner", None)
    module = ref() if ref is not None else None
    if module is None or not any(q is p for _, q in module.trainable_parameters()):
        return None
    return module


class _KtOptimizer(torch.optim.Optimizer):
    _ALGORITHM = None

    def __init__(self, params, defaults, engine=None, assume_finite=False):
        if defaults.get("maximize"):
            raise ValueError("kt.optim: maximize=True is not supported")
        super().__init__(params, defaults)
        self.assume_finite = bool(assume_finite)
        self._engine = engine if engine is not None else default_engine()
        self._kt = {}       # parameter -> _KtParamState
        self._layers = {}   # id(MoEExperts) -> _KtLayerState

    def _options(self, group):
        o = _capi.OptimizerOptions()
        lib().kt_optimizer_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.algorithm = self._ALGORITHM
        o.arithmetic = host_arithmetic()
        o.assume_finite = 1 if self.assume_finite else 0
        self._fill_options(o, group)
        return o

    def _entry(self, p, group):
        entry = self._kt.get(p)
        if entry is None:
            entry = _KtParamState(p, self._options(group), self._engine)
            self._kt[p] = entry
            self._attach_state(p, group, entry)
        return entry

    def _attach_state(self, p, group, entry):
        """Points state[p] at kt's buffers, first copying in any state that
        load_state_dict put there (from kt or from torch's optimizer)."""
        entry.views = self._attach_views(p, group, entry.handle, 0)
        step = self._kt_step_of(self.state.get(p, {}))
        check(lib().kt_optimizer_set_step(entry.handle, step))
        self.state[p] = self._public_state(group, entry.views, step)

    def _attach_views(self, p, group, handle, index):
        old = self.state.get(p, {})
        keys = list(self._state_keys(group))
        if p.dtype != torch.float32:
            keys.append(("master", _capi.OPTIM_STATE_MASTER))
        views = {}
        for key, which in keys:
            view = _state_view(handle, which, tuple(p.shape), index)
            if isinstance(old.get(key), torch.Tensor):
                view.copy_(old[key].to(torch.float32).reshape(view.shape))
            views[key] = view
        return views

    def _layer_entry(self, module, group):
        """The layer optimizer of module, when every trainable parameter of it
        is in this group with a gradient; else None."""
        params = [p for _, p in module.trainable_parameters()]
        in_group = set(id(q) for q in group["params"])
        if not params or any(id(p) not in in_group or p.grad is None for p in params):
            return None
        entry = self._layers.get(id(module))
        if entry is None or entry.module() is not module or any(
                a is not b for a, b in zip(entry.params, params)):
            entry = _KtLayerState(module, self._options(group))
            entry.group = group
            self._layers[id(module)] = entry
            entry.views = [self._attach_views(p, group, entry.handle, i) for i, p in enumerate(params)]
            step = self._kt_step_of(self.state.get(params[0], {}))
            check(lib().kt_optimizer_set_step(entry.handle, step))
        return entry

    def _step_layer(self, module, entry, group, options):
        if entry.job is not None:
            # overlap() already submitted this step: wait for it.
            job, entry.job, entry.job_grads = entry.job, None, None
            status = lib().kt_job_wait(job)
            lib().kt_job_destroy(job)
            check(status)
        else:
            module.sync_parameters()
            module._bind_grads_for_step()
            entry.take_host_writes()
            check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(options)))
            check(lib().kt_optimizer_step(entry.handle, None))
        steps = ctypes.c_int64()
        check(lib().kt_optimizer_get_step(entry.handle, ctypes.byref(steps)))
        # kt wrote the parameters (and in full mode the layer's packed
        # weights) itself: nothing for the next forward to re-read.
        module._versions_read()
        entry.versions = [p._version for p in entry.params]
        for p, views in zip(entry.params, entry.views):
            self.state[p] = self._public_state(group, views, steps.value)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finite = None if self.assume_finite else self._all_gradients_finite()
        if finite is False:
            return loss
        for group in self.param_groups:
            if group.get("maximize"):
                raise ValueError("kt.optim: maximize=True is not supported")
            options = self._options(group)
            if finite:  # checked above: kt's steps need not read the gradients twice
                options.assume_finite = 1
            stepped = set()
            for p in group["params"]:
                if p.grad is None or id(p) in stepped:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("kt.optim does not support sparse gradients")
                module = _layer_of(p)
                layer_entry = self._layer_entry(module, group) if module is not None else None
                if layer_entry is not None:
                    self._step_layer(module, layer_entry, group, options)
                    stepped.update(id(q) for q in layer_entry.params)
                    continue
                entry = self._entry(p, group)
                check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(options)))
                entry.use_grad(p.grad)
                check(lib().kt_optimizer_step(entry.handle, None))
                steps = ctypes.c_int64()
                check(lib().kt_optimizer_get_step(entry.handle, ctypes.byref(steps)))
                self.state[p] = self._public_state(group, entry.views, steps.value)
                # kt wrote p in place; move its version counter as torch's
                # in-place step would, so readers of p (a MoEExperts layer)
                # see the change.
                p.view(-1)[:0].zero_()
        return loss

    def _all_gradients_finite(self):
        """True when every gradient was read and none is inf or NaN, False
        when one is, None when they were not read: steps submitted by
        overlap() are already running, and step() then waits for them as
        they are. kt's own check covers one kt optimizer (a parameter or a
        layer); without this one the others would step. A float64 sum reads
        each gradient once (no mask as large as it) and is finite exactly
        when every element is: no sum of float32 or bfloat16 values reaches
        float64's range."""
        if any(entry.job is not None for entry in self._layers.values()):
            return None
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and not g.is_sparse and not bool(torch.isfinite(g.sum(dtype=torch.float64))):
                    return False
        return True

    @contextlib.contextmanager
    def overlap(self):
        """Steps each kt layer as soon as the backward run inside the block
        has written its gradients: kt's job thread makes the step while the
        backward goes on through the rest of the model; ``step()`` then waits
        for those steps and makes the others. The results are those of a
        plain ``step()`` after the backward.

        Only layers this optimizer has already stepped once take part (their
        kt optimizer exists; the first step is a plain one), and not those
        with experts in torch (hybrid placement), whose gradients torch
        completes later in the backward. Put only the
        last backward of a gradient-accumulation window in the block, with
        this step's learning rate set before it, and do not change the
        gradients between that backward and ``step()`` (clipping or unscaling
        them then would come too late: pass a fixed scale through the layer's
        ``grad_scale`` instead)."""
        armed = []
        try:
            for entry in self._layers.values():
                module = entry.module()
                # A layer with experts in torch (hybrid placement) gets part of
                # its gradients from torch's autograd later on: stepped by step().
                if module is None or entry.job is not None or module.torch_expert_ids:
                    continue
                module._grads_ready = self._submitter(module, entry)
                armed.append(module)
            yield self
        finally:
            for module in armed:
                module._grads_ready = None

    def _submitter(self, module, entry):
        def submit():
            if entry.job is not None:
                raise RuntimeError("kt.optim.overlap(): a second backward of the same layer in one overlap() "
                                   "block; put only the last backward of an accumulation window in it")
            module._bind_grads_for_step()
            entry.take_host_writes()
            check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(self._options(entry.group))))
            entry.job_grads = [p.grad for p in entry.params]
            job = ctypes.c_void_p()
            check(lib().kt_optimizer_step_submit(entry.handle, None, 0, ctypes.byref(job)))
            entry.job = job
        return submit

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
                       for k, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch casts loaded state to each parameter's dtype; kt keeps fp32
        # state (and masters) for bf16 parameters, so take the saved values.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i)
            if saved is not None and p.dtype != torch.float32:
                self.state[p] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) and k != "step" else
                                     self.state[p].get(k, v)) for k, v in saved.items()}
        for group in self.param_groups:
            for p in group["params"]:
                entry = self._kt.get(p)
                if entry is not None:
                    check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(self._options(group))))
                    self._attach_state(p, group, entry)
        # Layer optimizers are made again at the next step from the loaded state.
        for entry in self._layers.values():
            entry.close()
        self._layers = {}


class AdamW(_KtOptimizer):
    """torch.optim.AdamW computed by kt (decoupled weight decay, amsgrad)."""

    _ALGORITHM = _capi.OPTIM_ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, maximize=False, engine=None, assume_finite=False):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults, engine, assume_finite)

    def _fill_options(self, o, group):
        o.lr = group["lr"]
        o.beta1, o.beta2 = group["betas"]
        o.eps = group["eps"]
        o.weight_decay = group["weight_decay"]
        o.amsgrad = 1 if group["amsgrad"] else 0

    def _state_keys(self, group):
        keys = [("exp_avg", _capi.OPTIM_STATE_EXP_AVG), ("exp_avg_sq", _capi.OPTIM_STATE_EXP_AVG_SQ)]
        if group["amsgrad"]:
            keys.append(("max_exp_avg_sq", _capi.OPTIM_STATE_MAX_EXP_AVG_SQ))
        return keys

    @staticmethod
    def _kt_step_of(old):
        step = old.get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    @staticmethod
    def _public_state(group, views, step):
        state = {"step": torch.tensor(float(step))}
        state.update(views)
        return state


class SGD(_KtOptimizer):
    """torch.optim.SGD computed by kt (momentum, dampening, nesterov, weight decay)."""

    _ALGORITHM = _capi.OPTIM_SGD

    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, engine=None, assume_finite=False):
        if lr < 0.0:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if momentum < 0.0:
            raise ValueError("Invalid momentum value: {}".format(momentum))
        if weight_decay < 0.0:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, engine, assume_finite)

    def _fill_options(self, o, group):
        o.lr = group["lr"]
        o.momentum = group["momentum"]
        o.dampening = group["dampening"]
        o.weight_decay = group["weight_decay"]
        o.nesterov = 1 if group["nesterov"] else 0

    @staticmethod
    def _state_keys(group):
        return [("momentum_buffer", _capi.OPTIM_STATE_MOMENTUM)]

    # torch's SGD state is {'momentum_buffer': tensor or None}: a buffer means
    # it has started (kt's step count > 0).
    @staticmethod
    def _kt_step_of(old):
        return 1 if isinstance(old.get("momentum_buffer"), torch.Tensor) else 0

    @staticmethod
    def _public_state(group, views, step):
        started = step > 0 and group["momentum"] != 0
        state = {"momentum_buffer": views["momentum_buffer"] if started else None}
        if "master" in views:
            state["master"] = views["master"]
        return state
