#!/usr/bin/env python3
"""Whole-model synthetic checkpoints from the release configs in bench/models/: every layer, the
release's tensor names, shapes, dtypes and quantized expert layout, random values at realistic
scales, written once into a cache folder (numpy only; nothing is downloaded).

  python3 bench/synthetic_model.py --model gpt-oss-20b [--layers N] [--vocab N] [--experts N]
                                   [--seed S] [--out DIR] [--plan]

Models: gpt-oss-20b (the release: MXFP4 experts, bf16 rest) and qwen3-30b-a3b (Qwen3-30B-A3B with
its routed experts as a compressed-tensors int4 pack-quantized checkpoint, symmetric, groups of 32,
bf16 scales; bf16 rest). The folder holds config.json and generation_config.json (the in-tree
configs with the overrides applied), safetensors shards of at most 5 GB with
model.safetensors.index.json, a word-level tokenizer (tokenizer.json in the `tokenizers` WordLevel
format: id i is the word "w<i>" unless it is a special token) and kt-synthetic.json, the marker
that says what was written. Default folder: $KT_MODEL_CACHE (default ~/.cache/kt/models)/<name>,
the name carrying any override (gpt-oss-20b-2layers-512vocab-4experts). A second call with the
same arguments reuses the folder and writes nothing; a folder holding anything else is refused.

The overrides only make small test variants: `layers` (num_hidden_layers; gpt-oss's layer_types
and compressed-tensors' ignore list truncated to match), `vocab` (vocab_size; the special tokens
move to the top of the smaller vocabulary) and `experts` (the routed expert count, at least top-k).

Python API: plan(name, **overrides) -> [PlannedTensor], summary(tensors) -> sizes,
make(name, out=None, **overrides) -> the folder.

Values (seeded per tensor from the seed and the tensor's name, so a variant's tensors equal the
release-sized model's where their shapes agree):
  norms 1.0; linear weights, embedding, lm_head and routers N(0, 0.02) rounded to bf16; biases
  N(0, 0.01); gpt-oss attention sinks N(0, 0.5);
  MXFP4 experts: uniformly random e2m1 codes (std 2.93) with e8m0 scales 2^-8 or 2^-7
  (uint8 119 or 120): dequantized std about 0.018;
  int4 experts: codes uniform in [-7, 7] with 0 twice as likely (a uniform nibble, the code -8
  turned into 0, so the weights have mean 0; std 4.18) times bf16 scales uniform in
  [0.8, 1.2] x 0.00478: dequantized std about 0.020.
"""
import argparse
import collections
import json
import math
import os
import re
import shutil
import struct
import sys
import time
import zlib

import numpy as np

MAKER_VERSION = 1
MARKER = "kt-synthetic.json"
HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.join(HERE, "models")

# The models (their configs are bench/models/<name>/): release_bytes, the release's safetensors
# bytes, which the release-sized plan must match (within 10 %); special_tokens, the tokens the
# configs name (bos, eos, pad and generation's eos list) by release id.
MODELS = {
    "gpt-oss-20b": {"release_bytes": 13.8e9,
                    "special_tokens": {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                                       200012: "<|call|>"}},
    "qwen3-30b-a3b": {"release_bytes": 19.4e9,
                      "special_tokens": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}},
}
MODEL_NAMES = tuple(sorted(MODELS))
# Shards of at most this many bytes (save_pretrained's default "5GB").
SHARD_BYTES = 5 * 10 ** 9
UNK = "<unk>"  # always the last id
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

# Value scales (see the module docstring).
WEIGHT_STD, BIAS_STD, SINK_STD = 0.02, 0.01, 0.5
E8M0_SCALES = (119, 120)                      # 2^-8, 2^-7
INT4_SCALE = 0.02 / math.sqrt(17.5)          # 17.5: E[q^2] of the codes drawn
INT4_SCALE_SPREAD = (0.8, 1.2)
BF16_ONE = 0x3F80

