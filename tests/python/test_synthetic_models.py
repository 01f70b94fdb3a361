"""bench/synthetic_model.py: whole-model synthetic checkpoints of the gpt-oss-20b and
Qwen3-30B-A3B (int4 experts) releases. Small variants (2 layers, a small vocabulary, few experts)
are written and checked against their plan, the release-sized plan's layout and the release's
tensor list; kt opens every MoE layer in its stored format and computes a layer loaded from the
files; a folder is written once, reused, never overwritten, and a failed write leaves nothing.
With transformers (and compressed-tensors) installed, their loaders read the same expert weights
as kt and the tokenizer loads."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import kt

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench")
sys.path.insert(0, BENCH)
import synthetic_model as sm  # noqa: E402

VARIANTS = {"gpt-oss-20b": dict(layers=2, vocab=512, experts=8),
            "qwen3-30b-a3b": dict(layers=2, vocab=512, experts=16)}
# What kt must report for each variant's MoE layers.
LAYERS = {"gpt-oss-20b": dict(format="mxfp4", weight_format="mxfp4", layout="gpt_oss", E=8, k=4, H=2880,
                              I=2880, bias=True, weight_dtype="U8", activation="swiglu_oai"),
          "qwen3-30b-a3b": dict(format="int4_group", weight_format="int4_g32", layout="per_expert", E=16, k=8,
                                H=2048, I=768, bias=False, weight_dtype="I32", activation="silu")}
EOS = {"gpt-oss-20b": "<|return|>", "qwen3-30b-a3b": "<|im_end|>"}

# The release's tensors (outside the routed experts' per-expert names), as published.
GPT_OSS_LAYER0 = {
    "input_layernorm.weight": ("BF16", (2880,)), "post_attention_layernorm.weight": ("BF16", (2880,)),
    "self_attn.q_proj.weight": ("BF16", (4096, 2880)), "self_attn.q_proj.bias": ("BF16", (4096,)),
    "self_attn.k_proj.weight": ("BF16", (512, 2880)), "self_attn.k_proj.bias": ("BF16", (512,)),
    "self_attn.v_proj.weight": ("BF16", (512, 2880)), "self_attn.v_proj.bias": ("BF16", (512,)),
    "self_attn.o_proj.weight": ("BF16", (2880, 4096)), "self_attn.o_proj.bias": ("BF16", (2880,)),
    "self_attn.sinks": ("BF16", (64,)),
    "mlp.router.weight": ("BF16", (32, 2880)), "mlp.router.bias": ("BF16", (32,)),
    "mlp.experts.gate_up_proj_blocks": ("U8", (32, 5760, 90, 16)),
    "mlp.experts.gate_up_proj_scales": ("U8", (32, 5760, 90)),
    "mlp.experts.gate_up_proj_bias": ("BF16", (32, 5760)),
    "mlp.experts.down_proj_blocks": ("U8", (32, 2880, 90, 16)),
    "mlp.experts.down_proj_scales": ("U8", (32, 2880, 90)),
    "mlp.experts.down_proj_bias": ("BF16", (32, 2880)),
}
GPT_OSS_GLOBAL = {"model.embed_tokens.weight": ("BF16", (201088, 2880)), "model.norm.weight": ("BF16", (2880,)),
                  "lm_head.weight": ("BF16", (201088, 2880))}
QWEN3_LAYER0 = {
    "input_layernorm.weight": ("BF16", (2048,)), "post_attention_layernorm.weight": ("BF16", (2048,)),
    "self_attn.q_proj.weight": ("BF16", (4096, 2048)), "self_attn.k_proj.weight": ("BF16", (512, 2048)),
    "self_attn.v_proj.weight": ("BF16", (512, 2048)), "self_attn.o_proj.weight": ("BF16", (2048, 4096)),
    "self_attn.q_norm.weight": ("BF16", (128,)), "self_attn.k_norm.weight": ("BF16", (128,)),
    "mlp.gate.weight": ("BF16", (128, 2048)),
}
QWEN3_EXPERT = {  # per expert e: out, in
    "gate_proj": (768, 2048), "up_proj": (768, 2048), "down_proj": (2048, 768)}
QWEN3_GLOBAL = {"model.embed_tokens.weight": ("BF16", (151936, 2048)), "model.norm.weight": ("BF16", (2048,)),
                "lm_head.weight": ("BF16", (151936, 2048))}

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each variant written once: {model: (directory, log lines)}."""
    root = tmp_path_factory.mktemp("synthetic")
    out = {}
    for name, overrides in VARIANTS.items():
        lines = []
        d = sm.make(name, out=str(root / name), log=lines.append, **overrides)
        out[name] = (d, lines)
    yield out
    shutil.rmtree(str(root), ignore_errors=True)


