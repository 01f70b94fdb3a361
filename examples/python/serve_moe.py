#!/usr/bin/python3
"""A small serving loop: batched greedy generation on a synthetic MoE decoder
whose routed experts run in kt, submitted asynchronously and overlapped with
the host's own torch work, next to the same loop with the experts in torch.

Each MoE layer: the router runs in torch; the routed experts are submitted
to kt (MoE.forward_submit, kt_moe_forward_submit: kt computes on its job
thread); meanwhile torch computes the shared expert; then the host waits
for kt (Job.wait, kt_job_wait) and adds the two. On a GPU host the torch
parts would run on the GPU and only the routed experts' inputs and outputs
cross to the CPU; here everything is on the CPU.

  serve_moe.py [--experts kt|torch|both] [--batch 8] [--prompt 32] [--new-tokens 32]
               [--precision default|fp32] [--threads N]

Prints the generated tokens of each sequence and the prefill and decode
throughput (tokens/s) of each experts backend; with --experts both also
whether the two generated the same tokens (greedy decoding; the weights are
bf16-rounded so both compute with the same values: with --precision fp32 kt
keeps fp32 activations as torch does and the tokens match).
"""
import argparse
import math
import os
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "plugins", "python"))
import kt  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", choices=["kt", "torch", "both"], default="both")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--precision", choices=["default", "fp32"], default="default",
                   help="kt engine precision (fp32: fp32 activations in the weight GEMMs)")
    p.add_argument("--threads", type=int, default=0, help="kt worker threads (0 = every CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def bf16_rounded(t):
    return t.to(torch.bfloat16).to(torch.float32)


class Attention(nn.Module):
    """Causal self-attention with a key/value cache."""

    def __init__(self, H, heads):
        super().__init__()
        self.heads, self.head_dim = heads, H // heads
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.out = nn.Linear(H, H, bias=False)

    def forward(self, h, cache):
        B, S, H = h.shape
        q, k, v = self.qkv(h).view(B, S, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        past = k.shape[2] - S
        causal = torch.ones(S, k.shape[2], dtype=torch.bool).triu(past + 1)
        a = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        return self.out(a.transpose(1, 2).reshape(B, S, H))


class SharedExpert(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_up = nn.Linear(H, 2 * I, bias=False)
        self.down = nn.Linear(I, H, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class MoELayer(nn.Module):
    """Router and shared expert in torch; routed experts [E, I, H] gate/up,
    [E, H, I] down, computed by kt (async) or by torch's per-expert loop."""

    def __init__(self, args, engine):
        super().__init__()
        H, I, E = args.hidden, args.intermediate, args.num_experts
        self.top_k = args.top_k
        self.router = nn.Linear(H, E, bias=False)
        self.shared = SharedExpert(H, I)
        self.w_gate = bf16_rounded(torch.randn(E, I, H) / math.sqrt(H))
        self.w_up = bf16_rounded(torch.randn(E, I, H) / math.sqrt(H))
        self.w_down = bf16_rounded(torch.randn(E, H, I) / math.sqrt(I))
        self.kt_layer = None
        if engine is not None:
            self.kt_layer = kt.MoE(E, args.top_k, H, I, max_tokens=args.batch * args.prompt, engine=engine)
            self.kt_layer.load_weights(gate=self.w_gate, up=self.w_up, down=self.w_down)

    def route(self, x):
        w, ids = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def torch_experts(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            h = x[tok]
            a = F.silu(h @ self.w_gate[e].T) * (h @ self.w_up[e].T)
            out.index_add_(0, tok, (a @ self.w_down[e].T) * w[tok, slot, None])
        return out

    def forward(self, x, use_kt):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        ids, w = self.route(x)
        if use_kt:
            y = torch.empty_like(x)
            job = self.kt_layer.forward_submit(x, ids, w, y)  # kt starts on its job thread
            shared = self.shared(x)                            # the host's work, meanwhile
            job.wait()
            out = y + shared
        else:
            out = self.torch_experts(x, ids, w) + self.shared(x)
        return out.reshape(shape)


class Decoder(nn.Module):
    def __init__(self, args, engine):
        super().__init__()
        H = args.hidden
        self.embed = nn.Embedding(args.vocab, H)
        self.layers = nn.ModuleList()
        for _ in range(args.layers):
            layer = nn.Module()
            layer.norm1, layer.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
            layer.attn = Attention(H, args.heads)
            layer.moe = MoELayer(args, engine)
            self.layers.append(layer)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, args.vocab, bias=False)

    def forward(self, tokens, caches, use_kt):
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            h = h + layer.attn(layer.norm1(h), cache)
            h = h + layer.moe(layer.norm2(h), use_kt)
        return self.head(self.norm(h[:, -1]))


@torch.inference_mode()
def generate(model, prompts, new_tokens, use_kt):
    """Greedy decoding; returns (tokens [B, new_tokens], prefill s, decode s)."""
    caches = [[] for _ in model.layers]
    start = time.perf_counter()
    next_token = model(prompts, caches, use_kt).argmax(-1)
    prefill = time.perf_counter() - start
    out = [next_token]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        next_token = model(next_token[:, None], caches, use_kt).argmax(-1)
        out.append(next_token)
    return torch.stack(out, dim=1), prefill, time.perf_counter() - start


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    engine = kt.Engine(num_threads=args.threads, precision=args.precision) if args.experts != "torch" else None
    model = Decoder(args, engine).eval()
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(args.seed + 1))
    print("serve_moe: %d layers, H=%d, %d experts (top %d, I=%d) + shared expert, batch %d, prompt %d, "
          "%d new tokens; kt: %s" % (args.layers, args.hidden, args.num_experts, args.top_k,
                                      args.intermediate, args.batch, args.prompt, args.new_tokens,
                                      engine.info() if engine else "not used"))
    backends = ["kt", "torch"] if args.experts == "both" else [args.experts]
    results = {}
    for name in backends:
        generate(model, prompts[:, :4], 2, name == "kt")  # warm-up
        tokens, prefill, decode = generate(model, prompts, args.new_tokens, name == "kt")
        results[name] = tokens
        for b in range(args.batch):
            print("tokens %s %d: %s" % (name, b, " ".join(str(t) for t in tokens[b].tolist())))
        decode_tokens = args.batch * (args.new_tokens - 1)
        print("%s experts: prefill %.0f tokens/s, decode %.1f tokens/s (%d tokens in %.3f s)" % (
            name, args.batch * args.prompt / prefill, decode_tokens / decode if decode else float("nan"),
            decode_tokens, decode))
    if len(results) == 2:
        print("kt and torch experts generated the same tokens: %s"
              % ("yes" if torch.equal(results["kt"], results["torch"]) else "no"))


if __name__ == "__main__":
    main()
