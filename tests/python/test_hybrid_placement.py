"""Hybrid placement: kt.hf keeps chosen experts of each block in torch (on the
host's device; CPU here, as this machine has no GPU) and the rest in kt
(kt_moe_set_skipped). Outputs and gradients of both parts are checked in fp32
against the unreplaced torch model (inference and full mode; LoRA mode with
PEFT-style LoRA added to its experts) and against the all-kt model (LoRA mode
on every block family, and training with kt's optimizer)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kt.hf
import kt.optim
from helpers import tolerances
from kt import _hf_names
from helpers.hf_shaped import (DeepseekV3MoE, Decoder, FusedMoeBlock, GptOssMLP, MixtralSparseMoeBlock,
                       Qwen3MoeSparseMoeBlock, round_params_to_bf16)
from helpers.reference import checked_lora_scale, rel_l2

H, I, E, K = 32, 24, 8, 2
BLOCKS = {
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
    "mixtral": lambda: MixtralSparseMoeBlock(H, I, E, K),
    "deepseek_v3": lambda: DeepseekV3MoE(H, I, E, K, shared_I=16),
    "fused_v5": lambda: FusedMoeBlock(H, I, E, K),
    "gpt_oss": lambda: GptOssMLP(H, I, E, K),
}
# The hottest 3: experts 1, 6 and 3 (3 before 4: a tie goes to the lower id).
COUNTS = torch.tensor([5, 90, 3, 40, 40, 7, 60, 1])
PLACEMENTS = {"first_3": dict(torch_experts=3), "ids": dict(torch_experts=[7, 2, 5]),
              "hottest_3": dict(torch_experts=3, torch_expert_counts=COUNTS)}
EXPECTED_IDS = {"first_3": (0, 1, 2), "ids": (2, 5, 7), "hottest_3": (1, 3, 6)}


class Wrapper(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        out = self.mlp(x)
        return out[0] if isinstance(out, tuple) else out


def model_pair(family):
    torch.manual_seed(0)
    ref = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    return ref, copy.deepcopy(ref)


def run(model, x, dy):
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad


def router_grads(model):
    return {n: p.grad for n, p in model.named_parameters()
            if p.grad is not None and ".experts." not in n and not n.endswith("experts")}


def routed_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 11, H, generator=g), torch.randn(3, 11, H, generator=g)


def the_experts(model):
    (experts,) = kt.hf.kt_experts_modules(model)
    return experts


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_inference_mode_matches_the_torch_model(family, placement, fp32_engine):
    ref, model = model_pair(family)
    kt.hf.replace_moe_experts(model, engine=fp32_engine, **PLACEMENTS[placement])
    experts = the_experts(model)
    assert experts.torch_expert_ids == EXPECTED_IDS[placement]
    assert experts.kt_layer.num_loaded() == E - 3  # kt skips the torch experts
    assert experts.torch_experts.ids.device.type == "cpu"  # the router's device (no GPU here)
    x, dy = routed_inputs()
    y0, dx0 = run(ref, x, dy)
    y, dx = run(model, x, dy)
    assert rel_l2(y, y0) <= tolerances.FP32
    assert rel_l2(dx, dx0) <= tolerances.FP32
    g0, g = router_grads(ref), router_grads(model)
    assert g.keys() == g0.keys() and g0
    for n in g0:
        assert rel_l2(g[n], g0[n]) <= tolerances.FP32, n


@pytest.mark.parametrize("family", ["qwen3_moe", "fused_v5", "gpt_oss"])
def test_full_mode_matches_the_torch_model(family, fp32_engine):
    ref, model = model_pair(family)
    kt.hf.replace_moe_experts(model, mode="full", engine=fp32_engine, torch_experts=[0, 3, 6])
    experts = the_experts(model)
    experts.grad_scale = 0.5  # scales kt's and torch's parameter gradients alike
    x, dy = routed_inputs()
    y0, dx0 = run(ref, x, dy)
    y, dx = run(model, x, dy)
    assert rel_l2(y, y0) <= tolerances.FP32 and rel_l2(dx, dx0) <= tolerances.FP32
    grads = {"gate": experts.w_gate.grad, "up": experts.w_up.grad, "down": experts.w_down.grad}
    if experts.has_bias:
        grads.update(bias_gate=experts.b_gate.grad, bias_up=experts.b_up.grad, bias_down=experts.b_down.grad)
    hf_grads = _hf_names.weights_to_hf(experts.hf_naming, grads)
    ref_experts = dict(ref.mlp.experts.named_parameters())
    for key, g in hf_grads.items():
        g0 = ref_experts[key].grad * 0.5
        assert rel_l2(g, g0) <= tolerances.FP32, key
    # Both parts wrote their rows: torch experts' and kt experts' gradients are non-zero.
    per_expert = experts.w_down.grad.abs().sum(dim=(1, 2))
    assert (per_expert[[0, 3, 6]] > 0).all() and (per_expert[[1, 2, 4, 5, 7]] > 0).all()
    # A second backward accumulates into both parts.
    first = {k: g.clone() for k, g in grads.items()}
    model(x.clone().requires_grad_()).backward(dy)
    for k, g in first.items():
        now = getattr(experts, ("b_" + k[5:]) if k.startswith("bias_") else "w_" + k).grad
        assert rel_l2(now, 2 * g) <= tolerances.FP32, k


def lora_models(family, engine, placement):
    torch.manual_seed(0)
    base = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    models = []
    for p in ({}, placement):
        m = copy.deepcopy(base)
        kt.hf.replace_moe_experts(m, mode="lora", lora_rank=4, lora_alpha=8, engine=engine, **p)
        models.append(m)
    torch.manual_seed(1)
    with torch.no_grad():
        for (_, a), (_, b) in zip(the_experts(models[0]).trainable_parameters(),
                                  the_experts(models[1]).trainable_parameters()):
            a.normal_(0, 0.2)
            b.copy_(a)
    return models


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "fused_v5", "gpt_oss"])
def test_lora_mode_matches_the_all_kt_model(family, fp32_engine):
    all_kt, hybrid = lora_models(family, fp32_engine, dict(torch_experts=3, torch_expert_counts=COUNTS))
    for m in (all_kt, hybrid):
        the_experts(m).grad_scale = 0.25
    x, dy = routed_inputs()
    for accumulate in (False, True):  # the second pass adds to .grad in both parts
        if not accumulate:
            for m in (all_kt, hybrid):
                m.zero_grad(set_to_none=True)
        outs = []
        for m in (all_kt, hybrid):
            xg = x.clone().requires_grad_()
            y = m(xg)
            y.backward(dy)
            outs.append((y.detach(), xg.grad))
        assert rel_l2(outs[1][0], outs[0][0]) <= tolerances.FP32
        assert rel_l2(outs[1][1], outs[0][1]) <= tolerances.FP32
        for (name, a), (_, b) in zip(the_experts(all_kt).trainable_parameters(),
                                     the_experts(hybrid).trainable_parameters()):
            assert rel_l2(b.grad, a.grad) <= tolerances.FP32, name
            torch_rows = b.grad[[1, 3, 6]]
            assert torch_rows.abs().sum() > 0, name  # torch wrote its experts' rows
        g0, g = router_grads(all_kt), router_grads(hybrid)
        for n in g0:
            assert rel_l2(g[n], g0[n]) <= tolerances.FP32, n


def test_lora_training_with_kt_optimizer_matches_the_all_kt_model(fp32_engine):
    """kt's optimizer steps the torch experts' rows too (from torch's gradients)."""
    all_kt, hybrid = lora_models("qwen3_moe", fp32_engine, dict(torch_experts=[0, 5]))
    losses = []
    for m in (all_kt, hybrid):
        opt = kt.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(4)
        curve = []
        for _ in range(4):
            x = torch.randn(2, 9, H, generator=g)
            opt.zero_grad(set_to_none=True)
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    for a, b in zip(*losses):
        assert abs(a - b) <= tolerances.TRAINING * abs(a)
    assert losses[0][-1] < losses[0][0]
    for (name, a), (_, b) in zip(the_experts(all_kt).trainable_parameters(),
                                 the_experts(hybrid).trainable_parameters()):
        assert rel_l2(b, a) <= tolerances.TRAINING, name


def test_hottest_experts_per_layer_from_routing_counts(fp32_engine):
    torch.manual_seed(0)
    model = Decoder(64, H, 4, 2, lambda: Qwen3MoeSparseMoeBlock(H, I, E, K))
    counts = torch.tensor([[0, 0, 0, 0, 9, 8, 7, 0], [5, 4, 0, 0, 0, 0, 0, 6]])
    kt.hf.replace_moe_experts(model, engine=fp32_engine, torch_experts=2, torch_expert_counts=counts)
    assert [m.torch_expert_ids for m in kt.hf.kt_experts_modules(model)] == [(4, 5), (0, 7)]
    model2 = Decoder(64, H, 4, 2, lambda: Qwen3MoeSparseMoeBlock(H, I, E, K))
    kt.hf.replace_moe_experts(model2, engine=fp32_engine, torch_experts=1,
                              torch_expert_counts={0: counts[1], "layers.1.mlp": counts[0]})
    assert [m.torch_expert_ids for m in kt.hf.kt_experts_modules(model2)] == [(7,), (4,)]
    assert kt.hf.hottest_experts(torch.tensor([1, 3, 3, 2]), 2) == (1, 2)


def test_copies_and_state_dict_of_a_hybrid_model(fp32_engine):
    torch.manual_seed(0)
    plain = round_params_to_bf16(Wrapper(FusedMoeBlock(H, I, E, K)))
    hybrid = copy.deepcopy(plain)
    kt.hf.replace_moe_experts(plain, engine=fp32_engine)
    kt.hf.replace_moe_experts(hybrid, engine=fp32_engine, torch_experts=[2, 3])
    sd0, sd = plain.state_dict(), hybrid.state_dict()
    assert sd.keys() == sd0.keys()  # the torch experts' copies are not saved twice
    for k in sd0:
        assert torch.equal(sd[k], sd0[k]), k
    twin = copy.deepcopy(hybrid)
    assert the_experts(twin).torch_expert_ids == (2, 3) and the_experts(twin).kt_layer.num_loaded() == E - 2
    x, _ = routed_inputs()
    with torch.no_grad():
        assert torch.equal(twin(x), hybrid(x))
        assert rel_l2(hybrid(x), plain(x)) <= tolerances.FP32
    # Giving every expert back to kt.
    the_experts(hybrid).set_torch_experts(())
    with torch.no_grad():
        assert torch.equal(hybrid(x), plain(x))


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match=r"torch_experts \[1, 9\] are not all in \[0, 8\)"):
        kt.hf.replace_moe_experts(Wrapper(BLOCKS["qwen3_moe"]()), torch_experts=[1, 9])
    with pytest.raises(ValueError, match="torch_experts=9 but the block has 8 experts"):
        kt.hf.replace_moe_experts(Wrapper(BLOCKS["qwen3_moe"]()), torch_experts=9)
    with pytest.raises(ValueError, match="give N as an int"):
        kt.hf.replace_moe_experts(Wrapper(BLOCKS["qwen3_moe"]()), torch_experts=[1],
                                  torch_expert_counts=COUNTS)
    with pytest.raises(ValueError, match=r"must be \[E=8\] or \[layers, E\], not \(5,\)"):
        kt.hf.replace_moe_experts(Wrapper(BLOCKS["qwen3_moe"]()), torch_experts=2,
                                  torch_expert_counts=torch.ones(5))
    with pytest.raises(ValueError, match="has no row for layer None"):
        kt.hf.replace_moe_experts(Wrapper(BLOCKS["qwen3_moe"]()), torch_experts=2,
                                  torch_expert_counts=torch.ones(2, E))
    experts = kt.torch.MoEExperts(E, K, H, I)
    with pytest.raises(ValueError, match=r"torch expert ids must be in \[0, 8\), got \[-1\]"):
        experts.set_torch_experts([-1])