# ------------------------------------------------------------------ files read without kt

def headers(directory):
    """{tensor name: (file, dtype, shape, absolute byte offset, nbytes)} of every shard."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(directory, f)
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        assert header.pop("__metadata__") == {"format": "pt"}
        end = 0
        for name, h in header.items():
            begin, stop = h["data_offsets"]
            out[name] = (f, h["dtype"], tuple(h["shape"]), 8 + n + begin, stop - begin)
            assert begin % sm.DTYPE_BYTES[h["dtype"]] == 0, name
            end = max(end, stop)
        assert (8 + n) % 8 == 0
        assert os.path.getsize(path) == 8 + n + end
        spans = sorted(h["data_offsets"] for h in header.values())
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f
    return out


def raw(directory, entry):
    f, _, _, offset, nbytes = entry
    return np.fromfile(os.path.join(directory, f), dtype=np.uint8, count=nbytes, offset=offset)


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def mxfp4_gate(directory, h, layer, e):
    """Expert e's gate [I, H] decoded from the files: even rows of gate_up, two e2m1 codes a
    byte (low nibble first) times 2^(scale - 127)."""
    p = "model.layers.%d.mlp.experts.gate_up_proj_" % layer
    blocks = raw(directory, h[p + "blocks"]).reshape(h[p + "blocks"][2])[e, 0::2]   # [I, H/32, 16]
    scales = raw(directory, h[p + "scales"]).reshape(h[p + "scales"][2])[e, 0::2]   # [I, H/32]
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(blocks.shape[0], -1)
    factor = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)
    return E2M1[codes] * np.repeat(factor, 32, axis=1)


def int4_gate(directory, h, layer, e):
    """Expert e's gate [out, in] decoded from the files: int32 word j of a row holds inputs
    8j..8j+7, input 8j+i as (q + 8) in bits 4i..4i+3 (compressed-tensors pack_to_int32), times
    the bf16 scale of its group of 32."""
    p = "model.layers.%d.mlp.experts.%d.gate_proj." % (layer, e)
    out, inp = raw(directory, h[p + "weight_shape"]).view("<i8")
    words = raw(directory, h[p + "weight_packed"]).view("<u4").reshape(out, inp // 8)
    shifts = (np.arange(8, dtype=np.uint32) * 4)
    q = ((words[:, :, None] >> shifts) & 15).reshape(out, inp).astype(np.int32) - 8
    scale = bf16_to_f32(raw(directory, h[p + "weight_scale"]).view("<u2")).reshape(out, inp // 32)
    return q.astype(np.float32) * np.repeat(scale, 32, axis=1), q


# ------------------------------------------------------------------ plans

def pattern(name):
    return re.sub(r"experts\.\d+\.", "experts.<e>.", re.sub(r"layers\.\d+\.", "layers.<L>.", name))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_release_plan_has_the_release_tensors_and_size(name):
    tensors = sm.plan(name)
    by_name = {t.name: t for t in tensors}
    s = sm.summary(tensors)
    assert s["total_bytes"] == sum(t.nbytes for t in tensors)
    assert abs(s["total_bytes"] / sm.MODELS[name]["release_bytes"] - 1) < 0.10, s
    files = sorted({t.file for t in tensors})
    sizes = [sum(t.nbytes for t in tensors if t.file == f) for f in files]
    assert max(sizes) <= sm.SHARD_BYTES
    if name == "gpt-oss-20b":
        assert len(tensors) == 24 * len(GPT_OSS_LAYER0) + len(GPT_OSS_GLOBAL)
        assert files == ["model-%05d-of-00003.safetensors" % i for i in (1, 2, 3)]
        want = dict(GPT_OSS_GLOBAL)
        for L in range(24):
            want.update({"model.layers.%d.%s" % (L, k): v for k, v in GPT_OSS_LAYER0.items()})
        assert 10.0e9 < s["expert_bytes"] < 10.3e9
    else:
        assert len(tensors) == 48 * (len(QWEN3_LAYER0) + 128 * 9) + len(QWEN3_GLOBAL)
        assert len(files) == 4
        want = dict(QWEN3_GLOBAL)
        for L in range(48):
            want.update({"model.layers.%d.%s" % (L, k): v for k, v in QWEN3_LAYER0.items()})
            for e in range(128):
                for p, (out, inp) in QWEN3_EXPERT.items():
                    x = "model.layers.%d.mlp.experts.%d.%s." % (L, e, p)
                    want[x + "weight_packed"] = ("I32", (out, inp // 8))
                    want[x + "weight_scale"] = ("BF16", (out, inp // 32))
                    want[x + "weight_shape"] = ("I64", (2,))
        assert 15.5e9 < s["expert_bytes"] < 16.5e9
    assert {n: (t.dtype, t.shape) for n, t in by_name.items()} == want
    assert s["expert_bytes"] == sum(t.nbytes for t in tensors if ".mlp.experts." in t.name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_plan_has_the_release_layout(name):
    """Every tensor of a small variant is a release tensor (same name, dtype, shape but for the
    expert count and vocabulary), and the variant has every release name of its layers."""
    small, full = sm.plan(name, **VARIANTS[name]), sm.plan(name)
    full_by_name = {t.name: t for t in full}
    ov = VARIANTS[name]
    release = json.load(open(os.path.join(sm.MODELS_DIR, name, "config.json")))
    E_full = release["num_local_experts" if name == "gpt-oss-20b" else "num_experts"]
    scaled = {(ov["experts"], E_full), (ov["vocab"], release["vocab_size"])}
    for t in small:
        f = full_by_name[t.name]
        assert t.dtype == f.dtype and len(t.shape) == len(f.shape), t.name
        assert all(a == b or (a, b) in scaled for a, b in zip(t.shape, f.shape)), (t.name, t.shape, f.shape)

    def index(what, name):
        m = re.search(r"%s\.(\d+)\." % what, name)
        return int(m.group(1)) if m else -1

    kept = {t.name for t in full if index("layers", t.name) < ov["layers"] and index("experts", t.name) < ov["experts"]}
    assert {t.name for t in small} == kept
    assert {pattern(t.name) for t in small} == {pattern(t.name) for t in full}


def test_plan_refuses_bad_overrides():
    with pytest.raises(sm.SyntheticModelError, match="fewer than top-k"):
        sm.plan("qwen3-30b-a3b", experts=4)
    with pytest.raises(sm.SyntheticModelError, match="has 24"):
        sm.plan("gpt-oss-20b", layers=25)
    with pytest.raises(sm.SyntheticModelError, match="positive integer"):
        sm.plan("gpt-oss-20b", layers=0)
    with pytest.raises(sm.SyntheticModelError, match="unknown model"):
        sm.plan("gpt-oss-120b")


# ------------------------------------------------------------------ written files

@pytest.mark.parametrize("name", list(VARIANTS))
def test_written_files_match_the_plan(written, name):
    d, log = written[name]
    tensors = sm.plan(name, **VARIANTS[name])
    h = headers(d)
    assert {n: (e[0], e[1], e[2], e[4]) for n, e in h.items()} == \
        {t.name: (t.file, t.dtype, t.shape, t.nbytes) for t in tensors}
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert index["weight_map"] == {t.name: t.file for t in tensors}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors)
    config = json.load(open(os.path.join(d, "config.json")))
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 512
    if name == "gpt-oss-20b":
        assert config["num_local_experts"] == 8
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert config["quantization_config"]["quant_method"] == "mxfp4"
    else:
        assert config["num_experts"] == 16
        q = config["quantization_config"]
        assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
        w = q["config_groups"]["group_0"]["weights"]
        assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == \
            (4, "int", "group", 32, True)
        # compressed-tensors names every Linear it did not quantize: those of the 2 layers.
        linear = {t.name[:-len(".weight")] for t in tensors if t.name.endswith(".weight") and len(t.shape) == 2
                  and not t.name.endswith("embed_tokens.weight")}
        assert set(q["ignore"]) == linear and len(q["ignore"]) == 2 * 5 + 1
    marker = json.load(open(os.path.join(d, sm.MARKER)))
    assert marker["model"] == name and marker["overrides"] == VARIANTS[name] and marker["seed"] == 0
    assert marker["maker_version"] == sm.MAKER_VERSION
    assert marker["files"] == {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f != sm.MARKER}
    assert any(line.startswith("wrote %s" % d) for line in log), log


@pytest.mark.parametrize("name", list(VARIANTS))
def test_written_values_have_the_stated_scales(written, name):
    d, _ = written[name]
    h = headers(d)
    # Each tensor's data is its own seeded stream, where the header says it is.
    t = {t.name: t for t in sm.plan(name, **VARIANTS[name])}["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(raw(d, h[t.name]), np.concatenate([c.view(np.uint8) for c in sm._values(
        t, sm._tensor_rng(0, t.name))]))
    assert np.all(raw(d, h["model.layers.1.input_layernorm.weight"]).view("<u2") == 0x3F80)
    q = bf16_to_f32(raw(d, h["model.layers.0.self_attn.q_proj.weight"]).view("<u2"))
    assert abs(q.std() - 0.02) < 0.0005 and abs(q.mean()) < 0.0005
    emb = bf16_to_f32(raw(d, h["model.embed_tokens.weight"]).view("<u2"))
    assert abs(emb.std() - 0.02) < 0.001
    if name == "gpt-oss-20b":
        b = bf16_to_f32(raw(d, h["model.layers.0.self_attn.q_proj.bias"]).view("<u2"))
        assert abs(b.std() - 0.01) < 0.001
        s = raw(d, h["model.layers.0.mlp.experts.down_proj_scales"])
        assert set(np.unique(s)) == {119, 120}
        w = mxfp4_gate(d, h, 0, 3)
        assert 0.015 < w.std() < 0.021 and abs(w.mean()) < 0.0005
    else:
        w, codes = int4_gate(d, h, 0, 5)
        assert codes.min() == -7 and codes.max() == 7
        assert abs((codes == 0).mean() - 2 / 16) < 0.01 and abs(codes.mean()) < 0.02
        scale = bf16_to_f32(raw(d, h["model.layers.0.mlp.experts.5.down_proj.weight_scale"]).view("<u2"))
        assert scale.min() >= 0.79 * sm.INT4_SCALE and scale.max() <= 1.21 * sm.INT4_SCALE
        assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.0005


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tokenizer_files(written, name):
    d, _ = written[name]
    config = json.load(open(os.path.join(d, "config.json")))
    generation = json.load(open(os.path.join(d, "generation_config.json")))
    tok = json.load(open(os.path.join(d, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    assert tok["model"]["type"] == "WordLevel" and len(vocab) == 512 == len(set(vocab.values()))
    assert sorted(vocab.values()) == list(range(512))
    assert vocab["w12"] == 12 and vocab["<unk>"] == 511
    assert {a["id"]: a["content"] for a in tok["added_tokens"]}[config["eos_token_id"]] == EOS[name]
    specials = {a["id"] for a in tok["added_tokens"]}
    assert config.get("pad_token_id", generation["pad_token_id"]) in specials
    assert all(i in specials for i in generation["eos_token_id"] + [generation.get("bos_token_id")])
    assert all(vocab["w%d" % i] == i for i in range(512) if i not in specials)
    tc = json.load(open(os.path.join(d, "tokenizer_config.json")))
    assert tc["eos_token"] == EOS[name] and tc["unk_token"] == "<unk>"


# ------------------------------------------------------------------ kt

@pytest.mark.parametrize("name", list(VARIANTS))
def test_kt_recognises_every_layer(written, name):
    d, _ = written[name]
    want = LAYERS[name]
    tensors = sm.plan(name, **VARIANTS[name])
    with kt.Checkpoint(d) as ck:
        assert ck.info["model_type"] == {"gpt-oss-20b": "gpt_oss", "qwen3-30b-a3b": "qwen3_moe"}[name]
        assert ck.info["layout"] == want["layout"] and ck.info["top_k"] == want["k"]
        assert ck.info["num_moe_layers"] == 2 and ck.info["num_tensors"] == len(tensors)
        assert sorted(ck.layers) == [0, 1]
        for L, info in ck.layers.items():
            got = (info["format"], info["weight_format"], info["layout"], info["num_experts"], info["hidden"],
                   info["intermediate"], info["bias"], info["weight_dtype"], info["loadable"], info["group_size"])
            assert got == (want["format"], want["weight_format"], want["layout"], want["E"], want["H"], want["I"],
                           want["bias"], want["weight_dtype"], True, 32)
            experts = sorted(t.name for t in tensors if t.expert and t.name.startswith("model.layers.%d." % L))
            assert ck.layer_tensor_names(L) == experts
            assert info["bytes"] == sum(t.nbytes for t in tensors if t.name in experts)
            opts = ck.moe_options(L)
            assert (opts["num_experts"], opts["top_k"], opts["hidden"], opts["intermediate"], opts["bias"],
                    opts["activation"], opts["weight_format"]) == (want["E"], want["k"], want["H"], want["I"],
                                                                   want["bias"], want["activation"],
                                                                   want["weight_format"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kt_reads_the_files_as_stated_and_computes_a_layer(written, name):
    """kt's decoding of layer 1 is this file's decoding of the bytes (exact), and a forward of
    the loaded layer on inputs of std 1 is finite and of a sensible scale."""
    d, _ = written[name]
    h = headers(d)
    T = 32
    with kt.Checkpoint(d) as ck:
        opts = ck.moe_options(1)
        E, H, I = opts["num_experts"], opts["hidden"], opts["intermediate"]
        gate = np.empty((E, I, H), np.float32)
        ck.read_layer(1, gate=gate)
        moe = kt.MoE(**opts, max_tokens=T)
        ck.load_layer(1, moe)
    for e in (0, E - 1):
        mine = mxfp4_gate(d, h, 1, e) if name == "gpt-oss-20b" else int4_gate(d, h, 1, e)[0]
        assert np.array_equal(gate[e], mine), e
    assert 0.015 < gate.std() < 0.025
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:opts["top_k"]] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, opts["top_k"])).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    y = np.full_like(x, np.nan)
    moe.forward(x, ids, w, y)
    assert np.isfinite(y).all()
    assert 1e-3 < y.std() < 10, y.std()


# ------------------------------------------------------------------ once, atomically

def snapshot(directory):
    return {f: (os.stat(os.path.join(directory, f)).st_mtime_ns, os.path.getsize(os.path.join(directory, f)))
            for f in sorted(os.listdir(directory))}


def test_second_make_reuses_the_folder(written):
    name = "gpt-oss-20b"
    d, _ = written[name]
    before, parent = snapshot(d), sorted(os.listdir(os.path.dirname(d)))
    lines = []
    assert sm.make(name, out=d, log=lines.append, **VARIANTS[name]) == d
    assert snapshot(d) == before and sorted(os.listdir(os.path.dirname(d))) == parent
    assert len(lines) == 1 and lines[0].startswith("reusing %s" % d) and "nothing written" in lines[0]
    # The CLI says the same and exits 0.
    cli = subprocess.run([sys.executable, os.path.join(BENCH, "synthetic_model.py"), "--model", name, "--out", d]
                         + ["--%s=%d" % kv for kv in VARIANTS[name].items()], capture_output=True, text=True)
    assert cli.returncode == 0 and cli.stdout.startswith("reusing %s" % d), cli.stdout + cli.stderr
    assert snapshot(d) == before


def test_a_folder_holding_something_else_is_refused(written, tmp_path):
    d, _ = written["gpt-oss-20b"]
    before = snapshot(d)
    with pytest.raises(sm.SyntheticModelError, match="holds another synthetic model.*qwen3-30b-a3b"):
        sm.make("qwen3-30b-a3b", out=d, log=lambda s: None, **VARIANTS["qwen3-30b-a3b"])
    with pytest.raises(sm.SyntheticModelError, match="holds another synthetic model"):
        sm.make("gpt-oss-20b", out=d, log=lambda s: None, **dict(VARIANTS["gpt-oss-20b"], layers=1))
    with pytest.raises(sm.SyntheticModelError, match="holds another synthetic model"):
        sm.make("gpt-oss-20b", out=d, seed=1, log=lambda s: None, **VARIANTS["gpt-oss-20b"])
    assert snapshot(d) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"not a model")
    with pytest.raises(sm.SyntheticModelError, match="not a folder this maker wrote"):
        sm.make("gpt-oss-20b", out=str(other), log=lambda s: None, **VARIANTS["gpt-oss-20b"])
    assert os.listdir(str(other)) == ["model.safetensors"]
    cli = subprocess.run([sys.executable, os.path.join(BENCH, "synthetic_model.py"), "--model", "qwen3-30b-a3b",
                          "--out", d, "--layers", "2"], capture_output=True, text=True)
    assert cli.returncode == 2 and "holds another synthetic model" in cli.stderr, cli.stderr


def test_an_interrupted_write_leaves_no_folder(tmp_path, monkeypatch):
    # A partial folder of a maker that no longer runs is removed too.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / (".m.partial-%d" % dead.pid)
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    values, calls = sm._values, []

    def failing(t, rng):
        calls.append(t.name)
        if len(calls) == 4:
            raise RuntimeError("injected failure")
        return values(t, rng)

    monkeypatch.setattr(sm, "_values", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        sm.make("gpt-oss-20b", out=str(tmp_path / "m"), log=lambda s: None, layers=1, vocab=64, experts=4)
    assert len(calls) == 4
    assert os.listdir(str(tmp_path)) == []


def test_default_folder_and_cli_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("KT_MODEL_CACHE", str(tmp_path))
    assert sm.default_dir("gpt-oss-20b") == os.path.join(str(tmp_path), "gpt-oss-20b")
    assert sm.default_dir("gpt-oss-20b", **VARIANTS["gpt-oss-20b"]) == \
        os.path.join(str(tmp_path), "gpt-oss-20b-2layers-512vocab-8experts")
    # An override equal to the release's is no override.
    assert sm.default_dir("qwen3-30b-a3b", layers=48, seed=2) == os.path.join(str(tmp_path), "qwen3-30b-a3b-seed2")
    cli = subprocess.run([sys.executable, os.path.join(BENCH, "synthetic_model.py"), "--model", "gpt-oss-20b",
                          "--plan"], capture_output=True, text=True, env=dict(os.environ, KT_MODEL_CACHE=str(tmp_path)))
    assert cli.returncode == 0, cli.stderr
    s = sm.summary(sm.plan("gpt-oss-20b"))
    assert cli.stdout.splitlines() == [
        "gpt-oss-20b: %d tensors in 3 files" % s["tensors"],
        "  experts  %8.3f GB" % (s["expert_bytes"] / 1e9),
        "  other    %8.3f GB" % (s["other_bytes"] / 1e9),
        "  total    %8.3f GB" % (s["total_bytes"] / 1e9),
        "  release  %8.3f GB (%+.1f %%)" % (13.8, 100.0 * (s["total_bytes"] / 13.8e9 - 1))]
    assert os.listdir(str(tmp_path)) == []


# ------------------------------------------------------------------ host libraries, where installed

@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_loads_the_same_experts(written, name):
    """transformers' loader (MXFP4 dequantized on a CPU; compressed-tensors decompression of the
    int4 experts) holds layer 1's experts as kt reads them (rounded to bf16), the model computes
    finite logits, and AutoTokenizer reads the word-level tokenizer."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
    if name == "qwen3-30b-a3b":
        pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed here")
    import torch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d, _ = written[name]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    config = json.load(open(os.path.join(d, "config.json")))
    assert tok("w12 w7 w500")["input_ids"] == [12, 7, 500]
    assert tok.eos_token == EOS[name] and tok.eos_token_id == config["eos_token_id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    sd = model.state_dict()
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"].float().numpy()
    down = sd["model.layers.1.mlp.experts.down_proj"].float().numpy()
    with kt.Checkpoint(d) as ck:
        opts = ck.moe_options(1)
        E, H, I = opts["num_experts"], opts["hidden"], opts["intermediate"]
        w = {"gate": np.empty((E, I, H), np.float32), "up": np.empty((E, I, H), np.float32),
             "down": np.empty((E, H, I), np.float32)}
        ck.read_layer(1, **w)
    if gate_up.shape == (E, H, 2 * I):  # gpt-oss: [E, in, out], gate and up interleaved
        theirs = {"gate": gate_up[:, :, 0::2].transpose(0, 2, 1), "up": gate_up[:, :, 1::2].transpose(0, 2, 1),
                  "down": down.transpose(0, 2, 1)}
    else:  # [E, out, in], gate then up
        theirs = {"gate": gate_up[:, :I], "up": gate_up[:, I:], "down": down}
    for p, mine in w.items():
        rounded = torch.from_numpy(mine).to(torch.bfloat16).float().numpy()
        assert np.array_equal(theirs[p], rounded), p
    with torch.no_grad():
        logits = model(torch.tensor([[12, 7, 500, 3]])).logits
    assert logits.shape == (1, 4, 512) and bool(torch.isfinite(logits).all())
