#!/usr/bin/python3
"""What activation checkpointing costs over kt experts, and what
activation_policy="retain" saves: one LoRA training step (forward +
backward) of a stack of pre-norm MoE layers (norm and router in torch,
routed experts in kt; no attention, whose recompute would cost every
checkpointed variant alike), without checkpointing and with
torch.utils.checkpoint (reentrant and not) under both policies, measured
side by side in one run (interleaved reps, median).

Per variant: ms per step, kt expert forwards per layer per step, ms of them
(kt forward calls, timed around the call), and the kt contexts (saved
activations) held from the forward to the backward, which is what
checkpointing exists to drop and "retain" keeps. Run with /usr/bin/python3.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "plugins", "python"))
import kt  # noqa: E402
import kt.torch  # noqa: E402

VARIANTS = [("none", None, "recompute"),
            ("reentrant", True, "recompute"), ("reentrant", True, "retain"),
            ("non_reentrant", False, "recompute"), ("non_reentrant", False, "retain")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p.parse_args()


class MoEBlock(nn.Module):
    def __init__(self, args, policy, engine):
        super().__init__()
        self.top_k = args.top_k
        self.gate = nn.Linear(args.hidden, args.experts, bias=False)
        self.experts = kt.torch.MoEExperts(args.experts, args.top_k, args.hidden, args.intermediate,
                                           mode="lora", lora_rank=args.rank, engine=engine,
                                           max_tokens=args.batch * args.seq, activation_policy=policy)

    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        w, ids = torch.topk(F.softmax(self.gate(h), dim=-1, dtype=torch.float), self.top_k, dim=-1)
        return self.experts(h, ids, (w / w.sum(-1, keepdim=True)).to(h.dtype)).reshape(shape)


class Model(nn.Module):
    def __init__(self, args, policy, engine):
        super().__init__()
        H = args.hidden
        self.layers = nn.ModuleList()
        for _ in range(args.layers):
            layer = nn.Module()
            layer.norm = nn.LayerNorm(H)
            layer.mlp = MoEBlock(args, policy, engine)
            self.layers.append(layer)
        self.use_reentrant = None

    @staticmethod
    def _layer(layer, h):
        return h + layer.mlp(layer.norm(h))

    def forward(self, h):
        for layer in self.layers:
            if self.use_reentrant is None:
                h = self._layer(layer, h)
            else:
                h = torch.utils.checkpoint.checkpoint(self._layer, layer, h, use_reentrant=self.use_reentrant)
        return h


def build(args, use_reentrant, policy, engine):
    torch.manual_seed(0)
    model = Model(args, policy, engine)
    model.use_reentrant = use_reentrant
    E, H, I = args.experts, args.hidden, args.intermediate
    for layer in model.layers:
        ex = layer.mlp.experts
        ex.load_weights(gate=torch.randn(E, I, H) / H ** 0.5, up=torch.randn(E, I, H) / H ** 0.5,
                        down=torch.randn(E, H, I) / I ** 0.5)
        with torch.no_grad():
            for p in (ex.lora_B_gate, ex.lora_B_up, ex.lora_B_down):
                p.normal_(0, 0.01)
        timer = {"calls": 0, "s": 0.0}
        forward = ex.kt_layer.forward

        def timed(*a, _forward=forward, _timer=timer, **k):
            start = time.perf_counter()
            out = _forward(*a, **k)
            _timer["s"] += time.perf_counter() - start
            _timer["calls"] += 1
            return out
        ex.kt_layer.forward = timed
        layer.mlp.timer = timer
    model.train()
    return model


def step(model, x):
    for layer in model.layers:
        layer.mlp.timer.update(calls=0, s=0.0)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(x).float().square().mean()
    held = sum(layer.mlp.experts.kt_layer.live_contexts for layer in model.layers)
    loss.backward()
    elapsed = time.perf_counter() - start
    calls = [layer.mlp.timer["calls"] for layer in model.layers]
    kt_s = sum(layer.mlp.timer["s"] for layer in model.layers)
    return elapsed, calls, kt_s, held


def main():
    args = parse_args()
    engine = kt.Engine()
    # Input that requires grad, as HF's enable_input_require_grads() makes the
    # embeddings' output: reentrant checkpointing needs one.
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    models = [build(args, r, p, engine) for _, r, p in VARIANTS]
    samples = [[] for _ in VARIANTS]
    for rep in range(args.warmup + args.reps):
        for i, model in enumerate(models):  # interleaved: noise hits every variant alike
            result = step(model, x)
            if rep >= args.warmup:
                samples[i].append(result)
    rows = []
    for (name, _, policy), s in zip(VARIANTS, samples):
        rows.append({"checkpointing": name, "policy": policy,
                     "ms": 1e3 * statistics.median(r[0] for r in s),
                     "expert_forwards_per_layer": s[-1][1][0],
                     "kt_forward_ms": 1e3 * statistics.median(r[2] for r in s),
                     "contexts_held": s[-1][3]})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_no_checkpointing"] = r["ms"] / base
    setup = {"hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts,
             "top_k": args.top_k, "layers": args.layers, "tokens": args.batch * args.seq,
             "lora_rank": args.rank, "reps": args.reps, "engine": engine.info()}
    if args.json:
        print(json.dumps({"setup": setup, "results": rows}))
        return
    print("checkpoint_bench: %(layers)d layers, T=%(tokens)d, H=%(hidden)d, I=%(intermediate)d, "
          "E=%(experts)d, k=%(top_k)d, LoRA r=%(lora_rank)d, median of %(reps)d" % setup)
    print("engine: %s" % setup["engine"])
    print("%-14s %-9s %9s %8s %12s %14s %14s" % ("checkpointing", "policy", "ms/step", "vs none",
                                                  "kt fwd/layer", "kt fwd ms/step", "contexts held"))
    for r in rows:
        print("%-14s %-9s %9.1f %8.2f %12d %14.1f %14d" % (
            r["checkpointing"], r["policy"], r["ms"], r["vs_no_checkpointing"],
            r["expert_forwards_per_layer"], r["kt_forward_ms"], r["contexts_held"]))


if __name__ == "__main__":
    main()
