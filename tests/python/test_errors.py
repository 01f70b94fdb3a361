"""Bad calls raise Python exceptions that carry kt's message; the process lives on."""
import numpy as np
import pytest
import torch

import kt
import kt.torch as ktt
from helpers.cases import build_module, make_case

E, K, H, I, T = 4, 2, 32, 16, 6


@pytest.fixture
def lora_layer():
    c = make_case(E, K, H, I, T, mode="lora")
    return c, build_module(c, E, K, H, I, mode="lora")


def test_wrong_dtype(lora_layer):
    c, m = lora_layer
    with pytest.raises(kt.DTypeError, match=r"kt_moe_forward: KT_ARG_X has dtype float64; "
                                            r"expected bfloat16\|float32") as info:
        m(c["x"].double(), c["ids"], c["weights"])
    assert info.value.status == 4 and info.value.status_name == "KT_ERR_DTYPE"
    with pytest.raises(kt.DTypeError, match="KT_ARG_IDS has dtype float32"):
        m(c["x"], c["ids"].float(), c["weights"])


def test_wrong_shape(lora_layer):
    c, m = lora_layer
    with pytest.raises(kt.ShapeError, match=r"KT_ARG_IDS has shape \[%d,%d\]; expected \[%d,%d\]"
                       % (T - 1, K, T, K)):
        m(c["x"], c["ids"][:-1], c["weights"])


def test_wrong_device(lora_layer):
    c, m = lora_layer
    with pytest.raises(kt.DeviceError, match="kt reads CPU memory only"):
        m(c["x"].to("meta"), c["ids"], c["weights"])


def test_expert_id_out_of_range(lora_layer):
    c, m = lora_layer
    ids = c["ids"].clone()
    ids[0, 0] = E
    with pytest.raises(kt.ExpertIdError, match="outside"):
        m(c["x"], ids, c["weights"])


def test_backward_twice(lora_layer):
    c, m = lora_layer
    x = c["x"].clone().requires_grad_(True)
    y = m(x, c["ids"], c["weights"])
    y.backward(c["dy"], retain_graph=True)
    with pytest.raises(kt.ContextError, match="kt_moe_backward: ctx"):
        y.backward(c["dy"])


def test_process_survives_and_layer_still_works(lora_layer):
    c, m = lora_layer
    for bad in (c["x"].double(), c["x"][:, :-1].contiguous()):
        with pytest.raises((kt.KtError, RuntimeError)):
            m(bad, c["ids"], c["weights"])
    x = c["x"].clone().requires_grad_(True)
    y = m(x, c["ids"], c["weights"])
    y.backward(c["dy"])
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_bad_options_and_params():
    with pytest.raises(kt.InvalidArgumentError, match="top_k"):
        kt.MoE(4, 5, 8, 8)
    m = ktt.MoEExperts(E, K, H, I, mode="lora", lora_rank=2)
    m.lora_A_gate.data = torch.zeros(E, 3, H)
    with pytest.raises(kt.ShapeError, match="KT_ARG_LORA_A_GATE has shape"):
        m.sync_parameters()


def test_weights_not_loaded():
    m = kt.MoE(E, K, H, I)
    x = np.zeros((T, H), np.float32)
    with pytest.raises(kt.NotLoadedError):
        m.forward(x, np.zeros((T, K), np.int32), np.ones((T, K), np.float32), np.empty_like(x))


def test_raw_handles_refuse_to_be_copied(lora_layer):
    # MoEExperts copies itself into a new layer (test_copies_and_adapters);
    # the handle objects underneath would be freed twice.
    import copy
    import pickle
    _, m = lora_layer
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(m.kt_layer)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(m.kt_layer)
