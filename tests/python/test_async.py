"""kt.MoE.forward_submit (kt_moe_forward_submit) and kt.Job: the async
forward a serving host overlaps with its own work."""
import pytest
import torch

import kt

E, K, H, I, T = 6, 2, 32, 16, 9


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    m = kt.MoE(E, K, H, I, max_tokens=T)
    m.load_weights(gate=torch.randn(E, I, H) / 5, up=torch.randn(E, I, H) / 5, down=torch.randn(E, H, I) / 4)
    return m


def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[2, 1] = -1
    return x, ids, torch.rand(T, K, generator=g)


def test_submitted_forward_equals_the_synchronous_one(layer):
    x, ids, w = inputs()
    y0 = torch.empty(T, H)
    layer.forward(x, ids, w, y0)
    assert y0.abs().sum() > 0
    y = torch.full((T, H), float("nan"))
    job = layer.forward_submit(x, ids, w, y)
    job.wait()
    assert torch.equal(y, y0)
    with pytest.raises(ValueError, match="this job was destroyed"):
        job.done()


def test_deferred_job_runs_when_asked(layer):
    x, ids, w = inputs()
    y0 = torch.empty(T, H)
    layer.forward(x, ids, w, y0)
    y = torch.full((T, H), float("nan"))
    job = layer.forward_submit(x, ids, w, y, deferred=True)
    assert not job.done() and torch.isnan(y).all()  # not started
    job.run()
    assert job.done() and torch.equal(y, y0)
    job.wait()
    # A deferred job nobody ran is run by wait.
    y.fill_(float("nan"))
    job = layer.forward_submit(x, ids, w, y, deferred=True)
    job.wait()
    assert torch.equal(y, y0)


def test_submit_checks_arguments_at_once(layer):
    x, ids, w = inputs()
    with pytest.raises(kt.ShapeError, match="kt_moe_forward_submit: KT_ARG_Y"):
        layer.forward_submit(x, ids, w, torch.empty(T, H + 1))
    with pytest.raises(kt.KtError, match="kt_moe_forward_submit: KT_ARG_IDS"):
        layer.forward_submit(x, ids[:, :1].contiguous(), w, torch.empty(T, H))