# Bytes per element and safetensors' order of dtypes in a file (its writer sorts tensors by
# dtype, largest first, then by name; every tensor then starts aligned to its element size).
DTYPE_BYTES = {"U8": 1, "BF16": 2, "I32": 4, "I64": 8}
DTYPE_RANK = {"U8": 0, "BF16": 1, "I32": 2, "I64": 3}
NORMALS_PER_CHUNK = 1 << 22
BYTES_PER_CHUNK = 1 << 25
SYNC_BYTES = 1 << 30  # written bytes between fdatasync + dropping them from the page cache

# One tensor of a plan. fill: how its values are drawn, ("ones",), ("normal", std),
# ("uniform", lo, hi) (bf16), ("bytes",) (uniform bytes: e2m1 pairs), ("int4",) (int32 words
# of 8 codes), ("e8m0", lo, hi) (uint8), ("values", (v, ...)) (int64). expert: a routed
# expert's tensor. file: its shard.
PlannedTensor = collections.namedtuple("PlannedTensor", "name dtype shape nbytes fill expert file")


class SyntheticModelError(Exception):
    """A request the maker refuses (bad override, a folder holding something else, no space)."""


def _tensor(name, dtype, shape, fill, expert=False):
    shape = tuple(int(s) for s in shape)
    return PlannedTensor(name, dtype, shape, DTYPE_BYTES[dtype] * math.prod(shape), fill, expert, None)


# ------------------------------------------------------------------------------ configs

def _load_json(path):
    with open(path) as f:
        return json.load(f)


def _normalized(name, layers=None, vocab=None, experts=None, shard_bytes=None):
    """The overrides that differ from the release, as ints (None dropped)."""
    if name not in MODELS:
        raise SyntheticModelError("unknown model %r: choose one of %s" % (name, ", ".join(MODEL_NAMES)))
    config = _load_json(os.path.join(MODELS_DIR, name, "config.json"))
    release = {"layers": config["num_hidden_layers"], "vocab": config["vocab_size"],
               "experts": config[_family(config)["experts_key"]], "shard_bytes": SHARD_BYTES}
    out = {}
    for key, value in (("layers", layers), ("vocab", vocab), ("experts", experts), ("shard_bytes", shard_bytes)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise SyntheticModelError("%s must be a positive integer, not %r" % (key, value))
        if int(value) != release[key]:
            out[key] = int(value)
    return out


def _layer_of(module_name):
    m = re.match(r"model\.layers\.(\d+)\.", module_name)
    return int(m.group(1)) if m else None


def _configs(name, overrides):
    """config.json and generation_config.json of the model with the overrides applied, and the
    special tokens {id: text} (the unknown token included)."""
    directory = os.path.join(MODELS_DIR, name)
    config = _load_json(os.path.join(directory, "config.json"))
    generation = _load_json(os.path.join(directory, "generation_config.json"))
    family = _family(config)
    layers = overrides.get("layers")
    if layers is not None:
        if layers > config["num_hidden_layers"]:
            raise SyntheticModelError("layers = %d: %s has %d" % (layers, name, config["num_hidden_layers"]))
        config["num_hidden_layers"] = layers
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:layers]
        # compressed-tensors lists every Linear it left alone by name: those of kept layers stay.
        q = config.get("quantization_config") or {}
        if isinstance(q.get("ignore"), list):
            q["ignore"] = [m for m in q["ignore"] if _layer_of(m) is None or _layer_of(m) < layers]
    if "experts" in overrides:
        top_k = config["num_experts_per_tok"]
        if overrides["experts"] < top_k:
            raise SyntheticModelError("experts = %d is fewer than top-k (%d)" % (overrides["experts"], top_k))
        config[family["experts_key"]] = overrides["experts"]
    tokens = MODELS[name]["special_tokens"]
    release_ids = sorted(tokens)
    vocab = overrides.get("vocab", config["vocab_size"])
    if vocab < len(release_ids) + 2:
        raise SyntheticModelError("vocab = %d: at least %d ids are needed (the special tokens, <unk> and a word)"
                                  % (vocab, len(release_ids) + 2))
    config["vocab_size"] = vocab
    if release_ids[-1] < vocab - 1:
        id_of = {i: i for i in release_ids}
    else:  # the special tokens take the ids just below <unk>
        id_of = {old: vocab - 1 - len(release_ids) + k for k, old in enumerate(release_ids)}

    def remap(value):
        if isinstance(value, list):
            return [remap(v) for v in value]
        return id_of[value] if isinstance(value, int) and value in id_of else value

    for c in (config, generation):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in c:
                c[key] = remap(c[key])
    specials = {id_of[i]: tokens[i] for i in release_ids}
    specials[vocab - 1] = UNK
    return config, generation, specials


