"""Replaced models behave as HF users expect: copy.deepcopy, state_dict /
load_state_dict with the original module's names (PEFT's names in LoRA
mode), and PEFT adapters checked by a reader that follows PEFT's own rules."""
import copy
import json
import re

import pytest
import torch

import kt.hf
from helpers import st_files
from helpers import tolerances
from helpers.hf_shaped import round_params_to_bf16
from helpers.reference import rel_l2
from test_hf import BLOCKS, H, Wrapper

E = 6


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _randomise_lora(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("mode", ["inference", "full"])
def test_state_dict_has_the_original_names_and_values(family, mode):
    torch.manual_seed(0)
    model = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    original = model.state_dict()
    kt.hf.replace_moe_experts(model, mode=mode)
    sd = model.state_dict()
    assert set(sd) == set(original)
    for k, v in original.items():
        assert torch.equal(sd[k].float(), v.float()), k
    # An original state_dict loads into a replaced model of other weights.
    torch.manual_seed(1)
    other = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    kt.hf.replace_moe_experts(other, mode=mode)
    other.load_state_dict(original)
    x = torch.randn(2, 3, H)
    with torch.no_grad():
        assert torch.equal(_out(other(x)), _out(model(x)))


def test_load_state_dict_reports_missing_and_unexpected_keys():
    torch.manual_seed(0)
    model = Wrapper(BLOCKS["qwen3_moe"]())
    kt.hf.replace_moe_experts(model)
    sd = model.state_dict()
    del sd["mlp.experts.3.up_proj.weight"]
    sd["mlp.experts.9.up_proj.weight"] = torch.zeros(1)
    result = model.load_state_dict(sd, strict=False)
    assert "mlp.experts.3.up_proj.weight" in result.missing_keys
    assert "mlp.experts.9.up_proj.weight" in result.unexpected_keys
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(sd)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_lora_state_dict_uses_peft_names_and_round_trips(family, tmp_path):
    torch.manual_seed(0)
    model = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=8)
    _randomise_lora(model)
    sd = model.state_dict()
    lora_keys = sorted(k for k in sd if "lora" in k)
    # The same tensors as the adapter save_adapter writes (PEFT's layout,
    # [E, in, out] factors where the experts module is_transposed).
    kt.hf.save_adapter(model, tmp_path / "adapter")
    adapter, _ = st_files.read(tmp_path / "adapter" / "adapter_model.safetensors")
    for k in lora_keys:
        assert torch.equal(sd[k], adapter["base_model.model." + k].to(sd[k].dtype)), k
    if family in ("fused_v5", "gpt_oss"):
        assert lora_keys == ["mlp.experts.base_layer.lora_A.weight", "mlp.experts.base_layer.lora_B.weight",
                             "mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight"]
    else:
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        assert len(lora_keys) == 2 * 3 * E
        assert "mlp.experts.5.%s.lora_B.weight" % names[2] in lora_keys
        assert tuple(sd["mlp.experts.0.%s.lora_A.weight" % names[0]].shape) == (4, H)
    torch.manual_seed(0)
    twin = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    kt.hf.replace_moe_experts(twin, mode="lora", lora_rank=4, lora_alpha=8)
    twin.load_state_dict(sd)
    x = torch.randn(2, 3, H)
    with torch.no_grad():
        assert torch.equal(_out(twin(x)), _out(model(x)))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["inference", "lora", "full"])
def test_deepcopy_computes_the_same_and_owns_its_trainable_tensors(family, mode):
    torch.manual_seed(0)
    model = round_params_to_bf16(Wrapper(BLOCKS[family]()))
    kt.hf.replace_moe_experts(model, mode=mode, lora_rank=4)
    _randomise_lora(model)
    twin = copy.deepcopy(model)
    a, b = kt.hf.kt_experts_modules(model)[0], kt.hf.kt_experts_modules(twin)[0]
    assert a.kt_layer is not b.kt_layer and a.kt_layer.engine is b.kt_layer.engine
    x = torch.randn(2, 3, H)
    with torch.no_grad():
        y = _out(model(x))
        assert torch.equal(_out(twin(x)), y)
    params = [p for p in twin.parameters() if p.requires_grad and p.dim() == 3]
    if params:  # trainable tensors are copies: changing the copy leaves the original
        with torch.no_grad():
            for p in params:
                p.add_(0.5)
            assert not torch.equal(_out(twin(x)), y)
            assert torch.equal(_out(model(x)), y)


def test_deepcopy_of_a_packed_layer_maps_the_same_file(tmp_path):
    torch.manual_seed(0)
    model = Wrapper(BLOCKS["qwen3_moe"]())
    kt.hf.replace_moe_experts(model)
    layer = kt.hf.kt_experts_modules(model)[0].kt_layer
    path = tmp_path / "layer.ktpack"
    layer.save_packed(path)
    layer.load_packed(path)
    twin = copy.deepcopy(model)
    assert kt.hf.kt_experts_modules(twin)[0].kt_layer.weights_source == ("packed", str(path))


