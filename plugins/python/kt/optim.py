"""torch optimizers that run kt's fused CPU step: ``kt.optim.AdamW`` and
``kt.optim.SGD``.

They are ``torch.optim.Optimizer`` subclasses with torch's hyperparameters,
``param_groups`` (read at every step, so LR schedulers work), ``state_dict``
/ ``load_state_dict`` (the keys of torch.optim.AdamW / SGD, so state moves
between them) and ``zero_grad``. Parameters must be CPU float32 tensors
(updated in place); gradients float32 or bfloat16. The arithmetic is
torch.optim's, in its operation order (see kt_c_api.h): the same bits as
torch's for-loop implementation on AVX2/AVX-512 CPUs.

Each parameter gets its own kt optimizer (kt owns its state); ``state[p]``
holds views of that state, and ``state_dict()`` returns copies. kt keeps
the parameter's storage from its first step on: replacing ``p.data`` with
another tensor afterwards is not followed.
"""
import ctypes

import torch

from . import _capi
from .core import _Handle, check, default_engine, lib
from ._tensor import DLView


def _state_view(handle, which, shape):
    """A torch tensor over kt's state buffer (no copy)."""
    t = _capi.DLTensor()
    check(lib().kt_optimizer_state(handle, 0, which, ctypes.byref(t)))
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.zeros(shape, dtype=torch.float32)
    buf = (ctypes.c_float * numel).from_address(t.data)
    return torch.frombuffer(buf, dtype=torch.float32).view(shape)


class _KtParamState(_Handle):
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

    def close(self):
        if self.handle:
            self._lib.kt_optimizer_destroy(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _KtOptimizer(torch.optim.Optimizer):
    _ALGORITHM = None

    def __init__(self, params, defaults, engine=None):
        if defaults.get("maximize"):
            raise ValueError("kt.optim: maximize=True is not supported")
        super().__init__(params, defaults)
        self._engine = engine if engine is not None else default_engine()
        self._kt = {}

    def _options(self, group):
        o = _capi.OptimizerOptions()
        lib().kt_optimizer_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.algorithm = self._ALGORITHM
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
        old = self.state.get(p, {})
        entry.views = {}
        for key, which in self._state_keys(group):
            view = _state_view(entry.handle, which, tuple(p.shape))
            if isinstance(old.get(key), torch.Tensor):
                view.copy_(old[key].to(torch.float32).reshape(view.shape))
            entry.views[key] = view
        step = self._kt_step_of(old)
        check(lib().kt_optimizer_set_step(entry.handle, step))
        self.state[p] = self._public_state(group, entry, step)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("maximize"):
                raise ValueError("kt.optim: maximize=True is not supported")
            options = None
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("kt.optim does not support sparse gradients")
                entry = self._entry(p, group)
                if options is None:
                    options = self._options(group)
                check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(options)))
                entry.use_grad(p.grad)
                check(lib().kt_optimizer_step(entry.handle, None))
                steps = ctypes.c_int64()
                check(lib().kt_optimizer_get_step(entry.handle, ctypes.byref(steps)))
                self.state[p] = self._public_state(group, entry, steps.value)
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
                       for k, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                entry = self._kt.get(p)
                if entry is not None:
                    check(lib().kt_optimizer_set_options(entry.handle, ctypes.byref(self._options(group))))
                    self._attach_state(p, group, entry)


class AdamW(_KtOptimizer):
    """torch.optim.AdamW computed by kt (decoupled weight decay, amsgrad)."""

    _ALGORITHM = _capi.OPTIM_ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, maximize=False, engine=None):
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
        super().__init__(params, defaults, engine)

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
    def _public_state(group, entry, step):
        state = {"step": torch.tensor(float(step))}
        state.update(entry.views)
        return state


class SGD(_KtOptimizer):
    """torch.optim.SGD computed by kt (momentum, dampening, nesterov, weight decay)."""

    _ALGORITHM = _capi.OPTIM_SGD

    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, engine=None):
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
        super().__init__(params, defaults, engine)

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
    def _public_state(group, entry, step):
        started = step > 0 and group["momentum"] != 0
        return {"momentum_buffer": entry.views["momentum_buffer"] if started else None}
