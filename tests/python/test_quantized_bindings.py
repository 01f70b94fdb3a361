"""The storage format of the frozen base through the Python bindings: kt.MoE,
kt.torch.MoEExperts and kt.hf.replace_moe_experts take weight_format; the
layer reports it and its bytes; it computes with the dequantized weights W'
(checked against the float64 reference of W' at the fp32 bound) and stays
within the quantization error kt_c_api.h states of the bf16 layer; packed
caches keep the format and refuse a layer of another."""
import os
import tempfile

import pytest
import torch

import kt
import kt.hf
import kt.torch
import tolerances
from cases import make_case
from hf_shaped import Qwen3MoeSparseMoeBlock, round_params_to_bf16
from reference import moe_forward, rel_l2

E, K, H, I, T = 6, 2, 96, 48, 24
# kt_c_api.h ("Quantized frozen bases"): the relative L2 error of W' against
# W is 0.8 % (int8 per channel) and 9.7 % (int4, groups of 32) on Gaussian
# rows. y = Wd (silu(Wg x) * Wu x): to first order the relative errors of
# the three projections add, so y may differ from the bf16 layer's by up to
# 3x the weights' error (measured on this case: weights 0.60 % and 9.5 %, y 1.2 %
# and 18 % for int8 and int4, about twice the weights' error); a
# wrong scale or nibble order gives errors of order 100 %.
STATED_WEIGHT_ERROR = {"int8_channel": 0.008, "int4_g32": 0.097}
FORMATS = list(STATED_WEIGHT_ERROR)


def align64(n):
    return (n + 63) // 64 * 64


