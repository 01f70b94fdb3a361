"""kt.hf swaps routed experts by module structure and leaves outputs as they were."""
import pytest
import torch

import kt.hf
import kt.torch
from helpers import tolerances
from helpers.hf_shaped import (DeepseekV3MoE, FusedMoeBlock, GptOssMLP, MixtralSparseMoeBlock,
                       Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, round_params_to_bf16)
from helpers.reference import rel_l2

H, I, E, K = 48, 40, 6, 2
BLOCKS = {
    "qwen2_moe": lambda: Qwen2MoeSparseMoeBlock(H, I, E, K, shared_I=24),
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
    "mixtral": lambda: MixtralSparseMoeBlock(H, I, E, K),
    "deepseek_v3": lambda: DeepseekV3MoE(H, I, E, K, shared_I=24),
    "fused_v5": lambda: FusedMoeBlock(H, I, E, K),
    "gpt_oss": lambda: GptOssMLP(H, I, E, K),
}


class Wrapper(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replacement_keeps_outputs(family, dtype, fp32_engine):
    torch.manual_seed(0)
    model = round_params_to_bf16(Wrapper(BLOCKS[family]())).to(dtype)
    x = torch.randn(2, 7, H, dtype=dtype)
    with torch.no_grad():
        before = model(x)
    engine = fp32_engine if dtype == torch.float32 else None
    replaced = kt.hf.replace_moe_experts(model, engine=engine)
    assert replaced and len(kt.hf.kt_experts_modules(model)) == 1
    assert not any(isinstance(m, torch.nn.Linear) and m.in_features == H and m.out_features == I
                   for m in model.modules()), "the torch copies of the experts were kept"
    with torch.no_grad():
        after = model(x)
    if isinstance(before, tuple):
        assert isinstance(after, tuple) and len(after) == len(before)
        assert torch.equal(before[1], after[1])  # the router is untouched
        before, after = before[0], after[0]
    assert after.shape == before.shape and after.dtype == before.dtype
    tol = tolerances.FP32 if dtype == torch.float32 else tolerances.BF16_TORCH
    assert rel_l2(after, before) <= tol


def test_lora_targets_follow_peft_names():
    torch.manual_seed(0)
    model = Wrapper(MixtralSparseMoeBlock(H, I, E, K))
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=8,
                              target_modules=["w1", "w2"])
    experts = kt.hf.kt_experts_modules(model)[0]
    names = sorted(n for n, _ in experts.named_parameters())
    assert names == ["lora_A_down", "lora_A_gate", "lora_B_down", "lora_B_gate"]
    assert experts.lora_scale == pytest.approx(2.0)
    assert tuple(experts.lora_A_gate.shape) == (E, 4, H)
    assert tuple(experts.lora_B_down.shape) == (E, H, 4)


def test_rslora_scale_and_unknown_target():
    model = Wrapper(Qwen3MoeSparseMoeBlock(H, I, E, K))
    with pytest.raises(ValueError, match="unknown target module"):
        kt.hf.replace_moe_experts(model, mode="lora", target_modules=["q_proj"])
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=16, lora_alpha=8, use_rslora=True)
    assert kt.hf.kt_experts_modules(model)[0].lora_scale == pytest.approx(2.0)


def test_lora_dropout_is_refused():
    model = Wrapper(Qwen3MoeSparseMoeBlock(H, I, E, K))
    with pytest.raises(ValueError, match="lora_dropout"):
        kt.hf.replace_moe_experts(model, mode="lora", lora_dropout=0.1)


class FcExpert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(H, I, bias=False)
        self.fc2 = torch.nn.Linear(I, H, bias=False)


class FcMoeBlock(torch.nn.Module):
    """An MoE block kt.hf does not know: experts named fc1/fc2."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList([FcExpert() for _ in range(E)])


def test_unrecognised_moe_block_is_reported():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Wrapper(FcMoeBlock()), Wrapper(Qwen3MoeSparseMoeBlock(H, I, E, K))])
    with pytest.warns(kt.hf.UnrecognisedMoEWarning,
                      match=r"layers\.0\.mlp: experts\[0\] has fc1, fc2, not gate_proj"):
        replaced = kt.hf.replace_moe_experts(model)
    assert replaced == ["layers.1.mlp"]


def test_strict_makes_an_unrecognised_block_an_error():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Wrapper(FcMoeBlock())])
    with pytest.raises(ValueError, match=r"(?s)1 MoE-looking block\(s\) not replaced.*fc1, fc2"):
        kt.hf.replace_moe_experts(model, strict=True)
    fused = Wrapper(FusedMoeBlock(H, I, E, K))
    fused.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 3 * I, H))  # fits no layout
    with pytest.raises(ValueError, match="do not fit together"):
        kt.hf.replace_moe_experts(fused, strict=True)


def test_recognised_models_raise_no_report(recwarn):
    kt.hf.replace_moe_experts(Wrapper(MixtralSparseMoeBlock(H, I, E, K)), strict=True)
    assert not [w for w in recwarn if issubclass(w.category, kt.hf.UnrecognisedMoEWarning)]


def test_gpt_oss_lora_targets_gate_up_proj_and_down_proj():
    torch.manual_seed(0)
    model = Wrapper(GptOssMLP(H, I, E, K))
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=8,
                              target_modules=["gate_up_proj", "down_proj"])
    experts = kt.hf.kt_experts_modules(model)[0]
    assert experts.lora_targets == ("gate", "up", "down")
    model2 = Wrapper(GptOssMLP(H, I, E, K))
    # PEFT's target_parameters spelling names the parameter's path.
    kt.hf.replace_moe_experts(model2, mode="lora", lora_rank=4,
                              target_modules=["mlp.experts.down_proj"])
    assert kt.hf.kt_experts_modules(model2)[0].lora_targets == ("down",)


def test_lora_bias_training_is_refused_with_the_alternative():
    model = Wrapper(GptOssMLP(H, I, E, K))
    for bias in ("all", "lora_only"):
        with pytest.raises(ValueError, match="not supported in LoRA mode.*mode='full'.*bias='none'"):
            kt.hf.replace_moe_experts(model, mode="lora", bias=bias)
    # mode="full" trains the gpt-oss expert biases.
    kt.hf.replace_moe_experts(model, mode="full", bias="all")
    experts = kt.hf.kt_experts_modules(model)[0]
    out = model(torch.randn(1, 3, H))[0]
    out.square().sum().backward()
    assert experts.b_gate.grad is not None and experts.b_gate.grad.abs().sum() > 0
