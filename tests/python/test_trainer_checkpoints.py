"""transformers.Trainer checkpoints of a model with kt experts: a resumed run
continues from the same bits, and a checkpoint cut short or changed is
refused by name (kt.integrations.trainer).

A Trainer checkpoint of a kt.hf.get_peft_model model holds PEFT's adapter,
which leaves kt's experts' LoRA factors out; the model's save_pretrained and
load_adapter carry them (kt_experts_lora.safetensors), so a run resumed
from checkpoint-2 ends with the parameters and optimizer state of the run
that went through, bit for bit."""
import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the real-host tests need transformers (tools/python_env.sh hosts)")
peft = pytest.importorskip("peft", reason="the real-host tests need peft (tools/python_env.sh hosts)")
import torch  # noqa: E402

import kt  # noqa: E402
import kt.hf  # noqa: E402
import kt.optim  # noqa: E402
from kt import _safetensors  # noqa: E402
from kt.integrations import trainer as kt_trainer  # noqa: E402
from helpers import real_models  # noqa: E402

STEPS, SAVE_EVERY = 4, 2


def _run(directory, engine, output_dir, resume=None):
    model = _kt_peft_model(directory, engine)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = kt.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, real_models.VOCAB, (16, 10), generator=g)
    data = [{"input_ids": t, "labels": t.clone(), "attention_mask": torch.ones_like(t)} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
        report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, save_strategy="steps",
        save_steps=SAVE_EVERY, disable_tqdm=True, logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None),
                                   callbacks=[kt_trainer.CompleteCheckpoints()])
    trainer.train(resume_from_checkpoint=resume)
    state = optimizer.state_dict()["state"]
    return [p.detach().clone() for p in trainable], [state[i] for i in sorted(state)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fp32_engine):
    directory = real_models.checkpoint_dir(tmp_path_factory, "qwen3_moe")
    out = tmp_path_factory.mktemp("trainer_checkpoints")
    through = _run(directory, fp32_engine, out / "through")
    resumed = _run(directory, fp32_engine, out / "resumed_from", resume=str(out / "through" / "checkpoint-2"))
    return out, through, resumed


def test_resumed_run_has_the_bits_of_the_run_that_went_through(runs):
    out, (params, states), (params2, states2) = runs
    assert len(params) == len(params2) == 12  # q, v (A, B) and the experts' down (A, B), 2 layers
    assert all(torch.equal(a, b) for a, b in zip(params, params2))
    assert len(states) == len(states2) == len(params)
    for a, b in zip(states, states2):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # The experts' factors moved, so the comparison covers them.
    saved = _safetensors.load(str(out / "through" / "checkpoint-2" / kt.hf.EXPERTS_LORA_FILE))
    assert sorted(saved) == ["model.layers.%d.mlp.experts.lora_%s_down" % (i, ab) for i in (0, 1) for ab in "AB"]
    assert all(t.abs().sum() > 0 for t in saved.values())


def _kt_peft_model(directory, engine):
    model = kt.hf.from_pretrained(directory, dtype=torch.float32, engine=engine, mode="lora", lora_rank=4,
                                  lora_alpha=8, target_modules=["down_proj"])
    return kt.hf.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_load_adapter_without_the_experts_factors_is_refused(runs, tmp_path, tmp_path_factory, fp32_engine):
    source = runs[0] / "through" / "checkpoint-2"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    model = _kt_peft_model(real_models.checkpoint_dir(tmp_path_factory, "qwen3_moe"), fp32_engine)
    with pytest.raises(ValueError, match="kt_experts_lora.safetensors does not exist"):
        model.load_adapter(str(tmp_path), "default", is_trainable=True)


