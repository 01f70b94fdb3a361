#!/usr/bin/env python3
"""Fine-tuning of a small MoE transformer whose routed experts run in kt.

The model has the module layout of a Qwen3-MoE checkpoint (attention, a
router ``mlp.gate`` and routed experts ``mlp.experts.{e}.{gate,up,down}_proj``);
kt.hf moves the routed experts into kt, the rest stays in torch.

* ``--mode lora`` (default): LoRA on every expert projection, plus the routers.
* ``--mode full``: every weight trains. The experts' weights are bf16
  parameters (``--param-dtype``) whose fp32 masters and AdamW moments kt's
  optimizer keeps; its step writes the layer's packed weights in the same pass.

``--optimizer kt`` (default) steps with ``kt.optim.AdamW``, ``torch`` with
``torch.optim.AdamW``. The data are generated token sequences that follow a hidden
rule (t -> (a*t + b) mod vocab, with some noise), so the loss has something to
learn. Prints ``loss <value>`` at every logged step, a progress bar when
stdout is a terminal, and tokens/s.

    python3 examples/python/finetune_moe.py --steps 60
    python3 examples/python/finetune_moe.py --mode full --steps 60
"""
import argparse
import math
import os
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

try:
    import kt.hf
    import kt.optim
except ImportError:  # run from a checkout without install_dev.sh
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "plugins", "python"))
    import kt.hf
    import kt.optim


class Expert(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing over a list of experts (the HF eager layout)."""

    def __init__(self, hidden, intermediate, experts, top_k):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, True
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, intermediate) for _ in range(experts)])

    def forward(self, hidden_states):
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(h)
        w, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                out.index_add_(0, tok, expert(h[tok]) * w[tok, slot, None])
        return out.reshape(shape), logits


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads, intermediate, experts, top_k):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = SparseMoeBlock(hidden, intermediate, experts, top_k)

    def forward(self, h, mask):
        a = self.input_layernorm(h)
        h = h + self.self_attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.post_attention_layernorm(h))[0]


class MoeForCausalLM(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, intermediate, experts, top_k):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([DecoderLayer(hidden, heads, intermediate, experts, top_k)
                                     for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=tokens.device), 1)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, mask)
        return self.lm_head(self.norm(h))


def generated_batches(vocab, batch, seq, noise, generator):
    """Sequences with t_{i+1} = (a t_i + b) mod vocab, a and b fixed; a fraction
    `noise` of the tokens is replaced by random ones."""
    a, b = 5, 3
    while True:
        t = torch.randint(0, vocab, (batch, 1), generator=generator)
        cols = [t]
        for _ in range(seq):
            cols.append((cols[-1] * a + b) % vocab)
        tokens = torch.cat(cols, dim=1)
        flip = torch.rand(tokens.shape, generator=generator) < noise
        tokens[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=generator)
        yield tokens


def progress(step, steps, loss, tok_s):
    width = 30
    done = int(width * step / steps)
    sys.stdout.write("\r[%s%s] %d/%d loss %.4f %.0f tok/s" % (
        "#" * done, "." * (width - done), step, steps, loss, tok_s))
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=96)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--mode", choices=("lora", "full"), default="lora")
    ap.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="full mode: dtype of the expert weight parameters")
    ap.add_argument("--optimizer", choices=("kt", "torch"), default="kt")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-2 (lora), 2e-3 (full)")
    ap.add_argument("--threads", type=int, default=0, help="kt worker threads (0 = all CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    model = MoeForCausalLM(args.vocab, args.hidden, args.heads, args.layers, args.intermediate,
                           args.experts, args.top_k)
    engine = kt.Engine(num_threads=args.threads)
    if args.mode == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        replaced = kt.hf.replace_moe_experts(model, mode="lora", lora_rank=args.lora_rank,
                                             lora_alpha=args.lora_alpha, engine=engine)
        # The usual MoE LoRA recipe: adapters on the experts, plus the routers.
        params = []
        for experts in kt.hf.kt_experts_modules(model):
            params += list(experts.parameters())
        for name in replaced:
            gate = model.get_submodule(name).gate.weight
            gate.requires_grad_(True)
            params.append(gate)
    else:
        dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
        replaced = kt.hf.replace_moe_experts(model, mode="full", param_dtype=dtype, engine=engine)
        params = list(model.parameters())
    n_train = sum(p.numel() for p in params)
    print("kt %s (%s): %d MoE blocks in kt, %s fine-tune, %d trainable parameters, %s AdamW" % (
        kt.version(), engine.info()["kernel_name"], len(replaced), args.mode, n_train, args.optimizer))

    lr = args.lr if args.lr is not None else (1e-2 if args.mode == "lora" else 2e-3)
    adamw = kt.optim.AdamW if args.optimizer == "kt" else torch.optim.AdamW
    opt = adamw(params, lr=lr, weight_decay=0.0)
    data = generated_batches(args.vocab, args.batch, args.seq, noise=0.05,
                             generator=torch.Generator().manual_seed(args.seed + 1))
    tty = sys.stdout.isatty()
    tokens_done, start = 0, time.perf_counter()
    first = last = None
    for step in range(1, args.steps + 1):
        tokens = next(data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens_done += tokens[:, :-1].numel()
        value = loss.item()
        if not math.isfinite(value):
            print("loss is not finite at step %d" % step)
            return 1
        first = value if first is None else first
        last = value
        tok_s = tokens_done / (time.perf_counter() - start)
        if tty:
            progress(step, args.steps, value, tok_s)
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            if tty:
                sys.stdout.write("\n")
            print("step %d loss %.4f tokens/s %.0f" % (step, value, tok_s), flush=True)
    elapsed = time.perf_counter() - start
    print("first loss %.4f final loss %.4f, %d tokens in %.1f s (%.0f tokens/s)" % (
        first, last, tokens_done, elapsed, tokens_done / elapsed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
