"""kt.optim over the parameters of kt.torch.MoEExperts: one kt optimizer per
layer, fed by the gradients kt wrote, writing the layer's packed weights in
the same pass. Compared bit for bit with torch.optim on the same layer
(kt's fwd/bwd in both runs, only the optimizer differs), so every step's
loss and every parameter must be equal."""
import pytest
import torch

import kt.optim
from kt.torch import MoEExperts

E, K, H, I, T, R = 6, 2, 40, 24, 12, 4
STEPS = 8


def make_layer(mode, dtype, engine, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # LoRA A's init draws from the global generator
    m = MoEExperts(E, K, H, I, mode=mode, param_dtype=dtype, lora_rank=R, lora_alpha=2.0 * R,
                   engine=engine)
    m.load_weights(gate=torch.randn(E, I, H, generator=g) * 0.2,
                   up=torch.randn(E, I, H, generator=g) * 0.2,
                   down=torch.randn(E, H, I, generator=g) * 0.2)
    if mode == "lora":
        with torch.no_grad():  # a trained-looking adapter: B = 0 would hide A's gradient
            for p in ("gate", "up", "down"):
                getattr(m, "lora_B_" + p).normal_(0, 0.1, generator=g)
    return m


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g)
    return x, ids, w, dy


def train(m, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        x, ids, w, dy = batch(step)
        loss = (m(x, ids, w) * dy).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def count_repacks(m):
    calls = []
    original = m.kt_layer.params_changed

    def counted():
        calls.append(1)
        original()
    m.kt_layer.params_changed = counted
    return calls


OPTIMIZERS = [
    (kt.optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (kt.optim.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)),
]


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("ours,theirs,kw", OPTIMIZERS)
def test_layer_step_matches_torch_optim(fp32_engine, mode, ours, theirs, kw, correctly_rounded_sqrt):
    a, b = make_layer(mode, torch.float32, fp32_engine), make_layer(mode, torch.float32, fp32_engine)
    opt_a, opt_b = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
    la, lb = train(a, opt_a, STEPS), train(b, opt_b, STEPS)
    assert la == lb
    assert len(opt_a._layers) == 1 and not opt_a._kt  # one kt optimizer, over the layer
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    # Forward after the last step uses the new values: as a layer loaded from them.
    x, ids, w, _ = batch(99)
    with torch.no_grad():
        assert torch.equal(a(x, ids, w), b(x, ids, w))


def test_full_mode_step_repacks_nothing(fp32_engine):
    a, b = make_layer("full", torch.float32, fp32_engine), make_layer("full", torch.float32, fp32_engine)
    opt_a, opt_b = kt.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    train(a, opt_a, 1)
    train(b, opt_b, 1)
    calls_a, calls_b = count_repacks(a), count_repacks(b)
    train(a, opt_a, 3, start=1)
    train(b, opt_b, 3, start=1)
    assert calls_a == []          # kt's step wrote the packed weights itself
    assert len(calls_b) == 3      # torch's step changed the parameters: kt repacks them


def test_bf16_parameters_keep_fp32_masters(fp32_engine, correctly_rounded_sqrt):
    """kt's masters against torch.optim.AdamW over fp32 masters whose rounded
    copies are the layer's bf16 parameters (the mixed-precision recipe)."""
    a, b = make_layer("full", torch.bfloat16, fp32_engine), make_layer("full", torch.bfloat16, fp32_engine)
    opt_a = kt.optim.AdamW(a.parameters(), lr=1e-2)
    masters = [p.detach().float().requires_grad_() for p in b.parameters()]
    opt_b = torch.optim.AdamW(masters, lr=1e-2)
    for step in range(STEPS):
        x, ids, w, dy = batch(step)
        la = (a(x, ids, w) * dy).sum()
        opt_a.zero_grad(set_to_none=True)
        la.backward()
        opt_a.step()
        lb = (b(x, ids, w) * dy).sum()
        b.zero_grad(set_to_none=True)
        lb.backward()
        for m, p in zip(masters, b.parameters()):
            m.grad = p.grad.float()
        opt_b.step()
        with torch.no_grad():
            for m, p in zip(masters, b.parameters()):
                p.copy_(m)
        assert la.item() == lb.item(), step
    for pa, m in zip(a.parameters(), masters):
        assert torch.equal(opt_a.state[pa]["master"], m.detach())
        assert torch.equal(pa, m.detach().to(torch.bfloat16))


def test_host_write_to_bf16_parameter_reaches_the_master(fp32_engine):
    m = make_layer("full", torch.bfloat16, fp32_engine)
    opt = kt.optim.AdamW(m.parameters(), lr=0.0, weight_decay=0.0)
    train(m, opt, 1)
    with torch.no_grad():
        m.w_up.mul_(0.5)  # e.g. a host's own load or edit between steps
    expected = m.w_up.detach().float().clone()
    train(m, opt, 1, start=1)  # lr 0: the master keeps what the host wrote
    assert torch.equal(opt.state[m.w_up]["master"], expected)
    assert torch.equal(m.w_up.detach().float(), expected)


def test_parameters_split_over_groups_are_stepped_one_by_one(fp32_engine, correctly_rounded_sqrt):
    """Not all of a layer's parameters in one group: kt steps each on its own
    and the layer re-reads them at the next forward."""
    a, b = make_layer("full", torch.float32, fp32_engine), make_layer("full", torch.float32, fp32_engine)

    def groups(m):
        return [{"params": [m.w_gate, m.w_up]}, {"params": [m.w_down], "lr": 3e-3}]
    opt_a, opt_b = kt.optim.AdamW(groups(a), lr=1e-2), torch.optim.AdamW(groups(b), lr=1e-2)
    assert train(a, opt_a, STEPS) == train(b, opt_b, STEPS)
    assert not opt_a._layers and len(opt_a._kt) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bit_identical(fp32_engine, dtype):
    straight = make_layer("full", dtype, fp32_engine)
    opt = kt.optim.AdamW(straight.parameters(), lr=1e-2)
    expected = train(straight, opt, 2 * STEPS)

    first = make_layer("full", dtype, fp32_engine)
    opt1 = kt.optim.AdamW(first.parameters(), lr=1e-2)
    got = train(first, opt1, STEPS)
    saved_model, saved_opt = first.state_dict(), opt1.state_dict()
    if dtype == torch.bfloat16:
        assert all("master" in s for s in saved_opt["state"].values())
    resumed = make_layer("full", dtype, fp32_engine, seed=7)  # other weights until loaded
    resumed.load_state_dict(saved_model)
    opt2 = kt.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(saved_opt)
    got += train(resumed, opt2, STEPS, start=STEPS)
    assert got == expected
    for pa, pb in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(pa, pb)


def test_a_deep_copy_is_stepped_as_its_own_layer(fp32_engine):
    import copy
    a = make_layer("full", torch.bfloat16, fp32_engine)
    b = copy.deepcopy(a)
    opt_a, opt_b = kt.optim.AdamW(a.parameters(), lr=1e-2), kt.optim.AdamW(b.parameters(), lr=1e-2)
    assert train(a, opt_a, STEPS) == train(b, opt_b, STEPS)
    assert len(opt_b._layers) == 1 and not opt_b._kt  # bf16 parameters: only a layer optimizer takes them
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def train_overlapped(m, opt, steps, start=0):
    """train() with each backward inside opt.overlap(): the layer's step is
    submitted as soon as its gradients are written."""
    losses = []
    for step in range(start, start + steps):
        x, ids, w, dy = batch(step)
        loss = (m(x, ids, w) * dy).sum()
        opt.zero_grad(set_to_none=True)
        with opt.overlap():
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode,dtype", [("full", torch.float32), ("full", torch.bfloat16), ("lora", torch.float32)])
def test_overlapped_steps_equal_plain_steps(fp32_engine, mode, dtype):
    a, b = make_layer(mode, dtype, fp32_engine), make_layer(mode, dtype, fp32_engine)
    opt_a, opt_b = kt.optim.AdamW(a.parameters(), lr=1e-2), kt.optim.AdamW(b.parameters(), lr=1e-2)
    submitted = []
    original = kt.optim._KtOptimizer._submitter

    def counting(self, module, entry):
        submit = original(self, module, entry)

        def wrapped():
            submitted.append(1)
            submit()
        return wrapped
    kt.optim._KtOptimizer._submitter = counting
    try:
        got = train_overlapped(a, opt_a, STEPS)
    finally:
        kt.optim._KtOptimizer._submitter = original
    assert got == train(b, opt_b, STEPS)
    assert len(submitted) == STEPS - 1  # every step but the first (which makes the kt optimizer)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert a._grads_ready is None  # the block disarms the layer


def test_two_backwards_in_one_overlap_block_are_refused(fp32_engine):
    m = make_layer("full", torch.float32, fp32_engine)
    opt = kt.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, 1)
    x, ids, w, dy = batch(1)
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="second backward"):
        with opt.overlap():
            (m(x, ids, w) * dy).sum().backward()
            (m(x, ids, w) * dy).sum().backward()
    opt.step()  # the first submitted step completes
    assert opt.state[m.w_gate]["step"].item() == 2
