"""INT4 pack-quantized checkpoints written by the compressed-tensors library
itself (apply_quantization_config, its own min-max qparams, ModelCompressor
compress_model and update_config), in groups of 32 and 128, symmetric and
asymmetric: kt opens them in the matching format, holds exactly the weights
compressed-tensors' own decompress_model gives back, and its forward is the
float64 reference of those weights at the fp32 bound. FP8 128x128 blocks
written the same way (format float-quantized).
Versions: packaging/python/requirements-hosts.txt."""
import copy
import json
import os
import re

import pytest

# Read by huggingface_hub at import: nothing is fetched from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ct = pytest.importorskip("compressed_tensors",
                         reason="the real-host tests need compressed-tensors (tools/python_env.sh hosts)")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,  # noqa: E402
                                             QuantizationScheme, apply_quantization_config)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import kt  # noqa: E402
from helpers import measured  # noqa: E402
from helpers import tolerances  # noqa: E402
from helpers.reference import moe_forward, rel_l2  # noqa: E402

E, K, H, I, T, LAYER = 4, 2, 256, 128, 12, 1
PROJ = ("gate_proj", "up_proj", "down_proj")


def _experts_model(dtype):
    """model.layers.<L>.mlp.experts.<e>.{gate,up,down}_proj as nn.Linear, the
    per-expert modules compressed-tensors quantizes ("Linear" targets)."""
    torch.manual_seed(17)
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for _ in range(LAYER + 1):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = nn.ModuleList()
        for _ in range(E):
            expert = nn.Module()
            expert.gate_proj = nn.Linear(H, I, bias=False)
            expert.up_proj = nn.Linear(H, I, bias=False)
            expert.down_proj = nn.Linear(I, H, bias=False)
            layer.mlp.experts.append(expert)
        root.model.layers.append(layer)
    return root.to(dtype)


def _calibrate(model, args):
    """Each weight's qparams by compressed-tensors' own min-max rule."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            scale, zero = compute_dynamic_scales_and_zp(module.weight, args, module)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if getattr(module, "weight_zero_point", None) is not None:
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def write_checkpoint(directory, args, fmt, dtype=torch.bfloat16, calibrate=None):
    """Quantizes and compresses the experts with compressed-tensors and saves
    them as a checkpoint directory; returns the compressed model."""
    model = _experts_model(dtype)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                format=fmt)
    apply_quantization_config(model, config)
    (calibrate or _calibrate)(model, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": E,
                   "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
                   "num_hidden_layers": LAYER + 1}, f)
    compressor.update_config(directory)
    return model, compressor


def decompressed_weights(model, compressor):
    """compressed-tensors' own decompression of the layer, in fp32 (the
    scales are widened first, so (q - z) * scale is exact)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            for name in ("weight_scale",):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    module.weight_scale = nn.Parameter(t.float(), requires_grad=False)
    compressor.decompress_model(model)
    experts = model.model.layers[LAYER].mlp.experts
    return {p.split("_")[0]: torch.stack([getattr(experts[e], p).weight.float() for e in range(E)])
            for p in PROJ}


def inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    return x, ids, torch.rand(T, K, generator=gen)


INT4 = [(32, True), (32, False), (128, True), (128, False)]


@pytest.mark.parametrize("group,symmetric", INT4, ids=["g32_sym", "g32_asym", "g128_sym", "g128_asym"])
def test_int4_pack_quantized_checkpoint_of_compressed_tensors(tmp_path, group, symmetric, fp32_engine):
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    directory = str(tmp_path / "ckpt")
    model, compressor = write_checkpoint(directory, args, "pack-quantized")
    fmt = "int4_g%d%s" % (group, "" if symmetric else "_zp")
    want = decompressed_weights(model, compressor)
    with kt.Checkpoint(directory) as ck:
        assert ck.layers[LAYER]["weight_format"] == fmt and ck.layers[LAYER]["group_size"] == group
        options = ck.moe_options(LAYER)
        assert options["weight_format"] == fmt
        layer = kt.MoE(**options, max_tokens=T, engine=fp32_engine)
        ck.load_layer(LAYER, layer)
        bf16 = kt.MoE(**dict(options, weight_format="bf16"), max_tokens=T, engine=fp32_engine)
        ck.load_layer(LAYER, bf16, dequantize=True)
    got = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    layer.read_weights(**got)
    for p in got:
        assert torch.equal(got[p], want[p]), p
    rounded = {p: torch.empty_like(t) for p, t in got.items()}
    bf16.read_weights(**rounded)
    for p in got:
        assert torch.equal(rounded[p], want[p].to(torch.bfloat16).float()), p
    x, ids, w = inputs()
    y = torch.empty(T, H)
    layer.forward(x, ids, w, y)
    ref = moe_forward(x.double(), ids.long(), w.double(), {p: t.double() for p, t in want.items()})
    err = rel_l2(y, ref)
    measured.record("fp32", "real compressed-tensors %s" % fmt, err)
    assert err <= tolerances.FP32, err


