"""kt.optim.AdamW / SGD against torch.optim.AdamW / SGD: 200 steps of random
gradients under LR schedulers, with weight decay and two parameter groups.
kt's step is torch's for-loop arithmetic in the same operation order, so the
parameters are compared bit for bit (torch.equal); under torch 2 with torch's
sqrt correctly rounded (conftest.correctly_rounded_sqrt says why), and once
more against the unpatched torch 2 within a stated bound."""
import pytest
import torch

import kt
import kt.optim


def make_params(seed, shapes=((37, 29), (300,), (64, 65))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def run(opt_cls, kwargs, groups, steps, schedule, seed=0, state=None, start=0, params=None):
    """Trains copies of params with opt_cls; returns (params, optimizer)."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    param_groups = [{"params": [params[i] for i in idx], **extra} for idx, extra in groups]
    opt = opt_cls(param_groups, **kwargs)
    sched = schedule(opt)
    if state is not None:
        opt.load_state_dict(state[0])
        sched.load_state_dict(state[1])
    g = torch.Generator().manual_seed(seed + 1000 * start)
    for _ in range(start, steps):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.1
        opt.step()
        sched.step()
    return params, opt, sched


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)


GROUPS = [((0, 1), {}), ((2,), {"lr": 3e-3, "weight_decay": 0.0})]


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_matches_torch_bit_for_bit(amsgrad, correctly_rounded_sqrt):
    init = make_params(1)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ours, opt, _ = run(kt.optim.AdamW, kw, GROUPS, 200, cosine, params=init)
    theirs, topt, _ = run(torch.optim.AdamW, kw, GROUPS, 200, cosine, params=init)
    for a, b, a0 in zip(ours, theirs, init):
        assert torch.equal(a, b), (a - b).abs().max()
        assert not torch.equal(a.detach(), a0)
    # The state is torch's, key for key.
    sa, sb = opt.state_dict(), topt.state_dict()
    for ga, gb in zip(sa["param_groups"], sb["param_groups"]):
        assert {k: ga[k] for k in ga if k in gb} == {k: gb[k] for k in ga if k in gb}
    for k in sb["state"]:
        assert set(sa["state"][k]) == set(sb["state"][k])
        for name, v in sb["state"][k].items():
            assert torch.equal(sa["state"][k][name], v), name


@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=1e-2),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
])
def test_sgd_matches_torch_bit_for_bit(kw):
    init = make_params(2)
    groups = [((0, 1), {}), ((2,), {"lr": 0.05})]
    ours, opt, _ = run(kt.optim.SGD, kw, groups, 200, step_lr, params=init)
    theirs, topt, _ = run(torch.optim.SGD, kw, groups, 200, step_lr, params=init)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (a - b).abs().max()
    sa, sb = opt.state_dict(), topt.state_dict()
    for k in sb["state"]:
        va, vb = sa["state"][k]["momentum_buffer"], sb["state"][k]["momentum_buffer"]
        assert (va is None) == (vb is None)
        if vb is not None:
            assert torch.equal(va, vb)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_against_torchs_own_sqrt(amsgrad):
    """torch as it is, MKL's sqrt included: the moments depend on the
    gradients alone and stay the same bits; the parameters differ by the
    one-ulp sqrt differences that the denominator passes on, which 200 steps
    of lr <= 1e-2 keep below 1e-6 on |p| ~ 1 (torch 1.13: none at all)."""
    init = make_params(1)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ours, opt, _ = run(kt.optim.AdamW, kw, GROUPS, 200, cosine, params=init)
    theirs, topt, _ = run(torch.optim.AdamW, kw, GROUPS, 200, cosine, params=init)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    assert worst < 1e-6, worst
    if int(torch.__version__.split(".")[0]) < 2:
        assert worst == 0.0
    sa, sb = opt.state_dict()["state"], topt.state_dict()["state"]
    for k in sb:
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name in sb[k]:
                assert torch.equal(sa[k][name], sb[k][name]), name


@pytest.mark.parametrize("source", [kt.optim.AdamW, torch.optim.AdamW])
def test_adamw_resumes_from_a_state_dict_bit_identically(source, correctly_rounded_sqrt):
    init = make_params(3)
    kw = dict(lr=1e-2, weight_decay=0.1)
    half, opt, sched = run(source, kw, GROUPS, 50, cosine, params=init)
    state = (opt.state_dict(), sched.state_dict())
    resumed, _, _ = run(kt.optim.AdamW, kw, GROUPS, 100, cosine, state=state, start=50,
                        params=[p.detach() for p in half])
    # The uninterrupted kt run, with the same gradients (run() seeds by start).
    full_a, opt_a, sched_a = run(kt.optim.AdamW, kw, GROUPS, 50, cosine, params=init)
    full_b, _, _ = run(kt.optim.AdamW, kw, GROUPS, 100, cosine,
                       state=(opt_a.state_dict(), sched_a.state_dict()), start=50,
                       params=[p.detach() for p in full_a])
    for a, b in zip(resumed, full_b):
        assert torch.equal(a, b)


def test_sgd_state_moves_to_and_from_torch():
    init = make_params(4)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)
    groups = [((0, 1, 2), {})]
    half, topt, tsched = run(torch.optim.SGD, kw, groups, 20, step_lr, params=init)
    state = (topt.state_dict(), tsched.state_dict())
    ours, _, _ = run(kt.optim.SGD, kw, groups, 40, step_lr, state=state, start=20,
                     params=[p.detach() for p in half])
    theirs, _, _ = run(torch.optim.SGD, kw, groups, 40, step_lr, state=state, start=20,
                       params=[p.detach() for p in half])
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_zero_grad_and_params_without_grad():
    p = torch.nn.Parameter(torch.ones(8))
    q = torch.nn.Parameter(torch.ones(8))
    opt = kt.optim.AdamW([p, q], lr=0.1)
    p.grad = torch.ones(8)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(8))
    assert torch.equal(q.detach(), torch.ones(8))  # no grad: untouched, no state
    assert q not in opt.state
    opt.zero_grad()
    assert p.grad is None or not p.grad.any()


def test_assume_finite_reads_the_gradient_once_and_lets_nan_in(correctly_rounded_sqrt):
    """By default a NaN gradient skips the step (nothing changes); with
    assume_finite=True it goes in, as in torch.optim.AdamW, at its own
    element only; finite steps are the same either way."""
    init = make_params(3, shapes=((70000,),))[0]
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    checked, assumed = kt.optim.AdamW([a], lr=1e-2), kt.optim.AdamW([b], lr=1e-2, assume_finite=True)
    theirs = torch.nn.Parameter(init.clone())
    topt = torch.optim.AdamW([theirs], lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for bad in (False, False, True):
        grad = torch.randn(init.shape, generator=g) * 0.1
        if bad:
            grad[-1] = float("nan")
        before = a.detach().clone()
        for p, o in ((a, checked), (b, assumed), (theirs, topt)):
            p.grad = grad.clone()
            o.step()
        if bad:
            assert torch.equal(a.detach(), before)
            assert checked.state[a]["step"].item() == 2
            assert assumed.state[b]["step"].item() == 3
            assert torch.isnan(b[-1]) and torch.isnan(theirs[-1])
            assert torch.equal(b.detach()[:-1], theirs.detach()[:-1])
            assert torch.isfinite(b.detach()[:-1]).all()
        else:
            assert torch.equal(a.detach(), b.detach())
    # The attribute changes the following steps.
    assumed.assume_finite = False
    b.grad = torch.full(init.shape, float("inf"))
    kept = b.detach().clone()
    assumed.step()
    assert torch.equal(b.detach()[:-1], kept[:-1])


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_one_non_finite_gradient_skips_the_step_of_every_parameter(bad):
    """kt checks the gradients of each of its optimizers (one a parameter);
    the step of the torch optimizer over all of them is skipped as one, so
    the parameters stay consistent with each other."""
    g = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (300, 40, 7)]
    opt = kt.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    params[2].grad[3] = float(bad)
    opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
    assert all(torch.equal(state[k], opt.state[params[0]][k]) for k in state)
    assert opt.state[params[1]]["step"].item() == 1
    # The next finite step goes in everywhere.
    params[2].grad[3] = 0.0
    opt.step()
    assert not any(torch.equal(a, b.detach()) for a, b in zip(before, params))
    assert opt.state[params[1]]["step"].item() == 2


def test_unsupported_parameters_are_refused_by_name():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    opt = kt.optim.AdamW([p])
    with pytest.raises(kt.KtError) as e:
        opt.step()
    # KT_ERR_DTYPE = 4 in kt_c_api.h (pinned by the ABI): the status itself,
    # not only its name in the message.
    assert e.value.status == 4, (e.value.status, str(e.value))
    assert isinstance(e.value, kt.DTypeError) and e.value.status_name == "KT_ERR_DTYPE"
    assert str(e.value).startswith("KT_ERR_DTYPE: ")
    assert "params[0].param" in str(e.value)
    with pytest.raises(ValueError):
        kt.optim.AdamW([torch.nn.Parameter(torch.ones(2))], betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        kt.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, nesterov=True)
