"""Tiny random MoE models of the real transformers classes, saved with
save_pretrained (safetensors) for the test_real_* tests. Nothing is
downloaded: each model comes from its config class with small sizes.

Every weight is rounded to bf16 before saving and the checkpoint is stored in
bf16, as released checkpoints are: kt keeps its base experts in bf16, so the
torch model (loaded in fp32) and kt then compute from the same values and
differ only in summation order (tolerances.FP32).
"""
import os

import pytest

# Read by huggingface_hub at import: nothing is fetched from the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="the real-host tests need transformers (tools/python_env.sh hosts)")
import torch  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 96, 64, 2, 4, 2
EXPERTS, TOP_K, MOE_I = 8, 2, 40
SEED = 1234
# A larger init than the configs' 0.02, so that the experts' share of the
# logits and of every gradient is far above the comparison bounds.
INIT_STD = 0.08


def _common(**extra):
    c = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
             initializer_range=INIT_STD, tie_word_embeddings=False, attn_implementation="eager")
    c.update(extra)
    return c


def _configs():
    t = transformers
    return {
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**_common(
            intermediate_size=72, moe_intermediate_size=MOE_I, shared_expert_intermediate_size=56,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False)),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**_common(
            intermediate_size=72, moe_intermediate_size=MOE_I, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, head_dim=16, norm_topk_prob=True)),
        "mixtral": lambda: t.MixtralConfig(**_common(
            intermediate_size=MOE_I, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)),
        "deepseek_v3": lambda: t.DeepseekV3Config(**_common(
            num_key_value_heads=HEADS, intermediate_size=72, moe_intermediate_size=MOE_I,
            n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
            first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, rope_scaling=None)),
        "gpt_oss": lambda: t.GptOssConfig(**_common(
            intermediate_size=MOE_I, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            head_dim=16, sliding_window=8)),
    }


ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def config(arch, **overrides):
    c = _configs()[arch]()
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def build(arch, **overrides):
    """The random fp32 model of arch, its weights rounded to bf16."""
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config(arch, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if b.is_floating_point() and "e_score_correction_bias" in name:
                # DeepSeek's routing bias is zero after init; a nonzero one
                # checks that the router's own buffer reaches the kt model.
                b.copy_((0.05 * torch.randn_like(b)).to(torch.bfloat16).float())
    return model


def save(arch, directory, **overrides):
    model = build(arch, **overrides)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def versions():
    return "transformers %s, torch %s" % (transformers.__version__, torch.__version__)


def is_v5():
    return int(transformers.__version__.split(".")[0]) >= 5


def token_batch(n=2, length=11, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def checkpoint_dir(tmp_path_factory, arch, **overrides):
    tag = arch + "".join("-%s=%s" % kv for kv in sorted(overrides.items()))
    d = tmp_path_factory.getbasetemp() / ("real-" + tag)
    if not (d / "config.json").exists():
        os.makedirs(d, exist_ok=True)
        save(arch, str(d), **overrides)
    return str(d)


def is_fused(arch):
    """Whether the installed transformers holds arch's experts as fused
    parameters (v5; gpt-oss in both) instead of one nn.Linear per expert."""
    return is_v5() or arch == "gpt_oss"


PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}


def peft_lora_config(arch, r, alpha, projections=("gate", "up", "down"), attention=("q_proj", "v_proj")):
    """PEFT's LoraConfig for LoRA on attention and on the routed experts of
    the plain transformers model: the fused parameters (target_parameters)
    or, in transformers 4, each expert's modules (a regex that leaves
    shared experts out)."""
    import peft
    kw = {}
    if is_fused(arch):
        params = (["mlp.experts.gate_up_proj"] if {"gate", "up"} & set(projections) else []) + \
            (["mlp.experts.down_proj"] if "down" in projections else [])
        kw["target_parameters"] = params
        modules = list(attention)
    else:
        names = PER_EXPERT_NAMES.get(arch, ("gate_proj", "up_proj", "down_proj"))
        wanted = [n for p, n in zip(("gate", "up", "down"), names) if p in projections]
        modules = r".*\.experts\.\d+\.(%s)|.*\.(%s)" % ("|".join(wanted), "|".join(attention))
    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, **kw)
