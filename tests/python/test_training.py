"""The same small MoE model trained with kt experts and with pure torch experts,
from the same init and data, follows the same loss curve."""
import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import kt.hf
from helpers import tolerances
from helpers.hf_shaped import Decoder, Qwen3MoeSparseMoeBlock, round_params_to_bf16
from helpers.reference import checked_lora_scale

VOCAB, H, HEADS, LAYERS, E, K, I, R, ALPHA = 64, 32, 4, 2, 8, 2, 48, 4, 8.0
STEPS, BATCH, SEQ = 32, 4, 16


class LoraLinear(nn.Module):
    """The torch side's LoRA: y = base(x) + s * B (A x)."""

    def __init__(self, base, A, B, scale):
        super().__init__()
        self.base, self.scale = base, scale
        self.A, self.B = nn.Parameter(A.clone()), nn.Parameter(B.clone())

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


def batches(seed):
    # Sequences that follow t -> (5 t + 3) mod VOCAB from a random start: learnable.
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        seq = [start]
        for _ in range(SEQ):
            seq.append((seq[-1] * 5 + 3) % VOCAB)
        yield torch.cat(seq, dim=1)


def train(model, params):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses = []
    for tokens in batches(seed=1):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# rsLoRA with R = 4: alpha / sqrt(r) = 4 where alpha / r = 2, so the torch side
# (given the scale computed from the options) parts from kt at once if kt
# used the other formula.
@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_kt_and_torch_training_agree(use_rslora, fp32_engine):
    torch.manual_seed(0)
    base = round_params_to_bf16(
        Decoder(VOCAB, H, HEADS, LAYERS, lambda: Qwen3MoeSparseMoeBlock(H, I, E, K)))
    for p in base.parameters():
        p.requires_grad_(False)
    kt_model, torch_model = copy.deepcopy(base), copy.deepcopy(base)

    kt.hf.replace_moe_experts(kt_model, mode="lora", lora_rank=R, lora_alpha=ALPHA,
                              use_rslora=use_rslora, engine=fp32_engine)
    kt_params = []
    for layer_kt, layer_t in zip(kt_model.layers, torch_model.layers):
        experts = layer_kt.mlp.experts
        scale = checked_lora_scale(experts.lora_scale, R, ALPHA, use_rslora)
        with torch.no_grad():  # B = 0 (PEFT); non-zero B so step 0 already tests the LoRA path
            for p in ("gate", "up", "down"):
                getattr(experts, "lora_B_" + p).normal_(0, 0.05)
        for e, expert in enumerate(layer_t.mlp.experts):
            for p in ("gate", "up", "down"):
                name = p + "_proj"
                setattr(expert, name, LoraLinear(getattr(expert, name),
                                                 getattr(experts, "lora_A_" + p)[e].detach(),
                                                 getattr(experts, "lora_B_" + p)[e].detach(),
                                                 scale))
        # The routers train too, so the routing-weight gradients matter.
        layer_kt.mlp.gate.weight.requires_grad_(True)
        layer_t.mlp.gate.weight.requires_grad_(True)
        kt_params += list(experts.parameters()) + [layer_kt.mlp.gate.weight]
    torch_params = [p for p in torch_model.parameters() if p.requires_grad]
    assert len(torch_params) == LAYERS * (E * 6 + 1) and len(kt_params) == LAYERS * 7

    kt_losses = train(kt_model, kt_params)
    torch_losses = train(torch_model, torch_params)
    worst = max(abs(a - b) / b for a, b in zip(kt_losses, torch_losses))
    print("max relative loss difference over %d steps: %.3e" % (STEPS, worst))
    assert worst <= tolerances.TRAINING, (kt_losses, torch_losses)
    assert kt_losses[-1] < 0.6 * kt_losses[0], kt_losses
