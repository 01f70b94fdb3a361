"""Fine-tuning a small MoE transformer for 50 steps with kt.optim.AdamW:
against torch.optim.AdamW on the same kt model and against kt's steps
overlapped with the backward (the loss curves must be the same numbers), against the pure torch model (tolerances.TRAINING: fp32
summation order; in full mode the torch experts compute with the bf16
rounding of their fp32 masters, as kt's packed weights are), and across a save at step 25, a new
process and a resume (the same numbers again).

Run as a script, this file is that new process: it rebuilds the model, loads
the checkpoint and prints the losses of the remaining steps as JSON."""
import copy
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import kt
import kt.hf
import kt.optim
from helpers import tolerances
from helpers.hf_shaped import Decoder, Qwen3MoeSparseMoeBlock, round_params_to_bf16
from helpers.reference import checked_lora_scale
from test_training import LoraLinear

VOCAB, H, HEADS, LAYERS, E, K, I, R, ALPHA = 64, 32, 4, 2, 8, 2, 48, 4, 8.0
STEPS, RESUME_AT, BATCH, SEQ = 50, 25, 4, 16
LR, WD = 3e-3, 0.01


def batch(step):
    # Sequences that follow t -> (5 t + 3) mod VOCAB from a random start.
    g = torch.Generator().manual_seed(1000 + step)
    seq = [torch.randint(0, VOCAB, (BATCH, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 3) % VOCAB)
    return torch.cat(seq, dim=1)


def base_model():
    torch.manual_seed(0)
    return round_params_to_bf16(Decoder(VOCAB, H, HEADS, LAYERS, lambda: Qwen3MoeSparseMoeBlock(H, I, E, K)))


def kt_model(mode, engine):
    """The model with its routed experts in kt and its trainable parameters:
    full: everything; lora: LoRA factors and the routers."""
    model = base_model()
    kt.hf.replace_moe_experts(model, mode=mode, lora_rank=R, lora_alpha=ALPHA, engine=engine)
    if mode == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        g = torch.Generator().manual_seed(5)
        for layer in model.layers:
            experts = layer.mlp.experts
            with torch.no_grad():  # non-zero B: the first steps already train A
                for p in ("gate", "up", "down"):
                    getattr(experts, "lora_B_" + p).normal_(0, 0.05, generator=g)
            for p in experts.parameters():
                p.requires_grad_(True)
            layer.mlp.gate.weight.requires_grad_(True)
    return model


class _RoundToBf16(torch.autograd.Function):
    """The bf16 copy a full-mode kt layer computes with (its packed panels,
    rounded to nearest even from the fp32 masters); the gradient goes to the
    master unchanged."""

    @staticmethod
    def forward(ctx, w):
        return w.to(torch.bfloat16).to(w.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Bf16ComputeLinear(torch.nn.Module):
    """nn.Linear over an fp32 master whose products use its bf16 rounding."""

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return F.linear(x, _RoundToBf16.apply(self.weight))


def torch_model(mode, reference):
    """The pure torch model with the same initial values as `reference`."""
    model = base_model()
    if mode == "full":
        for layer in model.layers:
            for expert in layer.mlp.experts:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    setattr(expert, name, Bf16ComputeLinear(getattr(expert, name)))
    if mode == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for layer_t, layer_kt in zip(model.layers, reference.layers):
            experts = layer_kt.mlp.experts
            scale = checked_lora_scale(experts.lora_scale, R, ALPHA)
            for e, expert in enumerate(layer_t.mlp.experts):
                for p in ("gate", "up", "down"):
                    name = p + "_proj"
                    setattr(expert, name, LoraLinear(getattr(expert, name),
                                                     getattr(experts, "lora_A_" + p)[e].detach(),
                                                     getattr(experts, "lora_B_" + p)[e].detach(),
                                                     scale))
            layer_t.mlp.gate.weight.requires_grad_(True)
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def train(model, opt, start, stop, overlap=False):
    """overlap: each kt layer's step starts once its gradients are written,
    while the backward goes on through the layers before it."""
    losses = []
    for step in range(start, stop):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        if overlap:
            with opt.overlap():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def resume_in_this_process(mode, checkpoint):
    engine = kt.Engine(precision="fp32")
    model = kt_model(mode, engine)
    saved = torch.load(checkpoint)
    model.load_state_dict(saved["model"])
    opt = kt.optim.AdamW(trainable(model), lr=LR, weight_decay=WD)
    opt.load_state_dict(saved["optimizer"])
    return train(model, opt, RESUME_AT, STEPS)


def check_mode(mode, engine, tmp_path):
    ours = kt_model(mode, engine)
    reference = copy.deepcopy(torch_model(mode, ours))  # before any step changes ours
    kt_losses = train(ours, kt.optim.AdamW(trainable(ours), lr=LR, weight_decay=WD), 0, STEPS)
    assert kt_losses[-1] < 0.7 * kt_losses[0], kt_losses

    # The same kt model under torch's optimizer: kt's step is torch's arithmetic.
    other = kt_model(mode, engine)
    torch_opt_losses = train(other, torch.optim.AdamW(trainable(other), lr=LR, weight_decay=WD), 0, STEPS)
    assert kt_losses == torch_opt_losses

    # Steps overlapped with the backward: the same numbers.
    overlapped = kt_model(mode, engine)
    assert train(overlapped, kt.optim.AdamW(trainable(overlapped), lr=LR, weight_decay=WD), 0, STEPS,
                 overlap=True) == kt_losses

    # Pure torch: experts and optimizer.
    torch_losses = train(reference, torch.optim.AdamW(trainable(reference), lr=LR, weight_decay=WD), 0, STEPS)
    worst = max(abs(a - b) / b for a, b in zip(kt_losses, torch_losses))
    print("%s: max relative loss difference, kt vs pure torch over %d steps: %.3e" % (mode, STEPS, worst))
    assert worst <= tolerances.TRAINING, (kt_losses, torch_losses)

    # Save at step 25, resume in a new process.
    first = kt_model(mode, engine)
    opt = kt.optim.AdamW(trainable(first), lr=LR, weight_decay=WD)
    head = train(first, opt, 0, RESUME_AT)
    checkpoint = str(tmp_path / ("%s.pt" % mode))
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(here, "..", "..", "plugins", "python"), here, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), mode, checkpoint], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    tail = json.loads(run.stdout.strip().splitlines()[-1])
    assert head + tail == kt_losses


def test_full_fine_tune_with_kt_optimizer(fp32_engine, tmp_path, correctly_rounded_sqrt):
    check_mode("full", fp32_engine, tmp_path)


def test_lora_fine_tune_with_kt_optimizer(fp32_engine, tmp_path, correctly_rounded_sqrt):
    check_mode("lora", fp32_engine, tmp_path)


if __name__ == "__main__":
    print(json.dumps(resume_in_this_process(sys.argv[1], sys.argv[2])))
