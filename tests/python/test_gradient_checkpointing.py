"""Activation checkpointing over kt experts: torch.utils.checkpoint (reentrant
and not) and HF's gradient_checkpointing_enable() give the same losses and
gradients as a run without it; the first forward's saved activations are
released (policy "recompute") or kept and used by the recompute instead of
computing the experts again (policy "retain"); no context outlives its use."""
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import kt.hf
import kt.optim
from helpers.hf_shaped import Decoder, FusedMoeBlock, GptOssMLP, Qwen3MoeSparseMoeBlock, round_params_to_bf16

VOCAB, H, I, E, K, HEADS, LAYERS, B, S = 64, 32, 24, 6, 2, 4, 2, 2, 9
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
    "fused_v5": lambda: FusedMoeBlock(H, I, E, K),
    "gpt_oss": lambda: GptOssMLP(H, I, E, K),
}
# (gradient_checkpointing_kwargs or None for no checkpointing)
CHECKPOINTING = {"none": None, "reentrant": {"use_reentrant": True},
                 "non_reentrant": {"use_reentrant": False}}


def build(family, mode, policy, engine, max_tokens=1024):
    torch.manual_seed(0)
    model = round_params_to_bf16(Decoder(VOCAB, H, HEADS, LAYERS, FAMILIES[family]))
    kt.hf.replace_moe_experts(model, mode=mode, lora_rank=4, lora_alpha=8, engine=engine,
                              activation_policy=policy, max_tokens=max_tokens)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in kt.hf.kt_experts_modules(model):
            if mode == "lora":  # PEFT starts B at 0; non-zero B makes every gradient non-trivial
                for p in (m.lora_B_gate, m.lora_B_up, m.lora_B_down):
                    p.normal_(0, 0.05)
    return model


def count_expert_forwards(model):
    """Counts kt forward calls per kt layer of model."""
    counts = []
    for m in kt.hf.kt_experts_modules(model):
        box = [0]

        def counted(*args, _forward=m.kt_layer.forward, _box=box, **kwargs):
            _box[0] += 1
            return _forward(*args, **kwargs)
        m.kt_layer.forward = counted
        counts.append(box)
    return counts


def live_contexts(model):
    return [m.kt_layer.live_contexts for m in kt.hf.kt_experts_modules(model)]


def train(model, steps, checkpointing):
    """Runs SGD steps; returns per step (loss, {name: grad}, live contexts
    after the forward, kt forwards per layer in the step)."""
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    model.train()
    counts = count_expert_forwards(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (B, S), generator=g)
        targets = torch.randint(0, VOCAB, (B, S), generator=g)
        for c in counts:
            c[0] = 0
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        after_forward = live_contexts(model)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.item(), grads, after_forward, [c[0] for c in counts]))
        opt.step()
    return out


@pytest.mark.parametrize("family,mode", [("qwen3_moe", "lora"), ("qwen3_moe", "full"),
                                         ("fused_v5", "lora"), ("gpt_oss", "full")])
@pytest.mark.parametrize("policy", ["recompute", "retain"])
def test_checkpointing_gives_the_same_losses_and_gradients(family, mode, policy, fp32_engine):
    baseline = train(build(family, mode, "recompute", fp32_engine), 2, None)
    for step in baseline:
        assert step[2] == [1] * LAYERS and step[3] == [1] * LAYERS
    kt_grads = [n for n in baseline[0][1] if ".experts." in n or n.endswith(".experts")]
    assert kt_grads and all(baseline[0][1][n].abs().sum() > 0 for n in kt_grads)
    for how in ("reentrant", "non_reentrant"):
        model = build(family, mode, policy, fp32_engine)
        run = train(model, 2, CHECKPOINTING[how])
        for (loss0, grads0, _, _), (loss, grads, after_forward, forwards) in zip(baseline, run):
            assert loss == loss0, how
            assert grads.keys() == grads0.keys()
            for n in grads0:
                assert torch.equal(grads[n], grads0[n]), (how, n)
            if policy == "recompute":
                # The first forward's activations are freed like torch's, and
                # the recompute runs the experts again.
                assert after_forward == [0] * LAYERS, how
                assert forwards == [2] * LAYERS, how
            else:
                assert after_forward == [1] * LAYERS, how
                assert forwards == [1] * LAYERS, how
        assert live_contexts(model) == [0] * LAYERS
        assert all(not m._retained for m in kt.hf.kt_experts_modules(model))


