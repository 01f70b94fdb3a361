"""transformers.Trainer fine-tunes a tiny MoE model with kt experts and
kt.optim.AdamW; its loss curve equals the plain transformers + PEFT run
(fp32) with torch's AdamW.

Both runs train the same parametrization from the same start: PEFT's LoRA
on attention (q_proj, v_proj) and on the routed experts' down_proj, which
in PEFT is LoRA on the fused down_proj parameter (target_parameters) and in
kt its own down factors, the same numbers. PEFT's initial adapter is saved
and loaded into the kt model (kt.hf.load_adapter), so the runs start equal.
(gate_up_proj is left out: PEFT's LoRA of the fused parameter shares one A
between gate and up, kt trains separate gate and up factors, a different
model to train.)

Bound: 1e-5 relative per logged loss. kt.optim.AdamW follows the
arithmetic of the torch it runs with; where the installed libkt predates
torch 2's operation order, the two optimizers differ by about 1 ulp per
step, which over the few steps here moves the loss by far less than 1e-5
(measured in the test output).
Versions: packaging/python/requirements-hosts.txt."""
import os

import pytest

# Read by huggingface_hub at import: nothing is fetched from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the real-host tests need transformers (tools/python_env.sh hosts)")
peft = pytest.importorskip("peft", reason="the real-host tests need peft (tools/python_env.sh hosts)")
import torch  # noqa: E402

import kt  # noqa: E402
import kt.hf  # noqa: E402
import kt.optim  # noqa: E402
from helpers import measured  # noqa: E402
from helpers import real_models  # noqa: E402

LOSS_BOUND = 1e-5
# The trained factors, relative L2 per tensor: Adam divides by sqrt of the
# second moment, so fp32 summation-order differences of small gradients are
# not damped (tolerances.TRAINING has the same reason).
ADAPTER_BOUND = 1e-4
STEPS, BATCH, ACCUMULATE, LENGTH, SAMPLES = 6, 2, 2, 12, 24
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class LossRecordingTrainer(transformers.Trainer):
    """Keeps every micro-batch's loss unrounded (the logged ones are rounded
    to 4 digits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        value = loss[0] if isinstance(loss, tuple) else loss
        self.losses.append(float(value.detach()))
        return loss


class AdamWOverEveryParameter(torch.optim.AdamW):
    """torch's AdamW, with a zero gradient for a parameter that got none.
    kt's LoRA factors of a layer are stacked over its experts, as one fused
    parameter (transformers 5) is, so an expert no token reached in a step
    has zero gradients and AdamW still decays its moments and weights;
    transformers 4's per-expert PEFT modules get no gradient then, and
    torch's AdamW skips them. Zeros make the per-expert run step as the
    stacked one does."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return super().step(closure)


def _dataset():
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, real_models.VOCAB, (SAMPLES, LENGTH), generator=g)
    return [{"input_ids": t, "labels": t.clone(), "attention_mask": torch.ones_like(t)} for t in tokens]


def _train(model, optimizer, output_dir):
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS, learning_rate=HYPER["lr"], lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=HYPER["weight_decay"], logging_steps=1, report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, save_strategy="no", disable_tqdm=True, max_grad_norm=1.0)
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=_dataset(),
                                   optimizers=(optimizer, None))
    trainer.train()
    assert trainer.state.global_step == STEPS
    return trainer.losses


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_trainer_loss_curve_with_kt_experts_and_kt_adamw_equals_peft(tmp_path_factory, tmp_path, fp32_engine):
    directory = real_models.checkpoint_dir(tmp_path_factory, "qwen3_moe")
    torch.manual_seed(5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reference = peft.get_peft_model(plain, real_models.peft_lora_config("qwen3_moe", 4, 8, projections=("down",)))
    reference.save_pretrained(str(tmp_path / "initial"))

    model = kt.hf.from_pretrained(directory, dtype=torch.float32, engine=fp32_engine, mode="lora",
                                  lora_rank=4, lora_alpha=8, target_modules=["down_proj"])
    model = kt.hf.load_adapter(model, tmp_path / "initial")
    kt_params, torch_params = _trainable(model), _trainable(reference)
    assert sum(p.numel() for p in kt_params) == sum(p.numel() for p in torch_params)
    assert len(kt.hf.kt_experts_modules(model)) == real_models.LAYERS

    want = _train(reference, AdamWOverEveryParameter(torch_params, foreach=False, **HYPER), tmp_path / "peft")
    got = _train(model, kt.optim.AdamW(kt_params, **HYPER), tmp_path / "kt")
    assert len(got) == len(want) == STEPS * ACCUMULATE
    errors = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    measured.record("fp32", "real Trainer loss", max(errors))
    print("losses (PEFT, kt):", ["%.7f/%.7f" % p for p in zip(want, got)])
    assert max(errors) <= LOSS_BOUND, list(zip(want, got))
    # The curve moved: the comparison covers training, not only the start.
    assert want[-1] < want[0] - 1e-3
    # And the trained adapters are the same: kt's, saved with PEFT's part,
    # against PEFT's own save.
    from safetensors.torch import load_file
    kt.hf.save_adapter(model, tmp_path / "kt_adapter")
    reference.save_pretrained(str(tmp_path / "peft_adapter"))
    mine = load_file(str(tmp_path / "kt_adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft_adapter" / "adapter_model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    worst = max(float((mine[k] - theirs[k]).norm() / theirs[k].norm()) for k in theirs)
    measured.record("fp32", "real Trainer adapter", worst)
    assert worst <= ADAPTER_BOUND
    assert all(theirs[k].abs().sum() > 0 for k in theirs if "lora_B" in k)
