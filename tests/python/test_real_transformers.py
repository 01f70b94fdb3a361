"""kt under real transformers models (Qwen2-MoE, Qwen3-MoE, Mixtral,
DeepSeek-V3, gpt-oss), each a tiny random model of its real config class
saved with save_pretrained: kt.hf.from_pretrained loads the experts from the
checkpoint files without a torch copy, and logits, loss and every gradient
equal transformers' own within the project's bounds (helpers/tolerances.py).
Versions: packaging/python/requirements-hosts.txt."""
import json
import os
import subprocess
import sys

import pytest

# Read by huggingface_hub at import: nothing is fetched from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the real-host tests need transformers (tools/python_env.sh hosts)")
import torch  # noqa: E402

import kt  # noqa: E402
import kt.hf  # noqa: E402
from helpers import measured  # noqa: E402
from helpers import real_models  # noqa: E402
from helpers import tolerances  # noqa: E402
from kt import _hf_names  # noqa: E402
from helpers.reference import rel_l2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PRECISIONS = {"fp32": (torch.float32, tolerances.FP32), "bf16": (torch.bfloat16, tolerances.BF16_TORCH)}
# Gradients of a bf16 model pass torch's bf16 roundings twice (forward and
# backward, every layer and every expert's intermediate), so a bf16 gradient
# of the torch model is twice as far from kt's as an output is; fp32
# gradients keep tolerances.FP32. Measured worst: 2.5e-2 (transformers 5,
# the gate weight of DeepSeek-V3's router, whose gradient sums every routed
# expert's), 1.8e-2 (transformers 4); 1.4e-6 in fp32.
GRAD_BOUND = {"fp32": tolerances.FP32, "bf16": 2 * tolerances.BF16_TORCH}


@pytest.fixture(scope="module", params=real_models.ARCHITECTURES)
def arch_dir(request, tmp_path_factory):
    return request.param, real_models.checkpoint_dir(tmp_path_factory, request.param)


def _engine(precision, fp32_engine):
    return fp32_engine if precision == "fp32" else None


def _torch_model(directory, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)


# A bf16 model is compared with transformers' bf16 model and, where that one
# is off, with its fp32 model: a router score near a tie falls one way or the
# other under bf16's rounding (GPT-OSS's small random model: transformers'
# own bf16 logits are 6 % from its fp32 logits, and kt's bf16 model follows
# either, by which kernels round where). kt passes when it agrees with one
# of the two; a fault in kt's experts agrees with neither.
def _references(directory, dtype):
    refs = {"transformers " + str(dtype): _torch_model(directory, dtype)}
    if dtype == torch.bfloat16:
        refs["transformers fp32"] = _torch_model(directory, torch.float32)
    return refs


def test_experts_are_loaded_by_kt_from_the_checkpoint(arch_dir):
    arch, directory = arch_dir
    model = kt.hf.from_pretrained(directory, dtype=torch.float32)
    blocks = kt.hf.kt_experts_modules(model)
    assert len(blocks) == real_models.LAYERS
    E, I, H = real_models.EXPERTS, real_models.MOE_I, real_models.HIDDEN
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.device.type == "cpu", name
        assert not (t.dim() == 3 and t.shape[0] == E), "%s: a torch copy of stacked experts" % name
        assert not (t.dim() == 2 and sorted(t.shape) == sorted((I, H)) and ".experts." in name), name
    reference = _torch_model(directory, torch.float32).state_dict()
    for layer, block in enumerate(blocks):
        assert block.kt_layer.weights_source == ("checkpoint", directory, layer)
        # What kt computes with is the checkpoint's tensors, in the host's layout.
        got = _hf_names.weights_to_hf(block.hf_naming, block.read_weights(torch.float32))
        prefix = next(n for n, m in model.named_modules() if m is block) + "."
        for key, value in got.items():
            assert torch.equal(value.to(reference[prefix + key].dtype), reference[prefix + key]), prefix + key