def test_retain_with_several_chunks_and_kt_optimizer(fp32_engine):
    """Forwards longer than max_tokens save one context per chunk; all are
    retained together, used, and released; kt's optimizer steps in between."""
    results = {}
    for policy in ("recompute", "retain"):
        model = build("qwen3_moe", "lora", policy, fp32_engine, max_tokens=7)
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        counts = count_expert_forwards(model)
        opt = kt.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, VOCAB, (B, S), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = model(tokens).float().logsumexp(-1).mean()
            chunks = -(-B * S // 7)
            assert live_contexts(model) == ([chunks] * LAYERS if policy == "retain" else [0] * LAYERS)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert [c[0] for c in counts] == [3 * chunks * (1 if policy == "retain" else 2)] * LAYERS
        assert live_contexts(model) == [0] * LAYERS
        results[policy] = losses
    assert results["retain"] == results["recompute"]


def make_layer(policy="retain", retain_limit=4):
    torch.manual_seed(0)
    m = kt.torch.MoEExperts(E, K, H, I, mode="lora", lora_rank=4, activation_policy=policy,
                            retain_limit=retain_limit, engine=kt.Engine(precision="fp32"))
    m.load_weights(gate=torch.randn(E, I, H) / 6, up=torch.randn(E, I, H) / 6,
                   down=torch.randn(E, H, I) / 5)
    with torch.no_grad():
        m.lora_B_gate.normal_(0, 0.1)
    return m


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


def test_retained_activations_are_released_and_bounded():
    m = make_layer(retain_limit=3)
    m.train()
    for seed in range(5):
        with torch.no_grad():
            m(*routing(4, seed))
    assert m.kt_layer.live_contexts == 3 and len(m._retained) == 3  # the oldest went first
    m.eval()
    assert m.kt_layer.live_contexts == 0 and not m._retained
    with torch.no_grad():
        m(*routing(4, 0))
    assert m.kt_layer.live_contexts == 0  # nothing is kept outside training
    m.train()
    with torch.no_grad():
        m(*routing(4, 0))
    assert m.kt_layer.live_contexts == 1
    m.release_retained()
    assert m.kt_layer.live_contexts == 0
    # An optimizer step (parameters changed) makes kept activations stale.
    with torch.no_grad():
        m(*routing(4, 0))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(*routing(4, 1)).sum().backward()
    opt.step()
    with torch.no_grad():
        m(*routing(4, 2))
    assert len(m._retained) == 1 and m.kt_layer.live_contexts == 1
    assert copy_has_no_retained(m)
    with torch.inference_mode():
        m(*routing(4, 3))
    assert len(m._retained) == 1


def copy_has_no_retained(m):
    import copy
    c = copy.deepcopy(m)
    return not c._retained and c.kt_layer.live_contexts == 0


def test_a_recompute_is_recognised_by_its_inputs():
    m = make_layer()
    ref = make_layer(policy="recompute")
    m.train()
    counts = count_layer_forwards(m)
    x, ids, w = routing(6, 0)
    with torch.no_grad():
        first = m(x, ids, w)
    # Other inputs are computed, not answered from the kept forward.
    other = routing(6, 1)
    y_other = m(*other)
    assert counts[0] == 2 and torch.equal(y_other, ref(*other))
    w2 = w.clone()
    w2[0, 0] += 1e-3
    m(x, ids, w2)
    assert counts[0] == 3 and len(m._retained) == 1
    # An output changed in place since is not returned.
    first.add_(1)
    y = m(x, ids, w)
    assert counts[0] == 4 and torch.equal(y, ref(x, ids, w))
    m.release_retained()
    # The recompute of the same inputs takes the kept forward: same output,
    # same gradients as computing it.
    with torch.no_grad():
        m(x, ids, w)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    y = m(xr, ids, wr)
    assert counts[0] == 5 and not m._retained
    x0, w0 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y0 = ref(x0, ids, w0)
    assert torch.equal(y, y0)
    dy = torch.randn_like(y)
    y.backward(dy)
    y0.backward(dy)
    assert torch.equal(xr.grad, x0.grad) and torch.equal(wr.grad, w0.grad)
    for (_, p), (_, p0) in zip(m.trainable_parameters(), ref.trainable_parameters()):
        assert torch.equal(p.grad, p0.grad)
    del y, y0, y_other
    assert m.kt_layer.live_contexts == 0 and ref.kt_layer.live_contexts == 0


def count_layer_forwards(m):
    box = [0]
    forward = m.kt_layer.forward

    def counted(*args, **kwargs):
        box[0] += 1
        return forward(*args, **kwargs)
    m.kt_layer.forward = counted
    return box


def test_contexts_are_released_with_the_graph():
    """Without checkpointing: a graph dropped without backward, and one
    backpropagated, release their contexts."""
    for policy in ("recompute", "retain"):
        m = make_layer(policy)
        m.train()
        y = m(*routing(5, 0))
        assert m.kt_layer.live_contexts == 1 and not m._retained
        del y
        assert m.kt_layer.live_contexts == 0
        y = m(*routing(5, 0))
        y.sum().backward()
        del y
        assert m.kt_layer.live_contexts == 0


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="activation_policy must be 'recompute' or 'retain', not 'keep'"):
        kt.torch.MoEExperts(E, K, H, I, activation_policy="keep")
    with pytest.raises(ValueError, match="retain_limit must be at least 1"):
        kt.torch.MoEExperts(E, K, H, I, retain_limit=0)