def test_fp32_scales_load_only_dequantized(tmp_path):
    """compressed-tensors computes scales in the weights' dtype: from an
    fp32 model they are fp32, which kt's int4 layers (bf16 scales) do not
    hold exactly; the load says so, and dequantize=True loads them into bf16."""
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
    directory = str(tmp_path / "ckpt")
    model, compressor = write_checkpoint(directory, args, "pack-quantized", dtype=torch.float32)
    want = decompressed_weights(model, compressor)
    with kt.Checkpoint(directory) as ck:
        options = ck.moe_options(LAYER)
        layer = kt.MoE(**options, max_tokens=T)
        with pytest.raises(kt.UnsupportedError, match="not exact in the bf16 scales.*load it dequantized"):
            ck.load_layer(LAYER, layer)
        bf16 = kt.MoE(**dict(options, weight_format="bf16"), max_tokens=T)
        ck.load_layer(LAYER, bf16, dequantize=True)
    got = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    bf16.read_weights(**got)
    for p in got:
        assert torch.equal(got[p], want[p].to(torch.bfloat16).float()), p


def _fp8_block_calibrate(model, args):
    """compressed-tensors has no dynamic rule for blocks: the scale of each
    128x128 block is its absmax over e4m3's largest value (448), as
    llm-compressor's min-max observer gives it."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.float()
            out, inp = w.shape
            amax = w.abs().reshape(out // 128, 128, inp // 128, 128).amax(dim=(1, 3))
            module.weight_scale.data.copy_((amax / 448).to(module.weight_scale.dtype))


def test_fp8_block_checkpoint_of_compressed_tensors(tmp_path, fp32_engine):
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128],
                            symmetric=True)
    directory = str(tmp_path / "ckpt")
    model, compressor = write_checkpoint(directory, args, "float-quantized", calibrate=_fp8_block_calibrate)
    # The reference: the e4m3 codes compressed-tensors stored, times their
    # block's scale (decompressed_weights' widened scales do not broadcast
    # over blocks in its decompress_model).
    experts = model.model.layers[LAYER].mlp.experts
    want = {p.split("_")[0]: torch.stack([
        getattr(experts[e], p).weight.float()
        * getattr(experts[e], p).weight_scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        for e in range(E)]) for p in PROJ}
    with kt.Checkpoint(directory) as ck:
        assert ck.layers[LAYER]["loadable"], ck.layers[LAYER]
        assert ck.layers[LAYER]["weight_format"] == "fp8_b128"
        layer = kt.MoE(**ck.moe_options(LAYER), max_tokens=T, engine=fp32_engine)
        ck.load_layer(LAYER, layer)
    got = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    layer.read_weights(**got)
    for p in got:
        assert torch.equal(got[p], want[p]), p
    x, ids, w = inputs()
    y = torch.empty(T, H)
    layer.forward(x, ids, w, y)
    ref = moe_forward(x.double(), ids.long(), w.double(), {p: t.double() for p, t in want.items()})
    err = rel_l2(y, ref)
    measured.record("fp32", "real compressed-tensors fp8_b128", err)
    assert err <= tolerances.FP32, err


def _fp8_checkpoint_with_config(tmp_path, change):
    """The fp8 block checkpoint with its config group's weights changed."""
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128],
                            symmetric=True)
    directory = str(tmp_path / "ckpt")
    write_checkpoint(directory, args, "float-quantized", calibrate=_fp8_block_calibrate)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def test_fp8_per_channel_config_is_described_not_loaded(tmp_path):
    """A config that says per-channel fp8 scales: kt describes the layer and
    a load refuses, saying what kt holds."""
    directory = _fp8_checkpoint_with_config(tmp_path, {"strategy": "channel", "block_structure": None})
    with kt.Checkpoint(directory) as ck:
        assert not ck.layers[LAYER]["loadable"], ck.layers[LAYER]
        layer = kt.MoE(**dict(ck.moe_options(LAYER), weight_format="fp8_b128"), max_tokens=T)
        with pytest.raises(kt.KtError, match=re.escape("in symmetric blocks (strategy block)")):
            ck.load_layer(LAYER, layer)


def test_fp8_config_contradicting_the_scales_fails_the_open(tmp_path):
    """block_structure [64, 64] over scales of 128 x 128 blocks: the open
    fails, naming the scale tensor and what the config implies."""
    directory = _fp8_checkpoint_with_config(tmp_path, {"block_structure": [64, 64]})
    with pytest.raises(kt.IOFailure, match=r"weight_scale' \(fp8 block scales\): expected float \[2,4\] "
                                           r"\(block_structure \[64,64\]\)"):
        kt.Checkpoint(directory)
