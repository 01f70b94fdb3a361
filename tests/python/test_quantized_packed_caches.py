"""Quantized checkpoints through the Python bindings: each layout kt holds as
stored (fp8 128x128 blocks, compressed-tensors int4 in groups of 128,
asymmetric compressed-tensors int4 in groups of 32, DeepSeek-V4 MXFP4) opens with its format in kt.Checkpoint.layers and
moe_options; a layer loaded from it saves a packed cache that kt.packed_info
reports in that format with the layer's bytes, maps back into a layer of
that format with the same weights and bit-identical outputs, and is refused
by a layer of another format, naming both. Into a bf16 layer a quantized
layer loads only when asked (load_layer(..., dequantize=True), and
kt.hf.replace_moe_experts(..., dequantize=True)): then it holds the weights
decoded here from the checkpoint's bits, rounded to bf16; without it, or
into a layer of another quantized format, the load is refused and the layer
keeps nothing."""
import json
import os

import pytest
import torch

import kt
import kt.hf
from helpers import st_files
from helpers import tolerances
from helpers.hf_shaped import Qwen3MoeSparseMoeBlock
from helpers.reference import moe_forward, rel_l2

E, K, H, I, T = 4, 2, 160, 96, 12
PROJ = ("gate_proj", "up_proj", "down_proj")
V4_PROJ = ("w1", "w3", "w2")


def shapes():
    """(out, in) of gate, up, down."""
    return ((I, H), (I, H), (H, I))


