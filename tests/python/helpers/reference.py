"""docs/math.md written in plain torch ops, differentiated by torch autograd.

Everything runs in float64 from the exact values kt is given (base weights
rounded to bf16 first, as kt stores them), so differences measure kt alone.
"""
import math

import torch
import torch.nn.functional as F


def bf16_round(t):
    return t.to(torch.bfloat16).to(t.dtype)


def lora_scale(rank, alpha, use_rslora=False):
    """docs/math.md, "LoRA": s = alpha / r, or alpha / sqrt(r) with rsLoRA, from the
    layer's options (never from the layer)."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def checked_lora_scale(kt_scale, rank, alpha, use_rslora=False):
    """The scale the reference must use: lora_scale() of the options, after
    checking that kt reports the same (kt computes it in fp32: 1e-6 relative
    is a few of its roundings; alpha / r for alpha / sqrt(r) is off by sqrt(r))."""
    want = lora_scale(rank, alpha, use_rslora)
    assert math.isclose(kt_scale, want, rel_tol=1e-6), (
        "kt's LoRA scale is %r; r=%d, alpha=%g, use_rslora=%s give %r"
        % (kt_scale, rank, alpha, bool(use_rslora), want))
    return want


def activation(g, u, kind, alpha, limit):
    if kind == "silu":
        if limit > 0:
            g = torch.clamp(g, max=limit)
            u = torch.clamp(u, -limit, limit)
        return F.silu(g) * u
    if limit > 0:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


class _BackwardThrough(torch.autograd.Function):
    """z W^T whose backward multiplies by other weights: dz = dy W_back.
    W itself gets no gradient (a frozen base)."""

    @staticmethod
    def forward(ctx, z, w, w_back):
        ctx.save_for_backward(w_back)
        return z @ w.t()

    @staticmethod
    def backward(ctx, dy):
        (w_back,) = ctx.saved_tensors
        return dy @ w_back, None, None


def moe_forward(x, ids, weights, w, *, kind="silu", alpha=1.702, limit=0.0, lora=None,
                lora_scale=0.0, w_backward=None):
    """x [T,H], ids [T,k] (-1 = none), weights [T,k]; w: dict gate/up/down
    [E,out,in] and optional b_gate/b_up/b_down; lora: dict A_<p> [E,r,in],
    B_<p> [E,out,r]. w_backward (optional, like w): the base weights the
    backward multiplies by where they differ from the forward's (kt_c_api.h:
    a quantized base's W'^T panels are W' rounded to bf16 once); the base
    then gets no gradient, and the routing weight scales the down
    projection's input instead of its output (the same product), so that
    its gradient, like kt's, comes from W_back^T dy. Returns y [T,H]."""
    T, H = x.shape
    y = x.new_zeros(T, H)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        t, j = torch.nonzero(ids == e, as_tuple=True)
        xe = x[t]

        def proj(p, z, bias_scale=1.0):
            # z (W + s B A)^T, with the low-rank term kept factored (same value).
            if w_backward is None:
                out = z @ w[p][e].t()
            else:
                out = _BackwardThrough.apply(z, w[p][e], w_backward[p][e].to(z.dtype))
            if lora is not None and ("A_" + p) in lora:
                out = out + lora_scale * (z @ lora["A_" + p][e].t()) @ lora["B_" + p][e].t()
            if ("b_" + p) in w:
                out = out + bias_scale * w["b_" + p][e]
            return out

        a = activation(proj("gate", xe), proj("up", xe), kind, alpha, limit)
        rw = weights[t, j].unsqueeze(1)
        if w_backward is None:
            y = y.index_add(0, t, rw * proj("down", a))
        else:
            y = y.index_add(0, t, proj("down", rw * a, bias_scale=rw))
    return y


def reference_grads(x, ids, weights, w, dy, *, lora=None, weight_grads=True, **kw):
    """Forward + autograd in float64. Returns (y, grads) where grads has x,
    weights, every LoRA tensor and (with weight_grads) every tensor of w."""
    leaves = {"x": x, "weights": weights}
    leaves.update({k: v for k, v in w.items()})
    if lora:
        leaves.update({k: v for k, v in lora.items()})
    frozen = set() if weight_grads else set(w)
    d = {k: v.detach().double().requires_grad_(k not in frozen) for k, v in leaves.items()}
    wd = {k: d[k] for k in w}
    ld = {k: d[k] for k in lora} if lora else None
    y = moe_forward(d["x"], ids, d["weights"], wd, lora=ld, **kw)
    y.backward(dy.double())
    return y.detach(), {k: v.grad for k, v in d.items()}


def rel_l2(got, want):
    got, want = got.double(), want.double()
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom > 0 else (got - want).norm().item()
