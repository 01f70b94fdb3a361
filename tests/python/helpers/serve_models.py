"""Small random-weight MoE checkpoints for the serving tests and the serving
bench: built from transformers' own config classes, written with
save_pretrained (safetensors) next to a word-level tokenizer, nothing
downloaded.

  build(directory, kind, dtype="float32", **shape) -> directory

kind: "qwen3_moe", "deepseek_v3", "gpt_oss" or "dbrx". The weights are drawn with a
fixed seed and rounded to bf16 values (also when stored as fp32), so that kt,
which keeps its expert weights as bf16, computes with the same numbers as the
server does.
"""
import json
import os

# A vocabulary of plain words "w0 w1 ..." plus the special tokens: prompts are
# "w12 w7 w99", and every token id the model can produce decodes to text.
SPECIAL = ["<unk>", "<s>", "</s>"]


def prompt_text(ids):
    return " ".join("w%d" % i for i in ids)


def write_tokenizer(directory, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for i in range(vocab_size - len(SPECIAL)):
        vocab["w%d" % i] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=4096)
    # A chat template, so that the chat endpoint can be served too.
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    fast.save_pretrained(directory)


def _config(kind, vocab, hidden, intermediate, moe_intermediate, experts, top_k, layers, heads,
            dtype):
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=4096, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
                              num_experts=experts, num_experts_per_tok=top_k, num_key_value_heads=heads // 2,
                              head_dim=hidden // heads, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], **common)
    if kind == "deepseek_v3":
        from transformers import DeepseekV3Config
        # Latent KV of 512 + rope 64: the one size vLLM's CPU MLA kernel has.
        # First layer dense, the others MoE with one shared expert and
        # grouped top-k routing with sigmoid scores and the correction bias.
        config = DeepseekV3Config(intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
                                n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                                n_group=4 if experts % 4 == 0 else 1, topk_group=2 if experts % 4 == 0 else 1,
                                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                num_key_value_heads=heads, q_lora_rank=64, kv_lora_rank=512,
                                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                rope_scaling=None, **common)
        # DeepSeek-V3's own config.json names its routing ("noaux_tc": the
        # correction bias picks the experts, sigmoid scores weight them).
        config.topk_method = "noaux_tc"
        config.scoring_func = "sigmoid"
        return config
    if kind == "gpt_oss":
        from transformers import GptOssConfig
        return GptOssConfig(intermediate_size=moe_intermediate, num_local_experts=experts,
                            num_experts_per_tok=top_k, num_key_value_heads=heads // 2,
                            head_dim=hidden // heads, sliding_window=128,
                            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                            + ["sliding_attention"] * (layers % 2), **common)
    if kind == "dbrx":
        # DBRX keeps its experts as [E*I, H] blocks under transformer.blocks.<L>.ffn:
        # a layout kt does not read.
        from transformers import DbrxConfig
        return DbrxConfig(d_model=hidden, n_heads=heads, n_layers=layers, max_seq_len=4096, vocab_size=vocab,
                          attn_config=dict(kv_n_heads=heads // 2, rope_theta=10000.0, clip_qkv=None),
                          ffn_config=dict(ffn_hidden_size=moe_intermediate, moe_num_experts=experts,
                                          moe_top_k=top_k), tie_word_embeddings=False)
    raise ValueError("unknown kind %r" % (kind,))


def build(directory, kind="qwen3_moe", dtype="float32", *, vocab=512, hidden=128, intermediate=256,
          moe_intermediate=64, experts=16, top_k=4, layers=2, heads=4, seed=0, weight_scale=None,
          expert_scale=None):
    """Writes a random-weight model of ``kind`` into ``directory``. Weights
    are drawn with std ``weight_scale`` (default 0.5 / sqrt(hidden)), the
    routed experts' with ``expert_scale`` (default the same), the
    embedding's with 1."""
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(directory, exist_ok=True)
    config = _config(kind, vocab, hidden, intermediate, moe_intermediate, experts, top_k, layers,
                     heads, dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    scale = weight_scale if weight_scale is not None else 0.5 / hidden ** 0.5
    experts_std = expert_scale if expert_scale is not None else scale
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith("layernorm.weight")):
                p.fill_(1.0)
            elif "bias" in name or "sinks" in name:
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else experts_std if ".experts." in name else scale)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b).mul_(0.01).to(torch.bfloat16).to(torch.float32))
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = dtype
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, vocab)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f)
    return directory


def build_int4(dense_dir, directory, group=32):
    """The routed experts of the dense checkpoint ``dense_dir`` written as an
    INT4 pack-quantized checkpoint by compressed-tensors (symmetric, groups
    of ``group`` inputs, bf16 scales), the other tensors as they are; and
    beside it ``directory + "-dequantized"``: the dense checkpoint with each
    expert weight replaced by its quantized value (code times scale).

    The scales are powers of two (the smallest that holds the group's
    absolute maximum in 7 steps), so that every quantized value is exact in
    bf16 and in fp32: kt computing from the codes and a server computing from
    the dequantized dense weights multiply the same numbers.
    Returns (directory, dequantized directory)."""
    import re
    import shutil
    import torch
    from torch import nn
    from safetensors.torch import load_file, save_file
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    expert = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
    root = nn.Module()
    linears = {}
    for key, w in tensors.items():
        m = expert.match(key)
        if not m:
            continue
        parent = root
        for part in m.group(1).split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        parent.add_module(m.group(2) + "_proj", lin)
        linears[m.group(1)] = lin
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=True)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], weights=args)}, format="pack-quantized")
    apply_quantization_config(root, config)
    dequantized = dict(tensors)
    with torch.no_grad():
        for name, lin in linears.items():
            w = lin.weight.float()
            out, inp = w.shape
            amax = w.reshape(out, inp // group, group).abs().amax(dim=2).clamp_min(2.0 ** -30)
            scale = torch.exp2(torch.ceil(torch.log2(amax / 7)))
            lin.weight_scale.data.copy_(scale.to(lin.weight_scale.dtype))
            q = torch.clamp(torch.round(w.reshape(out, inp // group, group) / scale[..., None]), -8, 7)
            dequantized[name + ".weight"] = (q * scale[..., None]).reshape(out, inp).to(tensors[name + ".weight"].dtype)
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format="pack-quantized")
    compressor.compress_model(root)
    quantized = {k: v for k, v in tensors.items() if not expert.match(k)}
    quantized.update({k: v.contiguous() for k, v in root.state_dict().items()})
    for out_dir, weights in ((directory, quantized), (directory + "-dequantized", dequantized)):
        os.makedirs(out_dir, exist_ok=True)
        for f in os.listdir(dense_dir):
            if f != "model.safetensors" and not f.endswith(".index.json"):
                shutil.copy(os.path.join(dense_dir, f), out_dir)
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(directory)
    return directory, directory + "-dequantized"
