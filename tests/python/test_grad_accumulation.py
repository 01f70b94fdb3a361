"""Parameter gradients over an accumulation window, with grad_scale, equal
torch's accumulated gradients of the reference."""
import pytest
import torch

from helpers import tolerances
from helpers.cases import build_module, make_case
from helpers.reference import checked_lora_scale, reference_grads, rel_l2

E, K, H, I, T = 5, 2, 40, 24, 9
R, ALPHA = 4, 8.0  # build_module's LoRA options (alpha / r = 2)


def _param_keys(mode):
    if mode == "lora":
        return {"lora_%s_%s" % (ab, p): "%s_%s" % (ab, p) for ab in "AB"
                for p in ("gate", "up", "down")}
    return {"w_" + p: p for p in ("gate", "up", "down")}


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_three_micro_batches_with_grad_scale(mode, fp32_engine):
    cases = [make_case(E, K, H, I, T, mode=mode, seed=s) for s in range(3)]
    for c in cases[1:]:  # one model: same weights and LoRA factors, new data
        c["w"], c["lora"] = cases[0]["w"], cases[0]["lora"]
    module = build_module(cases[0], E, K, H, I, mode=mode, rank=R, alpha=ALPHA, engine=fp32_engine)
    scale = checked_lora_scale(module.lora_scale, R, ALPHA) if mode == "lora" else 0.0
    module.grad_scale = 0.25
    keys = _param_keys(mode)
    want = {k: 0 for k in keys}
    for c in cases:
        x = c["x"].clone().requires_grad_(True)
        module(x, c["ids"], c["weights"]).backward(c["dy"])
        _, ref = reference_grads(c["x"], c["ids"], c["weights"], c["w"], c["dy"],
                                 lora=c["lora"], weight_grads=(mode == "full"),
                                 lora_scale=scale)
        for k, rk in keys.items():
            want[k] = want[k] + 0.25 * ref[rk]
        # dx goes back into autograd unscaled
        assert rel_l2(x.grad, ref["x"]) <= tolerances.FP32
    for k in keys:
        assert rel_l2(getattr(module, k).grad, want[k]) <= tolerances.FP32, k

    # A new window after zero_grad(set_to_none=True) starts from this micro-batch alone,
    # written into the same buffers (no reallocation per step).
    buffers = {k: getattr(module, k).grad for k in keys}
    module.zero_grad(set_to_none=True)
    c = cases[2]
    module(c["x"], c["ids"], c["weights"].clone().requires_grad_(True)).backward(c["dy"])
    _, ref = reference_grads(c["x"], c["ids"], c["weights"], c["w"], c["dy"], lora=c["lora"],
                             weight_grads=(mode == "full"), lora_scale=scale)
    for k, rk in keys.items():
        g = getattr(module, k).grad
        assert g is buffers[k]
        assert rel_l2(g, 0.25 * ref[rk]) <= tolerances.FP32, k

    # zero_grad(set_to_none=False) keeps the buffers: kt accumulates onto the zeros.
    module.zero_grad(set_to_none=False)
    module(c["x"], c["ids"], c["weights"].clone().requires_grad_(True)).backward(c["dy"])
    for k, rk in keys.items():
        assert rel_l2(getattr(module, k).grad, 0.25 * ref[rk]) <= tolerances.FP32, k


def test_frozen_parameters_get_no_grad(fp32_engine):
    c = make_case(E, K, H, I, T, mode="lora")
    module = build_module(c, E, K, H, I, mode="lora", engine=fp32_engine)
    module.lora_A_up.requires_grad_(False)
    x = c["x"].clone().requires_grad_(True)
    module(x, c["ids"], c["weights"]).backward(c["dy"])
    assert module.lora_A_up.grad is None
    assert module.lora_B_up.grad is not None and module.lora_B_up.grad.abs().sum() > 0


def test_optimizer_step_is_seen_by_kt(fp32_engine):
    # After an in-place update of the LoRA factors the next forward uses them.
    c = make_case(E, K, H, I, T, mode="lora")
    module = build_module(c, E, K, H, I, mode="lora", rank=R, alpha=ALPHA, engine=fp32_engine)
    y0 = module(c["x"], c["ids"], c["weights"])
    with torch.no_grad():
        module.lora_B_down.mul_(3.0)
    y1 = module(c["x"], c["ids"], c["weights"])
    lora = dict(c["lora"], B_down=c["lora"]["B_down"] * 3.0)
    ref1, _ = reference_grads(c["x"], c["ids"], c["weights"], c["w"], c["dy"], lora=lora,
                              weight_grads=False,
                              lora_scale=checked_lora_scale(module.lora_scale, R, ALPHA))
    assert rel_l2(y1, ref1) <= tolerances.FP32
    assert rel_l2(y0, ref1) > 100 * tolerances.FP32
    # Replacing the tensor (not in place) is seen as well.
    module.lora_B_down.data = module.lora_B_down.data / 3.0
    y2 = module(c["x"], c["ids"], c["weights"])
    assert rel_l2(y2, y0) <= tolerances.FP32


def test_full_mode_weight_update_is_repacked(fp32_engine):
    c = make_case(E, K, H, I, T, mode="full")
    module = build_module(c, E, K, H, I, mode="full", engine=fp32_engine)
    with torch.no_grad():
        module.w_down.mul_(0.5)
    y = module(c["x"], c["ids"], c["weights"])
    w = dict(c["w"], down=c["w"]["down"] * 0.5)
    ref, _ = reference_grads(c["x"], c["ids"], c["weights"], w, c["dy"], weight_grads=False)
    assert rel_l2(y, ref) <= tolerances.FP32
