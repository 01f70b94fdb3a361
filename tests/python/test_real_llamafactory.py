"""LlamaFactory's LoRA SFT of a tiny MoE model, started the way its users
start it (the CLI with a YAML config), with kt computing the routed experts
(python -m kt.integrations.llamafactory train cfg.yaml) and without kt
(llamafactory-cli train cfg.yaml). The loss curves agree (fp32) within
1e-5 relative per logged step.

The model: tests/python/helpers/real_models.py's Qwen3-MoE (transformers' own
config class, random weights rounded to bf16), saved in fp32: LlamaFactory
loads with torch_dtype "auto" and computes in fp32 on a CPU, so the plain
run is fp32 only from an fp32 checkpoint. kt keeps its base experts in bf16,
the same values. The tokenizer is character-level, written here with the
tokenizers library (nothing downloaded); the dataset is
tests/data/llamafactory (alpaca format, 32 examples).

What is trained: LlamaFactory's usual `lora_target: all`, which with
transformers 5's fused experts is LoRA on attention (PEFT) in both runs, the
routed experts frozen (kt computes their forward and input gradients).
A second kt run names down_proj in lora_target: kt's LoRA on the experts'
down projection next to PEFT's on attention, saved as one adapter that
PEFT loads onto the plain transformers model.

Each run is one process; its peak resident memory (ru_maxrss from wait4)
is printed for both. Most of it is the imported libraries (torch,
transformers, datasets, LlamaFactory: about 1 GB); the experts are made
large enough (201 MB in fp32) to show: the plain run holds them as fp32
torch tensors, kt as bf16 read from the checkpoint, so the kt run's peak is
lower by at least a quarter of their fp32 bytes (measured: 1343.5 MiB
without kt, 1191.5 MiB with kt; torch 2.9.1, 2 cores).
Versions: packaging/python/requirements-llamafactory.txt
(tools/python_env.sh llamafactory)."""
import json
import os
import subprocess
import sys

import pytest

# Read by huggingface_hub at import: nothing is fetched from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
llamafactory = pytest.importorskip(
    "llamafactory", reason="the LlamaFactory test needs llamafactory (tools/python_env.sh llamafactory)")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from helpers import real_models  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "tests", "data", "llamafactory")
LOSS_BOUND = 1e-5
STEPS = 6
# The trained LoRA factors, relative L2 per tensor: Adam divides by the
# root of the second moment, so fp32 summation-order differences of small
# gradients are not damped (as in test_real_trainer.py).
ADAPTER_BOUND = 1e-4
# fp32 logits of the same adapter on the kt model and the plain one
# (summation order only; tolerances.FP32's order of magnitude).
ADAPTER_LOGITS_BOUND = 1e-5

# Experts large enough that their weights (2 layers x 64 x 3 x 64 x 2048
# fp32 = 201 MB) show in the processes' peak memory next to the libraries.
MEMORY_SHAPE = dict(num_experts=64, moe_intermediate_size=2048)
EXPERT_BYTES = real_models.LAYERS * 64 * 3 * real_models.HIDDEN * 2048 * 4

# Character-level vocabulary of real_models.VOCAB tokens.
SPECIAL = ["<unk>", "<pad>", "</s>"]
CHARS = (" \n.,:;!?'-" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789"
         + "()+=/*\"#%&_<>[]{}|~@")


def write_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models
    vocab = {t: i for i, t in enumerate(SPECIAL + list(CHARS))}
    assert len(vocab) <= real_models.VOCAB
    # BPE without merges: every character is a token.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>", model_max_length=4096)
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamafactory-qwen3_moe")
    real_models.build("qwen3_moe", max_position_embeddings=256, **MEMORY_SHAPE).save_pretrained(str(d))
    write_tokenizer(str(d))
    return str(d)


def _config(model, output_dir, lora_target="all", kt=None):
    lines = [
        "model_name_or_path: %s" % model,
        "stage: sft",
        "do_train: true",
        "finetuning_type: lora",
        "lora_target: %s" % lora_target,
        "lora_rank: 4",
        "lora_alpha: 8",
        "dataset: kt_alpaca",
        "dataset_dir: %s" % DATA,
        "template: default",
        "cutoff_len: 64",
        "overwrite_cache: true",
        "output_dir: %s" % output_dir,
        "overwrite_output_dir: true",
        "logging_steps: 1",
        "save_strategy: 'no'",
        "report_to: none",
        "plot_loss: false",
        "per_device_train_batch_size: 2",
        "gradient_accumulation_steps: 2",
        "learning_rate: 1.0e-2",
        "lr_scheduler_type: linear",
        "warmup_steps: 0",
        "max_steps: %d" % STEPS,
        "seed: 0",
        "use_cpu: true",
        "dataloader_num_workers: 0",
        "disable_tqdm: true",
    ]
    if kt is not None:
        lines.append("kt:")
        lines += ["  %s: %s" % kv for kv in kt.items()]
    return "\n".join(lines) + "\n"


