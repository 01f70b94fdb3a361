"""Random MoE problems shared by the tests: weights, routing, LoRA factors."""
import math

import torch

from helpers.reference import bf16_round

PROJ_SHAPES = {"gate": ("I", "H"), "up": ("I", "H"), "down": ("H", "I")}


def make_case(E, k, H, I, T, *, dtype=torch.float32, mode="inference", bias=False, rank=4,
              x_scale=1.0, empty_routes=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    dims = {"H": H, "I": I}

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    w = {}
    for p, (o, i) in PROJ_SHAPES.items():
        w[p] = bf16_round(randn(E, dims[o], dims[i], scale=1.0 / math.sqrt(dims[i])))
        if bias:
            w["b_" + p] = randn(E, dims[o], scale=0.1)
    x = randn(T, H, scale=x_scale).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int64)
    if empty_routes and T > 2:
        ids[1, 0] = -1          # a route the host computes elsewhere
        ids[T - 1, :] = -1      # a token with no route at all
    weights = torch.rand(T, k, generator=g).to(dtype)
    dy = randn(T, H).to(dtype)
    lora = None
    if mode == "lora":
        lora = {}
        for p, (o, i) in PROJ_SHAPES.items():
            lora["A_" + p] = randn(E, rank, dims[i], scale=0.2).to(dtype)
            lora["B_" + p] = randn(E, dims[o], rank, scale=0.2).to(dtype)
    return dict(w=w, x=x, ids=ids, weights=weights, dy=dy, lora=lora)


def build_module(case, E, k, H, I, *, mode, kind="silu", limit=0.0, bias=False, rank=4,
                 alpha=8.0, use_rslora=False, engine=None, param_dtype=torch.float32,
                 max_tokens=1024):
    import kt.torch as ktt
    m = ktt.MoEExperts(E, k, H, I, activation=kind, act_limit=limit, bias=bias, mode=mode,
                       lora_rank=rank, lora_alpha=alpha, use_rslora=use_rslora, engine=engine,
                       param_dtype=param_dtype, max_tokens=max_tokens)
    w = case["w"]
    kwargs = dict(gate=w["gate"], up=w["up"], down=w["down"])
    if bias:
        kwargs.update(bias_gate=w["b_gate"], bias_up=w["b_up"], bias_down=w["b_down"])
    m.load_weights(**kwargs)
    if mode == "lora":
        with torch.no_grad():
            for key, t in case["lora"].items():
                getattr(m, "lora_" + key).copy_(t)
    return m