def test_loading_holds_no_torch_copy_of_the_experts(tmp_path):
    """Peak resident memory of the load, in a fresh process each: kt's part
    is its own bf16 copy of the experts; the bound leaves half of that again
    for kt's load staging and mapped checkpoint pages, less than any torch
    copy of the experts would take (bf16: 1x, fp32: 2x)."""
    directory = str(tmp_path / "wide")
    E, H, I = 64, 256, 256
    real_models.save("qwen3_moe", directory, num_experts=E, hidden_size=H, moe_intermediate_size=I,
                     intermediate_size=256, head_dim=32)
    expert_bf16 = real_models.LAYERS * E * 3 * H * I * 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                                    "plugins", "python"), HERE]))
    runs = {}
    for how in ("kt", "transformers"):
        out = subprocess.run([sys.executable, os.path.join(HERE, "helpers", "real_load_memory.py"), directory, how],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[how] = json.loads(out.stdout.strip().splitlines()[-1])
    kt_run, torch_run = runs["kt"], runs["transformers"]
    kt_delta = kt_run["after"] - kt_run["before"]
    torch_delta = torch_run["after"] - torch_run["before"]
    print("peak RSS of the load: kt %.1f MiB, transformers %.1f MiB; experts %.1f MiB in bf16"
          % (kt_delta / 2**20, torch_delta / 2**20, expert_bf16 / 2**20))
    assert kt_run["kt_blocks"] == real_models.LAYERS
    assert kt_run["torch_bytes"] < expert_bf16 / 20, "the kt model holds expert-sized torch tensors"
    assert kt_delta <= 1.5 * expert_bf16 + kt_run["torch_bytes"], (kt_delta, expert_bf16)
    assert torch_delta >= 2 * expert_bf16  # the fp32 torch copy, for scale


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_logits_equal_transformers(arch_dir, precision, fp32_engine):
    arch, directory = arch_dir
    dtype, bound = PRECISIONS[precision]
    references = _references(directory, dtype)
    model = kt.hf.from_pretrained(directory, dtype=dtype, engine=_engine(precision, fp32_engine))
    assert len(kt.hf.kt_experts_modules(model)) == real_models.LAYERS
    tokens = real_models.token_batch()
    errors = {}
    with torch.no_grad():
        got = model(tokens).logits
        for name, reference in references.items():
            want = reference(tokens).logits
            assert want.shape == got.shape
            errors[name] = rel_l2(got, want.to(got.dtype))
    assert got.dtype == dtype
    err = min(errors.values())
    print("%s %s logits against %s" % (arch, precision, errors))
    measured.record(precision, "real %s logits" % arch, err)
    assert err <= bound, (arch, precision, errors)


def _named_grads(model):
    """{name in the transformers model: gradient}; kt's full-mode expert
    gradients are given the host's names and layout."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None and not isinstance(model.get_submodule(name.rpartition(".")[0]),
                                                 kt.torch.MoEExperts):
            out[name] = p.grad
    for name, m in model.named_modules():
        if isinstance(m, kt.torch.MoEExperts):
            grads = {k: getattr(m, attr).grad for k, attr in (("gate", "w_gate"), ("up", "w_up"),
                                                               ("down", "w_down"), ("bias_gate", "b_gate"),
                                                               ("bias_up", "b_up"), ("bias_down", "b_down"))
                     if getattr(m, attr, None) is not None}
            for key, g in _hf_names.weights_to_hf(m.hf_naming, grads).items():
                out[name + "." + key] = g
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_checkpointing"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_loss_and_every_gradient_equal_transformers(arch_dir, precision, checkpointing, fp32_engine):
    """Full fine-tuning (mode="full": kt trains the expert weights), one
    step's loss and the gradient of every parameter, with transformers'
    gradient checkpointing on and off in both models."""
    arch, directory = arch_dir
    dtype, bound = PRECISIONS[precision]
    references = _references(directory, dtype)
    model = kt.hf.from_pretrained(directory, dtype=dtype, engine=_engine(precision, fp32_engine),
                                  mode="full", param_dtype=dtype, bias="all")
    tokens = real_models.token_batch()

    def step(m):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert m.is_gradient_checkpointing
        out = m(tokens, labels=tokens)
        out.loss.backward()
        return out.loss.detach().double()

    loss = step(model)
    got = _named_grads(model)
    outcomes = {}  # reference: (loss error, (worst gradient error, its name))
    for ref_name, reference in references.items():
        ref_loss = step(reference)
        want = _named_grads(reference)
        # transformers 4 leaves .grad None on the experts no token reached; kt
        # writes their zeros.
        assert set(want) <= set(got)
        extra = sorted(n for n in set(got) - set(want) if not (".experts." in n and not got[n].any()))
        if extra:  # routed otherwise than this reference: kt agrees with the other one, or fails
            outcomes[ref_name] = (float("inf"), (float("inf"), "a gradient where it has none: " + extra[0]))
            continue
        # The key bias's gradient is zero in exact arithmetic (softmax does
        # not change when one query's scores all move by q.b), so what both
        # models give is rounding noise: it is measured against its weight's
        # gradient.
        worst = max(((got[n].double() - want[n].double()).norm().item()
                     / want[n.replace("k_proj.bias", "k_proj.weight")].double().norm().item()
                     if n.endswith("k_proj.bias") else rel_l2(got[n], want[n].to(got[n].dtype)), n) for n in want)
        outcomes[ref_name] = (abs(float(loss - ref_loss)) / abs(float(ref_loss)), worst)
    print("loss error and worst gradient of %s in %s against %s" % (arch, precision, outcomes))
    # The reference kt agrees with (see _references).
    ref_name, (err, worst) = min(outcomes.items(), key=lambda kv: kv[1][1][0])
    measured.record(precision, "real loss", err)
    measured.record(precision, "real grads", worst[0])
    assert err <= bound, (arch, ref_name, outcomes)
    assert worst[0] <= GRAD_BOUND[precision], (arch, ref_name, outcomes)
    want = _named_grads(references[ref_name])
    experts = [n for n in want if ".experts." in n]
    # The experts' gradients take part (v4 keeps one tensor per expert, and
    # experts no token reached have zero gradients).
    assert experts and sum(int(want[n].abs().sum() > 0) for n in experts) >= len(experts) // 2


def test_tied_embeddings_stay_tied(tmp_path, fp32_engine):
    """A checkpoint without lm_head (tie_word_embeddings): the kt model ties
    it to the embedding as transformers does."""
    directory = real_models.save("qwen3_moe", str(tmp_path / "tied"), tie_word_embeddings=True)
    reference = _torch_model(directory, torch.float32)
    model = kt.hf.from_pretrained(directory, dtype=torch.float32, engine=fp32_engine)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = real_models.token_batch()
    with torch.no_grad():
        assert rel_l2(model(tokens).logits, reference(tokens).logits) <= tolerances.FP32