def fp8_ckpt(d, gen):
    """DeepSeek-V3: weight F8_E4M3 [out, in] (codes of exponent <= 9: |v| <= 7.5,
    no NaN), weight_scale_inv F32 [ceil(out/128), ceil(in/128)]."""
    tensors = {}
    for e in range(E):
        for p, (out, inp) in zip(PROJ, shapes()):
            sign = torch.randint(0, 2, (out, inp), generator=gen, dtype=torch.uint8) << 7
            exp = torch.randint(0, 10, (out, inp), generator=gen, dtype=torch.uint8) << 3
            man = torch.randint(0, 8, (out, inp), generator=gen, dtype=torch.uint8)
            name = "model.layers.1.mlp.experts.%d.%s" % (e, p)
            tensors[name + ".weight"] = ("F8_E4M3", sign | exp | man)
            rows, cols = -(-out // 128), -(-inp // 128)
            tensors[name + ".weight_scale_inv"] = (torch.rand(rows, cols, generator=gen) + 1) / (8 * inp ** 0.5)
    config = {"model_type": "deepseek_v3", "num_experts_per_tok": K,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    return tensors, config, 1


def random_words(gen, *shape):
    """int32 words of random bits (any nibble)."""
    halves = torch.randint(0, 2 ** 16, shape + (2,), generator=gen, dtype=torch.int32)
    return halves[..., 0] | (halves[..., 1] << 16)


def int4_ckpt(gen, layer, group, symmetric):
    """compressed-tensors pack-quantized: weight_packed I32 [out, in/8] (any
    nibble: q + 8), weight_scale BF16 [out, ceil(in/group)], weight_shape;
    asymmetric: weight_zero_point I32 [ceil(out/8), ceil(in/group)] (eight
    rows a word, row r in bits 4 (r % 8), stored as z + 8)."""
    tensors = {}
    for e in range(E):
        for p, (out, inp) in zip(PROJ, shapes()):
            name = "model.layers.%d.mlp.experts.%d.%s" % (layer, e, p)
            tensors[name + ".weight_packed"] = random_words(gen, out, -(-inp // 8))
            scales = (torch.rand(out, -(-inp // group), generator=gen) + 1) / (4 * inp ** 0.5)
            tensors[name + ".weight_scale"] = scales.to(torch.bfloat16)
            tensors[name + ".weight_shape"] = torch.tensor([out, inp], dtype=torch.int64)
            if not symmetric:
                tensors[name + ".weight_zero_point"] = random_words(gen, -(-out // 8), -(-inp // group))
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric,
               "dynamic": False}
    config = {"model_type": "kimi_k2", "num_experts_per_tok": K,
              "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}
    return tensors, config, layer


def int4_g128_ckpt(d, gen):
    return int4_ckpt(gen, 2, 128, True)


def int4_g32_zp_ckpt(d, gen):
    return int4_ckpt(gen, 4, 32, False)


def nibbles(words, n):
    """The first n 4-bit fields of each int32 word row, low nibble first."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return ((words.unsqueeze(-1) >> shifts) & 15).flatten(-2)[..., :n]


def decode_int4_zp(tensors, e, p, out, inp):
    """W = (q - z) * scale from the checkpoint's bits, in float64."""
    name = "model.layers.4.mlp.experts.%d.%s" % (e, p)
    q = nibbles(tensors[name + ".weight_packed"], inp).double()
    z = nibbles(tensors[name + ".weight_zero_point"].t(), out).t().double()  # [out, groups]
    s = tensors[name + ".weight_scale"].double()
    return (q - z.repeat_interleave(32, dim=1)[:, :inp]) * s.repeat_interleave(32, dim=1)[:, :inp]


def mxfp4_ckpt(d, gen):
    """DeepSeek-V4 style: weight U8 [out, in/2] (two e2m1 codes a byte),
    scale F8_E8M0 [out, ceil(in/32)] near 2^-4."""
    tensors = {}
    for e in range(E):
        for p, (out, inp) in zip(V4_PROJ, shapes()):
            name = "layers.3.ffn.experts.%d.%s" % (e, p)
            tensors[name + ".weight"] = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8)
            scales = torch.randint(121, 126, (out, -(-inp // 32)), generator=gen, dtype=torch.uint8)
            tensors[name + ".scale"] = ("F8_E8M0", scales)
    return tensors, {"num_experts_per_tok": K, "quantization_config": {"quant_method": "mxfp4"}}, 3


CHECKPOINTS = {"fp8_b128": fp8_ckpt, "int4_g128": int4_g128_ckpt, "int4_g32_zp": int4_g32_zp_ckpt,
               "mxfp4": mxfp4_ckpt}


def write_ckpt(d, fmt):
    gen = torch.Generator().manual_seed(7)
    tensors, config, layer = CHECKPOINTS[fmt](d, gen)
    d.mkdir()
    st_files.write(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(config))
    return layer


def weights(layer):
    w = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    layer.read_weights(**w)
    return w


def inputs():
    """x [T, H], expert ids [T, K] and routing weights [T, K]."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    return x, ids, torch.rand(T, K, generator=gen)


def forward(layer):
    y = torch.empty(T, H)
    layer.forward(*inputs(), y)
    return y


@pytest.mark.parametrize("fmt", sorted(CHECKPOINTS))
def test_packed_cache_of_a_quantized_checkpoint(fmt, tmp_path):
    layer_number = write_ckpt(tmp_path / "ckpt", fmt)
    with kt.Checkpoint(tmp_path / "ckpt") as ck:
        assert ck.layers[layer_number]["weight_format"] == fmt
        opts = ck.moe_options(layer_number)
        assert opts["weight_format"] == fmt
        loaded = kt.MoE(**opts, max_tokens=T)
        ck.load_layer(layer_number, loaded)
    info = loaded.info()
    assert info["weight_format"] == fmt and info["num_loaded"] == E
    path = os.fspath(tmp_path / "layer.ktpack")
    loaded.save_packed(path)
    p = kt.packed_info(path)
    assert (p["weight_format"], p["num_experts"], p["num_loaded"], p["hidden"], p["intermediate"]) == \
        (fmt, E, E, H, I)
    assert p["weight_bytes"] == info["weight_bytes"] and p["bias"] is False
    assert p["file_bytes"] == os.path.getsize(path)

    mapped = kt.MoE(**opts, max_tokens=T)
    mapped.load_packed(path)
    assert mapped.info()["weight_format"] == fmt
    w_loaded, w_mapped = weights(loaded), weights(mapped)
    assert all(torch.equal(w_loaded[k], w_mapped[k]) for k in w_loaded)
    assert torch.equal(forward(mapped), forward(loaded))

    other = "int4_g32" if fmt != "int4_g32" else "int8_channel"
    for stores in ("bf16", other):
        refusing = kt.MoE(**dict(opts, weight_format=stores), max_tokens=T)
        with pytest.raises(kt.InvalidArgumentError,
                           match="the cache holds %s weights, the layer stores %s" % (fmt, stores)):
            refusing.load_packed(path)
        assert refusing.num_loaded() == 0


def test_asymmetric_int4_checkpoint_is_held_natively_and_runs(tmp_path, fp32_engine):
    """Zero points stay in memory as stored: the layer reports int4_g32_zp
    with about 0.6 bytes a weight, holds (q - z) * scale exactly as this
    file decodes the bits, and its forward is the float64 reference of those
    weights at the fp32 bound; a symmetric int4 layer refuses it."""
    gen = torch.Generator().manual_seed(7)
    tensors, config, layer_number = int4_g32_zp_ckpt(tmp_path, gen)
    d = tmp_path / "ckpt"
    d.mkdir()
    st_files.write(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(config))
    with kt.Checkpoint(d) as ck:
        assert ck.layers[layer_number]["weight_format"] == "int4_g32_zp"
        opts = ck.moe_options(layer_number)
        assert opts["weight_format"] == "int4_g32_zp"
        layer = kt.MoE(**opts, max_tokens=T, engine=fp32_engine)
        ck.load_layer(layer_number, layer)
        refusing = kt.MoE(**dict(opts, weight_format="int4_g32"), max_tokens=T, engine=fp32_engine)
        with pytest.raises(kt.UnsupportedError, match="asymmetric"):
            ck.load_layer(layer_number, refusing)
    info = layer.info()
    assert info["weight_format"] == "int4_g32_zp" and info["num_loaded"] == E
    assert info["weight_bytes"] < 0.7 * info["num_weights"]
    held = weights(layer)
    for key, p, (out, inp) in zip(("gate", "up", "down"), PROJ, shapes()):
        want = torch.stack([decode_int4_zp(tensors, e, p, out, inp) for e in range(E)])
        assert torch.equal(held[key].double(), want), key
    x, ids, rw = inputs()
    y = forward(layer)
    ref = moe_forward(x.double(), ids, rw.double(), {k: v.double() for k, v in held.items()})
    assert rel_l2(y, ref) <= tolerances.FP32


# ---------------------------------------------------------------- dequantized loads

# e2m1 codes (sign in bit 3, two exponent bits, one mantissa bit).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e4m3_values(codes):
    """float32 values of e4m3 codes (bias 7; exponent field 0: subnormal)."""
    c = codes.to(torch.int64)
    sign = 1.0 - 2.0 * (c >> 7).double()
    exp, man = (c >> 3) & 15, (c & 7).double()
    normal = (1 + man / 8) * torch.pow(torch.full_like(man, 2.0), (exp - 7).double())
    value = torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)
    return (sign * value).float()


def decoded_weights(fmt, tensors):
    """Each projection's W [E, out, in] decoded here from the checkpoint's
    bits: the float32 product code * scale (W = (q - z) * scale with zero
    points), unrounded."""
    out = {}
    for key, p, v4, (o, i) in zip(("gate", "up", "down"), PROJ, V4_PROJ, shapes()):
        ws = []
        for e in range(E):
            if fmt == "fp8_b128":
                name = "model.layers.1.mlp.experts.%d.%s" % (e, p)
                q = e4m3_values(tensors[name + ".weight"][1])
                s = tensors[name + ".weight_scale_inv"].repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
                ws.append(q * s)
            elif fmt == "int4_g128":
                name = "model.layers.2.mlp.experts.%d.%s" % (e, p)
                q = (nibbles(tensors[name + ".weight_packed"], i) - 8).float()
                s = tensors[name + ".weight_scale"].float().repeat_interleave(128, 1)[:, :i]
                ws.append(q * s)
            elif fmt == "int4_g32_zp":
                ws.append(decode_int4_zp(tensors, e, p, o, i).float())  # exact in float32
            else:
                assert fmt == "mxfp4"
                name = "layers.3.ffn.experts.%d.%s" % (e, v4)
                b = tensors[name + ".weight"].to(torch.int64)
                q = E2M1[torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)]  # even element in the low nibble
                exps = tensors[name + ".scale"][1].double() - 127
                s = torch.pow(torch.full_like(exps, 2.0), exps).float().repeat_interleave(32, 1)[:, :i]
                ws.append(q * s)
        out[key] = torch.stack(ws)
    return out


def to_bf16(w):
    return {k: v.to(torch.bfloat16).float() for k, v in w.items()}


def written_ckpt(tmp_path, fmt):
    gen = torch.Generator().manual_seed(7)
    tensors, config, layer_number = CHECKPOINTS[fmt](tmp_path, gen)
    d = tmp_path / "ckpt"
    d.mkdir()
    st_files.write(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(config))
    return d, tensors, layer_number


@pytest.mark.parametrize("fmt", sorted(CHECKPOINTS))
def test_a_quantized_layer_loads_into_bf16_only_when_dequantized(fmt, tmp_path, fp32_engine):
    d, tensors, layer_number = written_ckpt(tmp_path, fmt)
    want = to_bf16(decoded_weights(fmt, tensors))
    with kt.Checkpoint(d) as ck:
        opts = ck.moe_options(layer_number)
        assert opts["weight_format"] == fmt
        bf16 = kt.MoE(**dict(opts, weight_format="bf16"), max_tokens=T, engine=fp32_engine)
        # No choice made (the plain call) or dequantize=False: refused, naming
        # the format that holds it and the option; the layer keeps nothing.
        for kw in ({}, {"dequantize": False}):
            with pytest.raises(kt.UnsupportedError) as err:
                ck.load_layer(layer_number, bf16, **kw)
            msg = str(err.value)
            assert "layer %d stores" % layer_number in msg and "the kt_moe stores bf16" in msg, msg
            assert "create the kt_moe with weight_format %s" % fmt in msg, msg
            assert "kt_ckpt_load_options.dequantize = 1" in msg, msg
            assert bf16.num_loaded() == 0 and bf16.info()["num_loaded"] == 0
        # Asked for: every expert loads, dequantized, rounded to bf16 once.
        calls = []
        ck.load_layer(layer_number, bf16, lambda done, total: calls.append((done, total)), dequantize=True)
        assert calls and calls[-1] == (E, E), calls
        # The flag permits, never forces: a layer of the checkpoint's format loads it as stored.
        native = kt.MoE(**opts, max_tokens=T)
        ck.load_layer(layer_number, native, dequantize=True)
        # Never re-quantized: a layer of another quantized format is refused with or without the flag.
        for dequantize in (False, True):
            other = kt.MoE(**dict(opts, weight_format="int8_channel"), max_tokens=T)
            with pytest.raises(kt.UnsupportedError) as err:
                ck.load_layer(layer_number, other, dequantize=dequantize)
            msg = str(err.value)
            assert "the kt_moe stores int8_channel: a quantized checkpoint is never re-quantized" in msg, msg
            assert "create the kt_moe with weight_format %s" % fmt in msg, msg
            assert other.num_loaded() == 0
    info = bf16.info()
    assert info["weight_format"] == "bf16" and info["num_loaded"] == E
    assert info["weight_bytes"] == E * 3 * H * I * 2
    held = weights(bf16)
    for k in held:
        assert torch.equal(held[k], want[k]), k
    # The same weights as the layer holding the codes, rounded to bf16.
    assert native.info()["weight_format"] == fmt and native.info()["num_loaded"] == E
    held_native = weights(native)
    for k in held:
        assert torch.equal(held[k], to_bf16(held_native)[k]), k
    # The bf16 layer computes with those weights.
    x, ids, rw = inputs()
    ref = moe_forward(x.double(), ids, rw.double(), {k: v.double() for k, v in held.items()})
    assert rel_l2(forward(bf16), ref) <= tolerances.FP32


def _meta_model_with_layer_1():
    """layers.0 (no MoE) and layers.1.mlp, a Qwen3-MoE block whose routed
    experts are on the meta device."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.layers[1].mlp = Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta")
    return model


def test_hf_replacement_dequantizes_a_quantized_checkpoint_only_when_asked(tmp_path):
    d, tensors, layer_number = written_ckpt(tmp_path, "fp8_b128")
    assert layer_number == 1
    decoded = decoded_weights("fp8_b128", tensors)
    with pytest.raises(kt.UnsupportedError, match=r"the kt_moe stores bf16: .*kt_ckpt_load_options\.dequantize = 1"):
        kt.hf.replace_moe_experts(_meta_model_with_layer_1(), checkpoint=d)

    model = _meta_model_with_layer_1()
    assert kt.hf.replace_moe_experts(model, checkpoint=d, dequantize=True) == ["layers.1.mlp"]
    (experts,) = kt.hf.kt_experts_modules(model)
    info = experts.kt_layer.info()
    assert info["weight_format"] == "bf16" and info["num_loaded"] == E
    held = weights(experts.kt_layer)
    want = to_bf16(decoded)
    for k in held:
        assert torch.equal(held[k], want[k]), k
    with torch.no_grad():
        y = model.layers[1].mlp(torch.randn(1, 3, H))
    assert torch.isfinite(y[0] if isinstance(y, tuple) else y).all()

    # weight_format of the checkpoint's own format: held as stored (code * scale, unrounded).
    model = _meta_model_with_layer_1()
    kt.hf.replace_moe_experts(model, checkpoint=d, weight_format="fp8_b128")
    (experts,) = kt.hf.kt_experts_modules(model)
    assert experts.kt_layer.info()["weight_format"] == "fp8_b128"
    held = weights(experts.kt_layer)
    for k in held:
        assert torch.equal(held[k], decoded[k]), k

    with pytest.raises(kt.UnsupportedError, match="the kt_moe stores int4_g32: a quantized checkpoint is never re-quantized"):
        kt.hf.replace_moe_experts(_meta_model_with_layer_1(), checkpoint=d, weight_format="int4_g32", dequantize=True)
    for source in ({}, {"packed": tmp_path}):
        with pytest.raises(ValueError, match=r"dequantize=True applies to the layers loaded from checkpoint="):
            kt.hf.replace_moe_experts(_meta_model_with_layer_1(), dequantize=True, **source)