def test_a_model_with_frozen_kt_experts_saves_and_loads_peft_adapters_as_before(tmp_path, tmp_path_factory,
                                                                                  fp32_engine):
    # kt's experts in inference mode, PEFT's LoRA on attention only (as a
    # LlamaFactory run without expert LoRA has it): no kt factors to carry,
    # so save_pretrained writes none and load_adapter asks for none.
    model = kt.hf.from_pretrained(real_models.checkpoint_dir(tmp_path_factory, "qwen3_moe"), dtype=torch.float32,
                                  engine=fp32_engine, mode="inference")
    model = kt.hf.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert not (tmp_path / kt.hf.EXPERTS_LORA_FILE).exists()
    model.load_adapter(str(tmp_path), "again", is_trainable=True)
    assert "again" in model.peft_config


def _copy_of_checkpoints(runs, tmp_path):
    import shutil
    shutil.copytree(runs[0] / "through", tmp_path / "run")
    return tmp_path / "run"


def test_every_checkpoint_recorded_complete(runs):
    run = runs[0] / "through"
    assert kt_trainer.checkpoints(str(run)) == [str(run / "checkpoint-4"), str(run / "checkpoint-2")]
    record = kt_trainer.verify_checkpoint(run / "checkpoint-4")
    assert record["global_step"] == 4
    assert {"optimizer.pt", "adapter_model.safetensors", kt.hf.EXPERTS_LORA_FILE, "trainer_state.json",
            "rng_state.pth", "scheduler.pt"} <= set(record["files"])


@pytest.mark.parametrize("damage, reason", [
    ("no_record", "kt_checkpoint.json does not exist: the save of .* did not finish"),
    ("truncate", "optimizer.pt has 100 bytes; [0-9]+ were saved"),
    ("flip", "adapter_model.safetensors has other contents than were saved"),
    ("remove", "kt_experts_lora.safetensors is missing"),
])
def test_damaged_checkpoint_refused_by_name_and_the_previous_one_taken(runs, tmp_path, damage, reason):
    run = _copy_of_checkpoints(runs, tmp_path)
    latest = run / "checkpoint-4"
    if damage == "no_record":
        (latest / kt_trainer.RECORD).unlink()
    elif damage == "truncate":
        os.truncate(latest / "optimizer.pt", 100)
    elif damage == "flip":
        data = bytearray((latest / "adapter_model.safetensors").read_bytes())
        data[-5] ^= 0x40  # a tensor's byte: safetensors would load it silently
        (latest / "adapter_model.safetensors").write_bytes(bytes(data))
    else:
        (latest / kt.hf.EXPERTS_LORA_FILE).unlink()
    with pytest.raises(kt_trainer.IncompleteCheckpointError, match=reason):
        kt_trainer.verify_checkpoint(latest)
    refusals = []
    assert kt_trainer.last_complete_checkpoint(str(run), refusals) == str(run / "checkpoint-2")
    assert len(refusals) == 1 and str(latest) in refusals[0]


def test_a_save_over_an_old_checkpoint_drops_its_record_first(runs, tmp_path):
    run = _copy_of_checkpoints(runs, tmp_path)
    callback = kt_trainer.CompleteCheckpoints()
    args = types.SimpleNamespace(output_dir=str(run))
    state = types.SimpleNamespace(global_step=4, is_world_process_zero=True)
    callback.on_step_end(args, state, types.SimpleNamespace(should_save=False))
    assert (run / "checkpoint-4" / kt_trainer.RECORD).exists()
    callback.on_step_end(args, state, types.SimpleNamespace(should_save=True))
    assert not (run / "checkpoint-4" / kt_trainer.RECORD).exists()
    assert kt_trainer.last_complete_checkpoint(str(run)) == str(run / "checkpoint-2")
    callback.on_save(args, state, None)
    assert kt_trainer.last_complete_checkpoint(str(run)) == str(run / "checkpoint-4")


def test_a_full_disk_names_the_file_kt_was_writing(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / kt.hf.EXPERTS_LORA_FILE
    with pytest.raises(OSError, match="No space left on device: .*kt_experts_lora.safetensors") as e:
        _safetensors.save(str(target), {"a": torch.ones(3)})
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # no temporary file left