def test_torch_experts_of_a_model_loaded_from_a_checkpoint(tmp_path, fp32_engine):
    """Experts on the meta device, filled from a checkpoint: the torch
    experts' weights come from what kt loaded."""
    from test_checkpoint import _per_expert_ckpt, _twin_models
    real, meta = _twin_models(lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
                              lambda: Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta"))
    _per_expert_ckpt(real, tmp_path / "ckpt", "per_expert")
    kt.hf.replace_moe_experts(meta, checkpoint=tmp_path / "ckpt", engine=fp32_engine, torch_experts=[1, 4])
    assert [m.torch_expert_ids for m in kt.hf.kt_experts_modules(meta)] == [(1, 4), (1, 4)]
    x, dy = routed_inputs()
    y0, dx0 = run(real, x, dy)
    y, dx = run(meta, x, dy)
    assert rel_l2(y, y0) <= tolerances.FP32 and rel_l2(dx, dx0) <= tolerances.FP32
    part = kt.hf.kt_experts_modules(meta)[0].torch_experts
    assert torch.equal(part.gate[1], real.layers[0].mlp.experts[4].gate_proj.weight.detach())


class LoraLinear(torch.nn.Module):
    """PEFT's LoRA on one nn.Linear, in torch: base(x) + s * B(A(x))."""

    def __init__(self, base, a, b, scale):
        super().__init__()
        self.base, self.scale = base, scale
        self.a, self.b = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.a), self.b)