def expected_weight_bytes(fmt, e, h, i):
    """Bytes of the stored base (formats/packed_quant.h): per expert and
    projection [n, k], 16-row panels of codes (K padded to 32) and bf16
    scales (one per row, or per group of 32), each block 64-byte aligned."""
    def block(n, k):
        panels, kq = (n + 15) // 16, (k + 31) // 32 * 32
        bits, groups = (8, 1) if fmt == "int8_channel" else (4, kq // 32)
        codes = panels * 16 * kq * bits // 8
        return align64(align64(codes) + panels * groups * 16 * 2)
    return e * (2 * block(i, h) + block(h, i))


def dequantized(layer):
    w = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    layer.read_weights(**w)
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_layer_in_each_format(fmt, fp32_engine):
    case = make_case(E, K, H, I, T, seed=11)
    w, x, ids, rw = case["w"], case["x"], case["ids"], case["weights"]
    bf16 = kt.MoE(E, K, H, I, max_tokens=T, engine=fp32_engine)
    quant = kt.MoE(E, K, H, I, max_tokens=T, engine=fp32_engine, weight_format=fmt)
    for layer in (bf16, quant):
        layer.load_weights(gate=w["gate"], up=w["up"], down=w["down"])
    info, base = quant.info(), bf16.info()
    assert info["weight_format"] == fmt and base["weight_format"] == "bf16"
    assert info["weight_bytes"] == expected_weight_bytes(fmt, E, H, I)
    assert base["weight_bytes"] == E * 3 * H * I * 2
    assert info["num_weights"] == E * 3 * H * I and info["num_loaded"] == E
    y_q, y_b = torch.empty_like(x), torch.empty_like(x)
    quant.forward(x, ids, rw, y_q)
    bf16.forward(x, ids, rw, y_b)
    # W' exactly as kt computes with it: y is the reference of W' at fp32 accuracy.
    w_q = dequantized(quant)
    assert rel_l2(y_q, moe_forward(x.double(), ids, rw.double(), {k: v.double() for k, v in w_q.items()})) \
        <= tolerances.FP32
    weight_error = rel_l2(torch.cat([w_q[p].flatten() for p in w_q]), torch.cat([w[p].flatten() for p in w_q]))
    assert weight_error <= STATED_WEIGHT_ERROR[fmt] * 1.1
    output_error = rel_l2(y_q, y_b)
    assert 0 < output_error <= 3 * STATED_WEIGHT_ERROR[fmt], output_error

    # A packed cache keeps the codes: an int layer maps them back; a bf16 layer refuses.
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "layer.ktpack")
        quant.save_packed(path)
        assert kt.packed_info(path)["weight_format"] == fmt
        assert kt.packed_info(path)["weight_bytes"] == info["weight_bytes"]
        mapped = kt.MoE(E, K, H, I, max_tokens=T, engine=fp32_engine, weight_format=fmt)
        mapped.load_packed(path)
        y_m = torch.empty_like(x)
        mapped.forward(x, ids, rw, y_m)
        assert torch.equal(y_m, y_q)
        with pytest.raises(kt.InvalidArgumentError, match="the cache holds %s weights, the layer stores bf16" % fmt):
            kt.MoE(E, K, H, I, max_tokens=T, engine=fp32_engine).load_packed(path)
    with pytest.raises(ValueError, match="weight_format must be one of"):
        kt.MoE(E, K, H, I, weight_format="fp4")
    with pytest.raises(kt.ModeError):
        kt.MoE(E, K, H, I, mode="full", weight_format=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_module_trains_lora_on_a_quantized_base(fmt, fp32_engine):
    case = make_case(E, K, H, I, T, seed=12)
    w, x, ids, rw = case["w"], case["x"], case["ids"], case["weights"]
    mods = {}
    for f in ("bf16", fmt):
        m = kt.torch.MoEExperts(E, K, H, I, mode="lora", lora_rank=4, lora_alpha=8.0, max_tokens=T,
                                engine=fp32_engine, weight_format=f)
        m.load_weights(gate=w["gate"], up=w["up"], down=w["down"])
        torch.manual_seed(3)
        with torch.no_grad():
            for p in ("gate", "up", "down"):
                getattr(m, "lora_B_" + p).normal_(0, 0.1)
        mods[f] = m
    assert mods[fmt].kt_layer.info()["weight_format"] == fmt
    assert "weight_format=%s" % fmt in repr(mods[fmt])
    # Same LoRA factors: the outputs differ by the base's quantization only.
    mods[fmt].load_state_dict(mods["bf16"].state_dict())
    xs = x.clone().requires_grad_(True)
    y_q = mods[fmt](xs, ids, rw)
    y_b = mods["bf16"](x, ids, rw)
    assert rel_l2(y_q.detach(), y_b.detach()) <= 3 * STATED_WEIGHT_ERROR[fmt]
    y_q.square().sum().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all()
    assert mods[fmt].lora_A_gate.grad is not None and mods[fmt].lora_A_gate.grad.abs().sum() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_hf_replacement_quantizes_the_experts(fmt, fp32_engine):
    torch.manual_seed(0)
    model = round_params_to_bf16(torch.nn.Sequential(Qwen3MoeSparseMoeBlock(H, I, E, K)))
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        before = model(x)
    replaced = kt.hf.replace_moe_experts(model, engine=fp32_engine, weight_format=fmt)
    assert replaced
    (experts,) = kt.hf.kt_experts_modules(model)
    assert experts.kt_layer.info()["weight_format"] == fmt
    assert experts.kt_layer.info()["weight_bytes"] == expected_weight_bytes(fmt, E, H, I)
    with torch.no_grad():
        after = model(x)
    before = before[0] if isinstance(before, tuple) else before
    after = after[0] if isinstance(after, tuple) else after
    assert 0 < rel_l2(after, before) <= 3 * STATED_WEIGHT_ERROR[fmt]


# compute="int8" (kt_c_api.h, "Int8 compute"): x and the activation as int8
# per row. y against the same base with bf16 activations: 1-2 % relative L2
# on Gaussian inputs (the header's figure; measured here 1.2-1.7 %), never 0
# (that would be a layer still computing in bf16) and far below the errors of
# a wrong scale or code order (order 100 %).
INT8_ACTIVATION_ERROR = 0.03


@pytest.mark.parametrize("fmt", ["int8_channel", "int4_g32", "int4_g128"])
def test_int8_compute_through_the_bindings(fmt, fp32_engine):
    case = make_case(E, K, H, I, T, seed=13)
    w, x, ids, rw = case["w"], case["x"], case["ids"], case["weights"]
    mods = {}
    for compute in ("bf16", "int8"):
        m = kt.torch.MoEExperts(E, K, H, I, max_tokens=T, engine=fp32_engine, weight_format=fmt, compute=compute)
        m.load_weights(gate=w["gate"], up=w["up"], down=w["down"])
        mods[compute] = m
    info = mods["int8"].kt_layer.info()
    assert info["compute"] == "int8" and mods["bf16"].kt_layer.info()["compute"] == "bf16"
    assert info["weight_format"] == fmt
    assert "compute=int8" in repr(mods["int8"]) and "compute" not in repr(mods["bf16"])
    with torch.no_grad():
        y_int8 = mods["int8"](x, ids, rw)
        y_bf16 = mods["bf16"](x, ids, rw)
    assert 1e-3 < rel_l2(y_int8, y_bf16) <= INT8_ACTIVATION_ERROR, rel_l2(y_int8, y_bf16)
    # No backward: a forward that would save a context for one is refused.
    with pytest.raises(kt.KtError, match="KT_COMPUTE_INT8"):
        mods["int8"](x.clone().requires_grad_(True), ids, rw)


def test_int8_compute_refusals(fp32_engine):
    with pytest.raises(ValueError, match="compute must be one of"):
        kt.MoE(E, K, H, I, engine=fp32_engine, weight_format="int4_g32", compute="int4")
    with pytest.raises(kt.KtError, match="int8_channel, int4_g32, int4_g128"):
        kt.MoE(E, K, H, I, engine=fp32_engine, compute="int8")  # a bf16 base
    with pytest.raises(kt.KtError, match="KT_MODE_INFERENCE"):
        kt.MoE(E, K, H, I, engine=fp32_engine, weight_format="int4_g32", mode="lora", compute="int8")
