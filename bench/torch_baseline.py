#!/usr/bin/python3
"""Torch eager baseline for kt_bench: the Hugging Face per-expert loop in bf16.

Runs the routed experts of one MoE layer the way transformers' sparse MoE
blocks do (one-hot expert mask, a loop over the experts that got tokens,
gate/up/down nn.Linear maths, index_add_ combine), on the routing that
kt_bench wrote (ids and routing weights per token count), and prints one
JSON object per line: first {"torch": ...} with the settings, then one
{"case", "tokens", "ms"} per measurement (or "error" instead of "ms").

Cases: forward; train_dx (forward + backward to x and the routing weights,
frozen experts); train_lora (+ PEFT-style LoRA r=16 on gate, up, down);
train_full (+ gradients of every expert weight).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--experts", type=int, required=True, help="experts held (ids are in [0, experts))")
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--tokens", required=True, help="comma-separated token counts")
    p.add_argument("--cases", default="forward,train_dx,train_lora,train_full")
    p.add_argument("--batch-dir", required=True,
                   help="holds ids_<T>.i32 [n,T,k] int32 and rw_<T>.f32 [n,T,k] float32")
    p.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=16)
    return p.parse_args()


def emit(obj):
    print(json.dumps(obj), flush=True)


class Experts:
    """Per-expert weights as separate tensors, as HF holds one module per expert."""

    def __init__(self, E, H, I, rank):
        g = torch.Generator().manual_seed(1234)
        sh, si = 1.0 / math.sqrt(H), 1.0 / math.sqrt(I)
        self.w = [[(torch.randn(I, H, generator=g) * sh).to(torch.bfloat16),
                   (torch.randn(I, H, generator=g) * sh).to(torch.bfloat16),
                   (torch.randn(H, I, generator=g) * si).to(torch.bfloat16)] for _ in range(E)]
        self.rank = rank
        self.scale = 2.0  # alpha / r with alpha = 2r
        self.lora = None

    def make_lora(self, H, I):
        g = torch.Generator().manual_seed(99)
        shapes = [(H, I), (H, I), (I, H)]  # (in, out) of gate, up, down
        self.lora = [[((torch.randn(self.rank, fin, generator=g) / math.sqrt(fin)).to(torch.bfloat16).requires_grad_(),
                       (torch.randn(fout, self.rank, generator=g) * 0.02).to(torch.bfloat16).requires_grad_())
                      for fin, fout in shapes] for _ in self.w]

    def drop_lora(self):
        self.lora = None

    def set_trainable(self, on):
        for ws in self.w:
            for t in ws:
                t.requires_grad_(on)
                t.grad = None

    def zero_grads(self):
        for ws in self.w:
            for t in ws:
                t.grad = None
        if self.lora:
            for ab in self.lora:
                for a, b in ab:
                    a.grad = None
                    b.grad = None

    def linear(self, x, e, p):
        y = F.linear(x, self.w[e][p])
        if self.lora is not None:
            a, b = self.lora[e][p]
            y = y + F.linear(F.linear(x, a), b) * self.scale
        return y

    def expert(self, x, e):
        return self.linear(F.silu(self.linear(x, e, 0)) * self.linear(x, e, 1), e, 2)


def moe_forward(experts, x, ids, rw, E):
    """transformers' sparse MoE expert loop; ids of -1 (no route) are dropped."""
    T, H = x.shape
    final = torch.zeros((T, H), dtype=x.dtype)
    mapped = torch.where(ids < 0, torch.full_like(ids, E), ids)
    expert_mask = F.one_hot(mapped, num_classes=E + 1)[..., :E].permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in expert_hit.flatten().tolist():
        idx, top_x = torch.where(expert_mask[e])
        current = x[None, top_x].reshape(-1, H)
        h = experts.expert(current, e) * rw[top_x, idx, None]
        final.index_add_(0, top_x, h.to(x.dtype))
    return final


def load_batches(batch_dir, T, k):
    with open(os.path.join(batch_dir, f"ids_{T}.i32"), "rb") as f:
        ids = torch.frombuffer(bytearray(f.read()), dtype=torch.int32)
    with open(os.path.join(batch_dir, f"rw_{T}.f32"), "rb") as f:
        rw = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    n = ids.numel() // (T * k)
    return ids.view(n, T, k).long(), rw.view(n, T, k).to(torch.bfloat16)


def time_case(case, experts, batches, H, E, warmup, reps):
    ids_all, rw_all = batches
    n, T, _ = ids_all.shape
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    training = case != "forward"
    times = []
    for call in range(warmup + reps):
        ids, rw = ids_all[call % n], rw_all[call % n]
        start = time.perf_counter()
        if training:
            xi = x.detach().requires_grad_()
            rwi = rw.detach().requires_grad_()
            experts.zero_grads()
            y = moe_forward(experts, xi, ids, rwi, E)
            y.backward(dy)
        else:
            with torch.no_grad():
                moe_forward(experts, x, ids, rw, E)
        if call >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    H, I, E, k = args.hidden, args.intermediate, args.experts, args.top_k
    tokens = [int(t) for t in args.tokens.split(",") if t]
    cases = [c for c in args.cases.split(",") if c]
    emit({"torch": torch.__version__, "threads": torch.get_num_threads(), "python": sys.version.split()[0]})
    experts = Experts(E, H, I, args.lora_rank)
    batches = {T: load_batches(args.batch_dir, T, k) for T in tokens}
    for case in cases:
        experts.set_trainable(case == "train_full")
        if case == "train_lora":
            experts.make_lora(H, I)
        for T in tokens:
            try:
                seconds = time_case(case, experts, batches[T], H, E, args.warmup, args.reps)
                emit({"case": case, "tokens": T, "ms": seconds * 1e3})
            except (RuntimeError, MemoryError) as e:
                emit({"case": case, "tokens": T, "error": str(e).splitlines()[0]})
        experts.drop_lora()
        experts.set_trainable(False)


if __name__ == "__main__":
    main()