def run_cli(tmp_path, name, model, with_kt, **config):
    """Runs one training; returns (logged losses, peak RSS in bytes, its
    output directory)."""
    out = tmp_path / name
    cfg = tmp_path / (name + ".yaml")
    cfg.write_text(_config(model, out, **config))
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"),
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               # The checkout's kt package (KT_LIBRARY names the library).
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "plugins", "python"),
                                                        env.get("PYTHONPATH")])))
    if with_kt:
        cmd = [sys.executable, "-m", "kt.integrations.llamafactory", "train", str(cfg)]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "llamafactory-cli"), "train", str(cfg)]
    log = tmp_path / (name + ".log")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        tail = log.read_text()[-6000:]
        pytest.fail("%s exited with %d:\n%s" % (" ".join(cmd), p.returncode, tail))
    with open(out / "trainer_state.json") as f:
        history = json.load(f)["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    return losses, usage.ru_maxrss * 1024, out


def test_llamafactory_lora_sft_loss_curve_with_kt_experts_equals_without(model_dir, tmp_path):
    want, rss_plain, _ = run_cli(tmp_path, "plain", model_dir, with_kt=False)
    got, rss_kt, out = run_cli(tmp_path, "kt", model_dir, with_kt=True, kt={"precision": "fp32"})
    with open(out / "kt_llamafactory.json") as f:
        report = json.load(f)
    print("losses (LlamaFactory, with kt):", ["%.7f/%.7f" % p for p in zip(want, got)])
    errors = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    print("max relative loss difference: %.3g" % max(errors))
    print("peak RSS of the training process: without kt %.1f MiB, with kt %.1f MiB"
          % (rss_plain / 2**20, rss_kt / 2**20))
    print("kt report:", json.dumps(report))
    assert len(got) == len(want) == STEPS
    assert max(errors) <= LOSS_BOUND, list(zip(want, got))
    # Training happened (each step's loss is of another batch, so the curve
    # need not fall in 6 steps): the two runs' saved LoRA (PEFT's, on
    # attention) moved from PEFT's zero B and is the same.
    from safetensors.torch import load_file
    theirs = load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    mine = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(mine) == sorted(theirs) and all("self_attn" in k for k in theirs)
    assert all(theirs[k].abs().sum() > 0 for k in theirs if "lora_B" in k)
    worst = max(float((mine[k] - theirs[k]).norm() / theirs[k].norm()) for k in theirs)
    print("saved adapters, relative L2: %.3g" % worst)
    assert worst <= ADAPTER_BOUND
    # kt computed every routed-experts block, frozen (lora_target: all with
    # fused experts), in every forward (gradient checkpointing recomputes).
    assert len(report["blocks"]) == real_models.LAYERS
    assert report["mode"] == "inference" and report["lora_targets"] == []
    assert report["engine"]["precision"] == "fp32"
    assert report["calls"] >= STEPS * 2 * real_models.LAYERS
    assert report["tokens"] > 0
    # No torch copy of the experts: kt's bf16 base is half their fp32 bytes.
    assert rss_plain - rss_kt >= EXPERT_BYTES // 4, (rss_plain, rss_kt)


def test_llamafactory_lora_on_routed_experts_by_kt_saves_one_peft_adapter(model_dir, tmp_path, fp32_engine):
    import peft
    losses, _, out = run_cli(tmp_path, "kt-experts", model_dir, with_kt=True,
                             lora_target="q_proj,v_proj,down_proj")
    with open(out / "kt_llamafactory.json") as f:
        report = json.load(f)
    assert report["mode"] == "lora" and report["lora_targets"] == ["down"]
    assert len(losses) == STEPS
    from safetensors.torch import load_file
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert any("experts" in k for k in tensors) and any("q_proj" in k for k in tensors)
    # Trained: kt's B factors moved from PEFT's zero start.
    assert all(tensors[k].abs().sum() > 0 for k in tensors if "experts" in k and "lora_B" in k)
    # PEFT (LlamaFactory's pin) loads the one adapter onto the plain
    # transformers model, and it computes what the kt model with the same
    # adapter computes.
    import kt
    import kt.hf
    from kt.integrations.llamafactory import peft_reads_3d_as_in_out
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(plain, str(out)).eval()
    model = kt.hf.from_pretrained(model_dir, dtype=torch.float32, engine=fp32_engine, mode="lora", lora_rank=4,
                                  lora_alpha=8, target_modules=["down_proj"])
    for block in kt.hf.kt_experts_modules(model):
        block.peft_in_out = peft_reads_3d_as_in_out()
    model = kt.hf.load_adapter(model, str(out)).eval()
    ids = real_models.token_batch()
    with torch.no_grad():
        want, got = loaded(input_ids=ids).logits, model(input_ids=ids).logits
    error = float((got - want).norm() / want.norm())
    print("logits of the saved adapter, kt vs PEFT on the plain model: relative L2 %.3g" % error)
    assert error <= ADAPTER_LOGITS_BOUND


def test_llamafactory_lora_target_decides_what_kt_trains():
    """LlamaFactory's own FinetuningArguments, read as the hook reads them."""
    from kt.integrations import llamafactory as hook

    def targets(per_expert, **args):
        return hook._kt_targets(hook._finetuning_arguments(dict(stage="sft", **args)), per_expert)

    # "all": what LlamaFactory's find_all_linear_modules would reach.
    assert targets(False, finetuning_type="lora", lora_target="all") == ("inference", ())
    assert targets(True, finetuning_type="lora", lora_target="all") == ("lora", ("gate", "up", "down"))
    assert targets(False, finetuning_type="lora", lora_target="q_proj,v_proj") == ("inference", ())
    assert targets(False, finetuning_type="lora", lora_target="q_proj,gate_up_proj") == ("lora", ("gate", "up"))
    assert targets(False, finetuning_type="lora", lora_target="w2,q_proj") == ("lora", ("down",))
    with pytest.raises(ValueError, match="LoRA only"):
        targets(False, finetuning_type="freeze")
    with pytest.raises(ValueError, match="use_dora"):
        targets(False, finetuning_type="lora", lora_target="down_proj,q_proj", use_dora=True)