def test_lora_mode_matches_torch_lora_on_the_unreplaced_model(fp32_engine):
    """The hybrid LoRA layer against the torch model with PEFT-style LoRA on
    each expert's projections: outputs, dx, router and every LoRA gradient."""
    ref, model = model_pair("qwen3_moe")
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=8, engine=fp32_engine,
                              torch_experts=[0, 2, 7])
    experts = the_experts(model)
    scale = checked_lora_scale(experts.lora_scale, 4, 8.0)
    torch.manual_seed(3)
    with torch.no_grad():
        for _, p in experts.trainable_parameters():
            p.normal_(0, 0.2)
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.mlp.gate.weight.requires_grad_(True)
    for e, ex in enumerate(ref.mlp.experts):
        for proj, name in zip(("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj")):
            setattr(ex, name, LoraLinear(getattr(ex, name), getattr(experts, "lora_A_" + proj)[e].detach(),
                                         getattr(experts, "lora_B_" + proj)[e].detach(), scale))
    x, dy = routed_inputs()
    y0, dx0 = run(ref, x, dy)
    y, dx = run(model, x, dy)
    assert rel_l2(y, y0) <= tolerances.FP32 and rel_l2(dx, dx0) <= tolerances.FP32
    assert rel_l2(model.mlp.gate.weight.grad, ref.mlp.gate.weight.grad) <= tolerances.FP32
    for proj, name in zip(("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj")):
        for ab in ("a", "b"):
            want = torch.stack([getattr(getattr(ex, name), ab).grad for ex in ref.mlp.experts])
            got = getattr(experts, "lora_%s_%s" % (ab.upper(), proj)).grad
            assert rel_l2(got, want) <= tolerances.FP32, (proj, ab)