# ------------------------------------------------------------------------------ tensors

def _attention(p, c, bias):
    """The q/k/v/o projections of layer prefix p (with biases of std ``bias`` when given)."""
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    t = []
    for proj, out, inp in (("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H),
                           ("o_proj", H, nh * hd)):
        t.append(_tensor(p + "self_attn.%s.weight" % proj, "BF16", (out, inp), ("normal", WEIGHT_STD)))
        if bias is not None:
            t.append(_tensor(p + "self_attn.%s.bias" % proj, "BF16", (out,), ("normal", bias)))
    return t


def _layer_norms(p, H):
    return [_tensor(p + "input_layernorm.weight", "BF16", (H,), ("ones",)),
            _tensor(p + "post_attention_layernorm.weight", "BF16", (H,), ("ones",))]


def _head(c):
    """The final norm and the lm_head (unless tied to the embedding)."""
    H, V = c["hidden_size"], c["vocab_size"]
    t = [_tensor("model.norm.weight", "BF16", (H,), ("ones",))]
    if not c.get("tie_word_embeddings", False):
        t.append(_tensor("lm_head.weight", "BF16", (V, H), ("normal", WEIGHT_STD)))
    return t


def _gpt_oss_tensors(c):
    q = c.get("quantization_config") or {}
    if q.get("quant_method") != "mxfp4":
        raise SyntheticModelError("gpt_oss: only MXFP4 experts (quant_method mxfp4) are written")
    H, I, E, V = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    nh = c["num_attention_heads"]
    if H % 32 or I % 32:
        raise SyntheticModelError("MXFP4 needs hidden and intermediate sizes divisible by 32")
    normal, bias = ("normal", WEIGHT_STD), ("normal", BIAS_STD)
    t = [_tensor("model.embed_tokens.weight", "BF16", (V, H), normal)]
    for L in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % L
        t += _attention(p, c, BIAS_STD)
        t.append(_tensor(p + "self_attn.sinks", "BF16", (nh,), ("normal", SINK_STD)))
        t.append(_tensor(p + "mlp.router.weight", "BF16", (E, H), normal))
        t.append(_tensor(p + "mlp.router.bias", "BF16", (E,), bias))
        # Blocks [E, out, in/32, 16]: 32 e2m1 codes of a row, two a byte, low nibble first;
        # scales [E, out, in/32] e8m0; gate and up interleave in gate_up's rows (gate even).
        x = p + "mlp.experts."
        for proj, out, inp in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            t.append(_tensor(x + proj + "_blocks", "U8", (E, out, inp // 32, 16), ("bytes",), True))
            t.append(_tensor(x + proj + "_scales", "U8", (E, out, inp // 32), ("e8m0",) + E8M0_SCALES, True))
            t.append(_tensor(x + proj + "_bias", "BF16", (E, out), bias, True))
        t += _layer_norms(p, H)
    return t + _head(c)


def _int4_group(c):
    """The group size of compressed-tensors pack-quantized symmetric int4 experts."""
    q = c.get("quantization_config") or {}
    groups = q.get("config_groups") or {}
    ok = q.get("quant_method") == "compressed-tensors" and q.get("format") == "pack-quantized" and len(groups) == 1
    w = next(iter(groups.values())).get("weights", {}) if ok else {}
    if not (ok and w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") == "group"
            and w.get("symmetric") is True and isinstance(w.get("group_size"), int) and w["group_size"] > 0):
        raise SyntheticModelError("qwen3_moe: only compressed-tensors pack-quantized symmetric int4 groups of "
                                  "experts are written")
    return w["group_size"]


def _qwen3_moe_tensors(c):
    group = _int4_group(c)
    H, MI, E, V = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["vocab_size"]
    hd = c["head_dim"]
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise SyntheticModelError("qwen3_moe: only configs whose every layer is MoE are written")
    normal, ones = ("normal", WEIGHT_STD), ("ones",)
    attn_bias = c.get("attention_bias", False)
    scales = ("uniform", INT4_SCALE * INT4_SCALE_SPREAD[0], INT4_SCALE * INT4_SCALE_SPREAD[1])
    t = [_tensor("model.embed_tokens.weight", "BF16", (V, H), normal)]
    for L in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % L
        t += _attention(p, c, BIAS_STD if attn_bias else None)
        t.append(_tensor(p + "self_attn.q_norm.weight", "BF16", (hd,), ones))
        t.append(_tensor(p + "self_attn.k_norm.weight", "BF16", (hd,), ones))
        t.append(_tensor(p + "mlp.gate.weight", "BF16", (E, H), normal))
        for e in range(E):
            # compressed-tensors pack-quantized: word j of a row holds inputs 8j..8j+7, input
            # 8j+i as (q + 8) in bits 4i..4i+3; weight_shape is torch.tensor(shape), int64.
            for proj, out, inp in (("gate_proj", MI, H), ("up_proj", MI, H), ("down_proj", H, MI)):
                x = p + "mlp.experts.%d.%s." % (e, proj)
                t.append(_tensor(x + "weight_packed", "I32", (out, -(-inp // 8)), ("int4",), True))
                t.append(_tensor(x + "weight_scale", "BF16", (out, -(-inp // group)), scales, True))
                t.append(_tensor(x + "weight_shape", "I64", (2,), ("values", (out, inp)), True))
        t += _layer_norms(p, H)
    return t + _head(c)


_FAMILIES = {"gpt_oss": {"experts_key": "num_local_experts", "tensors": _gpt_oss_tensors},
             "qwen3_moe": {"experts_key": "num_experts", "tensors": _qwen3_moe_tensors}}


def _family(config):
    family = _FAMILIES.get(config.get("model_type"))
    if family is None:
        raise SyntheticModelError("model_type %r has no tensor layout here" % config.get("model_type"))
    return family


def _shard(tensors, shard_bytes):
    """Files in module order, a new one when the next tensor would pass shard_bytes
    (save_pretrained's rule), named model-0000i-of-0000N.safetensors."""
    index, size, owner = 0, 0, []
    for t in tensors:
        if size and size + t.nbytes > shard_bytes:
            index, size = index + 1, 0
        owner.append(index)
        size += t.nbytes
    n = index + 1
    return [t._replace(file="model-%05d-of-%05d.safetensors" % (i + 1, n)) for t, i in zip(tensors, owner)]


def plan(name, **overrides):
    """Every tensor the model's checkpoint holds (PlannedTensor: name, dtype, shape, nbytes,
    fill, expert, file), in module order. overrides: layers, vocab, experts, shard_bytes."""
    norm = _normalized(name, **overrides)
    config, _, _ = _configs(name, norm)
    return _shard(_family(config)["tensors"](config), norm.get("shard_bytes", SHARD_BYTES))


def summary(tensors):
    """Counts and bytes of a plan: tensors, files, expert_bytes, other_bytes, total_bytes."""
    expert = sum(t.nbytes for t in tensors if t.expert)
    total = sum(t.nbytes for t in tensors)
    return {"tensors": len(tensors), "files": len({t.file for t in tensors}), "expert_bytes": expert,
            "other_bytes": total - expert, "total_bytes": total}


# ------------------------------------------------------------------------------ values

def _bf16(f):
    """float32 -> bf16 bit patterns, round to nearest even (finite values)."""
    u = f.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    return r.astype("<u2")


def _tensor_rng(seed, name):
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _values(t, rng):
    """The tensor's bytes as a sequence of contiguous numpy arrays."""
    n = math.prod(t.shape)
    kind = t.fill[0]
    if kind == "values":
        yield np.asarray(t.fill[1], dtype="<i8")
        return
    if kind in ("ones", "normal", "uniform"):
        ones = None
        for start in range(0, n, NORMALS_PER_CHUNK):
            m = min(NORMALS_PER_CHUNK, n - start)
            if kind == "ones":
                if ones is None or len(ones) != m:
                    ones = np.full(m, BF16_ONE, dtype="<u2")
                yield ones
            elif kind == "normal":
                f = rng.standard_normal(m, dtype=np.float32)
                f *= t.fill[1]
                yield _bf16(f)
            else:
                lo, hi = t.fill[1], t.fill[2]
                f = rng.random(m, dtype=np.float32)
                f *= hi - lo
                f += lo
                yield _bf16(f)
        return
    nbytes = t.nbytes
    for start in range(0, nbytes, BYTES_PER_CHUNK):
        m = min(BYTES_PER_CHUNK, nbytes - start)
        if kind == "e8m0":
            yield rng.integers(t.fill[1], t.fill[2] + 1, size=m, dtype=np.uint8)
            continue
        words = rng.bit_generator.random_raw(-(-m // 8))
        if kind == "int4":
            # Every zero nibble (code -8) becomes 8 (code 0): bit 3 of each nibble whose four
            # bits are all clear.
            z = ~words
            zero = z & (z >> np.uint64(1))
            zero &= z >> np.uint64(2)
            zero &= z >> np.uint64(3)
            zero &= np.uint64(0x1111111111111111)
            zero <<= np.uint64(3)
            words |= zero
        elif kind != "bytes":
            raise ValueError("unknown fill %r" % (t.fill,))
        yield words.view(np.uint8)[:m]


# ------------------------------------------------------------------------------ files

def _header(tensors):
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class _SyncedFile:
    """A file written in large pieces; every SYNC_BYTES the written data is synced and dropped
    from the page cache, so a multi-GB write holds little dirty memory."""

    def __init__(self, path):
        self.f = open(path, "wb")
        self.pending = 0

    def write(self, data):
        self.f.write(data)
        self.pending += memoryview(data).nbytes
        if self.pending >= SYNC_BYTES:
            self._sync()

    def _sync(self):
        self.f.flush()
        os.fdatasync(self.f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self.pending = 0

    def close(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _write_shard(path, tensors, seed):
    ordered = sorted(tensors, key=lambda t: (-DTYPE_RANK[t.dtype], t.name))
    out = _SyncedFile(path)
    try:
        out.write(_header(ordered))
        for t in ordered:
            written = 0
            for chunk in _values(t, _tensor_rng(seed, t.name)):
                out.write(chunk)
                written += chunk.nbytes
            if written != t.nbytes:
                raise AssertionError("%s: wrote %d bytes, planned %d" % (t.name, written, t.nbytes))
    finally:
        out.close()


def _write_json(path, value, **kwargs):
    with open(path, "w") as f:
        json.dump(value, f, **kwargs)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_tokenizer(directory, config, generation, specials):
    """tokenizer.json (tokenizers' WordLevel model, whitespace split), tokenizer_config.json and
    special_tokens_map.json: id i is "w<i>" unless special."""
    vocab_size = config["vocab_size"]
    vocab = {("w%d" % i if i not in specials else specials[i]): i for i in range(vocab_size)}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in sorted(specials.items())]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                 "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK}}
    _write_json(os.path.join(directory, "tokenizer.json"), tokenizer, ensure_ascii=False)

    def first(value):
        return value[0] if isinstance(value, list) else value

    roles = {"bos_token": first(generation.get("bos_token_id", config.get("bos_token_id"))),
             "eos_token": first(config.get("eos_token_id")),
             "pad_token": first(config.get("pad_token_id", generation.get("pad_token_id")))}
    tokens = {role: specials[i] for role, i in roles.items() if i in specials}
    tokens["unk_token"] = UNK
    tokenizer_config = dict(tokens, tokenizer_class="PreTrainedTokenizerFast",
                            model_max_length=config.get("max_position_embeddings", 4096),
                            clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
                            added_tokens_decoder={str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                                  for a in added})
    _write_json(os.path.join(directory, "tokenizer_config.json"), tokenizer_config, indent=2)
    _write_json(os.path.join(directory, "special_tokens_map.json"), tokens, indent=2)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_name(name, norm, seed):
    suffix = {"layers": "layers", "vocab": "vocab", "experts": "experts", "shard_bytes": "shardbytes"}
    parts = [name] + ["%d%s" % (norm[k], suffix[k]) for k in ("layers", "vocab", "experts", "shard_bytes")
                      if k in norm]
    if seed:
        parts.append("seed%d" % seed)
    return "-".join(parts)


def cache_root():
    return os.environ.get("KT_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kt", "models")


def default_dir(name, seed=0, **overrides):
    """The folder make() writes by default."""
    return os.path.join(cache_root(), _default_name(name, _normalized(name, **overrides), seed))


def _identity(name, norm, seed):
    return {"model": name, "overrides": norm, "seed": seed, "maker_version": MAKER_VERSION}


def _existing(directory, identity, log):
    """directory when it holds the model identity describes, complete; refuses anything else."""
    marker_path = os.path.join(directory, MARKER)
    if not os.path.isfile(marker_path):
        raise SyntheticModelError("%s exists and is not a folder this maker wrote (no %s); remove it or choose "
                                  "another --out" % (directory, MARKER))
    try:
        marker = _load_json(marker_path)
    except ValueError as e:
        raise SyntheticModelError("%s: unreadable %s (%s); remove the folder" % (directory, MARKER, e))
    have = {k: marker.get(k) for k in identity}
    if have != identity:
        raise SyntheticModelError("%s holds another synthetic model (%s: %s; wanted %s): remove it or choose "
                                  "another --out" % (directory, MARKER, json.dumps(have, sort_keys=True),
                                                     json.dumps(identity, sort_keys=True)))
    for f, size in sorted(marker.get("files", {}).items()):
        path = os.path.join(directory, f)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise SyntheticModelError("%s: %s is missing or not %d bytes as %s says: the folder was changed; "
                                      "remove it" % (directory, f, size, MARKER))
    log("reusing %s (%s, written by maker version %d): nothing written"
        % (directory, marker.get("description", identity["model"]), MAKER_VERSION))
    return directory


def _remove_stale_partials(parent, base):
    """Partial folders of this name left by makers that no longer run."""
    prefix = ".%s.partial-" % base
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry[len(prefix):])
            os.kill(pid, 0)
            continue  # its maker is still running
        except ValueError:
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def make(name, out=None, seed=0, log=print, **overrides):
    """Writes the model's checkpoint folder (default: default_dir(name, seed, **overrides)) once and
    returns its path; a folder already holding the same model is reused. overrides: layers,
    vocab, experts, shard_bytes."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SyntheticModelError("seed must be a non-negative integer, not %r" % (seed,))
    seed = int(seed)
    norm = _normalized(name, **overrides)
    directory = os.path.abspath(out if out is not None else
                                os.path.join(cache_root(), _default_name(name, norm, seed)))
    identity = _identity(name, norm, seed)
    if os.path.lexists(directory):
        return _existing(directory, identity, log)
    config, generation, specials = _configs(name, norm)
    tensors = _shard(_family(config)["tensors"](config), norm.get("shard_bytes", SHARD_BYTES))
    sizes = summary(tensors)
    parent, base = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_partials(parent, base)
    free = shutil.disk_usage(parent).free
    if free < sizes["total_bytes"] + (1 << 30):
        raise SyntheticModelError("%s: %.2f GB free, the model needs %.2f GB (and 1 GiB to spare)"
                                  % (parent, free / 1e9, sizes["total_bytes"] / 1e9))
    partial = os.path.join(parent, ".%s.partial-%d" % (base, os.getpid()))
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    description = "%s%s, seed %d" % (name, "".join(", %s %d" % kv for kv in sorted(norm.items())), seed)
    log("writing %s (%s): %d tensors, %.2f GB in %d files" % (directory, description, sizes["tensors"],
                                                             sizes["total_bytes"] / 1e9, sizes["files"]))
    start = time.time()
    try:
        _write_json(os.path.join(partial, "config.json"), config, indent=2, sort_keys=True)
        _write_json(os.path.join(partial, "generation_config.json"), generation, indent=2, sort_keys=True)
        _write_tokenizer(partial, config, generation, specials)
        files = sorted({t.file for t in tensors})
        for i, f in enumerate(files):
            t0 = time.time()
            shard = [t for t in tensors if t.file == f]
            _write_shard(os.path.join(partial, f), shard, seed)
            size = os.path.getsize(os.path.join(partial, f))
            log("  %s: %d tensors, %.2f GB in %.1f s" % (f, len(shard), size / 1e9, time.time() - t0))
        index = {"metadata": {"total_size": sizes["total_bytes"]},
                 "weight_map": {t.name: t.file for t in sorted(tensors, key=lambda t: t.name)}}
        _write_json(os.path.join(partial, "model.safetensors.index.json"), index, indent=2)
        written = {f: os.path.getsize(os.path.join(partial, f)) for f in os.listdir(partial)}
        marker = dict(identity, description=description, maker="bench/synthetic_model.py",
                      tensors=sizes["tensors"], expert_bytes=sizes["expert_bytes"],
                      total_size=sizes["total_bytes"], files=written)
        _write_json(os.path.join(partial, MARKER), marker, indent=2, sort_keys=True)
        _fsync_dir(partial)
        try:
            os.rename(partial, directory)
        except OSError:
            if not os.path.isdir(directory):
                raise
            # Another maker finished the same folder first.
            shutil.rmtree(partial, ignore_errors=True)
            return _existing(directory, identity, log)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = time.time() - start
    log("wrote %s: %.2f GB in %.1f s (%.0f MB/s)" % (directory, sizes["total_bytes"] / 1e9, seconds,
                                                     sizes["total_bytes"] / 1e6 / max(seconds, 1e-9)))
    return directory


# ------------------------------------------------------------------------------ CLI

def _plan_text(name, tensors, norm):
    s = summary(tensors)
    lines = ["%s%s: %d tensors in %d files" % (name, "".join(" %s=%d" % kv for kv in sorted(norm.items())),
                                               s["tensors"], s["files"]),
             "  experts  %8.3f GB" % (s["expert_bytes"] / 1e9),
             "  other    %8.3f GB" % (s["other_bytes"] / 1e9),
             "  total    %8.3f GB" % (s["total_bytes"] / 1e9)]
    if not norm:
        release = MODELS[name]["release_bytes"]
        lines.append("  release  %8.3f GB (%+.1f %%)" % (release / 1e9, 100.0 * (s["total_bytes"] / release - 1)))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Writes a synthetic whole-model checkpoint of a release config "
                                            "into the model cache, once.")
    p.add_argument("--model", required=True, choices=MODEL_NAMES)
    p.add_argument("--layers", type=int, help="num_hidden_layers of a smaller variant")
    p.add_argument("--vocab", type=int, help="vocab_size of a smaller variant")
    p.add_argument("--experts", type=int, help="routed experts of a smaller variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the folder to write (default: $KT_MODEL_CACHE or ~/.cache/kt/models, "
                                 "then the model's name with its overrides)")
    p.add_argument("--plan", action="store_true", help="print the tensor count and bytes; write nothing")
    a = p.parse_args(argv)
    overrides = {k: v for k, v in (("layers", a.layers), ("vocab", a.vocab), ("experts", a.experts))
                 if v is not None}
    try:
        if a.plan:
            print(_plan_text(a.model, plan(a.model, **overrides), _normalized(a.model, **overrides)))
        else:
            make(a.model, out=a.out, seed=a.seed, **overrides)
    except SyntheticModelError as e:
        print("synthetic_model: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