# ---------------------------------------------------------------- adapters
#
# The reader below follows PEFT's rules (PEFT 0.21's ParamWrapper), not kt's
# code: per-expert modules get W + scaling * B @ A; a targeted 3-D parameter
# [E, d1, d2] is [E, in, out] when its module says is_transposed, else
# [E, out, in], and gets scaling * einsum over B.reshape(out, R, E) and
# A.reshape(E, R, in) laid out as the parameter; nested wrappers put the
# first listed parameter under base_layer; scaling = lora_alpha / r (or
# / sqrt(r) with use_rslora).


def peft_merge(torch_block, adapter_dir, module_path):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors, _ = st_files.read(adapter_dir / "adapter_model.safetensors")
    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / (r ** 0.5 if config["use_rslora"] else r)
    prefix = "base_model.model." + module_path + "."
    with torch.no_grad():
        if config.get("target_parameters"):
            params = [p.rsplit(".", 1)[-1] for p in config["target_parameters"]]
            ex = torch_block.experts
            for depth, pname in enumerate(params):
                key = prefix + "base_layer." * (len(params) - 1 - depth)
                A, B = tensors[key + "lora_A.weight"], tensors[key + "lora_B.weight"]
                param = getattr(ex, pname)
                n, d1, d2 = param.shape
                if getattr(ex, "is_transposed", False):  # [E, in, out]
                    delta = torch.einsum("o r e, e r i -> e i o", B.reshape(d2, -1, n), A.reshape(n, -1, d1))
                else:  # [E, out, in]
                    delta = torch.einsum("o r e, e r i -> e o i", B.reshape(d1, -1, n), A.reshape(n, -1, d2))
                param.add_(scaling * delta)
        else:
            for name, module in torch_block.experts.named_modules():
                if isinstance(module, torch.nn.Linear) and re.fullmatch(config["target_modules"],
                                                                        prefix + name):
                    A = tensors[prefix + name + ".lora_A.weight"]
                    B = tensors[prefix + name + ".lora_B.weight"]
                    module.weight.add_(scaling * B @ A)
    return config


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("targets", [None, ["down_proj", "w2"], ["gate_proj", "w1", "gate_up_proj"]])
def test_saved_adapter_read_by_peft_rules_matches_kt(tmp_path, family, targets, fp32_engine):
    torch.manual_seed(0)
    block = round_params_to_bf16(BLOCKS[family]())
    reference = copy.deepcopy(block)
    model = Wrapper(block)
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=3, lora_alpha=5, engine=fp32_engine,
                              target_modules=targets)
    _randomise_lora(model)
    config = kt.hf.save_adapter(model, tmp_path / "adapter", base_model="tiny-moe")
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "tiny-moe"
    peft_merge(reference, tmp_path / "adapter", "mlp.experts")
    if family not in ("fused_v5", "gpt_oss"):
        # The regex targets routed experts only, never a shared expert's modules.
        shared = [n for n, m in reference.named_modules() if "shared" in n and isinstance(m, torch.nn.Linear)]
        assert not any(re.fullmatch(config["target_modules"], "base_model.model.mlp." + n) for n in shared)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        want, got = _out(reference(x)), _out(model(x))
    assert rel_l2(got, want) <= tolerances.FP32
    # And back: a fresh LoRA model loads the adapter and computes the same.
    torch.manual_seed(0)
    fresh = Wrapper(round_params_to_bf16(BLOCKS[family]()))
    kt.hf.replace_moe_experts(fresh, mode="lora", lora_rank=3, lora_alpha=5, engine=fp32_engine,
                              target_modules=targets)
    kt.hf.load_adapter(fresh, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(_out(fresh(x)), got)


def test_fused_adapter_config_targets_parameters(tmp_path):
    torch.manual_seed(0)
    model = Wrapper(BLOCKS["gpt_oss"]())
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=16, use_rslora=True)
    config = kt.hf.save_adapter(model, tmp_path)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] is None
    # gate and up factors of rank 4 are one gate_up_proj pair of rank 8; the
    # scale alpha / sqrt(r) is kept.
    assert config["r"] == 8 and config["lora_alpha"] == pytest.approx(16 * 2 ** 0.5)
    tensors, _ = st_files.read(tmp_path / "adapter_model.safetensors")
    assert tuple(tensors["base_model.model.mlp.experts.base_layer.lora_A.weight"].shape) == (E * 8, H)


def test_load_adapter_refuses_another_scale(tmp_path):
    torch.manual_seed(0)
    model = Wrapper(BLOCKS["mixtral"]())
    kt.hf.replace_moe_experts(model, mode="lora", lora_rank=4, lora_alpha=8)
    kt.hf.save_adapter(model, tmp_path)
    other = Wrapper(BLOCKS["mixtral"]())
    kt.hf.replace_moe_experts(other, mode="lora", lora_rank=4, lora_alpha=16)
    with pytest.raises(ValueError, match="scale"):
        kt.hf.load_adapter(other, tmp_path)
