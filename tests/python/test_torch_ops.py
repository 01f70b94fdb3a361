"""torch.ops.kt (the libtorch extension) against the reference, from Python."""
import os

import pytest
import torch

from helpers import tolerances
from helpers.cases import make_case
from helpers.reference import checked_lora_scale, reference_grads, rel_l2

OPS = os.environ.get("KT_TORCH_OPS_LIBRARY")
pytestmark = pytest.mark.skipif(not OPS, reason="KT_TORCH_OPS_LIBRARY not set (libtorch plugin not built)")

E, K, H, I, T, R = 6, 2, 72, 40, 13, 4
ALPHA = 8.0  # MoeLayer takes no rsLoRA option: s = alpha / r = 2
NAMES = ["lora_A_gate", "lora_B_gate", "lora_A_up", "lora_B_up", "lora_A_down", "lora_B_down"]


@pytest.fixture(scope="module")
def ops():
    torch.ops.load_library(OPS)
    return torch.ops.kt


def make_layer(case, mode="lora"):
    # kt's fp32-operand kernels, for a tight comparison (the env caps new engines).
    old = os.environ.get("KT_MAX_ISA")
    os.environ["KT_MAX_ISA"] = "avx2"
    try:
        layer = torch.classes.kt.MoeLayer(E, K, H, I, "silu", 0.0, mode, R, ALPHA, 64, 0)
    finally:
        if old is None:
            del os.environ["KT_MAX_ISA"]
        else:
            os.environ["KT_MAX_ISA"] = old
    w = case["w"]
    layer.load_weights(w["gate"], w["up"], w["down"])
    if mode == "lora":
        assert layer.parameter_names() == NAMES
        with torch.no_grad():
            for name, p in zip(NAMES, layer.parameters()):
                p.copy_(case["lora"][name[5:]])
    return layer


def test_moe_op_grads_match_reference(ops):
    c = make_case(E, K, H, I, T, mode="lora", rank=R)
    layer = make_layer(c)
    x = c["x"].clone().requires_grad_(True)
    w = c["weights"].clone().requires_grad_(True)
    y = ops.moe(layer, x, c["ids"], w)
    y.backward(c["dy"])
    ref_y, ref = reference_grads(c["x"], c["ids"], c["weights"], c["w"], c["dy"], lora=c["lora"],
                                 weight_grads=False,
                                 lora_scale=checked_lora_scale(layer.lora_scale(), R, ALPHA))
    assert rel_l2(y, ref_y) <= tolerances.FP32
    assert rel_l2(x.grad, ref["x"]) <= tolerances.FP32
    assert rel_l2(w.grad, ref["weights"]) <= tolerances.FP32
    for name, p in zip(NAMES, layer.parameters()):
        assert rel_l2(p.grad, ref[name[5:]]) <= tolerances.FP32, name
    # A second micro-batch accumulates, times grad_scale.
    layer.set_grad_scale(0.5)
    before = [p.grad.clone() for p in layer.parameters()]
    ops.moe(layer, c["x"], c["ids"], c["weights"]).backward(c["dy"])
    for name, p, b in zip(NAMES, layer.parameters(), before):
        assert rel_l2(p.grad, b + 0.5 * ref[name[5:]]) <= tolerances.FP32, name


def test_moe_op_finite_differences(ops):
    # d<y, dy>/dx along a random direction, by central differences of kt's own forward.
    c = make_case(E, K, H, I, T, mode="lora", rank=R, seed=3)
    layer = make_layer(c)
    x = c["x"].clone().requires_grad_(True)
    y = ops.moe(layer, x, c["ids"], c["weights"])
    (y * c["dy"]).sum().backward()
    v = torch.randn(c["x"].shape, generator=torch.Generator().manual_seed(11))
    eps = 1e-2
    with torch.no_grad():
        plus = (ops.moe(layer, c["x"] + eps * v, c["ids"], c["weights"]) * c["dy"]).double().sum()
        minus = (ops.moe(layer, c["x"] - eps * v, c["ids"], c["weights"]) * c["dy"]).double().sum()
    fd = (plus - minus).item() / (2 * eps)
    analytic = (x.grad.double() * v).sum().item()
    # Measured against the size a directional derivative can have, |grad| |v|:
    # relative to |analytic| itself a direction nearly orthogonal to the
    # gradient makes any tolerance flaky.
    scale = x.grad.norm().item() * v.norm().item()
    assert abs(fd - analytic) <= tolerances.FINITE_DIFFERENCE * scale, (fd, analytic, scale)


def test_raw_forward_backward_ops(ops):
    c = make_case(E, K, H, I, T, mode="inference")
    layer = make_layer(c, mode="inference")
    y, ctx = ops.moe_forward(layer, c["x"], c["ids"], c["weights"], True)
    dx, dw = ops.moe_backward(layer, ctx, c["dy"], False)
    ops.context_release(layer, ctx)
    ref_y, ref = reference_grads(c["x"], c["ids"], c["weights"], c["w"], c["dy"],
                                 weight_grads=False)
    assert rel_l2(y, ref_y) <= tolerances.FP32
    assert rel_l2(dx, ref["x"]) <= tolerances.FP32
    assert rel_l2(dw, ref["weights"]) <= tolerances.FP32


def test_errors_carry_kt_messages(ops):
    c = make_case(E, K, H, I, T, mode="lora", rank=R)
    layer = make_layer(c)
    with pytest.raises(RuntimeError, match="KT_ERR_DTYPE: kt_moe_forward: KT_ARG_X has dtype float64"):
        ops.moe(layer, c["x"].double(), c["ids"], c["weights"])
    with pytest.raises(RuntimeError, match="KT_ERR_SHAPE: kt_moe_forward: KT_ARG_IDS has shape"):
        ops.moe(layer, c["x"], c["ids"][:-1], c["weights"][:-1])
    x = c["x"].clone().requires_grad_(True)
    y = ops.moe(layer, x, c["ids"], c["weights"])
    y.backward(c["dy"], retain_graph=True)
    with pytest.raises(RuntimeError, match="KT_ERR_CONTEXT: kt_moe_backward: ctx"):
        y.backward(c["dy"])
    with pytest.raises(RuntimeError, match="mode must be"):
        torch.classes.kt.MoeLayer(E, K, H, I, "silu", 0.0, "bogus", R, 8.0, 64, 0)
